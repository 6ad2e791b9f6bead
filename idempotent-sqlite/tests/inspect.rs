//! What the conformance suite cannot see of `InspectStore` on SQLite: a file made by the
//! version before it (no label, release, count or time columns) migrates in place and its
//! records are inspected, listed and repaired; garbage in the new columns is corrupt or no
//! label, never a panic; a bad cursor is an error.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::conformance::fresh_key;
use idempotent_core::inspect::{
    Cursor, InspectStore, KeyLabel, ListQuery, Listed, RecordState, Repair, Repaired,
};
use idempotent_core::{Claim, FencingToken, Fingerprint, Key, Scope, Store, StoreError};
use idempotent_sqlite::SqliteStore;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{Connection as _, Executor as _, Row as _};

const MINUTE: Duration = Duration::from_secs(60);

async fn raw(path: &Path, create: bool) -> SqliteConnection {
    SqliteConnection::connect_with(
        &SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(create),
    )
    .await
    .unwrap()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn label(key: &str) -> KeyLabel {
    KeyLabel::new(&Key::new(key).unwrap(), &Scope::new().tenant("t"), true)
}

async fn open(path: &Path) -> SqliteStore {
    SqliteStore::builder(path)
        .reap_every(None)
        .build()
        .await
        .unwrap()
}

/// The schema of the version before `InspectStore`, as its `migrate` made it.
const OLD_SCHEMA: [&str; 5] = [
    "CREATE TABLE \"idempotent_records\" (storage_key BLOB NOT NULL PRIMARY KEY, \
     state TEXT NOT NULL, fingerprint BLOB NOT NULL, token INTEGER NOT NULL, \
     lifetime INTEGER NOT NULL, epoch INTEGER, expires_at INTEGER NOT NULL, \
     kept_until INTEGER NOT NULL, payload BLOB, steps BLOB, request BLOB)",
    "CREATE INDEX \"idempotent_records_kept_until\" ON \"idempotent_records\" (kept_until)",
    "CREATE INDEX \"idempotent_records_abandoned\" ON \"idempotent_records\" \
     (substr(request, 1, 36), expires_at) WHERE state = 'in_flight' AND request IS NOT NULL",
    "CREATE TABLE \"idempotent_tokens\" (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT INTO \"idempotent_tokens\" (name, value) VALUES ('last', 20)",
];

async fn columns(connection: &mut SqliteConnection) -> Vec<String> {
    connection
        .fetch_all("SELECT name FROM pragma_table_info('idempotent_records')")
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<String, _>("name"))
        .collect()
}

#[tokio::test]
async fn a_file_of_the_previous_version_migrates_and_its_records_are_inspected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let (done, running, lapsed) = (fresh_key(), fresh_key(), fresh_key());
    let fp = Fingerprint::from_bytes(b"old request");
    {
        let mut old = raw(&path, true).await;
        for statement in OLD_SCHEMA {
            old.execute(statement).await.unwrap();
        }
        let now = now_ms();
        for (key, state, token, expires_at, payload) in [
            (
                &done,
                "completed",
                10,
                now + 60_000,
                Some(&b"old answer"[..]),
            ),
            (&running, "in_flight", 11, now + 60_000, None),
            (&lapsed, "in_flight", 12, now - 5_000, None),
        ] {
            old.execute(
                sqlx::query(
                    "INSERT INTO \"idempotent_records\" (storage_key, state, fingerprint, token, \
                     lifetime, expires_at, kept_until, payload, steps) \
                     VALUES (?1, ?2, ?3, ?4, ?4, ?5, ?6, ?7, NULL)",
                )
                .bind(key.record_bytes().as_ref().to_vec())
                .bind(state)
                .bind(fp.as_bytes().to_vec())
                .bind(token)
                .bind(expires_at)
                .bind(now + 60_000)
                .bind(payload),
            )
            .await
            .unwrap();
        }
        old.close().await.unwrap();
    }

    let store = open(&path).await;
    let mut connection = raw(&path, false).await;
    let added = columns(&mut connection).await;
    for column in ["label", "released", "attempts", "since"] {
        assert!(
            added.iter().any(|c| c == column),
            "{column} added: {added:?}"
        );
    }

    // The old records: no label, not counted (0), in their state since the upgrade (or, a
    // lapsed lease, since it ended).
    let info = store
        .inspect(&done)
        .await
        .unwrap()
        .expect("the completed row");
    assert_eq!(info.state, RecordState::Completed);
    assert_eq!(info.token, FencingToken::new(10));
    assert_eq!(info.payload.as_deref(), Some(&b"old answer"[..]));
    assert_eq!((info.label, info.attempts), (None, 0));
    assert!(info.age < Duration::from_secs(5), "{:?}", info.age);
    let info = store
        .inspect(&running)
        .await
        .unwrap()
        .expect("the live row");
    assert_eq!(info.state, RecordState::InFlight);
    assert!(!info.abandoned());
    let info = store
        .inspect(&lapsed)
        .await
        .unwrap()
        .expect("the lapsed row");
    assert!(info.abandoned() && info.state == RecordState::InFlight);
    assert!(info.age >= Duration::from_secs(4), "{:?}", info.age);

    // Listed on the new indexes.
    let page = store
        .list(&ListQuery::new(Listed::Completed))
        .await
        .unwrap();
    assert_eq!(
        page.records.iter().map(|r| r.key).collect::<Vec<_>>(),
        [done]
    );
    let page = store.list(&ListQuery::new(Listed::InFlight)).await.unwrap();
    assert_eq!(
        page.records.iter().map(|r| r.key).collect::<Vec<_>>(),
        [running]
    );
    let page = store
        .list(&ListQuery::new(Listed::Abandoned))
        .await
        .unwrap();
    assert_eq!(
        page.records.iter().map(|r| r.key).collect::<Vec<_>>(),
        [lapsed]
    );

    // Claims and repairs work on them: a takeover of an uncounted record stays uncounted;
    // tokens go on above the old counter.
    match store.claim(&lapsed, &fp, MINUTE, MINUTE).await.unwrap() {
        Claim::TakenOver { token, lifetime } => {
            assert!(token.get() > 20);
            assert_eq!(lifetime, FencingToken::new(12));
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
    let info = store.inspect(&lapsed).await.unwrap().unwrap();
    assert_eq!((info.attempts, info.label), (0, None));
    assert_eq!(
        store
            .repair(&running, FencingToken::new(11), &Repair::Release, true)
            .await
            .unwrap(),
        Repaired::Done
    );
    assert_eq!(
        store.inspect(&running).await.unwrap().unwrap().state,
        RecordState::Released
    );
    let fresh = fresh_key();
    store
        .claim_labelled(&fresh, &fp, (MINUTE, MINUTE), &label("new-1"))
        .await
        .unwrap();
    let info = store.inspect(&fresh).await.unwrap().unwrap();
    assert_eq!(info.attempts, 1);
    assert_eq!(info.label.as_ref().and_then(KeyLabel::key), Some("new-1"));

    // Migrating again (every process does at startup) changes nothing.
    let before = since(&mut connection, &done).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    store.migrate().await.unwrap();
    drop(store);
    let store = open(&path).await;
    assert_eq!(since(&mut connection, &done).await, before);
    assert_eq!(columns(&mut connection).await, added);
    assert!(store.inspect(&done).await.unwrap().is_some());
}

/// The `since` column of `key`'s row.
async fn since(connection: &mut SqliteConnection, key: &idempotent_core::StorageKey) -> i64 {
    connection
        .fetch_one(
            sqlx::query("SELECT since FROM \"idempotent_records\" WHERE storage_key = ?1")
                .bind(key.record_bytes().as_ref().to_vec()),
        )
        .await
        .unwrap()
        .get::<i64, _>("since")
}

/// A live row with `column` set to `value` (an SQL expression), claimed by the store first.
async fn damaged(store: &SqliteStore, column: &str, value: &str) -> idempotent_core::StorageKey {
    let key = fresh_key();
    store
        .claim_labelled(
            &key,
            &Fingerprint::from_bytes(b"r"),
            (MINUTE, MINUTE),
            &label("k"),
        )
        .await
        .unwrap();
    let mut connection = raw(store.path(), false).await;
    connection
        .execute(
            sqlx::query(&format!(
                "UPDATE \"idempotent_records\" SET {column} = {value} WHERE storage_key = ?1"
            ))
            .bind(key.record_bytes().as_ref().to_vec()),
        )
        .await
        .unwrap();
    key
}

#[tokio::test]
async fn garbage_is_corrupt_or_no_label_and_a_bad_cursor_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir.path().join("garbage.db")).await;

    // A label that is not a blob, or not a label: the record reads, with no key.
    for value in ["'text label'", "42", "x'00ff'"] {
        let key = damaged(&store, "label", value).await;
        let info = store.inspect(&key).await.unwrap().expect(value);
        assert!(
            info.label.as_ref().and_then(KeyLabel::key).is_none(),
            "{value}"
        );
    }

    // The store's own bookkeeping out of range: corrupt, for inspect and for a repair.
    let mut broken = Vec::new();
    for (column, value) in [
        ("released", "7"),
        ("released", "'yes'"),
        ("attempts", "-1"),
        ("attempts", "5000000000"),
        ("since", "'yesterday'"),
        ("fingerprint", "x'01'"),
        ("token", "'t'"),
        ("steps", "'text'"),
    ] {
        let key = damaged(&store, column, value).await;
        match store.inspect(&key).await {
            Err(StoreError::Corrupt(error)) => {
                assert!(
                    error.to_string().contains("unexpected record data"),
                    "{error}"
                )
            }
            other => panic!("{column} = {value}: expected Corrupt, got {other:?}"),
        }
        assert!(matches!(
            store
                .repair(&key, FencingToken::new(1), &Repair::Forget, true)
                .await,
            Err(StoreError::Corrupt(_))
        ));
        broken.push(key);
    }

    // A listing skips what it cannot read and lists the rest, in pages.
    let good = fresh_key();
    store
        .claim_labelled(
            &good,
            &Fingerprint::from_bytes(b"g"),
            (MINUTE, MINUTE),
            &label("g"),
        )
        .await
        .unwrap();
    let mut query = ListQuery::new(Listed::InFlight);
    query.limit = 2;
    let mut listed = Vec::new();
    loop {
        let page = store.list(&query).await.unwrap();
        assert!(page.records.len() <= 2);
        listed.extend(page.records.into_iter().map(|r| r.key));
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    assert!(listed.contains(&good));
    assert!(broken.iter().all(|key| !listed.contains(key)));

    for cursor in ["", "nonsense", "12:xyz", "1:0"] {
        let mut query = ListQuery::new(Listed::Completed);
        query.after = Some(Cursor(cursor.to_owned()));
        match store.list(&query).await {
            Err(StoreError::Backend(error)) => {
                assert!(error.to_string().contains("listing cursor"), "{error}")
            }
            other => panic!("cursor {cursor:?}: expected an error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_give_up_takes_a_token_above_every_one_before_and_keeps_label_and_count() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir.path().join("give-up.db")).await;
    let fp = Fingerprint::from_bytes(b"r");
    let key = fresh_key();
    let token = match store
        .claim_labelled(&key, &fp, (Duration::from_millis(1), MINUTE), &label("g-1"))
        .await
        .unwrap()
    {
        Claim::Claimed(token) => token,
        other => panic!("{other:?}"),
    };
    // Tokens drawn for other keys since.
    let mut highest = token;
    for _ in 0..3 {
        if let Claim::Claimed(t) = store
            .claim(&fresh_key(), &fp, MINUTE, MINUTE)
            .await
            .unwrap()
        {
            highest = highest.max(t);
        }
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let repair = Repair::GiveUp {
        payload: Bytes::from_static(b"operation_failed"),
        ttl: MINUTE,
    };
    assert_eq!(
        store.repair(&key, token, &repair, false).await.unwrap(),
        Repaired::Done
    );
    let info = store.inspect(&key).await.unwrap().unwrap();
    assert!(info.token > highest, "{:?} after {highest:?}", info.token);
    assert_eq!(info.attempts, 1);
    assert_eq!(info.label.as_ref().and_then(KeyLabel::key), Some("g-1"));
    assert!(info.expires_in > Duration::from_secs(50));
    assert!(info.steps.is_empty() && info.request.is_none());
}
