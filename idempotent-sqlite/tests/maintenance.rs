//! Keeping the file in order: the reaper (explicit and in the background), tokens that keep
//! increasing across reaping and reopening, concurrent migrations, table prefixes, the WAL
//! journal, a claim given back when its caller stopped waiting, and waiting for a change.

use idempotent_core::{CheckpointStore, SessionStore};
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_core::conformance::{fresh_key, fresh_session};
use idempotent_core::{Claim, Fingerprint, SessionRequest, Store};
use idempotent_sqlite::{Durability, SqliteStore};
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{Connection as _, Executor as _, Row as _};

const MINUTE: Duration = Duration::from_secs(60);

async fn raw(path: &Path) -> SqliteConnection {
    SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(path))
        .await
        .unwrap()
}

async fn count(connection: &mut SqliteConnection, table: &str) -> i64 {
    connection
        .fetch_one(&*format!("SELECT count(*) AS n FROM \"{table}\""))
        .await
        .unwrap()
        .get("n")
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Writes records of every kind that expire within `short`, and one that lives on.
async fn expiring_and_live(store: &SqliteStore, short: Duration) -> idempotent_core::StorageKey {
    let f = Fingerprint::from_bytes(b"request");
    let lease = Duration::from_millis(100);
    // Completed with a short TTL.
    let done = fresh_key();
    let Ok(Claim::Claimed(token)) = store.claim(&done, &f, lease, short).await else {
        panic!("claim");
    };
    store
        .complete(&done, token, Bytes::from_static(b"r"), short)
        .await
        .unwrap();
    // Abandoned, claimed with a short TTL.
    let abandoned = fresh_key();
    let Ok(Claim::Claimed(token)) = store.claim(&abandoned, &f, lease, short).await else {
        panic!("claim");
    };
    store.release(&abandoned, token).await.unwrap();
    // A session with a short idle time.
    store
        .open_session(&fresh_session(), SessionRequest::new(1, 0, 64, short))
        .await
        .unwrap();
    // In flight for a minute.
    let live = fresh_key();
    let Ok(Claim::Claimed(_)) = store.claim(&live, &f, MINUTE, MINUTE).await else {
        panic!("claim");
    };
    live
}

#[tokio::test]
async fn reap_deletes_what_expired_in_batches_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reap.db");
    let store = SqliteStore::builder(&path)
        .reap_every(None)
        .reap_batch(1000)
        .build()
        .await
        .unwrap();
    let mut connection = raw(&path).await;
    let table = store.table().to_owned();
    let live = expiring_and_live(&store, Duration::from_millis(200)).await;
    // And 2,500 rows that expired long ago, more than two batches.
    let mut tx = connection.begin().await.unwrap();
    for n in 0..2500u32 {
        let mut key = [0xee; 32];
        key[..4].copy_from_slice(&n.to_be_bytes());
        tx.execute(
            sqlx::query(&format!(
                "INSERT INTO \"{table}\" (storage_key, state, fingerprint, token, lifetime, \
                 expires_at, kept_until, payload) VALUES (?1, 'completed', zeroblob(32), 1, 1, \
                 ?2, ?2, x'00')"
            ))
            .bind(key.to_vec())
            .bind(now_ms() - 60_000),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    assert_eq!(count(&mut connection, &table).await, 2500 + 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.reap().await.unwrap(), 2500 + 3);
    assert_eq!(
        count(&mut connection, &table).await,
        1,
        "only the live row is left"
    );
    assert_eq!(store.reap().await.unwrap(), 0, "nothing more to reap");
    assert!(matches!(
        store
            .claim(&live, &Fingerprint::from_bytes(b"x"), MINUTE, MINUTE)
            .await,
        Ok(Claim::InFlight { .. })
    ));
}

#[tokio::test]
async fn the_background_reaper_keeps_the_table_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reaper.db");
    let store = SqliteStore::builder(&path)
        .reap_every(Some(Duration::from_millis(50)))
        .build()
        .await
        .unwrap();
    let mut connection = raw(&path).await;
    let table = store.table().to_owned();
    expiring_and_live(&store, Duration::from_millis(200)).await;
    assert_eq!(count(&mut connection, &table).await, 4);
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&mut connection, &table).await > 1 {
        assert!(Instant::now() < deadline, "the reaper never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn tokens_keep_increasing_across_reaping_and_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens.db");
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"request");
    let short = Duration::from_millis(100);
    let mut last = 0;
    for round in 0..3 {
        let store = SqliteStore::builder(&path)
            .reap_every(None)
            .build()
            .await
            .unwrap();
        let token = match store.claim(&key, &f, short, short).await {
            Ok(Claim::Claimed(token)) => token,
            other => panic!("round {round}: expected Claimed, got {other:?}"),
        };
        assert!(token.get() > last, "round {round}: {token:?} after {last}");
        last = token.get();
        store
            .complete(&key, token, Bytes::from_static(b"r"), short)
            .await
            .unwrap();
        tokio::time::sleep(short + Duration::from_millis(50)).await;
        // The record is gone from the table; its token is not forgotten.
        assert_eq!(store.reap().await.unwrap(), 1);
    }
}

#[tokio::test]
async fn concurrent_migrations_of_a_new_file_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    let mut opening = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let path = path.clone();
        opening.spawn(async move { SqliteStore::builder(&path).reap_every(None).build().await });
    }
    let mut stores = Vec::new();
    while let Some(opened) = opening.join_next().await {
        stores.push(opened.unwrap().expect("every concurrent open migrates"));
    }
    for store in &stores {
        store
            .migrate()
            .await
            .expect("migrating again changes nothing");
    }
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"request");
    assert!(matches!(
        stores[0].claim(&key, &f, MINUTE, MINUTE).await,
        Ok(Claim::Claimed(_))
    ));
    for store in &stores[1..] {
        assert!(matches!(
            store.claim(&key, &f, MINUTE, MINUTE).await,
            Ok(Claim::InFlight { .. })
        ));
    }
    let mut connection = raw(&path).await;
    let mode: String = connection
        .fetch_one("PRAGMA journal_mode")
        .await
        .unwrap()
        .get(0);
    assert_eq!(mode, "wal");
}

#[tokio::test]
async fn table_prefixes_keep_stores_in_one_file_apart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefixes.db");
    let open = |prefix: &'static str| {
        SqliteStore::builder(&path)
            .table_prefix(prefix)
            .durability(Durability::Normal)
            .reap_every(None)
            .build()
    };
    let (billing, shipping, bare) = (
        open("billing_").await.unwrap(),
        open("shipping_").await.unwrap(),
        open("").await.unwrap(),
    );
    assert_eq!(
        (billing.table(), shipping.table(), bare.table()),
        ("billing_records", "shipping_records", "records")
    );
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"request");
    for store in [&billing, &shipping, &bare] {
        assert!(
            matches!(
                store.claim(&key, &f, MINUTE, MINUTE).await,
                Ok(Claim::Claimed(_))
            ),
            "{}",
            store.table()
        );
    }
    let mut connection = raw(&path).await;
    let tables: Vec<String> = connection
        .fetch_all("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .await
        .unwrap()
        .iter()
        .map(|row| row.get("name"))
        .collect();
    assert_eq!(
        tables,
        [
            "billing_records",
            "billing_tokens",
            "records",
            "shipping_records",
            "shipping_tokens",
            "tokens"
        ]
    );
}

/// A claim whose caller stopped waiting (the runtime bounds every claim) while another
/// process held the lock lands when the lock is let go, and is given back at once: the
/// caller's retry takes it over instead of waiting out a minute's lease.
#[tokio::test]
async fn a_claim_whose_caller_left_is_given_back_when_it_lands() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("give-back.db");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::from_secs(20))
        .reap_every(None)
        .build()
        .await
        .unwrap();
    let table = store.table().to_owned();
    let mut holder = raw(&path).await;
    holder.execute("BEGIN IMMEDIATE").await.unwrap();
    let (key, f) = (fresh_key(), Fingerprint::from_bytes(b"request"));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        store.claim(&key, &f, MINUTE, MINUTE),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the claim waited for the lock: {gave_up:?}"
    );
    holder.execute("ROLLBACK").await.unwrap();
    // The claim lands, then its lease is ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let row = holder
            .fetch_optional(
                sqlx::query(&format!(
                    "SELECT expires_at FROM \"{table}\" WHERE storage_key = ?1"
                ))
                .bind(key.record_bytes().as_ref().to_vec()),
            )
            .await
            .unwrap();
        if let Some(row) = row
            && row.get::<i64, _>("expires_at") <= now_ms()
        {
            break;
        }
        assert!(Instant::now() < deadline, "the claim was never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match store.claim(&key, &f, MINUTE, MINUTE).await {
        Ok(Claim::TakenOver { token, lifetime }) => assert!(lifetime < token),
        other => panic!("expected the given-back claim taken over, got {other:?}"),
    }
}

/// The same for a session request's gate and claim (one transaction): the claim that lands
/// after its caller left is given back, and the retry takes it over at once.
#[tokio::test]
async fn a_session_claim_whose_caller_left_is_given_back_when_it_lands() {
    use idempotent_core::SessionClaim;
    use idempotent_core::inspect::KeyLabel;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("session-give-back.db");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::from_secs(20))
        .reap_every(None)
        .build()
        .await
        .unwrap();
    let session = fresh_session();
    let f = Fingerprint::from_bytes(b"request");
    let label = KeyLabel::from_bytes(Bytes::new());
    let ask = || {
        store.claim_in_session(
            &session,
            SessionRequest::new(1, 0, 8, MINUTE),
            &f,
            MINUTE,
            &label,
        )
    };
    let mut holder = raw(&path).await;
    holder.execute("BEGIN IMMEDIATE").await.unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(300), ask()).await;
    assert!(
        gave_up.is_err(),
        "the claim waited for the lock: {gave_up:?}"
    );
    holder.execute("ROLLBACK").await.unwrap();
    // The claim lands, then its lease is ended: the retry takes it over.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ask().await {
            Ok(SessionClaim::Admitted {
                claim: Claim::TakenOver { token, lifetime },
                ..
            }) => {
                assert!(lifetime < token);
                break;
            }
            Ok(SessionClaim::Admitted {
                claim: Claim::InFlight { .. },
                ..
            }) => {
                assert!(Instant::now() < deadline, "the claim was never given back");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("expected the given-back claim taken over, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn waiting_for_a_change_wakes_on_a_completion_or_a_release() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("wait.db")).await.unwrap();
    // Its metrics label, and its records are outside the process (replays are checksummed).
    assert_eq!(store.name(), "sqlite");
    assert!(!store.keeps_records_in_process());
    let f = Fingerprint::from_bytes(b"request");
    for complete in [true, false] {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await else {
            panic!("claim");
        };
        let owner = store.clone();
        let finisher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if complete {
                owner
                    .complete(&key, token, Bytes::from_static(b"r"), MINUTE)
                    .await
            } else {
                owner.release(&key, token).await
            }
        });
        let started = Instant::now();
        store.wait_for_change(&key, Duration::from_secs(30)).await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "woken by the change ({:?})",
            started.elapsed()
        );
        finisher.await.unwrap().unwrap();
    }
    // Nothing changes: it waits the time given.
    let started = Instant::now();
    store
        .wait_for_change(&fresh_key(), Duration::from_millis(300))
        .await;
    assert!(started.elapsed() >= Duration::from_millis(250));
}

/// Checkpoints are appended in SQL (`||` joins the bytes as text, a cast makes them a blob
/// again): every byte value, NULs and invalid UTF-8 included, comes back as it was saved.
#[tokio::test]
async fn checkpoints_are_kept_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("bytes.db"))
        .await
        .unwrap();
    let (key, f) = (fresh_key(), Fingerprint::from_bytes(b"request"));
    let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await else {
        panic!("claim");
    };
    let every_byte: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let entries = [
        Bytes::from_static(b"\0"),
        Bytes::from(every_byte),
        Bytes::from_static(&[0xff, 0xfe, 0x00, 0xc3, 0x28, 0x00]),
        Bytes::new(),
        Bytes::from_static(b"\xe2\x82"),
    ];
    let mut expected = Vec::new();
    for entry in &entries {
        store.save_step(&key, token, entry.clone()).await.unwrap();
        expected.extend_from_slice(entry);
        assert_eq!(store.load_steps(&key, token).await.unwrap(), expected);
    }
    store
        .save_request(&key, token, Bytes::from_static(b"\0\xff request"))
        .await
        .unwrap();
    store.release(&key, token).await.unwrap();
    let listed = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].request, &b"\0\xff request"[..]);
}
