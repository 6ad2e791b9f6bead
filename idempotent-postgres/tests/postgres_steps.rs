//! Checkpoints and saved requests on `PostgresStore` against a real PostgreSQL server: the
//! columns as the statements leave them, the migration of an older table, the completer's
//! list, and the atomic step (`step_in_transaction`), whose effect and checkpoint commit
//! together.

use idempotent_core::CheckpointStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use idempotent_core::conformance::fresh_key;
use idempotent_core::memory::MemoryStore;
use idempotent_core::steps::encode_checkpoint;
use idempotent_core::{
    Call, CallOptions, Claim, ClaimHandle, Error, FencingToken, Fingerprint, Idempotency, Retain,
    StepError, StorageKey, Store, StoreError,
};
use idempotent_postgres::{PostgresStore, TransactionalClaim};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

/// A store on a fresh table of its own.
async fn fresh_store() -> Option<PostgresStore> {
    let url = postgres_url()?;
    let store = PostgresStore::builder(pool(&url, 8).await)
        .table(unique("steps"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

fn fp(name: &str) -> Fingerprint {
    Fingerprint::from_bytes(name.as_bytes())
}

async fn claim(store: &PostgresStore, key: &StorageKey, f: &Fingerprint) -> Claim {
    store.claim(key, f, LEASE, TTL).await.expect("claim")
}

/// The token of a claim that began a new lifetime.
async fn claimed(store: &PostgresStore, key: &StorageKey, f: &Fingerprint) -> FencingToken {
    match claim(store, key, f).await {
        Claim::Claimed(token) => token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The `steps` and `request` columns of `key`'s row.
async fn columns(store: &PostgresStore, key: &StorageKey) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    sqlx::query_as(&format!(
        "SELECT steps, request FROM \"{}\" WHERE storage_key = $1",
        store.table()
    ))
    .bind(key.record_bytes().as_ref())
    .fetch_one(store.pool())
    .await
    .expect("the row")
}

fn entry(name: &str, value: &str) -> Bytes {
    encode_checkpoint(name, value.as_bytes())
}

fn concat(entries: &[Bytes]) -> Vec<u8> {
    let mut all = BytesMut::new();
    for entry in entries {
        all.extend_from_slice(entry);
    }
    all.to_vec()
}

fn assert_rejected<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(result, Err(StoreError::TokenRejected)),
        "{what}: expected TokenRejected, got {result:?}"
    );
}

/// Ends the lease of `key`'s row now, as a stalled owner's lease ends: by the database clock.
async fn lapse(store: &PostgresStore, key: &StorageKey) {
    let lapsed = sqlx::query(&format!(
        "UPDATE \"{}\" SET expires_at = clock_timestamp() - interval '1 millisecond' \
         WHERE storage_key = $1 AND state = 'in_flight'",
        store.table()
    ))
    .bind(key.record_bytes().as_ref())
    .execute(store.pool())
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(lapsed, 1, "the row to lapse");
}

#[tokio::test]
async fn checkpoints_and_the_request_round_trip_in_their_columns() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let key = fresh_key();
    let token = claimed(&store, &key, &fp("order")).await;
    assert_eq!(columns(&store, &key).await, (None, None), "a new row");
    assert!(store.load_steps(&key, token).await.unwrap().is_empty());

    let entries = [
        entry("reserve", "\"r-1\""),
        entry("charge", ""),
        entry("x", "1"),
    ];
    for e in &entries {
        store.save_step(&key, token, e.clone()).await.unwrap();
    }
    let loaded = store.load_steps(&key, token).await.unwrap();
    assert_eq!(loaded.as_ref(), concat(&entries).as_slice());

    store
        .save_request(&key, token, Bytes::from_static(b"first"))
        .await
        .unwrap();
    store
        .save_request(&key, token, Bytes::from_static(b"second"))
        .await
        .unwrap();
    // The store never parses either: arbitrary bytes go in and come back whole.
    store
        .save_step(&key, token, Bytes::from_static(&[0, 255, 0]))
        .await
        .unwrap();
    let mut expected = concat(&entries);
    expected.extend_from_slice(&[0, 255, 0]);
    assert_eq!(
        columns(&store, &key).await,
        (Some(expected), Some(b"second".to_vec()))
    );

    // A token no row can hold, and a key nobody claimed.
    let huge = FencingToken::new(u64::MAX);
    assert_rejected(
        store.save_step(&key, huge, entry("y", "1")).await,
        "huge token",
    );
    assert_rejected(store.load_steps(&key, huge).await, "huge token read");
    assert_rejected(
        store.save_request(&key, huge, Bytes::new()).await,
        "huge token request",
    );
    let absent = fresh_key();
    assert_rejected(
        store.save_step(&absent, token, entry("y", "1")).await,
        "absent",
    );
    assert_rejected(store.load_steps(&absent, token).await, "absent read");
}

#[tokio::test]
async fn a_stale_owner_is_refused_after_a_takeover() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let key = fresh_key();
    let f = fp("order");
    let first = claimed(&store, &key, &f).await;
    store
        .save_step(&key, first, entry("reserve", "1"))
        .await
        .unwrap();
    store
        .save_request(&key, first, Bytes::from_static(b"request"))
        .await
        .unwrap();
    lapse(&store, &key).await;
    // Lapsed: refused before anyone took over.
    assert_rejected(store.load_steps(&key, first).await, "a lapsed owner's read");
    let second = match claim(&store, &key, &f).await {
        Claim::TakenOver { token, lifetime } => {
            assert_eq!(lifetime, first);
            token
        }
        other => panic!("expected TakenOver, got {other:?}"),
    };
    assert_rejected(
        store.save_step(&key, first, entry("charge", "stale")).await,
        "a stale owner's checkpoint",
    );
    assert_rejected(store.load_steps(&key, first).await, "a stale owner's read");
    assert_rejected(
        store
            .save_request(&key, first, Bytes::from_static(b"stale"))
            .await,
        "a stale owner's request",
    );
    assert_eq!(
        columns(&store, &key).await,
        (
            Some(entry("reserve", "1").to_vec()),
            Some(b"request".to_vec())
        ),
        "the stale owner changed nothing"
    );
    store
        .save_step(&key, second, entry("charge", "2"))
        .await
        .unwrap();
    assert_eq!(
        store.load_steps(&key, second).await.unwrap().as_ref(),
        concat(&[entry("reserve", "1"), entry("charge", "2")]).as_slice()
    );
}

#[tokio::test]
async fn a_takeover_keeps_the_columns_a_new_lifetime_and_a_completion_drop_them() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let key = fresh_key();
    let f = fp("order");
    let saved = (
        Some(entry("reserve", "1").to_vec()),
        Some(b"request".to_vec()),
    );

    // A release, then a takeover of the same request: kept.
    let first = claimed(&store, &key, &f).await;
    store
        .save_step(&key, first, entry("reserve", "1"))
        .await
        .unwrap();
    store
        .save_request(&key, first, Bytes::from_static(b"request"))
        .await
        .unwrap();
    store.release(&key, first).await.unwrap();
    assert_eq!(columns(&store, &key).await, saved, "a release keeps them");
    let second = match claim(&store, &key, &f).await {
        Claim::TakenOver { token, .. } => token,
        other => panic!("expected TakenOver, got {other:?}"),
    };
    assert_eq!(columns(&store, &key).await, saved, "a takeover keeps them");
    store.renew(&key, second, LEASE).await.unwrap();
    assert_eq!(columns(&store, &key).await, saved, "a renewal keeps them");

    // A lapsed lease taken over: kept too.
    lapse(&store, &key).await;
    let third = match claim(&store, &key, &f).await {
        Claim::TakenOver { token, .. } => token,
        other => panic!("expected TakenOver, got {other:?}"),
    };
    assert_eq!(
        columns(&store, &key).await,
        saved,
        "a takeover after a lapse"
    );

    // Another request on the abandoned record: refused, and nothing changes.
    store.release(&key, third).await.unwrap();
    assert!(matches!(
        claim(&store, &key, &fp("another order")).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        columns(&store, &key).await,
        saved,
        "another request's claim"
    );
    let fourth = match claim(&store, &key, &f).await {
        Claim::TakenOver { token, .. } => token,
        other => panic!("expected TakenOver, got {other:?}"),
    };

    // The same request after its record expired: a new lifetime too.
    store
        .save_step(&key, fourth, entry("reserve", "1"))
        .await
        .unwrap();
    store
        .save_request(&key, fourth, Bytes::from_static(b"request"))
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\" SET expires_at = clock_timestamp() - interval '1 second', \
         kept_until = clock_timestamp() - interval '1 second' WHERE storage_key = $1",
        store.table()
    ))
    .bind(key.record_bytes().as_ref())
    .execute(store.pool())
    .await
    .unwrap();
    let fifth = claimed(&store, &key, &fp("another order")).await;
    assert_eq!(columns(&store, &key).await, (None, None), "past its TTL");

    // A completion drops them.
    store
        .save_step(&key, fifth, entry("reserve", "1"))
        .await
        .unwrap();
    store
        .save_request(&key, fifth, Bytes::from_static(b"request"))
        .await
        .unwrap();
    store
        .complete(&key, fifth, Bytes::from_static(b"done"), TTL)
        .await
        .unwrap();
    assert_eq!(columns(&store, &key).await, (None, None), "a completion");
    // Repeated by the owner: still none, and nothing more to write.
    store
        .complete(&key, fifth, Bytes::from_static(b"again"), TTL)
        .await
        .unwrap();
    assert_eq!(columns(&store, &key).await, (None, None));
    assert_rejected(
        store.save_step(&key, fifth, entry("late", "1")).await,
        "a checkpoint on a completed record",
    );
}

#[tokio::test]
async fn the_transactional_completion_drops_the_columns_of_the_operation_it_took_over() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let idempotency = Idempotency::new(store.clone());
    let transactional = idempotent_postgres::Transactional::of(&idempotency, &store);
    let f = fp("deposit");
    let call = Call::new("deposit-1".parse().unwrap()).fingerprint(f);
    let key = transactional.storage_key(&call);
    // A standalone owner saved a checkpoint and a request, then gave the claim up.
    let first = claimed(&store, &key, &f).await;
    store
        .save_step(&key, first, entry("reserve", "1"))
        .await
        .unwrap();
    store
        .save_request(&key, first, Bytes::from_static(b"request"))
        .await
        .unwrap();
    store.release(&key, first).await.unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let TransactionalClaim::Run(pending) =
        transactional.claim::<i64>(&call, &mut tx).await.unwrap()
    else {
        panic!("expected to run");
    };
    assert_eq!(
        pending.claim().lifetime(),
        first,
        "the transaction took it over"
    );
    pending.complete(&mut tx, &7i64).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(columns(&store, &key).await, (None, None));
}

#[tokio::test]
async fn migrate_adds_the_columns_and_the_index_to_an_older_table() {
    let Some(url) = postgres_url() else {
        return;
    };
    let pool = pool(&url, 4).await;
    // The table as 0.2 made it, and as 0.3 made it.
    let old_02 = unique("old");
    let old_03 = unique("old");
    let shape_02 = |t: &str| {
        format!(
            "CREATE TABLE \"{t}\" (storage_key bytea PRIMARY KEY, state text NOT NULL, \
             fingerprint bytea NOT NULL, token bigint NOT NULL, payload bytea, \
             expires_at timestamptz NOT NULL); \
             CREATE INDEX \"{t}_expires_at_idx\" ON \"{t}\" (expires_at); \
             CREATE SEQUENCE \"{t}_token_seq\" START 100"
        )
    };
    sqlx::raw_sql(&shape_02(&old_02))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(&format!(
        "{}; ALTER TABLE \"{old_03}\" ADD COLUMN lifetime bigint, \
         ADD COLUMN kept_until timestamptz, ADD COLUMN claimant bigint; \
         CREATE INDEX \"{old_03}_kept_until_idx\" ON \"{old_03}\" \
         ((greatest(kept_until, expires_at)))",
        shape_02(&old_03)
    ))
    .execute(&pool)
    .await
    .unwrap();

    for table in [&old_02, &old_03] {
        // An operation of the old table, claimed before the upgrade and still running.
        let running = fresh_key();
        sqlx::query(&format!(
            "INSERT INTO \"{table}\" (storage_key, state, fingerprint, token, expires_at) \
             VALUES ($1, 'in_flight', $2, 7, clock_timestamp() + interval '1 minute')"
        ))
        .bind(running.record_bytes().as_ref())
        .bind(fp("order").as_bytes().as_slice())
        .execute(&pool)
        .await
        .unwrap();

        let store = PostgresStore::builder(pool.clone())
            .table(table.as_str())
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        store.migrate().await.expect("migrate again: nothing to do");

        let added: Vec<(String, String)> = sqlx::query_as(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_name = $1 AND column_name IN ('steps', 'request') ORDER BY column_name",
        )
        .bind(table.as_str())
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            added,
            [
                ("request".to_owned(), "bytea".to_owned()),
                ("steps".to_owned(), "bytea".to_owned())
            ],
            "{table}"
        );
        let index: Option<String> =
            sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE indexname = $1")
                .bind(format!("{table}_abandoned_idx"))
                .fetch_optional(&pool)
                .await
                .unwrap();
        let index = index.unwrap_or_else(|| panic!("{table}: no abandoned index"));
        assert!(
            index.contains("WHERE ((state = 'in_flight'::text) AND (request IS NOT NULL))"),
            "{index}"
        );

        // The row from before the upgrade serves checkpoints as it is.
        let token = FencingToken::new(7);
        store
            .save_step(&running, token, entry("reserve", "1"))
            .await
            .unwrap();
        store
            .save_request(&running, token, Bytes::from_static(b"request"))
            .await
            .unwrap();
        assert_eq!(
            store.load_steps(&running, token).await.unwrap().as_ref(),
            entry("reserve", "1").as_ref()
        );
        // Released, a row from before the upgrade (no `kept_until`) is not kept for a
        // takeover, so a completer does not list it either.
        store.release(&running, token).await.unwrap();
        assert!(
            store
                .abandoned(Duration::ZERO, 10, None)
                .await
                .unwrap()
                .is_empty()
        );
        // New claims work as on a new table.
        let key = fresh_key();
        abandon(&store, &key, &fp("new"), b"request").await;
        let listed = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
        assert_eq!(
            listed.iter().map(|a| a.key).collect::<Vec<_>>(),
            [key],
            "{table}"
        );
        let token = match claim(&store, &key, &fp("new")).await {
            Claim::TakenOver { token, .. } => token,
            other => panic!("expected TakenOver, got {other:?}"),
        };
        assert_eq!(columns(&store, &key).await.1, Some(b"request".to_vec()));
        store
            .complete(&key, token, Bytes::from_static(b"done"), TTL)
            .await
            .unwrap();
        assert_eq!(columns(&store, &key).await, (None, None));
    }
}

/// Claims `key` with a request, then releases it: an operation a completer may finish.
async fn abandon(store: &PostgresStore, key: &StorageKey, f: &Fingerprint, request: &'static [u8]) {
    let token = claimed(store, key, f).await;
    store
        .save_request(key, token, Bytes::from_static(request))
        .await
        .unwrap();
    store.release(key, token).await.unwrap();
}

#[tokio::test]
async fn abandoned_lists_exactly_the_idle_operations_with_a_request_longest_idle_first() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let table = store.table().to_owned();
    let set_lease_end = async |key: &StorageKey, ago_ms: i64| {
        sqlx::query(&format!(
            "UPDATE \"{table}\" SET expires_at = clock_timestamp() - $2 * interval '1 millisecond' \
             WHERE storage_key = $1"
        ))
        .bind(key.record_bytes().as_ref())
        .bind(ago_ms)
        .execute(store.pool())
        .await
        .unwrap();
    };
    let (oldest, middle, newest) = (fresh_key(), fresh_key(), fresh_key());
    abandon(&store, &middle, &fp("middle"), b"middle").await;
    abandon(&store, &newest, &fp("newest"), b"newest").await;
    abandon(&store, &oldest, &fp("oldest"), b"oldest").await;
    // Lease ends set apart by the database clock, not by how fast the test runs.
    set_lease_end(&oldest, 30_000).await;
    set_lease_end(&middle, 20_000).await;
    set_lease_end(&newest, 10_000).await;

    // A lapsed lease (never released) with a request counts too.
    let lapsed = fresh_key();
    let token = claimed(&store, &lapsed, &fp("lapsed")).await;
    store
        .save_request(&lapsed, token, Bytes::from_static(b"lapsed"))
        .await
        .unwrap();
    set_lease_end(&lapsed, 15_000).await;

    // Not listed: released without a request; still leased; completed; past its TTL.
    let bare = fresh_key();
    let token = claimed(&store, &bare, &fp("bare")).await;
    store
        .save_step(&bare, token, entry("reserve", "1"))
        .await
        .unwrap();
    store.release(&bare, token).await.unwrap();
    set_lease_end(&bare, 40_000).await;
    let leased = fresh_key();
    let token = claimed(&store, &leased, &fp("leased")).await;
    store
        .save_request(&leased, token, Bytes::from_static(b"leased"))
        .await
        .unwrap();
    let completed = fresh_key();
    let token = claimed(&store, &completed, &fp("completed")).await;
    store
        .save_request(&completed, token, Bytes::from_static(b"completed"))
        .await
        .unwrap();
    store
        .complete(&completed, token, Bytes::from_static(b"done"), TTL)
        .await
        .unwrap();
    let expired = fresh_key();
    abandon(&store, &expired, &fp("expired"), b"expired").await;
    sqlx::query(&format!(
        "UPDATE \"{table}\" SET expires_at = clock_timestamp() - interval '50 seconds', \
         kept_until = clock_timestamp() - interval '1 millisecond' WHERE storage_key = $1"
    ))
    .bind(expired.record_bytes().as_ref())
    .execute(store.pool())
    .await
    .unwrap();

    let found = store.abandoned(Duration::ZERO, 100, None).await.unwrap();
    let keys: Vec<StorageKey> = found.iter().map(|a| a.key).collect();
    assert_eq!(keys, [oldest, middle, lapsed, newest], "longest idle first");
    let oldest_entry = &found[0];
    assert_eq!(oldest_entry.fingerprint, fp("oldest"));
    assert_eq!(oldest_entry.request.as_ref(), b"oldest");
    assert!(
        (Duration::from_secs(30)..Duration::from_secs(3600)).contains(&oldest_entry.idle),
        "{:?}",
        oldest_entry.idle
    );
    assert!(found[1].idle < oldest_entry.idle);

    // The limit, and the idle time asked for.
    let keys = |found: Vec<idempotent_core::steps::Abandoned>| {
        found.into_iter().map(|a| a.key).collect::<Vec<_>>()
    };
    assert_eq!(
        keys(store.abandoned(Duration::ZERO, 2, None).await.unwrap()),
        [oldest, middle]
    );
    assert!(
        store
            .abandoned(Duration::ZERO, 0, None)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        keys(
            store
                .abandoned(Duration::from_secs(18), 100, None)
                .await
                .unwrap()
        ),
        [oldest, middle]
    );
    assert!(
        store
            .abandoned(Duration::from_secs(3600), 100, None)
            .await
            .unwrap()
            .is_empty()
    );
    // Taken over: leased again, so no longer listed.
    match claim(&store, &oldest, &fp("oldest")).await {
        Claim::TakenOver { .. } => {}
        other => panic!("expected TakenOver, got {other:?}"),
    }
    assert_eq!(
        keys(store.abandoned(Duration::ZERO, 100, None).await.unwrap()),
        [middle, lapsed, newest]
    );
}

#[tokio::test]
async fn abandoned_skips_rows_no_key_reaches_and_garbage() {
    let Some(store) = fresh_store().await else {
        return;
    };
    let insert = format!(
        "INSERT INTO \"{}\" (storage_key, state, fingerprint, token, expires_at, kept_until, request) \
         VALUES ($1, 'in_flight', $2, 1, clock_timestamp() - interval '1 second', \
         clock_timestamp() + interval '1 minute', 'request')",
        store.table()
    );
    let good = fp("order");
    // A key of 33 bytes is no storage key's: skipped.
    sqlx::query(&insert)
        .bind(vec![7u8; 33])
        .bind(good.as_bytes().as_slice())
        .execute(store.pool())
        .await
        .unwrap();
    // A request's record in a client session (48 bytes) comes back as that key.
    let mut seq = [0u8; 48];
    seq[..32].copy_from_slice(&[9; 32]);
    seq[32..40].copy_from_slice(&3u64.to_be_bytes());
    seq[40..].copy_from_slice(&5u64.to_be_bytes());
    sqlx::query(&insert)
        .bind(seq.as_slice())
        .bind(good.as_bytes().as_slice())
        .execute(store.pool())
        .await
        .unwrap();
    let found = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].key.record_bytes().as_ref(), seq.as_slice());
    assert_eq!(
        found[0].key.session_place(),
        Some(idempotent_core::SessionPlace::Seq { epoch: 3, seq: 5 })
    );
    // A fingerprint that is not 32 bytes: skipped, never a panic, and the rest still listed.
    sqlx::query(&insert)
        .bind(fresh_key().as_bytes().as_slice())
        .bind(b"short".as_slice())
        .execute(store.pool())
        .await
        .unwrap();
    let found = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].key.record_bytes().as_ref(), seq.as_slice());
}

// The atomic step.

/// A store on a fresh table, a runtime over it, and a table for the steps' effects.
struct Shop {
    store: PostgresStore,
    idempotency: Idempotency,
    effects: String,
}

impl Shop {
    async fn open() -> Option<Shop> {
        let store = fresh_store().await?;
        let effects = format!("{}_effects", store.table());
        sqlx::query(&format!(
            "CREATE TABLE \"{effects}\" (id text PRIMARY KEY, owner bigint NOT NULL)"
        ))
        .execute(store.pool())
        .await
        .unwrap();
        Some(Shop {
            idempotency: Idempotency::new(store.clone()),
            store,
            effects,
        })
    }

    fn call(&self, key: &str) -> Call {
        Call::new(key.parse().unwrap()).fingerprint(fp(key))
    }

    /// The atomic step `name`: inserts row `id` in the caller's transaction, counting its runs;
    /// returns the token it ran with.
    async fn reserve(
        &self,
        claim: &ClaimHandle,
        name: &str,
        id: &str,
        runs: &AtomicUsize,
    ) -> Result<u64, StepError<sqlx::Error>> {
        let insert = format!(
            "INSERT INTO \"{}\" (id, owner) VALUES ($1, $2)",
            self.effects
        );
        let (id, token) = (id.to_owned(), claim.token().get());
        self.store
            .step_in_transaction(claim, name, |mut tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                sqlx::query(&insert)
                    .bind(id)
                    .bind(i64::try_from(token).unwrap())
                    .execute(&mut *tx)
                    .await?;
                Ok((tx, token))
            })
            .await
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar(&format!("SELECT id FROM \"{}\" ORDER BY id", self.effects))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
    }

    /// The checkpoints of `key`'s row, decoded.
    async fn checkpoints(&self, key: &StorageKey) -> Vec<(String, Vec<u8>)> {
        let (steps, _) = columns(&self.store, key).await;
        let steps =
            idempotent_core::steps::Checkpoints::decode(Bytes::from(steps.unwrap_or_default()))
                .unwrap();
        steps
            .steps()
            .map(|(name, value)| (name.to_owned(), value.to_vec()))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_atomic_step_commits_its_effect_and_its_checkpoint_together() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let call = shop.call("order-1");
    let key = shop.idempotency.storage_key(&call);
    let runs = AtomicUsize::new(0);
    let outcome = shop
        .idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            let token = shop
                .reserve(&claim, "reserve", "r-1", &runs)
                .await
                .expect("the step");
            // Both committed, before the call completes.
            assert_eq!(shop.effects().await, ["r-1"]);
            assert_eq!(
                shop.checkpoints(&key).await,
                [("reserve".to_owned(), token.to_string().into_bytes())]
            );
            // The same step again in this call: the saved value, not another run.
            let again = shop.reserve(&claim, "reserve", "r-2", &runs).await.unwrap();
            assert_eq!(again, token);
            token
        })
        .await
        .unwrap();
    assert!(!outcome.is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(shop.effects().await, ["r-1"]);
    assert_eq!(columns(&shop.store, &key).await, (None, None), "completed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_atomic_step_leaves_neither_its_effect_nor_a_checkpoint() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let call = shop.call("order-2");
    let key = shop.idempotency.storage_key(&call);
    let insert = format!(
        "INSERT INTO \"{}\" (id, owner) VALUES ($1, 0)",
        shop.effects
    );
    shop.idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            let failed = shop
                .store
                .step_in_transaction(&claim, "reserve", |mut tx| async move {
                    sqlx::query(&insert)
                        .bind("r-1")
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    Err::<(_, u64), _>("out of stock".to_owned())
                })
                .await;
            assert!(
                matches!(&failed, Err(StepError::Failed(why)) if why == "out of stock"),
                "{failed:?}"
            );
            assert!(
                shop.effects().await.is_empty(),
                "the insert was rolled back"
            );
            assert_eq!(columns(&shop.store, &key).await, (None, None));
            assert!(!claim.is_lost(), "a failed step keeps the claim");
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_later_attempt_gets_the_saved_value_without_running_the_step() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let call = shop.call("order-3");
    let runs = AtomicUsize::new(0);
    let charges = AtomicUsize::new(0);
    // The first attempt reserves, then fails at the next step and gives the claim up.
    let first = shop
        .idempotency
        .run_with(
            &call,
            async {
                let claim = ClaimHandle::current().expect("inside run");
                let reserved = shop.reserve(&claim, "reserve", "r-1", &runs).await.unwrap();
                charges.fetch_add(1, Ordering::SeqCst);
                Err::<u64, _>(format!("charge failed after reservation {reserved}"))
            },
            |result| {
                if result.is_err() {
                    Retain::Release
                } else {
                    Retain::Keep
                }
            },
        )
        .await
        .unwrap();
    assert!(first.into_inner().is_err());
    // The retry takes the operation over: the reservation comes back without a second run.
    let (second, lifetime) = shop
        .idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            assert_ne!(claim.token(), claim.lifetime(), "a takeover");
            let reserved = shop.reserve(&claim, "reserve", "r-2", &runs).await.unwrap();
            charges.fetch_add(1, Ordering::SeqCst);
            (reserved, claim.lifetime().get())
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second, lifetime, "the value the first owner saved");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the step ran once");
    assert_eq!(charges.load(Ordering::SeqCst), 2);
    assert_eq!(shop.effects().await, ["r-1"], "one reservation");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stale_owners_atomic_step_is_refused_and_rolled_back() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let call = shop.call("order-4");
    let key = shop.idempotency.storage_key(&call);
    let insert = format!(
        "INSERT INTO \"{}\" (id, owner) VALUES ($1, 0)",
        shop.effects
    );
    let successor = std::sync::Mutex::new(None);
    // What the call answers (its completion is refused too) is not what this test is about.
    let _ = shop
        .idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            let (shop, key, insert, successor) = (&shop, &key, &insert, &successor);
            let step = shop
                .store
                .step_in_transaction(&claim, "reserve", |mut tx| async move {
                    sqlx::query(insert)
                        .bind("r-stale")
                        .execute(&mut *tx)
                        .await?;
                    // While the effect is uncommitted, this owner stalls past its lease and
                    // another caller takes the operation over.
                    lapse(&shop.store, key).await;
                    match claim_again(&shop.store, key).await {
                        Claim::TakenOver { token, .. } => *successor.lock().unwrap() = Some(token),
                        other => panic!("expected TakenOver, got {other:?}"),
                    }
                    Ok::<_, sqlx::Error>((tx, 1u64))
                })
                .await;
            assert!(
                matches!(step, Err(StepError::Idempotency(Error::ClaimLost))),
                "{step:?}"
            );
            assert!(claim.is_lost());
            // Refused before it runs from now on.
            let runs = AtomicUsize::new(0);
            let again = shop.reserve(&claim, "other", "r-other", &runs).await;
            assert!(
                matches!(again, Err(StepError::Idempotency(Error::ClaimLost))),
                "{again:?}"
            );
            assert_eq!(runs.load(Ordering::SeqCst), 0);
        })
        .await;
    assert!(
        shop.effects().await.is_empty(),
        "the stale insert was rolled back"
    );
    let successor = successor.lock().unwrap().expect("the successor's token");
    assert!(
        shop.store
            .load_steps(&key, successor)
            .await
            .unwrap()
            .is_empty(),
        "no stale checkpoint"
    );
}

/// Another caller's claim of the same request.
async fn claim_again(store: &PostgresStore, key: &StorageKey) -> Claim {
    store
        .claim(key, &fp("order-4"), LEASE, TTL)
        .await
        .expect("claim")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_atomic_step_refuses_a_claim_of_another_store() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let runs = AtomicUsize::new(0);
    // A runtime over another kind of store.
    let memory = Idempotency::new(MemoryStore::new());
    memory
        .run(&shop.call("order-5"), async {
            let claim = ClaimHandle::current().expect("inside run");
            let result = shop.reserve(&claim, "reserve", "r-1", &runs).await;
            assert!(
                matches!(
                    result,
                    Err(StepError::Idempotency(Error::Store(StoreError::Backend(_))))
                ),
                "{result:?}"
            );
        })
        .await
        .unwrap();
    // A PostgresStore on another table of the same database.
    let other = PostgresStore::builder(shop.store.pool().clone())
        .table(unique("steps"))
        .build()
        .unwrap();
    other.migrate().await.unwrap();
    Idempotency::new(other)
        .run(&shop.call("order-5"), async {
            let claim = ClaimHandle::current().expect("inside run");
            let result = shop.reserve(&claim, "reserve", "r-1", &runs).await;
            assert!(
                matches!(
                    result,
                    Err(StepError::Idempotency(Error::Store(StoreError::Backend(_))))
                ),
                "{result:?}"
            );
        })
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(shop.effects().await.is_empty());
    // A second store value on the same table and database is the same store.
    let twin = PostgresStore::builder(shop.store.pool().clone())
        .table(shop.store.table())
        .build()
        .unwrap();
    let twin_runtime = Idempotency::new(twin);
    twin_runtime
        .run(&shop.call("order-6"), async {
            let claim = ClaimHandle::current().expect("inside run");
            shop.reserve(&claim, "reserve", "r-6", &runs).await.unwrap();
        })
        .await
        .unwrap();
    assert_eq!(shop.effects().await, ["r-6"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transactional_claims_atomic_step_is_refused_and_runs_nothing() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let transactional = idempotent_postgres::Transactional::of(&shop.idempotency, &shop.store);
    let call = shop.call("order-7");
    let runs = AtomicUsize::new(0);
    let mut tx = shop.store.pool().begin().await.unwrap();
    let TransactionalClaim::Run(pending) =
        transactional.claim::<u64>(&call, &mut tx).await.unwrap()
    else {
        panic!("expected to run");
    };
    let claim = pending.claim();
    // A step committed on its own would outlive the caller's rollback, and its retry would
    // make the effect again: refused before anything runs.
    match shop.reserve(&claim, "reserve", "r-7", &runs).await {
        Err(StepError::Idempotency(Error::Store(StoreError::Backend(why)))) => {
            assert!(why.to_string().contains("transactional mode"), "{why}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    tx.rollback().await.unwrap();
    assert!(shop.effects().await.is_empty());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_atomic_step_past_the_checkpoint_limit_is_rolled_back() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let idempotency = Idempotency::builder(shop.store.clone())
        .defaults(idempotent_core::Defaults::new().max_checkpoint_bytes(64))
        .build();
    let call = shop.call("order-8");
    let key = idempotency.storage_key(&call);
    let insert = format!(
        "INSERT INTO \"{}\" (id, owner) VALUES ($1, 0)",
        shop.effects
    );
    idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            let insert = &insert;
            let result = shop
                .store
                .step_in_transaction(&claim, "big", |mut tx| async move {
                    sqlx::query(insert).bind("r-8").execute(&mut *tx).await?;
                    Ok::<_, sqlx::Error>((tx, "x".repeat(100)))
                })
                .await;
            assert!(
                matches!(
                    result,
                    Err(StepError::Idempotency(Error::Checkpoint(
                        idempotent_core::steps::CheckpointError::TooLarge { .. }
                    )))
                ),
                "{result:?}"
            );
            assert!(shop.effects().await.is_empty(), "rolled back");
            assert_eq!(columns(&shop.store, &key).await, (None, None));
        })
        .await
        .unwrap();
}

/// The atomic step's future is `Send`: work that uses it can be spawned.
#[tokio::test(flavor = "multi_thread")]
async fn an_atomic_step_runs_in_a_spawned_task() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let shop = Arc::new(shop);
    let call = shop
        .call("order-9")
        .options(CallOptions::new().lease(LEASE));
    let task = tokio::spawn({
        let shop = Arc::clone(&shop);
        async move {
            shop.idempotency
                .run(&call, async {
                    let claim = ClaimHandle::current().expect("inside run");
                    let runs = AtomicUsize::new(0);
                    shop.reserve(&claim, "reserve", "r-9", &runs).await.unwrap()
                })
                .await
                .unwrap()
                .into_inner()
        }
    });
    task.await.unwrap();
    assert_eq!(shop.effects().await, ["r-9"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn of_two_atomic_steps_of_one_name_in_one_call_the_first_saved_wins() {
    let Some(shop) = Shop::open().await else {
        return;
    };
    let call = shop.call("order-10");
    let insert = format!(
        "INSERT INTO \"{}\" (id, owner) VALUES ($1, 0)",
        shop.effects
    );
    let both_ran = tokio::sync::Barrier::new(2);
    let (first, second) = shop
        .idempotency
        .run(&call, async {
            let claim = ClaimHandle::current().expect("inside run");
            let step = |id: &'static str| {
                let (shop, claim, insert, both_ran) = (&shop, &claim, &insert, &both_ran);
                async move {
                    shop.store
                        .step_in_transaction(claim, "reserve", |mut tx| async move {
                            sqlx::query(insert).bind(id).execute(&mut *tx).await?;
                            // Neither records before both have run.
                            both_ran.wait().await;
                            Ok::<_, sqlx::Error>((tx, id.to_owned()))
                        })
                        .await
                        .unwrap()
                }
            };
            tokio::join!(step("a"), step("b"))
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first, second, "both get the value saved first");
    assert_eq!(
        shop.effects().await,
        [first],
        "the other's effect was rolled back"
    );
}
