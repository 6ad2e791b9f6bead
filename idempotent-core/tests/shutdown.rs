//! Graceful shutdown: new calls are refused, calls in flight finish and record their outcome
//! (so their retries replay on another instance), and work still running at the deadline is
//! stopped with its claim released (so its retry runs at once instead of after the lease).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::conformance::{Fault, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CallOptions, Error, Idempotency, Outcome, ProblemCode};
use support::{call, slow};

/// Two instances of one service sharing a store.
fn two_instances() -> (Idempotency, Idempotency) {
    let store = MemoryStore::new();
    (Idempotency::new(store.clone()), Idempotency::new(store))
}

/// A call on `key` through `idempotency`, on a task of its own.
fn spawn_run(
    idempotency: &Idempotency,
    key: &'static str,
    work: impl Future<Output = usize> + Send + 'static,
) -> tokio::task::JoinHandle<Result<Outcome<usize>, Error>> {
    let idempotency = idempotency.clone();
    tokio::spawn(async move { idempotency.run(&call(key), work).await })
}

/// Waits until the work counting into `runs` has started.
async fn started(runs: &AtomicUsize) {
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn calls_after_shutdown_began_are_refused_without_touching_the_store() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::new(store);
    let clone = idempotency.clone();
    assert!(!idempotency.is_shutting_down());
    let drained = idempotency.shutdown(Duration::from_secs(1)).await;
    assert!(drained.is_clean(), "{drained:?}");
    assert!(clone.is_shutting_down(), "clones share the shutdown");
    let runs = Arc::new(AtomicUsize::new(0));
    let refused = clone.run(&call("k"), slow(&runs, Duration::ZERO)).await;
    assert!(matches!(refused, Err(Error::ShuttingDown)), "{refused:?}");
    let error = refused.unwrap_err();
    assert_eq!(error.code(), ProblemCode::ShuttingDown);
    assert!(error.retry_after().is_some());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        faults.calls(Op::Claim),
        0,
        "a refused call never reaches the store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_in_flight_finishes_and_records_before_shutdown_returns() {
    let (a, b) = two_instances();
    let runs = Arc::new(AtomicUsize::new(0));
    let running = spawn_run(&a, "pay-1", slow(&runs, Duration::from_millis(400)));
    started(&runs).await;
    let shutdown = {
        let a = a.clone();
        tokio::spawn(async move { a.shutdown(Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Meanwhile, a new call on the instance shutting down is refused at once.
    let late = a.run(&call("pay-2"), slow(&runs, Duration::ZERO)).await;
    assert!(matches!(late, Err(Error::ShuttingDown)), "{late:?}");
    assert!(
        !shutdown.is_finished(),
        "shutdown waits for the call in flight"
    );

    let drained = shutdown.await.unwrap();
    assert!(drained.is_clean(), "{drained:?}");
    // By the time shutdown returns the result is recorded: its retry, sent to the other
    // instance, replays it.
    let retry = b
        .run(&call("pay-1"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Replayed(1));
    assert_eq!(running.await.unwrap().unwrap(), Outcome::Fresh(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_still_running_at_the_deadline_is_stopped_and_its_key_released() {
    let (a, b) = two_instances();
    let runs = Arc::new(AtomicUsize::new(0));
    let stuck = spawn_run(&a, "hung", slow(&runs, Duration::from_secs(3600)));
    started(&runs).await;
    let started = Instant::now();
    let drained = a.shutdown(Duration::from_millis(200)).await;
    assert_eq!((drained.stopped, drained.remaining), (1, 0), "{drained:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let stopped = stuck.await.unwrap();
    assert!(matches!(stopped, Err(Error::ShuttingDown)), "{stopped:?}");
    // The key is free now, not locked for the 30 s lease: the retry runs at once.
    let retry = b
        .run(&call("hung"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Fresh(2));
}

/// Work stopped at the deadline is dropped where it stood before its claim is released: what
/// it holds (a transaction, a lock, a connection) is let go before a retry can take the key.
/// The work's destructor reads the key's record: still in flight, not yet released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_stopped_at_the_deadline_is_dropped_before_its_key_is_released() {
    use idempotent_core::inspect::{InspectStore, RecordState};
    use std::sync::Mutex;
    use std::task::{Context, Poll, Waker};

    /// Whether the key was still in flight when the work was dropped (`None`: not dropped).
    type Seen = Arc<Mutex<Option<bool>>>;
    struct Held {
        store: MemoryStore,
        key: idempotent_core::StorageKey,
        seen: Seen,
    }
    impl Drop for Held {
        fn drop(&mut self) {
            // The memory store answers at once: one poll reads the record.
            let mut read = std::pin::pin!(self.store.inspect(&self.key));
            let Poll::Ready(record) = read.as_mut().poll(&mut Context::from_waker(Waker::noop()))
            else {
                panic!("the memory store answers an inspection at once");
            };
            let in_flight = record
                .expect("the memory store reads its records")
                .is_some_and(|record| record.state == RecordState::InFlight);
            *self.seen.lock().unwrap() = Some(in_flight);
        }
    }

    let store = MemoryStore::new();
    let a = Idempotency::new(store.clone());
    let seen: Seen = Arc::new(Mutex::new(None));
    let held = Held {
        store: store.clone(),
        key: a.storage_key(&call("hung")),
        seen: Arc::clone(&seen),
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let work = {
        let runs = Arc::clone(&runs);
        async move {
            let _held = held;
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3600)).await;
            1
        }
    };
    let stuck = spawn_run(&a, "hung", work);
    started(&runs).await;
    let drained = a.shutdown(Duration::from_millis(200)).await;
    assert_eq!((drained.stopped, drained.remaining), (1, 0), "{drained:?}");
    assert_eq!(
        *seen.lock().unwrap(),
        Some(true),
        "the stopped work is dropped before shutdown returns, while its key is still claimed"
    );
    let stopped = stuck.await.unwrap();
    assert!(matches!(stopped, Err(Error::ShuttingDown)), "{stopped:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_refused_at_first_is_recorded_before_shutdown_returns() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let a = Idempotency::new(store.clone());
    let b = Idempotency::new(store);
    // The first writes of the record fail: the result is retried in the background.
    faults.fail_next(Op::Complete, 4, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    let fresh = a
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(fresh, Outcome::Fresh(1));
    let drained = a.shutdown(Duration::from_secs(20)).await;
    assert!(drained.is_clean(), "{drained:?}");
    assert!(faults.calls(Op::Complete) >= 5, "the write was retried");
    let retry = b
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(
        retry,
        Outcome::Replayed(1),
        "recorded before shutdown returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_keeps_refusing_is_reported_as_remaining() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let a = Idempotency::new(store);
    faults.fail(Op::Complete, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    a.run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    let drained = a.shutdown(Duration::from_millis(300)).await;
    assert_eq!((drained.stopped, drained.remaining), (0, 1), "{drained:?}");
    assert!(!drained.is_clean());
}

/// Hundreds of calls on their own keys around a shutdown: a third started before it (each one
/// runs once and records its result), a third sent after it began (each one refused without
/// running), and a third racing it (either). The retry of each, on the other instance, replays
/// or runs for the first time, at once: no key is left locked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_calls_across_a_shutdown_each_run_once_or_not_at_all() {
    const CALLS: usize = 450;
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum When {
        Before,
        Racing,
        After,
    }
    let when = |i: usize| [When::Before, When::Racing, When::After][i % 3];
    let (a, b) = two_instances();
    let (go, gate) = tokio::sync::watch::channel(false);
    let runs: Vec<Arc<AtomicUsize>> = (0..CALLS).map(|_| Arc::default()).collect();
    let mut tasks = Vec::new();
    for (i, runs) in runs.iter().enumerate() {
        let (a, mut gate) = (a.clone(), gate.clone());
        let work = slow(runs, Duration::from_millis((i % 7) as u64 * 15));
        tasks.push(tokio::spawn(async move {
            match when(i) {
                When::Before => {}
                // Spread around the moment shutdown begins.
                When::Racing => tokio::time::sleep(Duration::from_millis((i % 40) as u64)).await,
                When::After => {
                    gate.wait_for(|go| *go).await.unwrap();
                }
            }
            a.run(&call(&format!("k-{i}")), work).await
        }));
    }
    // Every call of the first third has started its work.
    while (0..CALLS)
        .filter(|&i| when(i) == When::Before)
        .any(|i| runs[i].load(Ordering::SeqCst) == 0)
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let shutdown = {
        let a = a.clone();
        tokio::spawn(async move { a.shutdown(Duration::from_secs(20)).await })
    };
    while !a.is_shutting_down() {
        tokio::task::yield_now().await;
    }
    go.send(true).unwrap();
    let drained = shutdown.await.unwrap();
    assert!(drained.is_clean(), "{drained:?}");
    let (mut fresh, mut refused) = (0, 0);
    for (i, task) in tasks.into_iter().enumerate() {
        let key = call(&format!("k-{i}"));
        let retry_runs = Arc::new(AtomicUsize::new(0));
        let retry = b
            .run(&key, slow(&retry_runs, Duration::ZERO))
            .await
            .unwrap();
        match task.await.unwrap() {
            Ok(outcome) => {
                fresh += 1;
                assert_ne!(when(i), When::After, "call {i} ran after shutdown began");
                assert_eq!(outcome, Outcome::Fresh(1));
                assert_eq!(retry, Outcome::Replayed(1), "call {i}: the retry replays");
                assert_eq!(runs[i].load(Ordering::SeqCst), 1);
            }
            Err(Error::ShuttingDown) => {
                refused += 1;
                assert_ne!(when(i), When::Before, "call {i} was running already");
                assert_eq!(runs[i].load(Ordering::SeqCst), 0, "call {i} was refused");
                assert_eq!(
                    retry,
                    Outcome::Fresh(1),
                    "call {i}: the retry runs, at once"
                );
            }
            Err(other) => panic!("call {i}: {other}"),
        }
    }
    assert_eq!(fresh + refused, CALLS);
    assert!(
        fresh >= CALLS / 3 && refused >= CALLS / 3,
        "fresh {fresh}, refused {refused}"
    );
}

/// A duplicate waiting for another instance's owner (`InFlightPolicy::Wait`) stops waiting
/// once shutdown begins, instead of holding the shutdown up for its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_for_another_owner_gives_up_when_shutdown_begins() {
    let (a, b) = two_instances();
    let runs = Arc::new(AtomicUsize::new(0));
    let owner = spawn_run(&b, "k", slow(&runs, Duration::from_secs(2)));
    started(&runs).await;
    let waiter = {
        let a = a.clone();
        let work = slow(&runs, Duration::ZERO);
        tokio::spawn(async move {
            let patient = call("k").options(CallOptions::new().in_flight(
                idempotent_core::InFlightPolicy::Wait {
                    max: Duration::from_secs(60),
                },
            ));
            a.run(&patient, work).await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    let drained = a.shutdown(Duration::from_millis(100)).await;
    assert!(started.elapsed() < Duration::from_secs(1), "{drained:?}");
    assert_eq!(drained.remaining, 0, "{drained:?}");
    let waited = waiter.await.unwrap();
    assert!(matches!(waited, Err(Error::ShuttingDown)), "{waited:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the duplicate gave up long before the owner (2 s) finished"
    );
    assert_eq!(owner.await.unwrap().unwrap(), Outcome::Fresh(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A call whose claim is still on its way to the store when shutdown begins is waited for: it
/// was counted from before its claim, so it runs and records, and shutdown returns after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_still_on_its_way_to_the_store_is_waited_for() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let (a, b) = (Idempotency::new(store.clone()), Idempotency::new(store));
    faults.fail_next(Op::Claim, 1, Fault::Delay(Duration::from_millis(300)));
    let runs = Arc::new(AtomicUsize::new(0));
    let slow_claim = {
        let (a, work) = (a.clone(), slow(&runs, Duration::ZERO));
        tokio::spawn(async move { a.run(&call("k"), work).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let drained = a.shutdown(Duration::from_secs(10)).await;
    assert!(drained.is_clean(), "{drained:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "shutdown waited for the call"
    );
    let retry = b
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(
        retry,
        Outcome::Replayed(1),
        "recorded before shutdown returned"
    );
    assert_eq!(slow_claim.await.unwrap().unwrap(), Outcome::Fresh(1));
}

/// Work that asked to finish (its effect has happened) is not stopped at the deadline: it
/// completes and records, and its retry replays instead of running again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_asked_to_finish_is_not_stopped_at_the_deadline() {
    let (a, b) = two_instances();
    let runs = Arc::new(AtomicUsize::new(0));
    let finishing = {
        let (a, runs) = (a.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            a.run(&call("k"), async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                // The effect has happened; what is left only finishes up.
                idempotent_core::ClaimHandle::current()
                    .unwrap()
                    .finish_on_shutdown();
                tokio::time::sleep(Duration::from_millis(600)).await;
                n
            })
            .await
        })
    };
    started(&runs).await;
    let drained = a.shutdown(Duration::from_millis(100)).await;
    assert_eq!((drained.stopped, drained.remaining), (0, 0), "{drained:?}");
    assert_eq!(finishing.await.unwrap().unwrap(), Outcome::Fresh(1));
    let retry = b
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Replayed(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
