//! The running claim under store faults, through the fault-injecting store wrapper: the handle
//! the work holds (token, operation key, loss signal, check), renewal that survives failed and
//! hung attempts and cannot be starved, and a result that ran and is never lost to a transient
//! store error.
//!
//! Longer than most test files: every test drives the same faulty-store harness through one
//! claim's life, and reads best in that order.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::clock::ManualClock;
use idempotent_core::conformance::{Fault, Faults, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, CallOptions, Claim, ClaimHandle, Defaults, Error, FencingToken, Fingerprint, Idempotency,
    InFlightPolicy, Key, Outcome, Retain, Scope, Store,
};
use support::{call, slow};

fn faulty(lease: Duration) -> (Idempotency, Faults) {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    (
        Idempotency::builder(store)
            .defaults(Defaults::new().lease(lease))
            .build(),
        faults,
    )
}

/// A call on key `k` whose work counts its run and finishes at once.
async fn run_k(idem: &Idempotency, runs: &Arc<AtomicUsize>) -> Outcome<usize> {
    idem.run(&call("k"), slow(runs, Duration::ZERO))
        .await
        .unwrap()
}

/// An owner of key `k` whose work takes `delay`, and returns its run count and whether its
/// claim was lost by then.
fn spawn_owner(
    idem: &Idempotency,
    runs: &Arc<AtomicUsize>,
    delay: Duration,
) -> tokio::task::JoinHandle<Result<Outcome<(usize, bool)>, Error>> {
    let (idem, work) = (idem.clone(), slow(runs, delay));
    tokio::spawn(async move {
        idem.run(&call("k"), async {
            let claim = ClaimHandle::current().unwrap();
            let n = work.await;
            (n, claim.is_lost())
        })
        .await
    })
}

async fn expect_in_flight(idem: &Idempotency, key: &str, runs: &Arc<AtomicUsize>) {
    match idem.run(&call(key), slow(runs, Duration::ZERO)).await {
        Err(Error::InFlight { .. }) => {}
        other => panic!("the claim was not held: {other:?}"),
    }
}

#[tokio::test]
async fn the_work_sees_its_claim_and_nothing_outside_does() {
    assert!(ClaimHandle::current().is_none());
    let idem = Idempotency::new(MemoryStore::new());
    let key = idem.storage_key(&call("k"));
    let seen = idem
        .run(&call("k"), async {
            let claim = ClaimHandle::current().expect("inside the work");
            assert!(!claim.is_lost());
            assert_eq!(claim.storage_key(), key);
            claim.check().await.expect("held");
            (
                claim.token().get(),
                claim.operation_key().as_str().to_owned(),
            )
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        seen.1,
        key.operation_key(FencingToken::new(seen.0)).as_str(),
        "the first claim of a key begins its lifetime"
    );
    assert!(ClaimHandle::current().is_none());
    // A task spawned by the work does not inherit it.
    let inherited = idem
        .run(&call("spawned"), async {
            tokio::spawn(async { ClaimHandle::current().is_some() })
                .await
                .unwrap()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!inherited);
}

#[tokio::test]
async fn operation_key_is_one_per_operation_across_owners_and_distinct_across_scopes() {
    let idem = Idempotency::new(MemoryStore::new());
    let observe = |call: Call, release: bool| {
        let idem = idem.clone();
        async move {
            idem.run_with(
                &call,
                async {
                    let claim = ClaimHandle::current().unwrap();
                    (
                        claim.token().get(),
                        claim.operation_key().as_str().to_owned(),
                    )
                },
                move |_| {
                    if release {
                        Retain::Release
                    } else {
                        Retain::Keep
                    }
                },
            )
            .await
            .unwrap()
            .into_inner()
        }
    };
    // The first owner fails transiently (released); the second attempt is a new owner.
    let (first_token, first_key) = observe(call("order-1"), true).await;
    let (second_token, second_key) = observe(call("order-1"), false).await;
    assert!(
        second_token > first_token,
        "a new owner gets a higher token"
    );
    assert_eq!(
        first_key, second_key,
        "every owner passes the same key downstream"
    );

    let other_scope = observe(call("order-1").scope(Scope::new().principal("bob")), false).await;
    assert_ne!(other_scope.1, first_key);
    let other_namespace = Idempotency::builder(MemoryStore::new())
        .namespace("another-app")
        .build()
        .run(&call("order-1"), async {
            ClaimHandle::current()
                .unwrap()
                .operation_key()
                .as_str()
                .to_owned()
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(other_namespace, first_key);

    let text = first_key.as_str();
    assert!(Key::new(text).is_ok());
    assert_eq!(text.len(), 64);
    assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(!text.contains("order"));
    assert_ne!(text, idem.storage_key(&call("order-1")).to_hex());
}

// A key reused after its record expired reached the provider with the first operation's key
// (derived from the storage key alone), so the provider answered the old charge and the new
// payment never happened.
#[tokio::test]
async fn a_key_reused_after_its_record_expired_gets_a_new_operation_key() {
    let clock = ManualClock::new();
    let idem = Idempotency::new(MemoryStore::builder().clock(clock.clone()).build());
    let ttl = Duration::from_secs(2);
    let pay = || {
        let idem = idem.clone();
        async move {
            idem.run(
                &call("order-7").options(CallOptions::new().ttl(ttl)),
                async {
                    ClaimHandle::current()
                        .unwrap()
                        .operation_key()
                        .as_str()
                        .to_owned()
                },
            )
            .await
            .unwrap()
        }
    };
    let first = pay().await;
    assert!(!first.is_replayed());
    let first = first.into_inner();
    let replay = pay().await;
    assert!(replay.is_replayed());
    assert_eq!(replay.into_inner(), first, "the record's life");
    clock.advance(Duration::from_millis(3200));
    let reused = pay().await;
    assert!(!reused.is_replayed(), "the record expired: a new operation");
    assert_ne!(
        reused.into_inner(),
        first,
        "a new operation gets a new operation key"
    );
}

// Within one record's life, an owner whose lease lapsed (a store stall) and its successor
// pass the same operation key downstream.
#[tokio::test]
async fn a_takeover_after_a_lapsed_lease_keeps_the_operation_key() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let idem = Idempotency::new(store.clone());
    let lease = Duration::from_secs(30);
    let storage_key = idem.storage_key(&call("order-8"));
    let fingerprint = Fingerprint::empty();
    // The first owner's claim, which it then loses to a stall.
    let Ok(Claim::Claimed(first)) = store
        .claim(&storage_key, &fingerprint, lease, Duration::from_secs(3600))
        .await
    else {
        panic!("a fresh key is claimed");
    };
    clock.advance(lease + Duration::from_secs(1));
    let successor = idem
        .run(&call("order-8"), async {
            let claim = ClaimHandle::current().unwrap();
            (
                claim.token().get(),
                claim.operation_key().as_str().to_owned(),
            )
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        successor.0 > first.get(),
        "the successor holds a newer token"
    );
    assert_eq!(
        successor.1,
        storage_key.operation_key(first).as_str(),
        "the successor passes the first owner's operation key"
    );
}

#[tokio::test(start_paused = true)]
async fn renewal_retries_failed_attempts_and_keeps_the_claim() {
    let (idem, faults) = faulty(Duration::from_secs(3));
    // The first four renewal attempts fail at once (they are retried within ~150 ms).
    faults.fail_next(Op::Renew, 4, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    let owner = spawn_owner(&idem, &runs, Duration::from_secs(12));
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        expect_in_flight(&idem, "k", &runs).await;
    }
    let (n, lost) = owner.await.unwrap().unwrap().into_inner();
    assert_eq!((n, lost), (1, false));
    assert_eq!(faults.faulted(Op::Renew), 4);
    assert!(
        faults.calls(Op::Renew) > 4,
        "renewal went on after the failures"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_hung_renewal_does_not_block_the_next_one() {
    let (idem, faults) = faulty(Duration::from_secs(3));
    faults.fail_next(Op::Renew, 2, Fault::Hang);
    let runs = Arc::new(AtomicUsize::new(0));
    let owner = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_secs(10)));
        async move { idem.run(&call("k"), work).await }
    });
    for _ in 0..9 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        expect_in_flight(&idem, "k", &runs).await;
    }
    assert_eq!(owner.await.unwrap().unwrap(), Outcome::Fresh(1));
    assert!(faults.calls(Op::Renew) >= 4, "{}", faults.calls(Op::Renew));
}

/// Regression: renewal was polled by the call's own future, so work that blocked its thread
/// (or a caller that stopped polling) starved it and the claim lapsed while the work ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_is_not_starved_by_work_that_blocks_its_thread() {
    let lease = Duration::from_millis(600);
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().lease(lease))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let owner = tokio::spawn({
        let (idem, runs) = (idem.clone(), Arc::clone(&runs));
        async move {
            idem.run(&call("k"), async move {
                runs.fetch_add(1, Ordering::SeqCst);
                // Yield once so the renewal starts, then hold the thread for 4 leases.
                tokio::task::yield_now().await;
                std::thread::sleep(lease * 4);
                ClaimHandle::current().unwrap().is_lost()
            })
            .await
        }
    });
    for _ in 0..5 {
        tokio::time::sleep(lease / 2).await;
        expect_in_flight(&idem, "k", &runs).await;
    }
    let lost = owner.await.unwrap().unwrap().into_inner();
    assert!(!lost);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_store_stalled_past_the_lease_signals_the_loss_when_the_lease_ends() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    faults.fail(Op::Renew, Fault::Hang);
    let started = tokio::time::Instant::now();
    let (lost_after, checked) = idem
        .run(&call("k"), async {
            let claim = ClaimHandle::current().unwrap();
            tokio::time::timeout(Duration::from_secs(30), claim.lost())
                .await
                .expect("the loss is signalled");
            let checked = claim
                .check()
                .await
                .map_err(|e| e.code().as_str().to_owned());
            (started.elapsed(), checked)
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        lost_after <= lease,
        "signalled {lost_after:?} after the claim, the lease is {lease:?}"
    );
    assert!(lost_after >= lease / 2, "too early: {lost_after:?}");
    assert_eq!(checked, Err("claim_lost".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn a_takeover_is_signalled_at_the_next_renewal() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let lease = Duration::from_secs(3);
    let idem = Idempotency::builder(store.clone())
        .defaults(Defaults::new().lease(lease))
        .build();
    let key = idem.storage_key(&call("k"));
    let owner = tokio::spawn({
        let idem = idem.clone();
        async move {
            idem.run(&call("k"), async {
                let claim = ClaimHandle::current().unwrap();
                let started = tokio::time::Instant::now();
                tokio::time::timeout(Duration::from_secs(30), claim.lost())
                    .await
                    .expect("the loss is signalled");
                (claim.token().get(), started.elapsed())
            })
            .await
        }
    });
    tokio::task::yield_now().await;
    // The store's clock jumps past the lease (a stall) and a second owner takes over before
    // the first renews.
    clock.advance(lease * 2);
    let Claim::TakenOver { token: second, .. } = store
        .claim(&key, &Fingerprint::empty(), lease, lease)
        .await
        .unwrap()
    else {
        panic!("takeover")
    };
    let (first, lost_after) = owner.await.unwrap().unwrap().into_inner();
    assert!(second.get() > first);
    assert!(
        lost_after <= lease / 3 + Duration::from_millis(1),
        "{lost_after:?}"
    );
    // The stale owner's result was not recorded over the new owner's claim.
    assert!(matches!(
        store
            .claim(&key, &Fingerprint::empty(), lease, lease)
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn check_asks_the_store_once() {
    let (idem, faults) = faulty(Duration::from_secs(30));
    let before = faults.calls(Op::Renew);
    let outcome = idem
        .run(&call("k"), async {
            let claim = ClaimHandle::current().unwrap();
            let first = claim.check().await.is_ok();
            faults.fail_next(Op::Renew, 1, Fault::Unavailable);
            let second = claim.check().await;
            (
                first,
                matches!(second, Err(Error::Store(_))),
                claim.is_lost(),
            )
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        outcome,
        (true, true, false),
        "an unanswered check is not a loss"
    );
    assert_eq!(faults.calls(Op::Renew) - before, 2);
}

#[tokio::test(start_paused = true)]
async fn a_failed_completion_write_is_retried_while_duplicates_are_held_off() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    faults.fail(Op::Complete, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    let first = idem
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(
        first,
        Outcome::Fresh(1),
        "the caller gets its value at once"
    );
    // Three leases later the claim is still held: renewed while the write is retried.
    for _ in 0..9 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        expect_in_flight(&idem, "k", &runs).await;
    }
    assert!(faults.calls(Op::Complete) > 3);
    faults.heal(Op::Complete);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let retry = idem
        .run(&call("k"), slow(&runs, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Replayed(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_full_store_at_completion_keeps_the_result_until_space_frees() {
    let (idem, faults) = faulty(Duration::from_secs(3));
    // Neither the result nor the small "not retained" record fit.
    faults.fail(Op::Complete, Fault::Full);
    let runs = Arc::new(AtomicUsize::new(0));
    run_k(&idem, &runs).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    expect_in_flight(&idem, "k", &runs).await;
    faults.heal(Op::Complete);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        run_k(&idem, &runs).await,
        Outcome::Replayed(1),
        "the result itself, not a not-retained record"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_completion_write_is_abandoned_and_tried_again() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    faults.fail_next(Op::Complete, 1, Fault::Hang);
    let runs = Arc::new(AtomicUsize::new(0));
    let started = tokio::time::Instant::now();
    run_k(&idem, &runs).await;
    assert!(started.elapsed() <= lease / 3, "{:?}", started.elapsed());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(run_k(&idem, &runs).await, Outcome::Replayed(1));
}

#[tokio::test(start_paused = true)]
async fn a_lost_completion_reply_does_not_run_the_work_again() {
    let (idem, faults) = faulty(Duration::from_secs(3));
    faults.fail_next(Op::Complete, 1, Fault::LoseReply);
    let runs = Arc::new(AtomicUsize::new(0));
    run_k(&idem, &runs).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(run_k(&idem, &runs).await, Outcome::Replayed(1));
    assert_eq!(
        faults.calls(Op::Complete),
        2,
        "the retry stopped at the rejection"
    );
}

#[tokio::test(start_paused = true)]
async fn retrying_the_write_stops_when_another_owner_took_over() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    // The store is unreachable for writes and renewals: the lease lapses.
    faults.fail(Op::Complete, Fault::Unavailable);
    faults.fail(Op::Renew, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    run_k(&idem, &runs).await;
    tokio::time::sleep(lease * 2).await;
    faults.heal_all();
    // The lease ended: the retry is a new owner (an effect the first owner made must be
    // deduplicated downstream with the operation key).
    assert_eq!(run_k(&idem, &runs).await, Outcome::Fresh(2));
    let writes = faults.calls(Op::Complete);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        faults.calls(Op::Complete) <= writes + 1,
        "the stale owner stopped at its rejected token"
    );
    assert_eq!(
        run_k(&idem, &runs).await,
        Outcome::Replayed(2),
        "the new owner's record stands"
    );
}

#[tokio::test(start_paused = true)]
async fn retrying_the_write_ends_at_the_documented_bound() {
    let lease = Duration::from_secs(3);
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idem = Idempotency::builder(store)
        .defaults(Defaults::new().lease(lease))
        .record_retry(Duration::from_secs(10))
        .build();
    faults.fail(Op::Complete, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    run_k(&idem, &runs).await;
    tokio::time::sleep(Duration::from_secs(9)).await;
    expect_in_flight(&idem, "k", &runs).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let writes = faults.calls(Op::Complete);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        faults.calls(Op::Complete),
        writes,
        "no write after the bound"
    );
}

#[tokio::test]
async fn an_unencodable_result_is_recorded_as_ran_never_released() {
    use std::collections::BTreeMap;
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    // JSON maps need string keys: this value cannot be encoded.
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            BTreeMap::from([((1u8, 2u8), 3u8)])
        }
    };
    let first = idem.run(&call("k"), work(&runs)).await;
    assert!(matches!(first, Err(Error::Payload(_))), "{first:?}");
    let retry = idem.run(&call("k"), work(&runs)).await;
    assert!(matches!(retry, Err(Error::ResultNotRetained)), "{retry:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Regression: failed renewals were retried with a backoff growing to a third of the lease, so
/// a store that refused connections for a third of the lease cost the claim, though it was
/// back well before the lease ended.
#[tokio::test(start_paused = true)]
async fn a_fast_failing_outage_of_two_thirds_of_the_lease_keeps_the_claim() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    let runs = Arc::new(AtomicUsize::new(0));
    let owner = spawn_owner(&idem, &runs, Duration::from_secs(8));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Unreachable from 0.5 s to 2.5 s: the first renewal (at 1 s) and its retries fail.
    faults.fail(Op::Renew, Fault::Unavailable);
    tokio::time::sleep(Duration::from_secs(2)).await;
    faults.heal(Op::Renew);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        expect_in_flight(&idem, "k", &runs).await;
    }
    assert_eq!(owner.await.unwrap().unwrap().into_inner(), (1, false));
    assert!(
        faults.faulted(Op::Renew) >= 5,
        "{}",
        faults.faulted(Op::Renew)
    );
}

/// Regression: the lease was counted from before the call started waiting for a duplicate in
/// flight, so a call that waited longer than a lease thought its fresh claim lost at once.
#[tokio::test(start_paused = true)]
async fn a_claim_won_after_a_long_wait_is_held() {
    let lease = Duration::from_secs(1);
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(
            Defaults::new()
                .lease(lease)
                .in_flight(InFlightPolicy::Wait {
                    max: Duration::from_secs(30),
                }),
        )
        .build();
    // The first call holds the key for five leases, then fails transiently (released).
    let first = tokio::spawn({
        let idem = idem.clone();
        async move {
            idem.run_with(
                &call("k"),
                async {
                    tokio::time::sleep(lease * 5).await;
                    false
                },
                |_| Retain::Release,
            )
            .await
        }
    });
    tokio::task::yield_now().await;
    let second = idem
        .run(&call("k"), async {
            let claim = ClaimHandle::current().unwrap();
            tokio::time::sleep(lease / 2).await;
            claim.is_lost()
        })
        .await
        .unwrap();
    assert_eq!(second, Outcome::Fresh(false));
    assert!(!first.await.unwrap().unwrap().is_replayed());
}

#[tokio::test(start_paused = true)]
async fn tasks_holding_the_claim_learn_when_the_call_gives_it_up() {
    let idem = Idempotency::new(MemoryStore::new());
    // The work fails transiently: its claim is released, and a task it spawned is told.
    let (tx, rx) = tokio::sync::oneshot::channel();
    idem.run_with(
        &call("released"),
        async {
            let claim = ClaimHandle::current().unwrap();
            tx.send(tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(5), claim.lost())
                    .await
                    .is_ok()
            }))
            .unwrap();
            false
        },
        |_| Retain::Release,
    )
    .await
    .unwrap();
    assert!(rx.await.unwrap().await.unwrap(), "lost() fired on release");

    // The caller stops waiting: the abandoned claim is released and the task is told.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        idem.run(&call("abandoned"), async {
            let claim = ClaimHandle::current().unwrap();
            tx.send(tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(5), claim.lost())
                    .await
                    .is_ok()
            }))
            .unwrap();
            std::future::pending::<()>().await
        }),
    )
    .await;
    assert!(abandoned.is_err());
    assert!(
        rx.await.unwrap().await.unwrap(),
        "lost() fired on abandonment"
    );

    // A completed call's claim is not lost.
    let claim = idem
        .run_with(
            &call("completed"),
            async { ClaimHandle::current().unwrap().token().get() },
            |_| Retain::Keep,
        )
        .await
        .unwrap();
    assert!(!claim.is_replayed());
}

#[tokio::test(start_paused = true)]
async fn a_hung_release_does_not_hold_the_caller() {
    let lease = Duration::from_secs(3);
    let (idem, faults) = faulty(lease);
    faults.fail(Op::Release, Fault::Hang);
    let started = tokio::time::Instant::now();
    let out = idem
        .run_with(&call("k"), async { 1 }, |_| Retain::Release)
        .await
        .unwrap();
    assert_eq!(out, Outcome::Fresh(1));
    assert!(started.elapsed() <= lease / 6, "{:?}", started.elapsed());
}

/// A result whose `Serialize` panics.
#[derive(Debug, serde::Deserialize)]
struct PanicsWhenEncoded;

impl serde::Serialize for PanicsWhenEncoded {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("this result cannot be encoded");
    }
}

// A panic in `retain` or in the result's `Serialize` unwound through the armed claim, whose
// drop released the key: the retry ran the work, and its effect, again.
#[tokio::test]
async fn a_panic_after_the_work_ran_is_recorded_not_released() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
        }
    };

    // `Serialize` panics, through `run`.
    let encode = {
        let (idem, runs) = (idem.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            idem.run(&call("encode"), async move {
                counted(&runs).await;
                PanicsWhenEncoded
            })
            .await
        })
    };
    let panic = encode.await.expect_err("the panic reaches the caller");
    assert!(panic.is_panic());
    // `retain` panics, through `run_with`.
    let retain = {
        let (idem, runs) = (idem.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            idem.run_with(
                &call("retain"),
                async move {
                    counted(&runs).await;
                    7u32
                },
                |_| panic!("retain cannot decide"),
            )
            .await
        })
    };
    assert!(
        retain
            .await
            .expect_err("the panic reaches the caller")
            .is_panic()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The retries do not run the work again: the calls are recorded as done, not retained.
    for key in ["encode", "retain"] {
        let retry = idem
            .run(&call(key), async {
                runs.fetch_add(1, Ordering::SeqCst);
                0u32
            })
            .await;
        assert!(
            matches!(retry, Err(Error::ResultNotRetained)),
            "{key}: {retry:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "no work ran twice");
}
