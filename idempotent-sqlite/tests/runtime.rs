//! The runtime of `idempotent-core` on top of `SqliteStore`: a call run twice on one key runs
//! once and replays, across store handles on one file too; another request under the key is
//! refused; a released attempt's step is not run again; client sessions; a corrupt record.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotent_core::session::InSession;
use idempotent_core::{
    Call, ClaimHandle, Error, Fingerprint, Idempotency, Outcome, Retain, StorageKey,
};
use idempotent_sqlite::SqliteStore;
use sqlx::Executor as _;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use tempfile::TempDir;

async fn runtime_on(path: &Path) -> Idempotency {
    let store = SqliteStore::open(path).await.expect("open");
    Idempotency::builder(store)
        .namespace("idempotent-sqlite tests")
        .build()
}

fn temp() -> (TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runtime.db");
    (dir, path)
}

#[tokio::test]
async fn a_call_run_twice_on_one_key_runs_once_and_replays() {
    let (_dir, path) = temp();
    let idempotency = runtime_on(&path).await;
    let runs = AtomicUsize::new(0);
    let call = Call::new("order-1".parse().unwrap());
    let work = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        format!("receipt {}", runs.load(Ordering::SeqCst))
    };
    let first = idempotency.run(&call, work()).await.unwrap();
    assert!(!first.is_replayed());
    assert_eq!(first.into_inner(), "receipt 1");
    let retry = idempotency.run(&call, work()).await.unwrap();
    assert!(retry.is_replayed(), "the retry replays");
    assert_eq!(retry.into_inner(), "receipt 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    // Another key is another operation.
    let other = Call::new("order-2".parse().unwrap());
    assert!(!idempotency.run(&other, work()).await.unwrap().is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn runtimes_on_two_handles_of_one_file_share_their_records() {
    let (_dir, path) = temp();
    // As two processes would: each its own store, its own connections.
    let (a, b) = (runtime_on(&path).await, runtime_on(&path).await);
    let call = Call::new("payment-7".parse().unwrap());
    let first = a.run(&call, async { 700u64 }).await.unwrap();
    assert_eq!(first, Outcome::Fresh(700));
    let seen_by_b = b.run(&call, async { 701u64 }).await.unwrap();
    assert_eq!(seen_by_b, Outcome::Replayed(700));
    drop((a, b));
    // And a runtime opened afterwards.
    let c = runtime_on(&path).await;
    assert_eq!(
        c.run(&call, async { 702u64 }).await.unwrap(),
        Outcome::Replayed(700)
    );
}

#[tokio::test]
async fn another_request_under_a_used_key_is_a_fingerprint_mismatch() {
    let (_dir, path) = temp();
    let idempotency = runtime_on(&path).await;
    let key = "transfer-3";
    let call = |amount: &str| {
        Call::new(key.parse().unwrap()).fingerprint(Fingerprint::from_bytes(amount.as_bytes()))
    };
    idempotency.run(&call("10.00"), async { 1 }).await.unwrap();
    let ran = AtomicUsize::new(0);
    let other = idempotency
        .run(&call("99.00"), async {
            ran.fetch_add(1, Ordering::SeqCst);
            2
        })
        .await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch)),
        "{other:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// The first attempt saves a step and fails transiently (its claim released); the retry takes
/// the operation over and gets the step's saved result instead of running it again.
#[tokio::test]
async fn a_step_saved_before_a_released_attempt_is_not_run_again() {
    let (_dir, path) = temp();
    let idempotency = runtime_on(&path).await;
    let call = Call::new("order-9".parse().unwrap());
    let (reserved, attempts) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let attempt = || async {
        idempotency
            .run_with(
                &call,
                async {
                    let claim = ClaimHandle::current().expect("inside the work");
                    let reservation: u64 = claim
                        .step("reserve", async {
                            100 + reserved.fetch_add(1, Ordering::SeqCst) as u64
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err("the payment provider timed out".to_owned());
                    }
                    Ok(reservation)
                },
                |result| match result {
                    Ok(_) => Retain::Keep,
                    Err(_) => Retain::Release,
                },
            )
            .await
            .unwrap()
    };
    assert_eq!(
        attempt().await,
        Outcome::Fresh(Err("the payment provider timed out".to_owned()))
    );
    assert_eq!(attempt().await, Outcome::Fresh(Ok(100)));
    assert_eq!(attempt().await, Outcome::Replayed(Ok(100)));
    assert_eq!(reserved.load(Ordering::SeqCst), 1, "the step ran once");
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn client_sessions_run_each_number_once_and_refuse_acknowledged_ones() {
    let (_dir, path) = temp();
    let idempotency = runtime_on(&path).await;
    let session = |seq, ack| {
        Call::in_session(
            "device-7".parse().unwrap(),
            InSession::new(seq, ack).unwrap(),
        )
    };
    assert_eq!(
        idempotency
            .run(&session(1, 0), async { 10u32 })
            .await
            .unwrap(),
        Outcome::Fresh(10)
    );
    assert_eq!(
        idempotency
            .run(&session(1, 0), async { 11u32 })
            .await
            .unwrap(),
        Outcome::Replayed(10)
    );
    assert_eq!(
        idempotency
            .run(&session(2, 1), async { 20u32 })
            .await
            .unwrap(),
        Outcome::Fresh(20)
    );
    let late = idempotency.run(&session(1, 0), async { 12u32 }).await;
    assert!(
        matches!(late, Err(Error::SequenceAcknowledged { seq: 1, ack: 1 })),
        "{late:?}"
    );
}

#[tokio::test]
async fn a_corrupt_completed_record_is_refused_and_the_work_does_not_run() {
    let (_dir, path) = temp();
    let idempotency = runtime_on(&path).await;
    let call = Call::new("corrupt-envelope".parse().unwrap());
    let key: StorageKey = idempotency.storage_key(&call);
    let mut connection: SqliteConnection =
        sqlx::Connection::connect_with(&SqliteConnectOptions::new().filename(&path))
            .await
            .unwrap();
    connection
        .execute(
            sqlx::query(
                "INSERT INTO idempotent_records (storage_key, state, fingerprint, token, \
                 lifetime, expires_at, kept_until, payload) VALUES (?1, 'completed', ?2, 1, 1, \
                 ?3, ?3, x'6e6f7420616e20656e76656c6f7065')",
            )
            .bind(key.record_bytes().as_ref().to_vec())
            .bind(Fingerprint::empty().as_bytes().to_vec())
            .bind(i64::MAX / 2),
        )
        .await
        .unwrap();
    let ran = AtomicUsize::new(0);
    let result = idempotency
        .run(&call, async {
            ran.fetch_add(1, Ordering::SeqCst);
        })
        .await;
    assert!(matches!(result, Err(Error::CorruptRecord(_))), "{result:?}");
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the work ran despite a corrupt record"
    );
}
