//! A replay answered from a store's record in this process, before any claim
//! (`Store::completed_in_process`): it gives the answer the claim would have given, and only
//! that one. Shutdown still refuses, an expired record runs the work again, a reused key is
//! still refused, and a store in front of the memory store (fault injection here) still sees
//! every replay's claim.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::clock::ManualClock;
use idempotent_core::conformance::{Fault, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    CallOptions, Claim, Error, Fingerprint, Idempotency, StorageKey, Store, StoreError,
};
use support::{call, counted};

/// The answer is the one the claim gave before (that no claim is sent for it is shown by
/// `metrics.rs`, which counts the store's claims).
#[tokio::test]
async fn a_completed_record_is_replayed_and_the_work_does_not_run_again() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = idempotency.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(!first.is_replayed());
    for _ in 0..3 {
        let again = idempotency.run(&call("k"), counted(&runs)).await.unwrap();
        assert!(again.is_replayed());
        assert_eq!(again.into_inner(), 1, "the first run's result");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Once shutdown has begun, a call is refused without touching the store, a replay too: the
/// answer in this process is not read during a shutdown.
#[tokio::test]
async fn a_replay_after_shutdown_began_is_refused() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    idempotency.run(&call("k"), counted(&runs)).await.unwrap();
    let drained = idempotency.shutdown(Duration::from_secs(1)).await;
    assert!(drained.is_clean(), "{drained:?}");
    let refused = idempotency.run(&call("k"), counted(&runs)).await;
    assert!(matches!(refused, Err(Error::ShuttingDown)), "{refused:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A store in front of the memory store that does not tell records in process itself (the
/// default) gets every replay's claim: here it injects faults, and a replay fails as its
/// claim fails.
#[tokio::test]
async fn a_store_in_front_of_the_memory_store_sees_every_replays_claim() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    idempotency.run(&call("k"), counted(&runs)).await.unwrap();
    let replay = idempotency.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(replay.is_replayed());
    assert_eq!(faults.calls(Op::Claim), 2, "the replay claimed through it");
    faults.fail(Op::Claim, Fault::Unavailable);
    let failed = idempotency.run(&call("k"), counted(&runs)).await;
    assert!(
        matches!(failed, Err(Error::Store(StoreError::Unavailable(_)))),
        "{failed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A record past its TTL is not replayed: the next call runs the work again.
#[tokio::test(start_paused = true)]
async fn an_expired_record_runs_the_work_again() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let short = || call("k").options(CallOptions::new().ttl(Duration::from_secs(1)));
    idempotency.run(&short(), counted(&runs)).await.unwrap();
    assert!(
        idempotency
            .run(&short(), counted(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    let again = idempotency.run(&short(), counted(&runs)).await.unwrap();
    assert!(!again.is_replayed(), "the expired record was replayed");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The key reused for another request is refused, as the claim refuses it.
#[tokio::test]
async fn a_key_reused_for_another_request_is_refused() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let of = |body: &str| call("k").fingerprint(Fingerprint::from_bytes(body.as_bytes()));
    idempotency.run(&of("a"), counted(&runs)).await.unwrap();
    let reused = idempotency.run(&of("b"), counted(&runs)).await;
    assert!(
        matches!(reused, Err(Error::FingerprintMismatch)),
        "{reused:?}"
    );
    assert!(
        idempotency
            .run(&of("a"), counted(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The memory store tells a completed, live record in process, as its claim reports it, and
/// nothing else.
#[tokio::test]
async fn the_memory_store_tells_a_completed_record_as_its_claim_reports_it() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let (key, f) = (
        StorageKey::from_bytes([7; 32]),
        Fingerprint::from_bytes(b"r"),
    );
    let minute = Duration::from_secs(60);
    assert_eq!(store.completed_in_process(&key), None, "absent");
    let Claim::Claimed(token) = store.claim(&key, &f, minute, minute).await.unwrap() else {
        panic!("an absent key is claimed")
    };
    assert_eq!(store.completed_in_process(&key), None, "in flight");
    let payload = bytes::Bytes::from_static(b"kept");
    store
        .complete(&key, token, payload.clone(), minute)
        .await
        .unwrap();
    assert_eq!(
        store.completed_in_process(&key),
        Some((f, payload.clone())),
        "completed"
    );
    let Claim::Completed {
        fingerprint,
        payload: claimed,
        ..
    } = store.claim(&key, &f, minute, minute).await.unwrap()
    else {
        panic!("a completed record is reported")
    };
    assert_eq!((fingerprint, claimed), (f, payload));
    clock.advance(minute);
    assert_eq!(store.completed_in_process(&key), None, "expired");
}
