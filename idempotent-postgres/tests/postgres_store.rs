//! `PostgresStore` against a real PostgreSQL server (started by `scripts/test.sh`): the
//! conformance suite, garbage in the table, table names, migrations, the reaper, and an
//! unreachable server.

use idempotent_core::SessionStore;
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::conformance::{Harness, fresh_key, fresh_session};
use idempotent_core::{
    Call, Claim, Error, Fingerprint, Idempotency, ProblemCode, SessionGate, SessionKey,
    SessionRequest, StorageKey, Store, StoreError,
};
use idempotent_postgres::PostgresStore;
use idempotent_test_kit::backend::{POSTGRES_URL, postgres_url};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool;
use sqlx::postgres::{PgPool, PgPoolOptions};

struct Postgres {
    store: PostgresStore,
}

impl Harness for Postgres {
    type Store = PostgresStore;

    async fn setup() -> Self {
        let url = postgres_url().unwrap_or_else(|| "postgres://127.0.0.1:1/x".into());
        let store = PostgresStore::new(pool(&url, 8).await);
        store.migrate().await.expect("migrate");
        Postgres { store }
    }

    fn store(&self) -> &PostgresStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    fn time_unit(&self) -> Duration {
        Duration::from_millis(150)
    }

    fn backend_env() -> Option<&'static str> {
        Some(POSTGRES_URL)
    }
}

idempotent_core::store_conformance_tests!(Postgres);

/// A store on its own fresh table, for checks that count or corrupt rows.
async fn store_on_fresh_table(
    url: &str,
    configure: impl FnOnce(
        idempotent_postgres::PostgresStoreBuilder,
    ) -> idempotent_postgres::PostgresStoreBuilder,
) -> PostgresStore {
    let table = unique("test");
    let store = configure(PostgresStore::builder(pool(url, 4).await).table(table))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store
}

async fn count_rows(store: &PostgresStore) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\"", store.table()))
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn garbage_in_the_table_is_a_corrupt_error_never_absent() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let insert = format!(
        "INSERT INTO \"{}\" (storage_key, state, fingerprint, token, payload, expires_at) \
         VALUES ($1, $2, $3, 1, $4, now() + interval '1 minute')",
        store.table()
    );
    let f = Fingerprint::from_bytes(b"x");
    let good = f.as_bytes().to_vec();
    let payload = Some(b"payload".to_vec());
    // (state, fingerprint, payload)
    let cases = [
        ("completed", b"short".to_vec(), payload.clone()),
        ("completed", good.clone(), None),
        ("in_flight", vec![7; 33], None),
        ("zz", good.clone(), payload.clone()),
        ("", good.clone(), None),
    ];
    for (state, fingerprint, payload) in &cases {
        let key = fresh_key();
        sqlx::query(&insert)
            .bind(key.as_bytes().as_slice())
            .bind(*state)
            .bind(fingerprint)
            .bind(payload)
            .execute(store.pool())
            .await
            .unwrap();
        let result = store
            .claim(&key, &f, Duration::from_secs(5), Duration::from_secs(5))
            .await;
        assert!(
            matches!(result, Err(StoreError::Corrupt(_))),
            "{state:?}: {result:?}"
        );
        // The garbage is reported, not overwritten.
        let (still_state, still_token): (String, i64) = sqlx::query_as(&format!(
            "SELECT state, token FROM \"{}\" WHERE storage_key = $1",
            store.table()
        ))
        .bind(key.as_bytes().as_slice())
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!((still_state.as_str(), still_token), (*state, 1));
    }

    // A completed row whose payload is not a valid envelope: the runtime reports a corrupt
    // record and does not run the work.
    let idempotency = Idempotency::new(store.clone());
    let call = Call::new("corrupt-envelope".parse().unwrap());
    let key = idempotency.storage_key(&call);
    sqlx::query(&insert)
        .bind(key.as_bytes().as_slice())
        .bind("completed")
        .bind(Fingerprint::empty().as_bytes().as_slice())
        .bind(Some(&b"not an envelope"[..]))
        .execute(store.pool())
        .await
        .unwrap();
    let mut ran = false;
    let result = idempotency
        .run(&call, async {
            ran = true;
        })
        .await;
    assert!(matches!(result, Err(Error::CorruptRecord(_))), "{result:?}");
    assert!(!ran, "the work ran despite a corrupt record");
}

#[tokio::test]
async fn expired_garbage_is_absent_and_taken_over() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let key = fresh_key();
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (storage_key, state, fingerprint, token, expires_at) \
         VALUES ($1, 'zz', '\\x00', 5, now() - interval '1 second')",
        store.table()
    ))
    .bind(key.as_bytes().as_slice())
    .execute(store.pool())
    .await
    .unwrap();
    let f = Fingerprint::from_bytes(b"new");
    match store
        .claim(&key, &f, Duration::from_secs(5), Duration::from_secs(5))
        .await
    {
        Ok(Claim::Claimed(token)) => assert!(token.get() > 5, "{token:?}"),
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[tokio::test]
async fn table_name_is_validated_configurable_and_schema_qualified() {
    for bad in [
        "x; DROP TABLE users",
        "Robert'); --",
        "\"x\"",
        "",
        "a.b.c",
        "Upper",
    ] {
        let error = PostgresStore::builder(PgPool::connect_lazy("postgres://localhost/x").unwrap())
            .table(bad)
            .build()
            .unwrap_err();
        assert!(error.to_string().contains("invalid table name"), "{error}");
    }
    let Some(url) = postgres_url() else {
        return;
    };
    let schema = unique("s");
    let pool = pool(&url, 2).await;
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&pool)
        .await
        .unwrap();
    // A reserved word works as a name: identifiers are always quoted.
    let store = PostgresStore::builder(pool)
        .table(format!("{schema}.select"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"q");
    let Ok(Claim::Claimed(token)) = store
        .claim(&key, &f, Duration::from_secs(5), Duration::from_secs(5))
        .await
    else {
        panic!("claim on a schema-qualified table");
    };
    store
        .complete(
            &key,
            token,
            Bytes::from_static(b"r"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{schema}\".\"select\" WHERE state = 'completed'"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(rows, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_of_one_table_all_succeed() {
    let Some(url) = postgres_url() else {
        return;
    };
    let table = unique("test");
    let pool = pool(&url, 8).await;
    let store = PostgresStore::builder(pool).table(table).build().unwrap();
    let migrations: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for migration in migrations {
        migration.await.unwrap().expect("concurrent migrate");
    }
    assert_eq!(count_rows(&store).await, 0);
}

#[tokio::test]
async fn operations_before_migrate_are_errors() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = PostgresStore::builder(pool(&url, 1).await)
        .table(unique("never_migrated"))
        .build()
        .unwrap();
    let result = store
        .claim(
            &fresh_key(),
            &Fingerprint::empty(),
            Duration::from_secs(1),
            Duration::from_secs(1),
        )
        .await;
    assert!(matches!(result, Err(StoreError::Backend(_))), "{result:?}");
}

async fn fill_with_expired_and_live(store: &PostgresStore, expired: usize) -> Vec<StorageKey> {
    let short = Duration::from_millis(1);
    for i in 0..expired {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) =
            store.claim(&key, &Fingerprint::empty(), short, short).await
        else {
            panic!("claim");
        };
        if i % 2 == 0 {
            // Completed with a tiny TTL or left to its tiny lease: both expire.
            let _ = store
                .complete(&key, token, Bytes::from_static(b"r"), short)
                .await;
        }
    }
    let mut live = Vec::new();
    for _ in 0..3 {
        let key = fresh_key();
        store
            .claim(
                &key,
                &Fingerprint::empty(),
                Duration::from_secs(60),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        live.push(key);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    live
}

#[tokio::test]
async fn reaper_deletes_expired_rows_in_batches_and_keeps_live_ones() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b.reap_batch(4).reap_grace(Duration::ZERO)).await;
    let live = fill_with_expired_and_live(&store, 11).await;
    assert_eq!(count_rows(&store).await, 14);
    assert_eq!(store.reap().await.unwrap(), 11);
    assert_eq!(count_rows(&store).await, 3);
    for key in &live {
        assert!(matches!(
            store
                .claim(
                    key,
                    &Fingerprint::empty(),
                    Duration::from_secs(1),
                    Duration::from_secs(1)
                )
                .await,
            Ok(Claim::InFlight { .. })
        ));
    }
    assert_eq!(store.reap().await.unwrap(), 0);
}

#[tokio::test]
async fn reaper_leaves_recently_expired_rows_for_the_grace_period() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b.reap_grace(Duration::from_millis(500))).await;
    fill_with_expired_and_live(&store, 4).await;
    assert_eq!(
        store.reap().await.unwrap(),
        0,
        "reaped within the grace period"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(store.reap().await.unwrap(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawned_reaper_keeps_the_table_clean() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b.reap_grace(Duration::ZERO)).await;
    let reaper = store.spawn_reaper(Duration::from_millis(50));
    fill_with_expired_and_live(&store, 6).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count_rows(&store).await != 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reaper did not run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reaper.abort();
}

#[tokio::test]
async fn released_token_stays_dead_and_the_row_waits_for_its_ttl_and_the_reaper() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b.reap_grace(Duration::ZERO)).await;
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"r");
    let kept = Duration::from_millis(300);
    let Ok(Claim::Claimed(token)) = store.claim(&key, &f, kept, kept).await else {
        panic!("claim");
    };
    store.release(&key, token).await.unwrap();
    // The row stays, with its lease ended: the next claim of the same request takes it over
    // under its lock and continues its lifetime, until the TTL it was claimed with.
    assert_eq!(count_rows(&store).await, 1);
    assert!(matches!(
        store.renew(&key, token, Duration::from_secs(30)).await,
        Err(StoreError::TokenRejected)
    ));
    assert_eq!(store.reap().await.unwrap(), 0, "kept for its TTL");
    tokio::time::sleep(kept + Duration::from_millis(50)).await;
    assert_eq!(store.reap().await.unwrap(), 1);
    assert_eq!(count_rows(&store).await, 0);
}

/// The rows of `session` in the store's table: its own and its requests'.
async fn session_rows(store: &PostgresStore, session: &SessionKey) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\" WHERE substring(storage_key from 1 for 32) = $1",
        store.table()
    ))
    .bind(session.as_bytes().as_slice())
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Opens request `seq` acknowledging `ack`, claims its record and completes it.
async fn answer_in_session(
    store: &PostgresStore,
    session: &SessionKey,
    (seq, ack): (u64, u64),
    window: u64,
    idle: Duration,
) {
    let epoch = match store
        .open_session(session, SessionRequest::new(seq, ack, window, idle))
        .await
    {
        Ok(SessionGate::Open { epoch }) => epoch,
        other => panic!("request {seq} (ack {ack}): expected Open, got {other:?}"),
    };
    let key = session.seq_key(epoch, seq);
    let fingerprint = Fingerprint::from_bytes(seq.to_string().as_bytes());
    let token = match store
        .claim(&key, &fingerprint, Duration::from_secs(30), idle)
        .await
    {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("request {seq}: expected a fresh claim, got {other:?}"),
    };
    store
        .complete(&key, token, Bytes::from(seq.to_string()), idle)
        .await
        .unwrap();
}

/// However many requests a session makes, its acknowledgements keep its rows within its
/// window: the session's own row and at most `window` answers, counted in the table.
#[tokio::test]
async fn a_session_of_a_thousand_requests_keeps_at_most_its_window_of_rows() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let session = fresh_session();
    let (window, idle) = (8, Duration::from_secs(60));
    let mut most = 0;
    for seq in 1..=1000u64 {
        answer_in_session(&store, &session, (seq, seq - 1), window, idle).await;
        if seq % 100 == 0 {
            most = most.max(session_rows(&store, &session).await);
        }
    }
    let rows = session_rows(&store, &session).await;
    assert!(
        rows <= i64::try_from(window).unwrap() + 1 && most <= rows,
        "{rows} rows of the session after 1000 requests (at most {most} on the way)"
    );
    // Each request acknowledged the one before it: the session's row and the last answer.
    assert_eq!(rows, 2);
    assert_eq!(count_rows(&store).await, 2, "rows outside the session");
    // Answers the client does not acknowledge yet are kept: the window's worth (1000 to 1007
    // above the mark 999), and a request past it is refused but still acknowledges.
    for seq in 1001..=1007u64 {
        answer_in_session(&store, &session, (seq, 999), window, idle).await;
    }
    assert_eq!(session_rows(&store, &session).await, 9);
    assert_eq!(
        store
            .open_session(&session, SessionRequest::new(1009, 1000, window, idle))
            .await
            .unwrap(),
        SessionGate::WindowFull { ack: 1000 }
    );
    assert_eq!(session_rows(&store, &session).await, 8);
}

/// A session row the store cannot interpret is reported as corrupt, never taken for an
/// absent session nor overwritten while it is live; an expired one is absent.
#[tokio::test]
async fn a_garbled_session_row_is_corrupt_never_absent() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let insert = format!(
        "INSERT INTO \"{}\" (storage_key, state, fingerprint, token, lifetime, claimant, \
         expires_at) VALUES ($1, $2, '\\x', $3, $4, $5, now() + $6 * interval '1 second')",
        store.table()
    );
    let idle = Duration::from_secs(60);
    // (state, mark, high, epoch)
    let cases: [(&str, i64, Option<i64>, Option<i64>); 7] = [
        ("session", -1, Some(3), Some(7)),
        ("session", 2, None, Some(7)),
        ("session", 2, Some(-3), Some(7)),
        ("session", 2, Some(3), None),
        ("session", 2, Some(3), Some(0)),
        ("session", i64::MAX, Some(3), Some(7)),
        ("completed", 2, Some(3), Some(7)),
    ];
    for (state, mark, high, epoch) in cases {
        let session = fresh_session();
        let record = session.record_key().record_bytes();
        sqlx::query(&insert)
            .bind(record.as_ref())
            .bind(state)
            .bind(mark)
            .bind(high)
            .bind(epoch)
            .bind(60.0)
            .execute(store.pool())
            .await
            .unwrap();
        for (seq, ack) in [(1, 0), (4, 3), (3, 3)] {
            let gate = store
                .open_session(&session, SessionRequest::new(seq, ack, 64, idle))
                .await;
            assert!(
                matches!(gate, Err(StoreError::Corrupt(_))),
                "{state} {mark} {high:?} {epoch:?}, request ({seq}, {ack}): {gate:?}"
            );
        }
        let still: (String, i64, Option<i64>, Option<i64>) = sqlx::query_as(&format!(
            "SELECT state, token, lifetime, claimant FROM \"{}\" WHERE storage_key = $1",
            store.table()
        ))
        .bind(record.as_ref())
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(still, (state.to_owned(), mark, high, epoch), "overwritten");
    }
    // Expired garbage is no session: refused as expired with an ack, started without one.
    let session = fresh_session();
    let record = session.record_key().record_bytes();
    sqlx::query(&insert)
        .bind(record.as_ref())
        .bind("session")
        .bind(-1_i64)
        .bind(None::<i64>)
        .bind(None::<i64>)
        .bind(-1.0)
        .execute(store.pool())
        .await
        .unwrap();
    let request = |seq, ack| SessionRequest::new(seq, ack, 64, idle);
    assert_eq!(
        store.open_session(&session, request(2, 1)).await.unwrap(),
        SessionGate::Expired
    );
    assert!(matches!(
        store.open_session(&session, request(1, 0)).await,
        Ok(SessionGate::Open { .. })
    ));
}

/// A first request that meets a session started after its statement began (a concurrent
/// first request, not committed yet when it looked) waits for it, then joins it: same epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_joins_a_session_started_concurrently() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let session = fresh_session();
    let record = session.record_key().record_bytes();
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (storage_key, state, fingerprint, token, lifetime, claimant, \
         expires_at) VALUES ($1, 'session', '\\x', 0, 1, 424242, now() + interval '1 minute')",
        store.table()
    ))
    .bind(record.as_ref())
    .execute(&mut *tx)
    .await
    .unwrap();
    let gate = tokio::spawn({
        let (store, session) = (store.clone(), session);
        async move {
            store
                .open_session(
                    &session,
                    SessionRequest::new(2, 0, 64, Duration::from_secs(60)),
                )
                .await
        }
    });
    // Commit once the gate waits on the uncommitted row.
    let marker = format!("WITH locked AS (SELECT % FROM \"{}\" %", store.table());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE $1",
        )
        .bind(&marker)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            !gate.is_finished(),
            "the gate did not wait: {:?}",
            gate.await
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gate is not seen waiting"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.commit().await.unwrap();
    assert_eq!(
        gate.await.unwrap().unwrap(),
        SessionGate::Open { epoch: 424242 }
    );
    let high: i64 = sqlx::query_scalar(&format!(
        "SELECT lifetime FROM \"{}\" WHERE storage_key = $1",
        store.table()
    ))
    .bind(record.as_ref())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(high, 2);
}

/// The reaper deletes a session nobody sent to for its idle time, with its answers; the
/// session is then unknown.
#[tokio::test]
async fn the_reaper_deletes_expired_sessions() {
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b.reap_grace(Duration::ZERO)).await;
    let (session, live) = (fresh_session(), fresh_session());
    let idle = Duration::from_millis(100);
    answer_in_session(&store, &session, (1, 0), 64, idle).await;
    answer_in_session(&store, &session, (2, 0), 64, idle).await;
    answer_in_session(&store, &live, (1, 0), 64, Duration::from_secs(60)).await;
    assert_eq!(session_rows(&store, &session).await, 3);
    assert_eq!(store.reap().await.unwrap(), 0, "reaped a live session");
    tokio::time::sleep(idle + Duration::from_millis(50)).await;
    assert_eq!(store.reap().await.unwrap(), 3);
    assert_eq!(session_rows(&store, &session).await, 0);
    assert_eq!(session_rows(&store, &live).await, 2);
    assert_eq!(
        store
            .open_session(&session, SessionRequest::new(3, 2, 64, idle))
            .await
            .unwrap(),
        SessionGate::Expired
    );
}

#[tokio::test]
async fn unreachable_server_is_unavailable() {
    // Nothing listens on port 1.
    match PostgresStore::connect("postgres://postgres@127.0.0.1:1/postgres").await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // A lazily connected pool reports the same on every operation.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/postgres")
        .unwrap();
    let store = PostgresStore::new(pool);
    let key = fresh_key();
    let f = Fingerprint::empty();
    assert!(matches!(
        store
            .claim(&key, &f, Duration::from_secs(1), Duration::from_secs(1))
            .await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.migrate().await,
        Err(StoreError::Unavailable(_))
    ));
    let runtime = Idempotency::new(store);
    let result = runtime
        .run(&Call::new("k".parse().unwrap()), async { 1 })
        .await;
    let error = result.unwrap_err();
    assert_eq!(error.code(), ProblemCode::StoreUnavailable);
    assert!(error.retry_after().is_some());
}

/// The store does not check its connections before or after each operation: a connection
/// broken under it (a database restart; here every backend of its database terminated) fails
/// the one operation that next uses it and is closed, so at most one failure per open
/// connection, and service resumes on new connections without a new store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_connections_fail_one_operation_each_then_are_replaced() {
    let Some(url) = postgres_url() else {
        return;
    };
    // A database of its own, so that terminating its backends touches no other test.
    let admin = pool(&url, 1).await;
    let database = unique("idempotent_broken");
    sqlx::query(&format!("CREATE DATABASE \"{database}\""))
        .execute(&admin)
        .await
        .unwrap();
    let (base, _) = url.rsplit_once('/').expect("a database in the URL");
    let store = PostgresStore::connect(&format!("{base}/{database}"))
        .await
        .unwrap();
    store.migrate().await.unwrap();

    // Open several of the store's connections with concurrent claims.
    let claims: Vec<_> = (0..200)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim(
                        &fresh_key(),
                        &Fingerprint::empty(),
                        Duration::from_secs(30),
                        Duration::from_secs(30),
                    )
                    .await
                    .unwrap()
            })
        })
        .collect();
    for claim in claims {
        assert!(matches!(claim.await.unwrap(), Claim::Claimed(_)));
    }
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&database)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(open >= 2, "only {open} connections open");
    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()) AS t",
    )
    .bind(&database)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(
        terminated, open,
        "terminated {terminated} of {open} backends"
    );

    let mut failures = 0;
    let mut last_failure = 0;
    for attempt in 1..=48 {
        let key = fresh_key();
        match store
            .claim(
                &key,
                &Fingerprint::empty(),
                Duration::from_secs(30),
                Duration::from_secs(30),
            )
            .await
        {
            Ok(Claim::Claimed(_)) => {}
            Ok(other) => panic!("a fresh key was {other:?}"),
            Err(StoreError::Unavailable(_)) => {
                failures += 1;
                last_failure = attempt;
            }
            Err(error) => panic!("unexpected {error:?}"),
        }
    }
    // One failure per broken connection (the pool's own connection, used by `migrate`, is
    // among them but serves no claim).
    assert!(
        failures < open,
        "{failures} operations failed on {open} connections"
    );
    assert!(
        last_failure < open,
        "operation {last_failure} still failed: broken connections are not replaced"
    );

    store.pool().close().await;
    sqlx::query(&format!("DROP DATABASE \"{database}\" WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}

/// A repair refused during a live lease leaves the row unlocked: the owner renews and
/// completes at once (the refusal's transaction was left open on its pooled connection, the
/// row locked `FOR UPDATE` until that connection was used again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_repair_leaves_the_row_to_its_owner() {
    use idempotent_core::inspect::{InspectStore, Refusal, Repair, Repaired};
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    // The operator's tool: another process, its own connections.
    let operator = PostgresStore::builder(pool(&url, 2).await)
        .table(store.table())
        .build()
        .unwrap();
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"owner");
    let lease = Duration::from_secs(30);
    let token = match store.claim(&key, &f, lease, lease).await.unwrap() {
        Claim::Claimed(token) => token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    for repair in [Repair::Release, Repair::Forget] {
        match operator.repair(&key, token, &repair, false).await.unwrap() {
            Repaired::Refused(Refusal::LeaseLive { .. }) => {}
            other => panic!("expected LeaseLive, got {other:?}"),
        }
    }
    let renewed =
        tokio::time::timeout(Duration::from_secs(5), store.renew(&key, token, lease)).await;
    assert!(
        matches!(renewed, Ok(Ok(()))),
        "the owner's renewal after a refused repair: {renewed:?}"
    );
    let completed = tokio::time::timeout(
        Duration::from_secs(5),
        store.complete(&key, token, Bytes::from_static(b"done"), lease),
    )
    .await;
    assert!(matches!(completed, Ok(Ok(()))), "{completed:?}");
}

/// A session claim that lands after its caller stopped waiting (the database was frozen) is
/// given back through the session's epoch once the database answers: the same request then
/// takes it over, or claims it anew if the database never committed it, instead of waiting out
/// its lease. The request acknowledges the one before it, so what is frozen in flight is the
/// statement that claims it (the common case's), not one that would find it not its case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_claim_whose_caller_stopped_waiting_is_given_back() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let Some(postgres) = idempotent_test_kit::postgres::PrivatePostgres::start().await else {
        return;
    };
    let store = PostgresStore::connect(&postgres.url()).await.unwrap();
    store.migrate().await.unwrap();
    let session = fresh_session();
    let (idle, lease) = (Duration::from_secs(60), Duration::from_secs(60));
    let f = Fingerprint::from_bytes(b"session give-back");
    let label = KeyLabel::from_bytes(Bytes::new());
    let ask = |seq: u64| {
        let (store, label) = (store.clone(), label.clone());
        async move {
            store
                .claim_in_session(
                    &session,
                    SessionRequest::new(seq, seq - 1, 8, idle),
                    &f,
                    lease,
                    &label,
                )
                .await
        }
    };
    // The session starts, so the request's record is found through its epoch.
    let epoch = match ask(1).await.unwrap() {
        SessionClaim::Admitted {
            epoch,
            claim: Claim::Claimed(token),
        } => {
            store
                .complete(&session.seq_key(epoch, 1), token, Bytes::new(), idle)
                .await
                .unwrap();
            epoch
        }
        other => panic!("request 1: {other:?}"),
    };
    let frozen = postgres.freeze();
    let late = tokio::time::timeout(Duration::from_millis(500), ask(2)).await;
    assert!(late.is_err(), "the frozen database answered: {late:?}");
    drop(frozen);
    // Thawed: the claim lands (or is rolled back with its connection), then its give-back;
    // the same request holds it at once.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        match ask(2).await {
            Ok(SessionClaim::Admitted {
                epoch: again,
                claim: Claim::TakenOver { .. } | Claim::Claimed(_),
            }) => {
                assert_eq!(again, epoch);
                break;
            }
            Ok(SessionClaim::Admitted {
                claim: Claim::InFlight { .. },
                ..
            })
            | Err(StoreError::Unavailable(_)) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the late claim was not given back within 15 s"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("request 2 after the thaw: {other:?}"),
        }
    }
}

/// A table migrated by an older release has no session claim function: a session request that
/// needs it (here a new session's first, which the common case's statement does not make) is a
/// `backend` error naming it (and what to run), never a panic or a silent fallback, and
/// `migrate` creates it.
#[tokio::test]
async fn a_session_claim_without_the_function_says_to_migrate() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    sqlx::query(&format!(
        "DROP FUNCTION \"{}_session_claim\"",
        store.table()
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let session = fresh_session();
    let label = KeyLabel::from_bytes(Bytes::new());
    let f = Fingerprint::from_bytes(b"migrate");
    let ask = || {
        store.claim_in_session(
            &session,
            SessionRequest::new(1, 0, 8, Duration::from_secs(60)),
            &f,
            Duration::from_secs(30),
            &label,
        )
    };
    match ask().await {
        Err(StoreError::Backend(error)) => {
            let error = error.to_string();
            assert!(error.contains("_session_claim"), "{error}");
            assert!(error.contains("run PostgresStore::migrate"), "{error}");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    store.migrate().await.unwrap();
    assert!(matches!(
        ask().await,
        Ok(SessionClaim::Admitted {
            claim: Claim::Claimed(_),
            ..
        })
    ));
}

/// A session request in the common case (a live session, its request admitted, nothing left
/// unacknowledged above the new mark) is made by one plain statement, without the session claim
/// function; every other case is the function's. Shown by replacing the function with one that
/// fails: the common requests still succeed, and each other case reaches it.
#[tokio::test]
async fn a_session_request_in_the_common_case_does_not_call_the_function() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let session = fresh_session();
    let label = KeyLabel::from_bytes(Bytes::new());
    let idle = Duration::from_secs(60);
    let ask = |seq: u64, ack: u64| {
        let (store, label) = (store.clone(), label.clone());
        async move {
            store
                .claim_in_session(
                    &session,
                    SessionRequest::new(seq, ack, 8, idle),
                    &Fingerprint::from_bytes(&seq.to_be_bytes()),
                    Duration::from_secs(30),
                    &label,
                )
                .await
        }
    };
    let answer = |seq: u64, epoch: u64, token: idempotent_core::FencingToken| {
        let store = store.clone();
        async move {
            store
                .complete(
                    &session.seq_key(epoch, seq),
                    token,
                    Bytes::from(seq.to_string()),
                    idle,
                )
                .await
                .unwrap();
        }
    };
    let claimed = |result: Result<SessionClaim, StoreError>| match result {
        Ok(SessionClaim::Admitted {
            epoch,
            claim: Claim::Claimed(token),
        }) => (epoch, token),
        other => panic!("expected a claim, got {other:?}"),
    };
    // The session starts through the function (no row yet).
    let (epoch, token) = claimed(ask(1, 0).await);
    answer(1, epoch, token).await;
    let function = format!("\"{}_session_claim\"", store.table());
    sqlx::query(&format!(
        "CREATE OR REPLACE FUNCTION {function}(bytea, int8, int8, int8, int8, bytea, int8, int8, \
         bytea) RETURNS TABLE (o_gate text, o_epoch int8, o_mark int8, o_state text, \
         o_token int8, o_lifetime int8, o_fingerprint bytea, o_payload bytea, \
         o_remaining_us int8) LANGUAGE plpgsql AS $$ BEGIN \
         RAISE EXCEPTION 'the session claim function ran'; END $$"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let reached_the_function = |result: Result<SessionClaim, StoreError>| match result {
        Err(StoreError::Backend(error)) => {
            assert!(
                error.to_string().contains("the session claim function ran"),
                "{error}"
            )
        }
        other => panic!("expected the function's error, got {other:?}"),
    };
    // Requests that acknowledge the one before: the common case, each claimed, each dropping
    // the answer it acknowledges.
    for seq in 2..=5 {
        let (same_epoch, token) = claimed(ask(seq, seq - 1).await);
        assert_eq!(same_epoch, epoch);
        answer(seq, epoch, token).await;
        // The session's own row, and request `seq`'s.
        assert_eq!(
            session_rows(&store, &session).await,
            2,
            "after request {seq}"
        );
    }
    // The session's row as the common case left it: mark, highest number, end of idle time.
    let row = || {
        let store = store.clone();
        async move {
            let row: (i64, i64, i64) = sqlx::query_as(&format!(
                "SELECT token, lifetime, (EXTRACT(EPOCH FROM idle_until) * 1000000)::int8 \
                 FROM \"{}\" WHERE storage_key = $1",
                store.table()
            ))
            .bind(session.record_key().record_bytes().as_ref().to_vec())
            .fetch_one(store.pool())
            .await
            .unwrap();
            row
        }
    };
    let before = row().await;
    assert_eq!((before.0, before.1), (4, 5), "mark 4, highest 5");
    // A request that leaves the one before unacknowledged (here 6, acknowledging 4, leaves 5
    // above its mark) is the function's, as is a refusal (3, which the mark covers), an
    // unknown session, and a request past the window.
    reached_the_function(ask(6, 4).await);
    reached_the_function(ask(3, 5).await);
    let other = fresh_session();
    reached_the_function(
        store
            .claim_in_session(
                &other,
                SessionRequest::new(1, 0, 8, idle),
                &Fingerprint::from_bytes(b"other"),
                Duration::from_secs(30),
                &label,
            )
            .await,
    );
    reached_the_function(ask(20, 5).await);
    // None of them wrote anything on their way to the function.
    assert_eq!(row().await, before);
    // A row an older release wrote last (NULL in `payload`) is the function's too, even for a
    // request that would otherwise be the common case.
    sqlx::query(&format!(
        "UPDATE \"{}\" SET payload = NULL WHERE storage_key = $1",
        store.table()
    ))
    .bind(session.record_key().record_bytes().as_ref().to_vec())
    .execute(store.pool())
    .await
    .unwrap();
    reached_the_function(ask(6, 5).await);
    assert_eq!(row().await, before);
    // A row already at the request's key (which no admitted number can have: here put there
    // by hand) is the function's too; the statement's gate has written what the function's
    // would write again.
    let table = store.table().to_owned();
    let by_hand = |sql: &'static str| {
        let (store, table) = (store.clone(), table.clone());
        async move {
            sqlx::query(&sql.replace("TABLE", &format!("\"{table}\"")))
                .bind(session.record_key().record_bytes().as_ref().to_vec())
                .bind(session.seq_key(epoch, 6).record_bytes().as_ref().to_vec())
                .execute(store.pool())
                .await
                .unwrap();
        }
    };
    by_hand("UPDATE TABLE SET payload = ''::bytea WHERE storage_key = $1 AND $2 IS NOT NULL").await;
    by_hand(
        "INSERT INTO TABLE (storage_key, state, fingerprint, token, expires_at) \
         SELECT $2, 'in_flight', ''::bytea, 1, clock_timestamp() + interval '1 hour' \
         WHERE $1 IS NOT NULL",
    )
    .await;
    reached_the_function(ask(6, 5).await);
    let gated = row().await;
    assert_eq!((gated.0, gated.1), (5, 6), "mark 5, highest 6");
    // With the function back, it decides that request from the row there, as the claim
    // statement answers such a row (this one, made by hand, has no valid fingerprint).
    store.migrate().await.unwrap();
    let from_the_row = ask(6, 5).await;
    assert!(
        matches!(from_the_row, Err(StoreError::Corrupt(_))),
        "{from_the_row:?}"
    );
    // Without the row, the function claims request 6 (already the session's highest), and
    // the session goes on in the common case from the row the function wrote: request 7's
    // acknowledgement drops answer 6.
    by_hand("DELETE FROM TABLE WHERE storage_key = $2 AND $1 IS NOT NULL").await;
    let (same_epoch, token) = claimed(ask(6, 5).await);
    assert_eq!(same_epoch, epoch);
    answer(6, epoch, token).await;
    let (same_epoch, _) = claimed(ask(7, 6).await);
    assert_eq!(same_epoch, epoch);
    assert_eq!(session_rows(&store, &session).await, 2);
    let after = row().await;
    assert_eq!((after.0, after.1), (6, 7), "mark 6, highest 7");
}

/// A session's row keeps its indexed `expires_at` (one and a half idle times ahead) while a
/// request moves only the exact end of its idle time, `idle_until`; `expires_at` moves once it
/// has less than the idle time left, and stays at or after `idle_until`.
#[tokio::test]
async fn a_sessions_row_is_not_rewritten_in_its_indexed_expiry_by_every_request() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let session = fresh_session();
    let label = KeyLabel::from_bytes(Bytes::new());
    let ask = |seq: u64, idle: Duration| {
        let (store, label) = (store.clone(), label.clone());
        async move {
            match store
                .claim_in_session(
                    &session,
                    SessionRequest::new(seq, seq - 1, 8, idle),
                    &Fingerprint::from_bytes(&seq.to_be_bytes()),
                    Duration::from_secs(30),
                    &label,
                )
                .await
            {
                Ok(SessionClaim::Admitted {
                    claim: Claim::Claimed(_),
                    ..
                }) => {}
                other => panic!("request {seq}: {other:?}"),
            }
        }
    };
    let times = || async {
        let row: (i64, i64) = sqlx::query_as(&format!(
            "SELECT (EXTRACT(EPOCH FROM expires_at) * 1000000)::int8, \
             (EXTRACT(EPOCH FROM idle_until) * 1000000)::int8 \
             FROM \"{}\" WHERE storage_key = $1",
            store.table()
        ))
        .bind(session.record_key().record_bytes().as_ref().to_vec())
        .fetch_one(store.pool())
        .await
        .unwrap();
        row
    };
    let idle = Duration::from_secs(60);
    ask(1, idle).await;
    let (expires, until) = times().await;
    // One and a half idle times ahead, the idle time's end one idle time ahead.
    assert!(
        (expires - until - 30_000_000).abs() < 1_000_000,
        "{expires} {until}"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    ask(2, idle).await;
    let (expires_after, until_after) = times().await;
    assert_eq!(expires_after, expires, "expires_at was rewritten");
    assert!(until_after >= until + 50_000, "{until} {until_after}");
    // A request with a longer idle time than `expires_at` leaves moves it on.
    ask(3, Duration::from_secs(120)).await;
    let (expires_long, until_long) = times().await;
    assert!(expires_long >= until_long, "{expires_long} {until_long}");
    assert!(expires_long > expires, "{expires} {expires_long}");
}

/// During a rolling upgrade an older release writes a session's row too: it keeps the exact
/// end of the idle time in `expires_at` and NULL in `payload`, and leaves `idle_until` as it
/// was. 0.4 then reads `expires_at`: the session is live while the older release says so.
#[tokio::test]
async fn a_sessions_row_written_last_by_an_older_release_is_read_by_its_expires_at() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let Some(url) = postgres_url() else {
        return;
    };
    let store = store_on_fresh_table(&url, |b| b).await;
    let session = fresh_session();
    let label = KeyLabel::from_bytes(Bytes::new());
    let idle = Duration::from_secs(60);
    let first = store
        .claim_in_session(
            &session,
            SessionRequest::new(1, 0, 8, idle),
            &Fingerprint::from_bytes(b"1"),
            Duration::from_secs(30),
            &label,
        )
        .await
        .unwrap();
    let SessionClaim::Admitted { epoch, .. } = first else {
        panic!("request 1: {first:?}");
    };
    // An older release's gate: the exact end in `expires_at`, NULL in `payload`; here with an
    // `idle_until` already past, which 0.4 must not read.
    sqlx::query(&format!(
        "UPDATE \"{}\" SET payload = NULL, expires_at = clock_timestamp() + interval '1 minute', \
         idle_until = clock_timestamp() - interval '1 second' WHERE storage_key = $1",
        store.table()
    ))
    .bind(session.record_key().record_bytes().as_ref().to_vec())
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(
        store.session_mark(&session).await.unwrap(),
        Some(idempotent_core::SessionMark { epoch, ack: 0 })
    );
    match store
        .claim_in_session(
            &session,
            SessionRequest::new(2, 1, 8, idle),
            &Fingerprint::from_bytes(b"2"),
            Duration::from_secs(30),
            &label,
        )
        .await
    {
        Ok(SessionClaim::Admitted { epoch: again, .. }) => assert_eq!(again, epoch),
        other => panic!("request 2 in the live session: {other:?}"),
    }
}
