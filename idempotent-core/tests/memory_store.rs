//! `MemoryStore` beyond the shared contract: bounds, reclamation of expired records, and the
//! background sweep's lifetime.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::clock::ManualClock;
use idempotent_core::memory::{MemoryStore, RECORD_OVERHEAD};
use idempotent_core::{Claim, Fingerprint, StorageKey, Store, StoreError};

fn key(n: u8) -> StorageKey {
    StorageKey::from_bytes([n; 32])
}

async fn claim(store: &MemoryStore, n: u8, lease: Duration) -> Result<Claim, StoreError> {
    store
        .claim(&key(n), &Fingerprint::empty(), lease, lease)
        .await
}

#[tokio::test]
async fn byte_bound_counts_payload_and_overhead_and_refuses_rather_than_evicts() {
    let store = MemoryStore::builder()
        .max_bytes(3 * RECORD_OVERHEAD + 100)
        .build();
    let lease = Duration::from_secs(60);
    let Claim::Claimed(t1) = claim(&store, 1, lease).await.unwrap() else {
        panic!()
    };
    store
        .complete(&key(1), t1, Bytes::from(vec![7; 100]), lease)
        .await
        .unwrap();
    assert_eq!(store.stats().bytes, RECORD_OVERHEAD + 100);
    let Claim::Claimed(t2) = claim(&store, 2, lease).await.unwrap() else {
        panic!()
    };
    // One more byte than fits: refused, and the claim stays in flight.
    let err = store
        .complete(
            &key(2),
            t2,
            Bytes::from(vec![0; RECORD_OVERHEAD + 1]),
            lease,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Capacity { what: "max bytes" }),
        "{err:?}"
    );
    assert!(matches!(
        claim(&store, 2, lease).await.unwrap(),
        Claim::InFlight { .. }
    ));
    claim(&store, 3, lease).await.unwrap();
    let err = claim(&store, 4, lease).await.unwrap_err();
    assert!(matches!(err, StoreError::Capacity { .. }), "{err:?}");
    // Nothing live was evicted.
    assert!(matches!(
        claim(&store, 1, lease).await.unwrap(),
        Claim::Completed { .. }
    ));
    assert_eq!(store.stats().records, 3);
}

#[tokio::test]
async fn full_store_reclaims_expired_records_before_refusing() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .max_entries(2)
        .clock(clock.clone())
        .sweep_interval(None)
        .build();
    claim(&store, 1, Duration::from_secs(5)).await.unwrap();
    claim(&store, 2, Duration::from_secs(50)).await.unwrap();
    assert!(claim(&store, 3, Duration::from_secs(5)).await.is_err());
    clock.advance(Duration::from_secs(10));
    // Key 1's lease has ended: a claim on a new key sweeps it away and fits.
    assert!(matches!(
        claim(&store, 3, Duration::from_secs(5)).await.unwrap(),
        Claim::Claimed(_)
    ));
    assert_eq!(store.stats().records, 2);
    assert!(matches!(
        claim(&store, 2, Duration::from_secs(5)).await.unwrap(),
        Claim::InFlight { .. }
    ));
}

#[tokio::test]
async fn expired_record_is_reclaimed_in_place_by_the_next_claim() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let Claim::Claimed(t) = claim(&store, 1, Duration::from_secs(5)).await.unwrap() else {
        panic!()
    };
    store
        .complete(
            &key(1),
            t,
            Bytes::from(vec![1; 1000]),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(store.stats().bytes, RECORD_OVERHEAD + 1000);
    clock.advance(Duration::from_secs(11));
    assert!(matches!(
        claim(&store, 1, Duration::from_secs(5)).await.unwrap(),
        Claim::Claimed(_)
    ));
    assert_eq!(store.stats().records, 1);
    assert_eq!(store.stats().bytes, RECORD_OVERHEAD);
}

#[tokio::test]
async fn background_sweep_deletes_expired_records() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(Some(Duration::from_millis(10)))
        .build();
    for n in 0..50 {
        claim(&store, n, Duration::from_secs(1)).await.unwrap();
    }
    claim(&store, 99, Duration::from_secs(100)).await.unwrap();
    clock.advance(Duration::from_secs(2));
    for _ in 0..200 {
        if store.stats().records == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(store.stats().records, 1, "only the live record remains");
    assert_eq!(store.stats().bytes, RECORD_OVERHEAD);
}

/// A clock that notes the threads it is read on, other than the test's own.
#[derive(Clone)]
struct ThreadsReading {
    test_thread: std::thread::ThreadId,
    others: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl idempotent_core::clock::Clock for ThreadsReading {
    fn now(&self) -> Duration {
        if std::thread::current().id() != self.test_thread {
            self.others
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Duration::from_secs(1)
    }
}

/// The background sweep looks at every record, so with ten million records it takes about a
/// fifth of a second: it runs on tokio's blocking pool, never on the runtime's own threads
/// (there it would stop every request the runtime serves meanwhile). On a current-thread
/// runtime, everything but a blocking-pool task runs on the test's thread; the sweep reads
/// the clock, so it is seen reading it from another thread. (Seen failing with the sweep run
/// on the runtime's thread, as it was.)
#[tokio::test(flavor = "current_thread")]
async fn background_sweep_runs_off_the_runtimes_threads() {
    let clock = ThreadsReading {
        test_thread: std::thread::current().id(),
        others: Default::default(),
    };
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(Some(Duration::from_millis(5)))
        .build();
    claim(&store, 1, Duration::from_secs(100)).await.unwrap();
    for _ in 0..400 {
        if clock.others.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        clock.others.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the sweep never read the clock off the runtime's thread"
    );
    assert_eq!(store.stats().records, 1, "the live record is kept");
}

#[tokio::test(flavor = "current_thread")]
async fn background_sweep_ends_when_the_store_is_dropped() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let store = MemoryStore::builder()
        .sweep_interval(Some(Duration::from_millis(5)))
        .build();
    let clone = store.clone();
    assert_eq!(metrics.num_alive_tasks(), before + 1, "one sweep task");
    drop(store);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        metrics.num_alive_tasks(),
        before + 1,
        "a clone keeps it alive"
    );
    drop(clone);
    for _ in 0..100 {
        if metrics.num_alive_tasks() == before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the sweep task outlived the store");
}

#[test]
fn store_built_outside_a_runtime_works_without_a_sweeper() {
    let store = MemoryStore::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        assert!(matches!(
            claim(&store, 1, Duration::from_secs(1)).await.unwrap(),
            Claim::Claimed(_)
        ));
    });
    assert_eq!(store.sweep(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_on_a_full_store_never_exceed_the_bound() {
    let store = MemoryStore::builder().max_entries(100).build();
    let tasks: Vec<_> = (0..1000u32)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut bytes = [0u8; 32];
                bytes[..4].copy_from_slice(&i.to_le_bytes());
                store
                    .claim(
                        &StorageKey::from_bytes(bytes),
                        &Fingerprint::empty(),
                        Duration::from_secs(60),
                        Duration::from_secs(60),
                    )
                    .await
            })
        })
        .collect();
    let mut claimed = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(Claim::Claimed(_)) => claimed += 1,
            Err(StoreError::Capacity { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(claimed, 100);
    assert_eq!(store.stats().records, 100);
    assert_eq!(store.stats().bytes, 100 * RECORD_OVERHEAD);
}

/// A new session's record takes its share of the bounds as a claim's does: on a full store,
/// concurrent first requests of new sessions open as many as the bound holds and are refused
/// past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_new_sessions_on_a_full_store_never_exceed_the_bound() {
    let store = MemoryStore::builder().max_entries(50).build();
    let tasks: Vec<_> = (0..500u32)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = idempotent_core::Key::new(format!("session-{i}")).unwrap();
                let session = idempotent_core::SessionKey::derive(
                    b"app",
                    &idempotent_core::Scope::new(),
                    &id,
                );
                idempotent_core::SessionStore::open_session(
                    &store,
                    &session,
                    idempotent_core::SessionRequest::new(1, 0, 64, Duration::from_secs(60)),
                )
                .await
            })
        })
        .collect();
    let mut opened = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(idempotent_core::SessionGate::Open { .. }) => opened += 1,
            Err(StoreError::Capacity { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(opened, 50);
    assert_eq!(store.stats().records, 50);
    assert_eq!(store.stats().bytes, 50 * RECORD_OVERHEAD);
}
