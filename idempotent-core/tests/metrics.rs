//! The runtime's metrics, read back through a recorder: every call counted once by its
//! outcome, store operations and work timed, claims in flight, lost claims and completion
//! retries; under real concurrency and under store faults.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::conformance::{Fault, Faults, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::{
    CLAIMS_IN_FLIGHT, CLAIMS_LOST, COMPLETION_RETRIES, REQUESTS, Recorded,
    STORE_OPERATION_DURATION, WORK_DURATION,
};
use idempotent_core::{Defaults, Error, Fingerprint, Idempotency, idempotent};
use support::call;

fn requests(recorded: &Recorded, outcome: &str) -> u64 {
    recorded.counter(REQUESTS, &[("protocol", "call"), ("outcome", outcome)])
}

fn store_ops(recorded: &Recorded, operation: &str, result: &str) -> usize {
    recorded
        .histogram(
            STORE_OPERATION_DURATION,
            &[
                ("operation", operation),
                ("store", "memory"),
                ("result", result),
            ],
        )
        .0
}

fn faulty(lease: Duration) -> (Idempotency, Faults, Recorded) {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let (idempotency, recorded) = Recorded::capture(|| {
        Idempotency::builder(store)
            .defaults(Defaults::new().lease(lease))
            .build()
    });
    (idempotency, faults, recorded)
}

#[tokio::test]
async fn a_fresh_call_and_its_replay_are_counted_and_timed() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let observed = idempotency
        .run(&call("k"), async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            recorded.gauge(CLAIMS_IN_FLIGHT, &[])
        })
        .await
        .unwrap();
    assert_eq!(observed.into_inner(), 1.0, "the owner counts in flight");
    let replay = idempotency.run(&call("k"), async { -1.0 }).await.unwrap();
    assert!(replay.is_replayed());

    assert_eq!(requests(&recorded, "fresh"), 1);
    assert_eq!(requests(&recorded, "replayed"), 1);
    assert_eq!(recorded.counter(REQUESTS, &[]), 2, "each call counted once");
    // The replay is answered from the memory store's record in this process, before any
    // claim (`Store::completed_in_process`): only the owner's claim is a store operation.
    assert_eq!(store_ops(&recorded, "claim", "ok"), 1);
    assert_eq!(store_ops(&recorded, "complete", "ok"), 1);
    let (works, seconds) = recorded.histogram(WORK_DURATION, &[]);
    assert_eq!(works, 1, "only the owner's work is timed");
    assert!(seconds >= 0.02, "the work took its 20 ms: {seconds}");
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 0.0);
    assert_eq!(recorded.counter(CLAIMS_LOST, &[]), 0);
    assert_eq!(recorded.counter(COMPLETION_RETRIES, &[]), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_hundreds_of_concurrent_duplicates_one_is_fresh_and_the_rest_in_flight() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let owner = {
        let (idempotency, runs, release) = (idempotency.clone(), runs.clone(), release.clone());
        tokio::spawn(async move {
            idempotency
                .run(&call("k"), async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    release.notified().await;
                    7
                })
                .await
        })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let duplicates: Vec<_> = (0..300)
        .map(|_| {
            let idempotency = idempotency.clone();
            tokio::spawn(async move { idempotency.run(&call("k"), async { 8 }).await })
        })
        .collect();
    for duplicate in duplicates {
        assert!(matches!(
            duplicate.await.unwrap(),
            Err(Error::InFlight { .. })
        ));
    }
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 1.0);
    release.notify_one();
    assert_eq!(owner.await.unwrap().unwrap().into_inner(), 7);

    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(requests(&recorded, "fresh"), 1);
    assert_eq!(requests(&recorded, "in_flight"), 300);
    assert_eq!(store_ops(&recorded, "claim", "ok"), 301);
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 0.0);
}

#[tokio::test]
async fn refusals_are_counted_by_outcome() {
    let (idempotency, faults, recorded) = faulty(Duration::from_secs(30));
    let first = call("k").fingerprint(Fingerprint::of(&1).unwrap());
    idempotency.run(&first, async { 1 }).await.unwrap();
    let other = call("k").fingerprint(Fingerprint::of(&2).unwrap());
    assert!(matches!(
        idempotency.run(&other, async { 2 }).await,
        Err(Error::FingerprintMismatch)
    ));

    faults.fail_next(Op::Claim, 1, Fault::Unavailable);
    assert!(matches!(
        idempotency.run(&call("down"), async { 3 }).await,
        Err(Error::Store(_))
    ));
    faults.fail_next(Op::Claim, 1, Fault::Full);
    assert!(idempotency.run(&call("full"), async { 4 }).await.is_err());

    idempotency.shutdown(Duration::from_secs(1)).await;
    assert!(matches!(
        idempotency.run(&call("late"), async { 5 }).await,
        Err(Error::ShuttingDown)
    ));

    assert_eq!(requests(&recorded, "fresh"), 1);
    assert_eq!(requests(&recorded, "mismatch"), 1);
    assert_eq!(requests(&recorded, "store_error"), 1);
    assert_eq!(requests(&recorded, "store_full"), 1);
    assert_eq!(requests(&recorded, "shutting_down"), 1);
    assert_eq!(recorded.counter(REQUESTS, &[]), 5);
    assert_eq!(store_ops(&recorded, "claim", "unavailable"), 1);
    assert_eq!(store_ops(&recorded, "claim", "capacity"), 1);
    // Refused before the store: the mismatch was found by a claim, the shutdown by nothing.
    assert_eq!(store_ops(&recorded, "claim", "ok"), 2);
}

#[tokio::test(start_paused = true)]
async fn a_claim_lost_to_a_stalled_store_is_counted() {
    let lease = Duration::from_secs(3);
    let (idempotency, faults, recorded) = faulty(lease);
    faults.fail(Op::Renew, Fault::Hang);
    let lost = idempotency
        .run(&call("k"), async {
            let claim = idempotent_core::ClaimHandle::current().unwrap();
            claim.lost().await;
            true
        })
        .await
        .unwrap();
    assert!(lost.into_inner());
    assert_eq!(recorded.counter(CLAIMS_LOST, &[]), 1);
    // Its record write was refused (the claim had lapsed): timed as such.
    assert_eq!(store_ops(&recorded, "complete", "token_rejected"), 1);
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 0.0);
}

// A completion whose reply was lost landed; its retry found the record completed with its own
// token and was refused, which the runtime took for a lost claim: a false "another owner may
// run" alarm and `claims.lost` + 1.
#[tokio::test(start_paused = true)]
async fn a_completion_whose_reply_was_lost_is_a_success_not_a_lost_claim() {
    let (idempotency, faults, recorded) = faulty(Duration::from_secs(30));
    faults.fail_next(Op::Complete, 1, Fault::LoseReply);
    let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
    let first = idempotency
        .run(&call("k"), async {
            let _ = handle_tx.send(idempotent_core::ClaimHandle::current().unwrap());
            1
        })
        .await
        .unwrap();
    assert!(!first.is_replayed());
    let handle = handle_rx.await.unwrap();
    let replay = loop {
        match idempotency.run(&call("k"), async { 2 }).await {
            Err(Error::InFlight { .. }) => tokio::time::sleep(Duration::from_millis(100)).await,
            other => break other.unwrap(),
        }
    };
    assert_eq!(replay.into_inner(), 1);
    // Let the background write finish whatever it does next.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(faults.calls(Op::Complete), 2, "one retry, which succeeded");
    assert_eq!(store_ops(&recorded, "complete", "ok"), 1);
    assert_eq!(store_ops(&recorded, "complete", "token_rejected"), 0);
    assert_eq!(recorded.counter(CLAIMS_LOST, &[]), 0, "no false alarm");
    assert!(!handle.is_lost());
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_result_written_after_store_failures_counts_its_retries() {
    let (idempotency, faults, recorded) = faulty(Duration::from_secs(30));
    faults.fail_next(Op::Complete, 3, Fault::Unavailable);
    let first = idempotency.run(&call("k"), async { 1 }).await.unwrap();
    assert!(!first.is_replayed());
    // The retries run in the background while the claim is kept: wait for the replay.
    let replay = loop {
        match idempotency.run(&call("k"), async { 2 }).await {
            Err(Error::InFlight { .. }) => tokio::time::sleep(Duration::from_millis(100)).await,
            other => break other.unwrap(),
        }
    };
    assert!(replay.is_replayed());
    assert_eq!(replay.into_inner(), 1);
    assert_eq!(recorded.counter(COMPLETION_RETRIES, &[]), 3);
    assert_eq!(store_ops(&recorded, "complete", "unavailable"), 3);
    assert_eq!(store_ops(&recorded, "complete", "ok"), 1);
    assert_eq!(recorded.gauge(CLAIMS_IN_FLIGHT, &[]), 0.0);
}

struct Consumer {
    idempotency: Idempotency,
    applied: AtomicUsize,
}

impl Consumer {
    #[idempotent(key = id, runtime = &self.idempotency)]
    async fn apply(&self, id: &str) -> Result<usize, Error> {
        Ok(self.applied.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

#[tokio::test]
async fn the_attribute_counts_its_calls_as_the_runtime_does() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let consumer = Consumer {
        idempotency,
        applied: AtomicUsize::new(0),
    };
    assert_eq!(consumer.apply("m-1").await.unwrap(), 1);
    assert_eq!(consumer.apply("m-1").await.unwrap(), 1);
    assert!(consumer.apply("").await.is_err(), "an empty key is refused");
    assert_eq!(requests(&recorded, "fresh"), 1);
    assert_eq!(requests(&recorded, "replayed"), 1);
    assert_eq!(requests(&recorded, "invalid_key"), 1);
}

#[tokio::test]
async fn a_runtime_created_before_the_recorder_records_nothing_into_it() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let ((), recorded) = Recorded::capture(|| ());
    idempotency.run(&call("k"), async { 1 }).await.unwrap();
    assert_eq!(recorded.counter(REQUESTS, &[]), 0);
}
