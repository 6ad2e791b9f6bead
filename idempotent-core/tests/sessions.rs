//! Client sessions through the runtime: concurrency, a failing or frozen gate, what each
//! request's record is (its own claim, token and operation key), and the metrics.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::capability::{KeysAndSessions, NeedsSessions};
use idempotent_core::conformance::{Fault, FaultyStore, KeysOnlyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::{self, Recorded};
use idempotent_core::session::InSession;
use idempotent_core::{Call, ClaimHandle, Defaults, Error, Idempotency, Key, StoreError};

fn in_session(id: &str, seq: u64, ack: u64) -> Call<NeedsSessions> {
    Call::in_session(Key::new(id).unwrap(), InSession::new(seq, ack).unwrap())
}

fn runtime(window: u64) -> Idempotency {
    Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().session_window(window))
        .build()
}

/// 300 concurrent duplicates of one request of a session: the work runs once, and every
/// duplicate gets its answer or is told it is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_of_one_seq_run_once() {
    let idempotency = runtime(64);
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..300 {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tasks.spawn(async move {
            let call = in_session("dup", 1, 0);
            idempotency
                .run(&call, async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    runs.fetch_add(1, Ordering::SeqCst)
                })
                .await
        });
    }
    let mut answered = 0;
    while let Some(result) = tasks.join_next().await {
        match result.unwrap() {
            Ok(outcome) => {
                assert_eq!(outcome.into_inner(), 0);
                answered += 1;
            }
            Err(Error::InFlight { .. }) => {}
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(answered >= 1);
}

/// 256 requests of one session at once, within its window: each runs once, each with a
/// claim of its own (its own operation key), and their acks never lose an answer that a
/// later duplicate needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_seqs_each_run_once_with_their_own_operation_key() {
    let idempotency = runtime(256);
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for seq in 1..=256u64 {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tasks.spawn(async move {
            let call = in_session("many", seq, 0);
            let first = idempotency
                .run(&call, async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let claim = ClaimHandle::current().expect("the running claim");
                    (seq, claim.operation_key().as_str().to_owned())
                })
                .await
                .unwrap();
            let again = idempotency
                .run(&call, async { (0, String::new()) })
                .await
                .unwrap();
            assert!(again.is_replayed());
            let (first, again) = (first.into_inner(), again.into_inner());
            assert_eq!(first, again);
            first
        });
    }
    let mut keys = HashSet::new();
    while let Some(result) = tasks.join_next().await {
        let (seq, key) = result.unwrap();
        assert!(keys.insert(key), "request {seq} shares an operation key");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 256);
    assert_eq!(keys.len(), 256);
}

/// A gate that fails or never answers fails the call closed: nothing runs, and the store
/// error says to retry.
#[tokio::test]
async fn a_failing_or_frozen_gate_runs_nothing() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::builder(store)
        .defaults(Defaults::new().lease(Duration::from_millis(600)))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move { runs.fetch_add(1, Ordering::SeqCst) }
    };
    faults.fail_next(Op::OpenSession, 1, Fault::Unavailable);
    let failed = idempotency.run(&in_session("g", 1, 0), work(&runs)).await;
    assert!(
        matches!(failed, Err(Error::Store(StoreError::Unavailable(_)))),
        "{failed:?}"
    );
    faults.fail_next(Op::OpenSession, 1, Fault::Hang);
    let frozen = idempotency.run(&in_session("g", 1, 0), work(&runs)).await;
    assert!(
        matches!(frozen, Err(Error::Store(StoreError::Unavailable(_)))),
        "{frozen:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(faults.calls(Op::Claim), 0, "no claim without the gate");
    // Healed, the same request runs once.
    idempotency
        .run(&in_session("g", 1, 0), work(&runs))
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Each refusal has its error and its metric outcome, and the gate is timed as a store
/// operation.
#[tokio::test]
async fn refusals_are_counted_by_outcome_and_the_gate_is_timed() {
    let (idempotency, recorded) = Recorded::capture(|| runtime(4));
    let run = |call: Call<NeedsSessions>| {
        let idempotency = idempotency.clone();
        async move { idempotency.run(&call, async { 1u8 }).await }
    };
    run(in_session("m", 1, 0)).await.unwrap();
    assert!(matches!(
        run(in_session("m", 1, 1)).await,
        Err(Error::SequenceAcknowledged { seq: 1, ack: 1 })
    ));
    assert!(matches!(
        run(in_session("m", 9, 1)).await,
        Err(Error::SessionWindowFull {
            seq: 9,
            ack: 1,
            window: 4
        })
    ));
    assert!(matches!(
        run(in_session("gone", 2, 1)).await,
        Err(Error::SessionExpired)
    ));
    for (outcome, n) in [
        ("fresh", 1),
        ("sequence_acknowledged", 1),
        ("session_window_full", 1),
        ("session_expired", 1),
    ] {
        assert_eq!(
            recorded.counter(metrics::REQUESTS, &[("outcome", outcome)]),
            n,
            "{outcome}"
        );
    }
    // Each request's gate and claim (and the fresh one's check of its mark) is one call.
    let (gates, _) = recorded.histogram(
        metrics::STORE_OPERATION_DURATION,
        &[("operation", "claim_in_session"), ("result", "ok")],
    );
    assert_eq!(gates, 4);
    for separate in ["open_session", "session_mark", "claim"] {
        let (calls, _) = recorded.histogram(
            metrics::STORE_OPERATION_DURATION,
            &[("operation", separate), ("result", "ok")],
        );
        assert_eq!(calls, 0, "{separate}");
    }
}

/// A session's records live as long as the session, not the call's TTL: an answer is
/// replayed long after the TTL while the session is in use.
#[tokio::test(start_paused = true)]
async fn a_sessions_answers_outlive_the_ttl() {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(
            Defaults::new()
                .ttl(Duration::from_secs(1))
                .session_idle(Duration::from_secs(3600)),
        )
        .build();
    idempotency
        .run(&in_session("ttl", 1, 0), async { 7u8 })
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(600)).await;
    let again = idempotency
        .run(&in_session("ttl", 1, 0), async { 8u8 })
        .await
        .unwrap();
    assert!(again.is_replayed());
    assert_eq!(again.into_inner(), 7);
}

/// A store that keeps no sessions runs in a keys-only runtime: it serves keys, a call in a
/// session does not compile with it (the ui cases), and code whose input decides (a layer
/// reading a session header) learns it has no sessions.
#[tokio::test]
async fn a_store_without_sessions_serves_keys_and_says_it_has_no_sessions() {
    let idempotency = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    assert!(idempotency.sessions().is_none());
    assert!(idempotency.checkpoints().is_none());
    let key = Call::new(Key::new("k").unwrap());
    assert_eq!(
        idempotency
            .run(&key, async { 2u8 })
            .await
            .unwrap()
            .into_inner(),
        2
    );
    let full = Idempotency::new(MemoryStore::new());
    let sessions = full.sessions().expect("the memory store keeps sessions");
    assert_eq!(
        sessions
            .run(&in_session("s", 1, 0), async { 1u8 })
            .await
            .unwrap()
            .into_inner(),
        1
    );
    // The view shares the runtime's records: the full runtime replays it.
    assert!(
        full.run(&in_session("s", 1, 0), async { 9u8 })
            .await
            .unwrap()
            .is_replayed()
    );
}

/// A duplicate that passed the gate before a later request's `ack` covered its number, and
/// whose claim came after that `ack` dropped the answer, finds no record: it must not run.
#[tokio::test(start_paused = true)]
async fn a_duplicate_claimed_after_its_answer_was_dropped_does_not_run() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move { runs.fetch_add(1, Ordering::SeqCst) }
    };
    idempotency
        .run(&in_session("race", 1, 0), work(&runs))
        .await
        .unwrap();
    // The duplicate's claim is slow: it passes the gate, then waits 200 ms to claim.
    faults.fail_next(Op::Claim, 1, Fault::Delay(Duration::from_millis(200)));
    let duplicate = tokio::spawn({
        let (idempotency, work) = (idempotency.clone(), work(&runs));
        async move { idempotency.run(&in_session("race", 1, 0), work).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Meanwhile the client, holding answer 1, goes on and acknowledges it.
    idempotency
        .run(&in_session("race", 2, 1), work(&runs))
        .await
        .unwrap();
    let late = duplicate.await.unwrap();
    assert!(
        matches!(late, Err(Error::SequenceAcknowledged { seq: 1, ack: 1 })),
        "{late:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "request 1 ran once");
}

/// The same race through the wait policy, on a store that polls (as Redis and PostgreSQL
/// do): a duplicate waiting for a running request, whose answer is acknowledged and dropped
/// before the duplicate looks again, must not run it a second time.
#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_whose_answer_was_dropped_does_not_run() {
    /// The memory store without change notifications: waiters poll.
    #[derive(Clone, Default)]
    struct Polling(MemoryStore);
    impl idempotent_core::Store for Polling {
        async fn claim(
            &self,
            key: &idempotent_core::StorageKey,
            fingerprint: &idempotent_core::Fingerprint,
            lease: Duration,
            ttl: Duration,
        ) -> Result<idempotent_core::Claim, StoreError> {
            self.0.claim(key, fingerprint, lease, ttl).await
        }
        async fn complete(
            &self,
            key: &idempotent_core::StorageKey,
            token: idempotent_core::FencingToken,
            payload: bytes::Bytes,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            self.0.complete(key, token, payload, ttl).await
        }
        async fn release(
            &self,
            key: &idempotent_core::StorageKey,
            token: idempotent_core::FencingToken,
        ) -> Result<(), StoreError> {
            self.0.release(key, token).await
        }
        async fn renew(
            &self,
            key: &idempotent_core::StorageKey,
            token: idempotent_core::FencingToken,
            lease: Duration,
        ) -> Result<(), StoreError> {
            self.0.renew(key, token, lease).await
        }
    }
    impl idempotent_core::SessionStore for Polling {
        async fn open_session(
            &self,
            session: &idempotent_core::SessionKey,
            request: idempotent_core::SessionRequest,
        ) -> Result<idempotent_core::SessionGate, StoreError> {
            self.0.open_session(session, request).await
        }
        async fn session_mark(
            &self,
            session: &idempotent_core::SessionKey,
        ) -> Result<Option<idempotent_core::SessionMark>, StoreError> {
            self.0.session_mark(session).await
        }
    }
    // A store of keys and sessions (no checkpoints).
    let idempotency = Idempotency::<KeysAndSessions>::builder_for(Polling::default())
        .defaults(
            Defaults::new().in_flight(idempotent_core::InFlightPolicy::Wait {
                max: Duration::from_secs(30),
            }),
        )
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let slow = |runs: &Arc<AtomicUsize>, ms: u64| {
        let runs = Arc::clone(runs);
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            runs.fetch_add(1, Ordering::SeqCst)
        }
    };
    let first = tokio::spawn({
        let (idempotency, work) = (idempotency.clone(), slow(&runs, 300));
        async move { idempotency.run(&in_session("wait", 1, 0), work).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let duplicate = tokio::spawn({
        let (idempotency, work) = (idempotency.clone(), slow(&runs, 0));
        async move { idempotency.run(&in_session("wait", 1, 0), work).await }
    });
    // Request 1 answers; the client acknowledges it before the duplicate looks again.
    first.await.unwrap().unwrap();
    idempotency
        .run(&in_session("wait", 2, 1), slow(&runs, 0))
        .await
        .unwrap();
    let late = duplicate.await.unwrap();
    match late {
        // Replayed if it looked before the answer was dropped; refused after. Never run.
        Ok(outcome) => assert!(outcome.is_replayed()),
        Err(Error::SequenceAcknowledged { seq: 1, .. }) => {}
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "request 1 ran once");
}

/// A resume-only call in a session passes the gate, then only takes an abandoned operation of
/// its request over: with none, it runs nothing and says so, and begins nothing.
#[tokio::test]
async fn a_resume_only_call_in_a_session_begins_nothing() {
    let idempotency = runtime(8);
    let runs = Arc::new(AtomicUsize::new(0));
    let work = {
        let runs = Arc::clone(&runs);
        async move { runs.fetch_add(1, Ordering::SeqCst) }
    };
    let resumed = idempotency
        .run(&in_session("resume", 1, 0).resume_only(), work)
        .await;
    assert!(
        matches!(resumed, Err(Error::NothingToResume)),
        "{resumed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Nothing was claimed: the same number then runs as a new request.
    let fresh = idempotency
        .run(&in_session("resume", 1, 0), async { 7u8 })
        .await
        .unwrap();
    assert!(!fresh.is_replayed());
}
