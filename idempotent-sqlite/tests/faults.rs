//! What goes wrong around the store: garbage in the table, a file that is not a database, a
//! path that cannot be opened, a read-only database, a lock held past the busy timeout, a
//! full database, and absurd settings. Each is a clear `StoreError` (or a clamp), never a
//! panic and never a record taken for absent.

use idempotent_core::{CheckpointStore, SessionStore};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::conformance::{fresh_key, fresh_session};
use idempotent_core::steps::encode_checkpoint;
use idempotent_core::{
    Claim, FencingToken, Fingerprint, RequestOwner, SessionRequest, StorageKey, Store, StoreError,
    limits,
};
use idempotent_sqlite::{Database, SqliteStore};
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{Connection as _, Executor as _, Row as _};
use tempfile::TempDir;

const MINUTE: Duration = Duration::from_secs(60);

async fn fresh() -> (TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("faults.db"))
        .reap_every(None)
        .build()
        .await
        .unwrap();
    (dir, store)
}

/// A connection of its own on the store's file, to write what the store never would.
async fn raw(path: &Path) -> SqliteConnection {
    SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(path))
        .await
        .unwrap()
}

/// The error and all its sources, as one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// Every column of a row, given as SQL expressions.
struct Garbage {
    what: &'static str,
    state: &'static str,
    fingerprint: &'static str,
    token: &'static str,
    lifetime: &'static str,
    expires_at: &'static str,
    kept_until: &'static str,
    payload: &'static str,
}

const GOOD_FP: &str = "zeroblob(32)";
const LATER: &str = "(CAST(strftime('%s', 'now') AS INTEGER) * 1000 + 60000)";
const EARLIER: &str = "(CAST(strftime('%s', 'now') AS INTEGER) * 1000 - 60000)";

fn live(what: &'static str) -> Garbage {
    Garbage {
        what,
        state: "'completed'",
        fingerprint: GOOD_FP,
        token: "1",
        lifetime: "1",
        expires_at: LATER,
        kept_until: LATER,
        payload: "x'7061796c6f6164'",
    }
}

async fn insert(connection: &mut SqliteConnection, table: &str, key: &[u8], row: &Garbage) {
    let statement = format!(
        "INSERT INTO \"{table}\" (storage_key, state, fingerprint, token, lifetime, expires_at, \
         kept_until, payload) VALUES (?1, {}, {}, {}, {}, {}, {}, {})",
        row.state,
        row.fingerprint,
        row.token,
        row.lifetime,
        row.expires_at,
        row.kept_until,
        row.payload
    );
    connection
        .execute(sqlx::query(&statement).bind(key))
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", row.what));
}

/// The row as it is stored: every column's type and value, as text.
async fn snapshot(connection: &mut SqliteConnection, table: &str, key: &[u8]) -> String {
    let row = connection
        .fetch_one(
            sqlx::query(&format!(
                "SELECT quote(state) || quote(fingerprint) || quote(token) || quote(lifetime) \
                 || quote(expires_at) || quote(kept_until) || quote(payload) || quote(steps) \
                 AS everything FROM \"{table}\" WHERE storage_key = ?1"
            ))
            .bind(key),
        )
        .await
        .unwrap();
    row.get("everything")
}

#[tokio::test]
async fn garbage_in_a_live_row_is_corrupt_and_left_as_it_is() {
    let (dir, store) = fresh().await;
    let mut connection = raw(&dir.path().join("faults.db")).await;
    let cases = [
        Garbage {
            fingerprint: "x'73686f7274'",
            ..live("a fingerprint of 5 bytes")
        },
        Garbage {
            fingerprint: "zeroblob(33)",
            state: "'in_flight'",
            ..live("an in-flight fingerprint of 33 bytes")
        },
        Garbage {
            fingerprint: "'0123456789abcdef0123456789abcdef'",
            ..live("a fingerprint of text")
        },
        Garbage {
            payload: "NULL",
            ..live("a completed record without a payload")
        },
        Garbage {
            payload: "'text, not a blob'",
            ..live("a payload of text")
        },
        Garbage {
            state: "'zz'",
            ..live("an unknown state")
        },
        Garbage {
            state: "''",
            ..live("an empty state")
        },
        Garbage {
            state: "x'00'",
            ..live("a state that is a blob")
        },
        Garbage {
            state: "'session'",
            ..live("a session's state at a request's key")
        },
        Garbage {
            state: "'in_flight'",
            token: "'abc'",
            ..live("a token of text")
        },
        Garbage {
            state: "'in_flight'",
            token: "-4",
            lifetime: "-4",
            ..live("a negative token")
        },
        Garbage {
            state: "'in_flight'",
            token: "3",
            lifetime: "9",
            ..live("a lifetime after its token")
        },
        Garbage {
            state: "'in_flight'",
            lifetime: "1.5",
            ..live("a lifetime that is a real number")
        },
        Garbage {
            expires_at: "'tomorrow'",
            ..live("an expiry of text")
        },
        Garbage {
            // Not a whole number, so the column's affinity keeps it a real number.
            expires_at: "1780000000000.5",
            kept_until: "1780000000000.5",
            ..live("an expiry that is a real number")
        },
        Garbage {
            kept_until: "x'01'",
            ..live("a kept-until that is a blob")
        },
    ];
    let f = Fingerprint::from_digest([0; 32]);
    for case in &cases {
        let key = fresh_key();
        let record = key.record_bytes();
        insert(&mut connection, store.table(), record.as_ref(), case).await;
        let before = snapshot(&mut connection, store.table(), record.as_ref()).await;
        let claim = store.claim(&key, &f, MINUTE, MINUTE).await;
        assert!(
            matches!(claim, Err(StoreError::Corrupt(_))),
            "{}: claim answered {claim:?}",
            case.what
        );
        let resume = store.resume(&key, &f, MINUTE, MINUTE).await;
        assert!(
            matches!(resume, Err(StoreError::Corrupt(_))),
            "{}: resume answered {resume:?}",
            case.what
        );
        // Nobody's token fits garbage: the owner's operations are refused, never a panic.
        for token in [1, 3, 9] {
            let token = FencingToken::new(token);
            let complete = store.complete(&key, token, Bytes::new(), MINUTE).await;
            assert!(
                matches!(complete, Err(StoreError::TokenRejected) | Ok(())),
                "{}: {complete:?}",
                case.what
            );
            let _ = store.release(&key, token).await;
            let _ = store.renew(&key, token, MINUTE).await;
            let _ = store.load_steps(&key, token).await;
        }
        // The garbage is reported, not overwritten (a completion of a completed row with its
        // own token changes nothing either).
        let after = snapshot(&mut connection, store.table(), record.as_ref()).await;
        assert_eq!(before, after, "{}: the row was changed", case.what);
    }
}

#[tokio::test]
async fn garbage_past_its_time_is_absent_and_the_next_token_is_above_it() {
    let (dir, store) = fresh().await;
    let mut connection = raw(&dir.path().join("faults.db")).await;
    let key = fresh_key();
    let expired = Garbage {
        state: "'zz'",
        fingerprint: "x'00'",
        token: "5",
        lifetime: "'?'",
        expires_at: EARLIER,
        kept_until: EARLIER,
        ..live("expired garbage")
    };
    insert(
        &mut connection,
        store.table(),
        key.record_bytes().as_ref(),
        &expired,
    )
    .await;
    let f = Fingerprint::from_bytes(b"new");
    match store.claim(&key, &f, MINUTE, MINUTE).await {
        Ok(Claim::Claimed(token)) => assert!(token.get() > 5, "{token:?}"),
        other => panic!("expected Claimed, got {other:?}"),
    }
    match store.claim(&key, &f, MINUTE, MINUTE).await {
        Ok(Claim::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, f),
        other => panic!("expected the new claim in flight, got {other:?}"),
    }
}

#[tokio::test]
async fn garbage_sessions_checkpoints_and_counters_are_corrupt() {
    let (dir, store) = fresh().await;
    let path = dir.path().join("faults.db");
    let mut connection = raw(&path).await;
    let table = store.table().to_owned();
    let request = SessionRequest::new(1, 0, 64, MINUTE);

    // A live row at a session's key that is not a session, or not a valid one.
    for (what, state, token, lifetime, epoch) in [
        ("a request's row", "'in_flight'", "1", "1", "NULL"),
        ("no epoch", "'session'", "0", "0", "NULL"),
        ("a zero epoch", "'session'", "0", "0", "0"),
        (
            "a mark past the largest",
            "'session'",
            "1000000000000000",
            "0",
            "7",
        ),
        ("a negative high", "'session'", "0", "-1", "7"),
        ("a mark of text", "'session'", "'one'", "0", "7"),
    ] {
        let session = fresh_session();
        let statement = format!(
            "INSERT INTO \"{table}\" (storage_key, state, fingerprint, token, lifetime, epoch, \
             expires_at, kept_until) VALUES (?1, {state}, x'', {token}, {lifetime}, {epoch}, \
             {LATER}, {LATER})"
        );
        connection
            .execute(
                sqlx::query(&statement).bind(session.record_key().record_bytes().as_ref().to_vec()),
            )
            .await
            .unwrap();
        let gate = store.open_session(&session, request).await;
        assert!(
            matches!(gate, Err(StoreError::Corrupt(_))),
            "{what}: {gate:?}"
        );
        let mark = store.session_mark(&session).await;
        assert!(
            matches!(mark, Err(StoreError::Corrupt(_))),
            "{what}: {mark:?}"
        );
    }

    // Checkpoints that are not a blob.
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"steps");
    let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await else {
        panic!("claim");
    };
    connection
        .execute(
            sqlx::query(&format!(
                "UPDATE \"{table}\" SET steps = 'text' WHERE storage_key = ?1"
            ))
            .bind(key.record_bytes().as_ref().to_vec()),
        )
        .await
        .unwrap();
    let steps = store.load_steps(&key, token).await;
    assert!(matches!(steps, Err(StoreError::Corrupt(_))), "{steps:?}");

    // A damaged token counter: no token is drawn from it.
    let tokens = table.replace("records", "tokens");
    connection
        .execute(&*format!("UPDATE \"{tokens}\" SET value = 'x'"))
        .await
        .unwrap();
    let claim = store.claim(&fresh_key(), &f, MINUTE, MINUTE).await;
    assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{claim:?}");
    // A missing one: refused too, until `migrate` makes it again above every token kept.
    connection
        .execute(&*format!("DELETE FROM \"{tokens}\""))
        .await
        .unwrap();
    let claim = store.claim(&fresh_key(), &f, MINUTE, MINUTE).await;
    match claim {
        Err(StoreError::Corrupt(e)) => assert!(e.to_string().contains("missing"), "{e}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    store.migrate().await.unwrap();
    match store.claim(&fresh_key(), &f, MINUTE, MINUTE).await {
        Ok(Claim::Claimed(next)) => assert!(next > token, "{next:?} after {token:?}"),
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[tokio::test]
async fn an_abandoned_row_that_cannot_be_read_is_skipped_not_the_list() {
    let (dir, store) = fresh().await;
    let mut connection = raw(&dir.path().join("faults.db")).await;
    let table = store.table().to_owned();
    let (good, bad) = (fresh_key(), fresh_key());
    for key in [good, bad] {
        let f = Fingerprint::from_bytes(b"kept");
        let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await else {
            panic!("claim");
        };
        store
            .save_request(&key, token, Bytes::from_static(b"request"))
            .await
            .unwrap();
        store.release(&key, token).await.unwrap();
    }
    connection
        .execute(
            sqlx::query(&format!(
                "UPDATE \"{table}\" SET fingerprint = x'01' WHERE storage_key = ?1"
            ))
            .bind(bad.record_bytes().as_ref().to_vec()),
        )
        .await
        .unwrap();
    let listed = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
    assert_eq!(
        listed.iter().map(|a| a.key).collect::<Vec<_>>(),
        [good],
        "the readable one is listed, the damaged one skipped"
    );
    let owner = RequestOwner::new([9; RequestOwner::LEN]);
    assert!(
        store
            .abandoned(Duration::ZERO, 10, Some(&owner))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-database.db");
    std::fs::write(&path, "this is not a SQLite database\n".repeat(200)).unwrap();
    let error = SqliteStore::open(&path).await.unwrap_err();
    assert!(matches!(error, StoreError::Corrupt(_)), "{error:?}");
    let text = chain(&error);
    assert!(text.contains("not-a-database.db"), "{text}");
    assert!(text.contains("not a database"), "{text}");
}

#[tokio::test]
async fn a_path_that_cannot_be_opened_is_unavailable_and_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no such directory").join("records.db");
    let error = SqliteStore::open(&path).await.unwrap_err();
    assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
    let text = chain(&error);
    assert!(text.contains("no such directory"), "{text}");
    assert!(text.contains("unable to open"), "{text}");
    // Not created when told not to.
    let path = dir.path().join("absent.db");
    let error = SqliteStore::builder(&path)
        .create_if_missing(false)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
    assert!(!path.exists());
}

#[tokio::test]
async fn a_read_only_database_refuses_writes_clearly_and_still_reads() {
    let (dir, store) = fresh().await;
    let path = dir.path().join("faults.db");
    let done = fresh_key();
    let f = Fingerprint::from_bytes(b"done");
    let Ok(Claim::Claimed(token)) = store.claim(&done, &f, MINUTE, MINUTE).await else {
        panic!("claim");
    };
    store
        .complete(&done, token, Bytes::from_static(b"result"), MINUTE)
        .await
        .unwrap();
    drop(store);
    let options = SqliteConnectOptions::new().filename(&path).read_only(true);
    let read_only = SqliteStore::builder(Database::options(options.clone()))
        .migrate(false)
        .reap_every(None)
        .build()
        .await
        .unwrap();
    // Replays need no write.
    match read_only.claim(&done, &f, MINUTE, MINUTE).await {
        Ok(Claim::Completed { payload, .. }) => assert_eq!(payload, "result"),
        other => panic!("expected the replay, got {other:?}"),
    }
    let error = read_only
        .claim(&fresh_key(), &f, MINUTE, MINUTE)
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Backend(_)), "{error:?}");
    let text = chain(&error);
    assert!(text.contains("readonly"), "{text}");
    // Migrating it is refused the same way.
    let error = SqliteStore::builder(Database::options(options))
        .build()
        .await
        .unwrap_err();
    assert!(chain(&error).contains("readonly"), "{error:?}");
}

#[tokio::test]
async fn a_lock_held_past_the_busy_timeout_is_unavailable_and_reads_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locked.db");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::from_millis(200))
        .reap_every(None)
        .build()
        .await
        .unwrap();
    let done = fresh_key();
    let f = Fingerprint::from_bytes(b"request");
    let Ok(Claim::Claimed(token)) = store.claim(&done, &f, MINUTE, MINUTE).await else {
        panic!("claim");
    };
    store
        .complete(&done, token, Bytes::from_static(b"result"), MINUTE)
        .await
        .unwrap();
    // Another process holds the write lock.
    let mut holder = raw(&path).await;
    holder.execute("BEGIN IMMEDIATE").await.unwrap();
    let started = std::time::Instant::now();
    let error = store
        .claim(&fresh_key(), &f, MINUTE, MINUTE)
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
    assert!(chain(&error).contains("locked"), "{}", chain(&error));
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "it waited for the lock first ({:?})",
        started.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let error = store.release(&done, token).await.unwrap_err();
    assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
    // A replay reads past the writer.
    match store.claim(&done, &f, MINUTE, MINUTE).await {
        Ok(Claim::Completed { payload, .. }) => assert_eq!(payload, "result"),
        other => panic!("expected the replay, got {other:?}"),
    }
    holder.execute("ROLLBACK").await.unwrap();
    assert!(matches!(
        store.claim(&fresh_key(), &f, MINUTE, MINUTE).await,
        Ok(Claim::Claimed(_))
    ));
}

/// An owner's operation that waited for the write lock while its lease ended is refused: the
/// lease is judged when the lock is held, not when the operation was sent.
#[tokio::test]
async fn a_lease_that_ended_while_waiting_for_the_lock_is_not_renewed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("late.db");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::from_secs(10))
        .reap_every(None)
        .build()
        .await
        .unwrap();
    let lease = Duration::from_millis(300);
    let f = Fingerprint::from_bytes(b"request");
    let (renewed, completed) = (fresh_key(), fresh_key());
    let mut tokens = Vec::new();
    for key in [renewed, completed] {
        let Ok(Claim::Claimed(token)) = store.claim(&key, &f, lease, MINUTE).await else {
            panic!("claim");
        };
        tokens.push(token);
    }
    let mut holder = raw(&path).await;
    holder.execute("BEGIN IMMEDIATE").await.unwrap();
    let renew = tokio::spawn({
        let store = store.clone();
        let token = tokens[0];
        async move { store.renew(&renewed, token, MINUTE).await }
    });
    let complete = tokio::spawn({
        let store = store.clone();
        let token = tokens[1];
        async move {
            store
                .complete(&completed, token, Bytes::from_static(b"late"), MINUTE)
                .await
        }
    });
    tokio::time::sleep(lease * 2).await;
    holder.execute("ROLLBACK").await.unwrap();
    let renew = renew.await.unwrap();
    assert!(matches!(renew, Err(StoreError::TokenRejected)), "{renew:?}");
    let complete = complete.await.unwrap();
    assert!(
        matches!(complete, Err(StoreError::TokenRejected)),
        "{complete:?}"
    );
    // Both are abandoned claims now: the same request takes each over.
    for key in [renewed, completed] {
        assert!(matches!(
            store.claim(&key, &f, MINUTE, MINUTE).await,
            Ok(Claim::TakenOver { .. })
        ));
    }
}

/// A full database (here its `max_page_count`, a full disk in small) refuses new records
/// with `Capacity`, keeps serving what it holds, and takes new ones again once rows are
/// reaped: the failed transactions (which SQLite rolls back by itself) leave no connection
/// unusable.
#[tokio::test]
async fn a_full_database_refuses_with_capacity_and_recovers_when_reaped() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("small.db"))
        .pragma("max_page_count", "40");
    let store = SqliteStore::builder(options)
        .reap_every(None)
        .build()
        .await
        .unwrap();
    let f = Fingerprint::from_bytes(b"request");
    let payload = Bytes::from(vec![7u8; 16 * 1024]);
    let short = Duration::from_millis(300);
    let mut kept = Vec::new();
    let full = loop {
        let key = fresh_key();
        let token = match store.claim(&key, &f, MINUTE, MINUTE).await {
            Ok(Claim::Claimed(token)) => token,
            Err(error) => break error,
            other => panic!("unexpected claim answer {other:?}"),
        };
        match store.complete(&key, token, payload.clone(), short).await {
            Ok(()) => kept.push(key),
            Err(error) => break error,
        }
        assert!(kept.len() < 100, "the database never filled up");
    };
    assert!(
        matches!(full, StoreError::Capacity { .. }),
        "after {} records: {full:?}",
        kept.len()
    );
    assert!(!kept.is_empty(), "some records fit");
    // Full, it still replays.
    match store.claim(&kept[0], &f, MINUTE, MINUTE).await {
        Ok(Claim::Completed { payload: p, .. }) => assert_eq!(p, payload),
        other => panic!("expected the replay, got {other:?}"),
    }
    for _ in 0..3 {
        let key = fresh_key();
        if let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await {
            let done = store.complete(&key, token, payload.clone(), short).await;
            assert!(matches!(done, Err(StoreError::Capacity { .. })), "{done:?}");
        }
    }
    // Once the records expire and are reaped, there is room again.
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    assert!(store.reap().await.unwrap() >= kept.len() as u64);
    let key = fresh_key();
    let Ok(Claim::Claimed(token)) = store.claim(&key, &f, MINUTE, MINUTE).await else {
        panic!("no room after reaping");
    };
    store
        .complete(&key, token, payload.clone(), MINUTE)
        .await
        .expect("room after reaping");
}

#[tokio::test]
async fn absurd_settings_are_clamped_or_refused_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("settings.db");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::MAX)
        .max_readers(0)
        .reap_every(Some(Duration::ZERO))
        .reap_batch(0)
        .build()
        .await
        .expect("clamped settings build");
    let other = SqliteStore::builder(&path)
        .busy_timeout(Duration::ZERO)
        .max_readers(u32::MAX)
        .reap_every(Some(Duration::MAX))
        .build()
        .await
        .expect("clamped settings build");
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"request");
    // The longest lease and TTL are written as their ceilings.
    let token = match store.claim(&key, &f, Duration::MAX, Duration::MAX).await {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    match other.claim(&key, &f, Duration::ZERO, Duration::ZERO).await {
        Ok(Claim::InFlight { retry_after, .. }) => {
            assert!(retry_after <= limits::MAX_LEASE && retry_after > limits::MAX_LEASE / 2)
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    store.renew(&key, token, Duration::MAX).await.unwrap();
    store
        .complete(&key, token, Bytes::from_static(b"x"), Duration::MAX)
        .await
        .unwrap();
    match other.claim(&key, &f, Duration::ZERO, Duration::ZERO).await {
        Ok(Claim::Completed { expires_in, .. }) => assert!(expires_in <= limits::MAX_TTL),
        other => panic!("expected Completed, got {other:?}"),
    }
    // A token no row can hold, and session numbers past the largest.
    let huge = FencingToken::new(u64::MAX);
    assert!(matches!(
        store.release(&key, huge).await,
        Err(StoreError::TokenRejected)
    ));
    assert!(matches!(
        store
            .save_step(&key, huge, encode_checkpoint("s", b"1"))
            .await,
        Err(StoreError::TokenRejected)
    ));
    let session = fresh_session();
    for request in [
        SessionRequest::new(u64::MAX, 0, 64, MINUTE),
        SessionRequest::new(1, u64::MAX, 64, MINUTE),
    ] {
        let gate = store.open_session(&session, request).await;
        assert!(matches!(gate, Err(StoreError::Backend(_))), "{gate:?}");
    }
    // A window or idle time past any use is clamped.
    assert!(
        store
            .open_session(&session, SessionRequest::new(5, 0, u64::MAX, Duration::MAX))
            .await
            .is_ok()
    );
    // Refused, with what is wrong.
    for prefix in ["Bad", "x\"; DROP TABLE t; --", "a.b"] {
        let error = SqliteStore::builder(&path)
            .table_prefix(prefix)
            .build()
            .await
            .unwrap_err();
        assert!(matches!(error, StoreError::Backend(_)), "{error:?}");
        assert!(chain(&error).contains("invalid table prefix"), "{error}");
    }
    for memory in [":memory:", ""] {
        let error = SqliteStore::open(memory).await.unwrap_err();
        assert!(chain(&error).contains("in-memory"), "{memory:?}: {error}");
    }
    let memory: SqliteConnectOptions = "sqlite::memory:".parse().unwrap();
    let error = SqliteStore::builder(memory).build().await.unwrap_err();
    assert!(chain(&error).contains("in-memory"), "{error}");
}

/// A key of its own and the places of a session that share its digest are records of their
/// own.
#[tokio::test]
async fn a_key_and_session_places_with_one_digest_are_apart() {
    let (_dir, store) = fresh().await;
    let digest = [3; 32];
    let own = StorageKey::from_bytes(digest);
    let session = idempotent_core::SessionKey::from_bytes(digest);
    let f = Fingerprint::from_bytes(b"f");
    for key in [
        own,
        session.seq_key(1, 1),
        session.seq_key(u64::MAX, u64::MAX),
    ] {
        assert!(
            matches!(
                store.claim(&key, &f, MINUTE, MINUTE).await,
                Ok(Claim::Claimed(_))
            ),
            "{key:?}"
        );
    }
}
