//! The runtime's rules, one test each: replay, mismatch, in-flight reject and wait, lease
//! renewal, takeover, release on panic and on drop, outcome classification, limits, corrupt
//! records, scopes, store failures and real concurrency.
//!
//! Longer than most test files: one short test per rule of one type (`Idempotency`), with
//! nothing to share but `support`; split by rule, the files would repeat their setup.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::capability::KeysOnly;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    CallOptions, Claim, Defaults, Error, Execution, FencingToken, Fingerprint, Idempotency,
    InFlightPolicy, ProblemCode, Retain, Scope, StorageKey, Store, StoreError,
};
use support::{call, counted, slow};

#[tokio::test]
async fn retry_replays_the_first_result_without_running_again() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = idem.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(!first.is_replayed());
    for _ in 0..3 {
        let retry = idem.run(&call("k"), counted(&runs)).await.unwrap();
        assert!(retry.is_replayed());
        assert_eq!(retry.into_inner(), 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn replays_falsy_values_identically() {
    let idem = Idempotency::new(MemoryStore::new());
    async fn check<T>(idem: &Idempotency, key: &str, value: T)
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug + Clone,
    {
        let v = value.clone();
        assert_eq!(
            idem.run(&call(key), async { v })
                .await
                .unwrap()
                .into_inner(),
            value
        );
        let replay = idem
            .run(&call(key), async {
                if key.is_empty() {
                    return value.clone();
                }
                panic!("ran twice")
            })
            .await
            .unwrap();
        assert!(replay.is_replayed());
        assert_eq!(replay.into_inner(), value);
    }
    check(&idem, "zero", 0u64).await;
    check(&idem, "empty string", String::new()).await;
    check(&idem, "empty vec", Vec::<u8>::new()).await;
    check(&idem, "none", Option::<u8>::None).await;
    check(&idem, "unit", ()).await;
    check(&idem, "ok unit", Result::<(), String>::Ok(())).await;
}

#[tokio::test]
async fn different_fingerprint_is_a_mismatch_and_leaves_the_record() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let a = call("k").fingerprint(Fingerprint::of(&("EUR", 100u32)).unwrap());
    let b = call("k").fingerprint(Fingerprint::of(&("EUR", 999u32)).unwrap());
    idem.run(&a, counted(&runs)).await.unwrap();
    let err = idem.run(&b, counted(&runs)).await.unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch), "{err:?}");
    assert_eq!(err.code(), ProblemCode::FingerprintMismatch);
    // The original request still replays.
    assert!(idem.run(&a, counted(&runs)).await.unwrap().is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn mismatch_is_reported_while_in_flight_too() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let a = call("k").fingerprint(Fingerprint::from_bytes(b"a"));
    let b = call("k")
        .fingerprint(Fingerprint::from_bytes(b"b"))
        .options(CallOptions::new().in_flight(InFlightPolicy::Wait {
            max: Duration::from_secs(5),
        }));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(1)));
        async move { idem.run(&a, work).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let err = idem.run(&b, counted(&runs)).await.unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch), "{err:?}");
    first.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn in_flight_duplicate_is_rejected_with_retry_after() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().lease(Duration::from_secs(30)))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(2)));
        async move { idem.run(&call("k"), work).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let err = idem.run(&call("k"), counted(&runs)).await.unwrap_err();
    match err {
        Error::InFlight { retry_after } => {
            assert_eq!(retry_after, idempotent_core::MAX_IN_FLIGHT_RETRY_HINT);
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert!(first.await.unwrap().unwrap().get() == &1);
    assert!(
        idem.run(&call("k"), counted(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicate_replays_once_the_first_completes() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().in_flight(InFlightPolicy::Wait {
            max: Duration::from_secs(10),
        }))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(3)));
        async move { idem.run(&call("k"), work).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = tokio::time::Instant::now();
    let second = idem.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(second.is_replayed());
    assert_eq!(second.into_inner(), 1);
    assert!(started.elapsed() >= Duration::from_millis(2800));
    assert!(!first.await.unwrap().unwrap().is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn waiting_is_bounded_then_reports_in_flight() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let _first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(60)));
        async move { idem.run(&call("k"), work).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = tokio::time::Instant::now();
    let waiting = call("k").options(CallOptions::new().in_flight(InFlightPolicy::Wait {
        max: Duration::from_secs(2),
    }));
    let err = idem.run(&waiting, counted(&runs)).await.unwrap_err();
    assert!(matches!(err, Error::InFlight { .. }), "{err:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    // The first run began (and still sleeps); the waiting duplicate ran nothing.
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicate_runs_the_work_when_the_first_releases() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(1)));
        async move { idem.run_with(&call("k"), work, |_| Retain::Release).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let waiting = call("k").options(CallOptions::new().in_flight(InFlightPolicy::Wait {
        max: Duration::from_secs(5),
    }));
    let second = idem.run(&waiting, counted(&runs)).await.unwrap();
    assert!(!second.is_replayed(), "the released call is not replayed");
    assert_eq!(second.into_inner(), 2);
    first.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn renewal_keeps_a_long_job_claimed_past_its_initial_lease() {
    let lease = Duration::from_secs(3);
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().lease(lease))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(20)));
        async move { idem.run(&call("k"), work).await }
    });
    // Probe well past the first lease, repeatedly: the claim must still be held.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let err = idem.run(&call("k"), counted(&runs)).await.unwrap_err();
        match err {
            Error::InFlight { retry_after } => {
                assert!(retry_after <= idempotent_core::MAX_IN_FLIGHT_RETRY_HINT)
            }
            other => panic!("claim was lost: {other:?}"),
        }
    }
    assert_eq!(first.await.unwrap().unwrap().into_inner(), 1);
    assert!(
        idem.run(&call("k"), counted(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn owner_that_never_completes_is_taken_over_after_its_lease() {
    let store = MemoryStore::new();
    let idem = Idempotency::builder(store.clone())
        .defaults(Defaults::new().lease(Duration::from_secs(5)))
        .build();
    let key = idem.storage_key(&call("k"));
    // A crashed owner: it claimed and will never renew, complete or release.
    let Claim::Claimed(crashed) = store
        .claim(
            &key,
            &Fingerprint::empty(),
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    else {
        panic!("claim")
    };
    let runs = Arc::new(AtomicUsize::new(0));
    assert!(matches!(
        idem.run(&call("k"), counted(&runs)).await,
        Err(Error::InFlight { .. })
    ));
    tokio::time::sleep(Duration::from_millis(4600)).await;
    match idem.run(&call("k"), counted(&runs)).await {
        Err(Error::InFlight { retry_after }) => {
            assert!(
                retry_after <= Duration::from_millis(400),
                "hint {retry_after:?} outlives the lease"
            )
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let taken = idem.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(!taken.is_replayed());
    // The crashed owner, if it ever comes back, cannot overwrite the new result.
    let stale = store
        .complete(
            &key,
            crashed,
            Bytes::from_static(b"stale"),
            Duration::from_secs(60),
        )
        .await;
    assert!(matches!(stale, Err(StoreError::TokenRejected)), "{stale:?}");
    assert_eq!(
        idem.run(&call("k"), counted(&runs)).await.unwrap(),
        idempotent_core::Outcome::Replayed(1)
    );
}

#[tokio::test]
async fn panicking_work_releases_its_claim() {
    let idem = Idempotency::new(MemoryStore::new());
    let task = tokio::spawn({
        let idem = idem.clone();
        async move {
            idem.run(&call("k"), async {
                tokio::task::yield_now().await;
                panic!("provider client bug");
                #[allow(unreachable_code)]
                0u32
            })
            .await
        }
    });
    assert!(task.await.unwrap_err().is_panic());
    let runs = Arc::new(AtomicUsize::new(0));
    let retry = eventually_fresh(&idem, "k", &runs).await;
    assert_eq!(retry, 1);
}

#[tokio::test]
async fn dropped_call_releases_its_claim() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let abandoned = tokio::time::timeout(
        Duration::from_millis(20),
        idem.run(&call("k"), slow(&runs, Duration::from_secs(3600))),
    )
    .await;
    assert!(abandoned.is_err(), "the call should have timed out");
    // The abandoned run began (the first); the retry runs afresh as the second.
    assert_eq!(eventually_fresh(&idem, "k", &runs).await, 2);
}

/// A call dropped while its work waits drops the work inside the claim's scope (its
/// destructor still sees the claim, as the work itself did) and then releases the claim.
#[tokio::test]
async fn dropped_call_drops_its_work_inside_the_claims_scope() {
    use std::sync::Mutex;
    /// Whether the claim was current when the work was dropped (`None`: not dropped).
    type Seen = Arc<Mutex<Option<bool>>>;
    struct Held(Seen);
    impl Drop for Held {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(idempotent_core::KeyClaim::current().is_some());
        }
    }
    let idem = Idempotency::new(MemoryStore::new());
    let seen: Seen = Arc::new(Mutex::new(None));
    let runs = Arc::new(AtomicUsize::new(0));
    let work = {
        let (held, runs) = (Held(Arc::clone(&seen)), Arc::clone(&runs));
        async move {
            let _held = held;
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3600)).await;
            0usize
        }
    };
    let abandoned =
        tokio::time::timeout(Duration::from_millis(20), idem.run(&call("k"), work)).await;
    assert!(abandoned.is_err(), "the call should have timed out");
    assert_eq!(
        *seen.lock().unwrap(),
        Some(true),
        "the work is dropped with the call, inside its claim's scope"
    );
    assert_eq!(eventually_fresh(&idem, "k", &runs).await, 2);
}

/// Retries until the key is free (the release happens on a spawned task) and returns the fresh
/// result; fails if it stays in flight for a second.
async fn eventually_fresh(idem: &Idempotency, key: &str, runs: &Arc<AtomicUsize>) -> usize {
    for _ in 0..100 {
        match idem.run(&call(key), counted(runs)).await {
            Ok(outcome) => {
                assert!(!outcome.is_replayed());
                return outcome.into_inner();
            }
            Err(Error::InFlight { .. }) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(other) => panic!("unexpected error: {other:?}"),
        }
    }
    panic!("the abandoned claim was never released");
}

#[tokio::test]
async fn classifier_release_lets_the_retry_run_again() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    // An odd count is a "transient failure": released, not stored.
    let transient = |n: &usize| {
        if n.is_multiple_of(2) {
            Retain::Keep
        } else {
            Retain::Release
        }
    };
    let first = idem
        .run_with(&call("k"), counted(&runs), transient)
        .await
        .unwrap();
    assert_eq!(first, idempotent_core::Outcome::Fresh(1));
    let second = idem
        .run_with(&call("k"), counted(&runs), transient)
        .await
        .unwrap();
    assert_eq!(second, idempotent_core::Outcome::Fresh(2));
    let third = idem
        .run_with(&call("k"), counted(&runs), transient)
        .await
        .unwrap();
    assert_eq!(third, idempotent_core::Outcome::Replayed(2));
}

#[tokio::test]
async fn execute_classifies_and_replays_raw_bytes() {
    let idem = Idempotency::new(MemoryStore::new());
    let fresh = idem
        .execute(
            &call("k"),
            async { 201u16 },
            |_| Retain::Keep,
            |status| Some(Bytes::from(status.to_string())),
        )
        .await
        .unwrap();
    assert_eq!(fresh, Execution::Fresh(201));
    let replay = idem
        .execute(&call("k"), async { 500u16 }, |_| Retain::Release, |_| None)
        .await
        .unwrap();
    assert_eq!(replay, Execution::Replayed(Bytes::from_static(b"201")));
}

#[tokio::test]
async fn oversized_result_is_recorded_as_not_retained_and_never_rerun() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().max_result_bytes(64))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let big = {
        let runs = Arc::clone(&runs);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "x".repeat(1000)
        }
    };
    let first = idem.run(&call("k"), big).await.unwrap();
    assert_eq!(
        first.get().len(),
        1000,
        "the caller still gets the full result"
    );
    let retry = idem
        .run(&call("k"), async { String::new() })
        .await
        .unwrap_err();
    assert!(matches!(retry, Error::ResultNotRetained), "{retry:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn complete_without_result_refuses_retries_without_rerunning() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = idem
        .execute(&call("k"), counted(&runs), |_| Retain::Keep, |_| None)
        .await
        .unwrap();
    assert_eq!(first, Execution::Fresh(1));
    let retry = idem
        .execute(&call("k"), counted(&runs), |_| Retain::Release, |_| None)
        .await
        .unwrap_err();
    assert!(matches!(retry, Error::ResultNotRetained), "{retry:?}");
    assert_eq!(retry.code(), ProblemCode::ResultNotRetained);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn result_that_does_not_fit_the_store_is_recorded_as_not_retained() {
    let store = MemoryStore::builder().max_bytes(4096).build();
    let idem = Idempotency::new(store);
    let first = idem
        .run(&call("k"), async { "y".repeat(10_000) })
        .await
        .unwrap();
    assert!(!first.is_replayed());
    let retry = idem
        .run(&call("k"), async { String::new() })
        .await
        .unwrap_err();
    assert!(matches!(retry, Error::ResultNotRetained), "{retry:?}");
}

#[tokio::test]
async fn corrupt_record_is_a_conflict_never_absent() {
    let store = MemoryStore::new();
    let idem = Idempotency::new(store.clone());
    let key = idem.storage_key(&call("k"));
    let Claim::Claimed(token) = store
        .claim(
            &key,
            &Fingerprint::empty(),
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    else {
        panic!("claim")
    };
    store
        .complete(
            &key,
            token,
            Bytes::from_static(b"garbage, not an envelope"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let err = idem.run(&call("k"), counted(&runs)).await.unwrap_err();
    assert!(matches!(err, Error::CorruptRecord(_)), "{err:?}");
    assert_eq!(err.code(), ProblemCode::CorruptRecord);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the work must not run again"
    );
}

#[tokio::test]
async fn replayed_bytes_of_another_type_are_a_payload_error() {
    let idem = Idempotency::new(MemoryStore::new());
    idem.run(&call("k"), async { "text".to_string() })
        .await
        .unwrap();
    let err = idem.run(&call("k"), async { 5u32 }).await.unwrap_err();
    assert!(matches!(err, Error::Payload(_)), "{err:?}");
}

#[tokio::test]
async fn scopes_and_namespaces_never_share_records() {
    let store = MemoryStore::new();
    let a = Idempotency::builder(store.clone())
        .namespace("app-a")
        .build();
    let b = Idempotency::builder(store.clone())
        .namespace("app-b")
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let alice = call("k").scope(Scope::new().principal("alice"));
    let bob = call("k").scope(Scope::new().principal("bob"));
    assert_eq!(a.run(&alice, counted(&runs)).await.unwrap().into_inner(), 1);
    assert_eq!(a.run(&bob, counted(&runs)).await.unwrap().into_inner(), 2);
    assert_eq!(b.run(&alice, counted(&runs)).await.unwrap().into_inner(), 3);
    assert!(a.run(&alice, counted(&runs)).await.unwrap().is_replayed());
    assert_eq!(a.storage_key(&alice), a.storage_key(&alice.clone()));
    assert_ne!(a.storage_key(&alice), a.storage_key(&bob));
}

#[tokio::test]
async fn full_store_refuses_new_keys_but_still_replays() {
    let store = MemoryStore::builder().max_entries(2).build();
    let idem = Idempotency::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    idem.run(&call("a"), counted(&runs)).await.unwrap();
    idem.run(&call("b"), counted(&runs)).await.unwrap();
    let err = idem.run(&call("c"), counted(&runs)).await.unwrap_err();
    assert!(
        matches!(err, Error::Store(StoreError::Capacity { .. })),
        "{err:?}"
    );
    assert_eq!(err.code(), ProblemCode::StoreCapacity);
    assert!(err.retry_after().is_some());
    assert!(
        idem.run(&call("a"), counted(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(store.stats().records, 2);
}

/// A store whose backend is down.
struct DownStore;

impl Store for DownStore {
    async fn claim(
        &self,
        _: &StorageKey,
        _: &Fingerprint,
        _: Duration,
        _: Duration,
    ) -> Result<Claim, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn complete(
        &self,
        _: &StorageKey,
        _: FencingToken,
        _: Bytes,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn release(&self, _: &StorageKey, _: FencingToken) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn renew(&self, _: &StorageKey, _: FencingToken, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
}

#[tokio::test]
async fn store_down_fails_closed_without_running_the_work() {
    let idem = Idempotency::keys_only(DownStore);
    let runs = Arc::new(AtomicUsize::new(0));
    let err = idem.run(&call("k"), counted(&runs)).await.unwrap_err();
    assert!(
        matches!(err, Error::Store(StoreError::Unavailable(_))),
        "{err:?}"
    );
    assert_eq!(err.code(), ProblemCode::StoreUnavailable);
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
    let source = std::error::Error::source(&err).expect("store error kept as source");
    assert!(
        std::error::Error::source(source).is_some(),
        "backend error kept as source"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_concurrent_duplicates_run_the_work_once() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(500));
    let tasks: Vec<_> = (0..500)
        .map(|_| {
            let (idem, runs, start) = (idem.clone(), Arc::clone(&runs), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                idem.run(&call("same"), slow(&runs, Duration::from_millis(50)))
                    .await
            })
        })
        .collect();
    let (mut fresh, mut in_flight, mut replayed) = (0, 0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(outcome) if outcome.is_replayed() => replayed += 1,
            Ok(_) => fresh += 1,
            Err(Error::InFlight { .. }) => in_flight += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(fresh + in_flight + replayed, 500);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_waiters_all_get_the_single_result() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().in_flight(InFlightPolicy::Wait {
            max: Duration::from_secs(30),
        }))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (idem, runs) = (idem.clone(), Arc::clone(&runs));
            tokio::spawn(async move {
                idem.run(&call("same"), slow(&runs, Duration::from_millis(100)))
                    .await
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap().into_inner(), 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_run_independently() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().in_flight(InFlightPolicy::Wait {
            max: Duration::from_secs(30),
        }))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let (idem, runs) = (idem.clone(), Arc::clone(&runs));
            tokio::spawn(async move {
                idem.run(&call(&format!("k{}", i % 100)), counted(&runs))
                    .await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(runs.load(Ordering::SeqCst), 100);
}

/// A memory store whose writes of completed records take a while, like a remote store's.
#[derive(Clone)]
struct SlowComplete(MemoryStore);

impl Store for SlowComplete {
    async fn claim(
        &self,
        key: &StorageKey,
        f: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.0.claim(key, f, lease, ttl).await
    }
    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.0.complete(key, token, payload, ttl).await
    }
    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.0.release(key, token).await
    }
    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.0.renew(key, token, lease).await
    }
}

#[tokio::test]
async fn caller_giving_up_during_the_completion_write_still_records_the_result() {
    let idem = Idempotency::<KeysOnly>::builder_for(SlowComplete(MemoryStore::new()))
        .defaults(Defaults::new().lease(Duration::from_secs(1)))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    // The work finishes at once; the caller stops waiting while the result is being written.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        idem.run(&call("k"), counted(&runs)),
    )
    .await;
    assert!(abandoned.is_err(), "the caller gave up during the write");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Well past the lease: without the write, the claim would have lapsed and the retry run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = idem.run(&call("k"), counted(&runs)).await.unwrap();
    assert!(
        retry.is_replayed(),
        "the result was recorded after the caller left"
    );
    assert_eq!(retry.into_inner(), 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Regression: when a completion did not fit a store full to its byte bound, the fallback
/// "done, result not retained" record was refused too; the claim lapsed and the work ran again.
#[tokio::test]
async fn full_byte_bound_still_records_a_call_that_ran() {
    let clock = idempotent_core::clock::ManualClock::new();
    let store = MemoryStore::builder()
        .max_entries(10)
        .max_bytes(idempotent_core::memory::RECORD_OVERHEAD)
        .sweep_interval(None)
        .clock(clock.clone())
        .build();
    let idem = Idempotency::builder(store)
        .defaults(Defaults::new().lease(Duration::from_secs(1)))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "r".repeat(200) // too large for the bytes left
        }
    };
    let first = idem.run(&call("k"), work(&runs)).await.unwrap();
    assert_eq!(first.into_inner().len(), 200, "the caller gets its result");
    clock.advance(Duration::from_secs(2)); // past the lease
    let retry = idem.run(&call("k"), work(&runs)).await.unwrap_err();
    assert!(matches!(retry, Error::ResultNotRetained), "{retry:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
}

/// A memory store that changes the last byte of every completed record it hands back, and
/// says it keeps records in process or not.
struct Damaging {
    inner: MemoryStore,
    in_process: bool,
}

impl Store for Damaging {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        match self.inner.claim(key, fingerprint, lease, ttl).await? {
            Claim::Completed {
                fingerprint,
                payload,
                expires_in,
            } => {
                let mut damaged = payload.to_vec();
                *damaged.last_mut().unwrap() ^= 0x01;
                Ok(Claim::Completed {
                    fingerprint,
                    payload: Bytes::from(damaged),
                    expires_in,
                })
            }
            other => Ok(other),
        }
    }
    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, payload, ttl).await
    }
    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease).await
    }
    fn keeps_records_in_process(&self) -> bool {
        self.in_process
    }
}

/// Results are checksummed on every store except one that keeps its records in this process
/// (the memory store): there the damage goes through, which shows the checksum is neither
/// written nor checked; everywhere else it is a corrupt record and the work does not run again.
#[tokio::test]
async fn results_are_checksummed_unless_the_store_keeps_them_in_process() {
    assert!(MemoryStore::new().keeps_records_in_process());
    for in_process in [false, true] {
        let idem = Idempotency::keys_only(Damaging {
            inner: MemoryStore::new(),
            in_process,
        });
        let runs = Arc::new(AtomicUsize::new(0));
        let keep = |_: &usize| Retain::Keep;
        let encode = |_: &usize| Some(Bytes::from_static(b"abc"));
        let first = idem.execute(&call("k"), counted(&runs), keep, encode).await;
        assert_eq!(first.unwrap(), Execution::Fresh(1));
        let retry = idem.execute(&call("k"), counted(&runs), keep, encode).await;
        if in_process {
            assert_eq!(
                retry.unwrap(),
                Execution::Replayed(Bytes::from_static(b"abb"))
            );
        } else {
            let error = retry.unwrap_err();
            assert!(matches!(error, Error::CorruptRecord(_)), "{error:?}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
