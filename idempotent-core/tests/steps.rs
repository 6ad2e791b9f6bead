//! Steps through the runtime: a step runs once per operation and later attempts get its
//! checkpoint; a stale owner's checkpoint is refused; limits, names, failures and faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::clock::ManualClock;
use idempotent_core::conformance::{Fault, FaultyStore, KeysOnlyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::{self, Recorded};
use idempotent_core::steps::{Abandoned, CheckpointError};
use idempotent_core::{
    Call, ClaimHandle, Defaults, Error, Execution, Fingerprint, Idempotency, KeyClaim, Retain,
    StepError, StoreError,
};

fn call(key: &str) -> Call {
    Call::new(key.parse().unwrap())
}

/// Runs `work` on `key` with [`Idempotency::execute`] (its value need not be serializable),
/// keeping what `keep` says with a placeholder record, and returns a fresh value.
async fn attempt<V>(
    idempotency: &Idempotency,
    key: &str,
    work: impl std::future::Future<Output = V>,
    keep: impl FnOnce(&V) -> bool,
) -> V {
    match idempotency
        .execute(
            &call(key),
            work,
            |v| {
                if keep(v) {
                    Retain::Keep
                } else {
                    Retain::Release
                }
            },
            |_| Some(Bytes::from_static(b"kept")),
        )
        .await
    {
        Ok(Execution::Fresh(value)) => value,
        other => panic!("expected a fresh run, got {:?}", other.map(|_| ())),
    }
}

fn current() -> ClaimHandle {
    ClaimHandle::current().expect("inside the work")
}

/// Counts each step's runs.
#[derive(Default)]
struct Effects {
    reserved: AtomicUsize,
    charged: AtomicUsize,
}

impl Effects {
    fn counts(&self) -> (usize, usize) {
        (
            self.reserved.load(Ordering::SeqCst),
            self.charged.load(Ordering::SeqCst),
        )
    }
}

/// Runs an order of two steps on `key`; `fail_after_reserve` makes the attempt fail (and its
/// claim be released) between them.
async fn order(
    idempotency: &Idempotency,
    key: &str,
    effects: &Effects,
    fail_after_reserve: bool,
) -> Result<Option<(String, u64)>, Error> {
    let work = async {
        let claim = current();
        let reservation: String = claim
            .step("reserve", async {
                effects.reserved.fetch_add(1, Ordering::SeqCst);
                format!("res-{}", &claim.step_key("reserve").unwrap().as_str()[..12])
            })
            .await?;
        if fail_after_reserve {
            return Ok(None);
        }
        let charge: u64 = claim
            .step("charge", async {
                effects.charged.fetch_add(1, Ordering::SeqCst) as u64 + 100
            })
            .await?;
        Ok::<_, Error>(Some((reservation, charge)))
    };
    let execution = idempotency
        .execute(
            &call(key),
            work,
            |result| match result {
                Ok(Some(_)) => Retain::Keep,
                _ => Retain::Release,
            },
            |result| {
                let kept = result.as_ref().ok()?.as_ref()?;
                Some(Bytes::from(serde_json::to_vec(kept).unwrap()))
            },
        )
        .await?;
    match execution {
        Execution::Fresh(result) => result,
        Execution::Replayed(bytes) => Ok(Some(serde_json::from_slice(&bytes).unwrap())),
    }
}

#[tokio::test]
async fn a_retry_resumes_after_the_steps_that_were_saved() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let effects = Effects::default();
    assert_eq!(
        order(&idempotency, "o-1", &effects, true).await.unwrap(),
        None
    );
    assert_eq!(effects.counts(), (1, 0));
    let (reservation, charge) = order(&idempotency, "o-1", &effects, false)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        effects.counts(),
        (1, 1),
        "the reservation was not made again"
    );
    assert!(reservation.starts_with("res-"));
    assert_eq!(charge, 100);
    // Completed: a replay, nothing runs.
    let replayed = order(&idempotency, "o-1", &effects, false).await.unwrap();
    assert_eq!(replayed, Some((reservation, charge)));
    assert_eq!(effects.counts(), (1, 1));
    // A new operation (another key) runs its steps afresh.
    order(&idempotency, "o-2", &effects, false).await.unwrap();
    assert_eq!(effects.counts(), (2, 2));
}

#[tokio::test]
async fn step_keys_are_stable_across_attempts_and_distinct_per_step_and_operation() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let keys = |key: &'static str, release: bool| {
        let idempotency = idempotency.clone();
        async move {
            let work = async {
                let claim = current();
                (
                    claim.step_key("reserve").unwrap(),
                    claim.step_key("charge").unwrap(),
                    claim.operation_key(),
                )
            };
            attempt(&idempotency, key, work, move |_| !release).await
        }
    };
    let (reserve, charge, operation) = keys("k", true).await;
    assert_eq!(
        reserve.as_str(),
        format!("{}.reserve", operation.as_str()),
        "the operation key and the step name"
    );
    assert_ne!(reserve, charge);
    let again = keys("k", false).await;
    assert_eq!((again.0, again.1), (reserve.clone(), charge), "the retry's");
    let other = keys("other", false).await;
    assert_ne!(other.0, reserve);
}

#[tokio::test]
async fn a_failed_step_is_not_saved_and_runs_again() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let tries = AtomicUsize::new(0);
    let once = || {
        let work = async {
            current()
                .try_step("charge", async {
                    let n = tries.fetch_add(1, Ordering::SeqCst);
                    if n == 0 { Err("declined") } else { Ok(n) }
                })
                .await
        };
        attempt(&idempotency, "flaky", work, |r| r.is_ok())
    };
    let first = once().await;
    assert!(matches!(first, Err(StepError::Failed("declined"))));
    assert_eq!(once().await.unwrap(), 1);
    assert_eq!(tries.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_stale_owners_checkpoint_is_refused_and_the_new_owner_runs_the_step() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let idempotency = Idempotency::builder(store)
        .defaults(Defaults::new().lease(Duration::from_secs(1)))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let (lapsed_tx, lapsed_rx) = tokio::sync::oneshot::channel::<()>();
    let (taken_tx, taken_rx) = tokio::sync::oneshot::channel::<()>();
    let stale = {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            let work = async move {
                let claim = current();
                lapsed_tx.send(()).unwrap();
                taken_rx.await.unwrap();
                claim
                    .step("charge", async { runs.fetch_add(1, Ordering::SeqCst) })
                    .await
            };
            attempt(&idempotency, "stale", work, |_| false).await
        })
    };
    lapsed_rx.await.unwrap();
    clock.advance(Duration::from_secs(2));
    let work = async {
        let claim = current();
        taken_tx.send(()).unwrap();
        // Let the stale owner try first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        claim
            .step("charge", async {
                runs.fetch_add(1, Ordering::SeqCst) + 100
            })
            .await
    };
    let successor = attempt(&idempotency, "stale", work, |_| true)
        .await
        .unwrap();
    let stale = stale.await.unwrap();
    assert!(
        matches!(stale, Err(Error::ClaimLost)),
        "the stale owner's checkpoint is refused: {stale:?}"
    );
    assert_eq!(
        successor, 101,
        "the new owner ran the step: nothing of the stale one's was saved"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn checkpoints_are_bounded_with_a_clear_error() {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().max_checkpoint_bytes(64))
        .build();
    let runs = AtomicUsize::new(0);
    let runs = &runs;
    let once = |size: usize| {
        let work = async move {
            let claim = current();
            claim.step("small", async { 1u8 }).await?;
            claim
                .step("document", async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    "x".repeat(size)
                })
                .await
        };
        attempt(&idempotency, "big", work, |r| r.is_ok())
    };
    match once(100).await {
        Err(Error::Checkpoint(CheckpointError::TooLarge { step, size, limit })) => {
            assert_eq!((step.as_str(), limit), ("document", 64));
            assert!(size > 64, "{size}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // Nothing was saved: the next attempt runs the step again.
    assert_eq!(once(10).await.unwrap().len(), 10);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let error = Error::Checkpoint(CheckpointError::TooLarge {
        step: "document".into(),
        size: 120,
        limit: 64,
    });
    assert_eq!(error.code().as_str(), "payload_error");
    assert!(error.to_string().contains("limit is 64"), "{error}");
}

#[tokio::test]
async fn invalid_names_and_changed_types_are_errors_not_panics() {
    let idempotency = Idempotency::new(MemoryStore::new());
    for (i, bad) in ["", "has space", "colon:", &"n".repeat(65)]
        .into_iter()
        .enumerate()
    {
        let work = async { current().step(bad, async { 1u8 }).await };
        let result = attempt(&idempotency, &format!("name-{i}"), work, |_| true).await;
        assert!(
            matches!(
                result,
                Err(Error::Checkpoint(CheckpointError::InvalidName { .. }))
            ),
            "{bad:?}: {result:?}"
        );
        let work = async { current().step_key(bad) };
        let key = attempt(&idempotency, &format!("key-{i}"), work, |_| true).await;
        assert!(key.is_err(), "{bad:?}");
    }
    // Saved as a string, read back as a number (the code changed between attempts).
    let work = async { current().step("n", async { "text".to_owned() }).await };
    assert_eq!(
        attempt(&idempotency, "typed", work, |_| false)
            .await
            .unwrap(),
        "text"
    );
    let work = async { current().step("n", async { 1u32 }).await };
    let second = attempt(&idempotency, "typed", work, |_| true).await;
    assert!(
        matches!(
            second,
            Err(Error::Checkpoint(CheckpointError::Value { .. }))
        ),
        "{second:?}"
    );
}

#[tokio::test]
async fn a_store_that_fails_the_checkpoint_fails_the_step_and_the_retry_runs_it() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::new(store);
    let runs = AtomicUsize::new(0);
    let once = || {
        let work = async {
            current()
                .step("charge", async { runs.fetch_add(1, Ordering::SeqCst) })
                .await
        };
        attempt(&idempotency, "faulty", work, |r| r.is_ok())
    };
    faults.fail_next(Op::SaveStep, 1, Fault::Unavailable);
    let first = once().await;
    assert!(
        matches!(first, Err(Error::Store(StoreError::Unavailable(_)))),
        "{first:?}"
    );
    assert_eq!(once().await.unwrap(), 1);
    // The retry took the operation over and read its (empty) checkpoints first.
    assert_eq!(faults.calls(Op::LoadSteps), 1);
    assert_eq!(faults.calls(Op::SaveStep), 2);
}

/// A store that keeps no checkpoints runs in a keys-only runtime, whose work gets its claim
/// as a `KeyClaim` and no `ClaimHandle` (no steps: they do not compile there, see the ui
/// cases); the claim itself works as on any runtime.
#[tokio::test]
async fn a_keys_only_runtime_hands_out_no_steps() {
    let idempotency = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let call = Call::new("keys-only".parse().unwrap());
    let seen = idempotency
        .run(&call, async {
            let claim = KeyClaim::current().expect("the work's claim");
            claim.check().await.expect("held");
            (
                ClaimHandle::current().is_none(),
                claim.clone().with_steps().is_none(),
                claim.step_key("charge").is_ok(),
            )
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen, (true, true, true));
    // The same store with its checkpoints: the work gets its steps.
    let full = Idempotency::new(MemoryStore::new());
    let stepped = full
        .run(&call, async {
            ClaimHandle::current()
                .expect("steps")
                .step("charge", async { 7u32 })
                .await
                .unwrap()
        })
        .await
        .unwrap();
    assert_eq!(stepped.into_inner(), 7);
}

/// 300 concurrent duplicates of a three-step operation: each step runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_run_each_step_once() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let steps = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..300 {
        let (idempotency, steps) = (idempotency.clone(), Arc::clone(&steps));
        tasks.spawn(async move {
            idempotency
                .run(&call("dup"), async move {
                    let claim = current();
                    let mut made = Vec::new();
                    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
                        let steps = Arc::clone(&steps);
                        made.push(
                            claim
                                .step(name, async move {
                                    tokio::time::sleep(Duration::from_millis(5)).await;
                                    steps[i].fetch_add(1, Ordering::SeqCst)
                                })
                                .await
                                .unwrap(),
                        );
                    }
                    made
                })
                .await
        });
    }
    while let Some(result) = tasks.join_next().await {
        match result.unwrap() {
            Ok(outcome) => assert_eq!(outcome.into_inner(), vec![0, 0, 0]),
            Err(Error::InFlight { .. }) => {}
            Err(other) => panic!("{other:?}"),
        }
    }
    for step in steps.iter() {
        assert_eq!(step.load(Ordering::SeqCst), 1);
    }
}

/// A completer's call resumes an abandoned operation and never starts a new one.
#[tokio::test]
async fn a_resume_call_runs_only_on_an_abandoned_operation() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let fingerprint = Fingerprint::from_bytes(b"order");
    let order = call("abandoned").fingerprint(fingerprint);
    idempotency
        .run_with(
            &order,
            async {
                let claim = current();
                claim
                    .save_request(Bytes::from_static(b"the request"))
                    .await
                    .unwrap();
                claim.step("reserve", async { 7u8 }).await.unwrap();
            },
            |()| Retain::Release,
        )
        .await
        .unwrap();
    let found = idempotency
        .abandoned(Duration::ZERO, 10, None)
        .await
        .unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].request.as_ref(), b"the request");
    assert_eq!(found[0].fingerprint, fingerprint);
    assert_eq!(found[0].key, idempotency.storage_key(&order));
    let resumed = idempotency
        .run(&Call::resume(&found[0]), async {
            runs.fetch_add(1, Ordering::SeqCst);
            current().step("reserve", async { 9u8 }).await.unwrap()
        })
        .await
        .unwrap();
    assert_eq!(resumed.into_inner(), 7, "resumed from the checkpoint");
    // The operation is done: resuming it again finds nothing, and replays.
    let again = idempotency
        .run(&Call::resume(&found[0]), async { 0u8 })
        .await
        .unwrap();
    assert!(again.is_replayed());
    // Nothing abandoned under a key: the resume call runs nothing and leaves nothing.
    let nothing = Abandoned {
        key: idempotency.storage_key(&call("never")),
        ..found[0].clone()
    };
    let refused = idempotency
        .run(&Call::resume(&nothing), async {
            runs.fetch_add(1, Ordering::SeqCst);
        })
        .await;
    assert!(
        matches!(refused, Err(Error::NothingToResume)),
        "{refused:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let fresh = idempotency
        .execute(&call("never"), async { 1u8 }, |_| Retain::Keep, |_| None)
        .await
        .unwrap();
    assert!(
        matches!(fresh, Execution::Fresh(1)),
        "the key is free for its client"
    );
}

#[tokio::test]
async fn checkpoint_writes_and_reads_are_timed_as_store_operations() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let effects = Effects::default();
    order(&idempotency, "m", &effects, true).await.unwrap();
    order(&idempotency, "m", &effects, false).await.unwrap();
    for (operation, n) in [("save_step", 2), ("load_steps", 1)] {
        let (count, _) = recorded.histogram(
            metrics::STORE_OPERATION_DURATION,
            &[("operation", operation), ("result", "ok")],
        );
        assert_eq!(count, n, "{operation}");
    }
}

/// A checkpoint whose write landed but whose reply was lost: the step fails, and the same step
/// asked again in the same attempt reads the store and gets the saved result instead of
/// running again, even on a claim that began its operation; a failed reload is tried again.
#[tokio::test]
async fn a_checkpoint_whose_reply_was_lost_is_found_again_not_run_again() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::new(store);
    let runs = AtomicUsize::new(0);
    let work = async {
        let claim = current();
        let charge = || async { runs.fetch_add(1, Ordering::SeqCst) };
        faults.fail_next(Op::SaveStep, 1, Fault::LoseReply);
        let first = claim.step("charge", charge()).await;
        assert!(
            matches!(first, Err(Error::Store(StoreError::Unavailable(_)))),
            "{first:?}"
        );
        // The reload fails once: still nothing is run, and the next ask reads the store.
        faults.fail_next(Op::LoadSteps, 1, Fault::Unavailable);
        assert!(claim.step("charge", charge()).await.is_err());
        claim.step("charge", charge()).await
    };
    let charge = attempt(&idempotency, "lost-reply", work, |r| r.is_ok())
        .await
        .unwrap();
    assert_eq!(charge, 0, "the saved result");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the charge ran once");
}

/// The attempts a completer counts are the runtime's own entries: never refused by the limit,
/// never in the way of a step, and counted across claims of the operation.
#[tokio::test]
async fn attempts_are_counted_on_the_record_past_the_checkpoint_limit() {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().max_checkpoint_bytes(40))
        .build();
    for expected in 0..5u32 {
        let work = async {
            let claim = current();
            let before = claim.count_attempt().await.unwrap();
            // A 33-byte checkpoint: within the limit whatever the attempts take.
            claim
                .step("reserve", async { "r".repeat(20) })
                .await
                .unwrap();
            before
        };
        let before = attempt(&idempotency, "counted", work, |_| false).await;
        assert_eq!(before, expected);
    }
}

/// Steps of one operation running side by side (the claim's checkpoint state is not locked
/// across a store write): together they never take the record past the limit, and each one
/// that saved is found by the next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_side_by_side_stay_within_the_limit() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::builder(store)
        .defaults(Defaults::new().max_checkpoint_bytes(100))
        .build();
    // Every write waits, so all ten are in flight together.
    faults.fail(Op::SaveStep, Fault::Delay(Duration::from_millis(50)));
    let work = async {
        let claim = current();
        let steps: Vec<_> = (0..10)
            .map(|i| {
                let claim = claim.clone();
                // 1 + 7 + 4 + 20 = 32 bytes each (lengths, name, JSON): three fit in 100, a fourth
                // does not.
                tokio::spawn(async move {
                    claim
                        .step(&format!("step-0{i}"), async { "s".repeat(18) })
                        .await
                })
            })
            .collect();
        let mut results = Vec::new();
        for step in steps {
            results.push(step.await.unwrap());
        }
        results
    };
    let results = attempt(&idempotency, "side-by-side", work, |_| false).await;
    let saved: Vec<usize> = (0..10).filter(|i| results[*i].is_ok()).collect();
    assert_eq!(saved.len(), 3, "{results:?}");
    for (i, result) in results.iter().enumerate() {
        if !saved.contains(&i) {
            assert!(
                matches!(
                    result,
                    Err(Error::Checkpoint(CheckpointError::TooLarge { .. }))
                ),
                "{result:?}"
            );
        }
    }
    faults.heal_all();
    // The next attempt finds the three saved and runs none of them again.
    let runs = AtomicUsize::new(0);
    let work = async {
        let claim = current();
        for i in &saved {
            claim
                .step(&format!("step-0{i}"), async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    String::new()
                })
                .await
                .unwrap();
        }
    };
    attempt(&idempotency, "side-by-side", work, |_| true).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Two steps of the same name in one attempt, side by side, both saving: both return what
/// the store kept first, and so does every later attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_named_steps_side_by_side_agree_with_the_store() {
    for round in 0..20 {
        let store = FaultyStore::new(MemoryStore::new());
        let faults = store.faults();
        let idempotency = Idempotency::new(store);
        faults.fail(Op::SaveStep, Fault::Delay(Duration::from_millis(5)));
        let key = format!("same-name-{round}");
        let work = async {
            let claim = current();
            let (a, b) = (claim.clone(), claim.clone());
            let first = tokio::spawn(async move { a.step("charge", async { 1u32 }).await });
            let second = tokio::spawn(async move { b.step("charge", async { 2u32 }).await });
            (
                first.await.unwrap().unwrap(),
                second.await.unwrap().unwrap(),
            )
        };
        let (a, b) = attempt(&idempotency, &key, work, |_| false).await;
        assert_eq!(a, b, "round {round}");
        faults.heal_all();
        let work = async { current().step("charge", async { 3u32 }).await.unwrap() };
        let later = attempt(&idempotency, &key, work, |_| true).await;
        assert_eq!(
            later, a,
            "round {round}: the later attempt gets the same result"
        );
    }
}

/// A step dropped while its checkpoint is being written (its caller gave up on it) lets go of
/// its name and of the bytes it reserved: a later step of that name writes, neither waiting
/// for the dropped one nor refused by the limit.
#[tokio::test]
async fn a_step_dropped_mid_write_lets_the_next_of_its_name_go_on() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idempotency = Idempotency::builder(store)
        .defaults(Defaults::new().max_checkpoint_bytes(40))
        .build();
    let work = async {
        let claim = current();
        faults.fail_next(Op::SaveStep, 1, Fault::Hang);
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            claim.step("charge", async { "c".repeat(20) }),
        )
        .await;
        assert!(cut.is_err(), "the hung write was dropped: {cut:?}");
        // 1 + 6 + 4 + 22 = 33 bytes: a second reservation beside a leaked one would pass 40.
        tokio::time::timeout(
            Duration::from_secs(10),
            claim.step("charge", async { "d".repeat(20) }),
        )
        .await
        .expect("the step does not wait for the dropped one")
    };
    let loads_before = faults.calls(Op::LoadSteps);
    let charged = attempt(&idempotency, "dropped", work, |r| r.is_ok()).await;
    assert_eq!(charged.unwrap(), "d".repeat(20));
    assert_eq!(
        faults.calls(Op::LoadSteps),
        loads_before + 1,
        "the dropped write may still land: the next step read the store first"
    );
}
