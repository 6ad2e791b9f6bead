//! Every duration is checked, not assumed: a zero or sub-millisecond lease used to be accepted
//! (so concurrent duplicates both ran), `InFlightPolicy::Wait { max: Duration::MAX }` panicked
//! on `Instant + max`, and a store given `Duration::MAX` could keep a record forever. The
//! ranges of `limits`, the setters that enforce them, and the memory store's ceiling.

#![cfg(all(feature = "memory", feature = "test-util"))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::clock::ManualClock;
use idempotent_core::conformance::{Fault, FaultyStore, Op};
use idempotent_core::limits::{self, Setting};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    CallOptions, Claim, Defaults, Error, Fingerprint, Idempotency, InFlightPolicy, StorageKey,
    Store,
};
use support::{call, slow};

const NANO: Duration = Duration::from_nanos(1);

#[test]
fn every_range_is_documented_and_ordered() {
    assert_eq!(limits::MIN_TTL, Duration::from_millis(1));
    assert_eq!(limits::MAX_TTL, Duration::from_secs(365 * 24 * 3600));
    assert_eq!(limits::MIN_LEASE, Duration::from_millis(100));
    assert_eq!(limits::MAX_LEASE, Duration::from_secs(365 * 24 * 3600));
    assert_eq!(
        limits::MAX_RECORD_RETRY,
        Duration::from_secs(365 * 24 * 3600)
    );
    assert_eq!(Setting::Ttl.range(), limits::MIN_TTL..=limits::MAX_TTL);
    assert_eq!(
        Setting::Lease.range(),
        limits::MIN_LEASE..=limits::MAX_LEASE
    );
    assert_eq!(
        Setting::RecordRetry.range(),
        Duration::ZERO..=limits::MAX_RECORD_RETRY
    );
    // The defaults are inside their ranges.
    assert!(Setting::Ttl.range().contains(&idempotent_core::DEFAULT_TTL));
    assert!(
        Setting::Lease
            .range()
            .contains(&idempotent_core::DEFAULT_LEASE)
    );
    assert!(
        Setting::RecordRetry
            .range()
            .contains(&idempotent_core::DEFAULT_RECORD_RETRY)
    );
}

#[test]
fn checks_accept_both_ends_and_refuse_just_outside_them() {
    for (check, setting) in [
        (limits::check_ttl as fn(Duration) -> _, Setting::Ttl),
        (limits::check_lease, Setting::Lease),
        (limits::check_record_retry, Setting::RecordRetry),
    ] {
        let range = setting.range();
        let (min, max) = (*range.start(), *range.end());
        assert_eq!(check(min), Ok(min), "{setting}");
        assert_eq!(check(max), Ok(max), "{setting}");
        let error = check(max + NANO).unwrap_err();
        assert_eq!((error.setting(), error.value()), (setting, max + NANO));
        assert_eq!(check(Duration::MAX).unwrap_err().value(), Duration::MAX);
        if let Some(below) = min.checked_sub(NANO) {
            assert_eq!(check(below).unwrap_err().value(), below, "{setting}");
        }
    }
}

#[test]
fn zero_and_sub_millisecond_leases_are_refused() {
    for lease in [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_micros(500),
        Duration::from_millis(99),
    ] {
        let error = limits::check_lease(lease).unwrap_err();
        assert_eq!(error.setting(), Setting::Lease);
        assert_eq!(error.value(), lease);
    }
    assert_eq!(
        limits::check_lease(Duration::from_micros(500))
            .unwrap_err()
            .to_string(),
        "lease must be between 100ms and 365d, got 500µs"
    );
    assert_eq!(
        limits::check_lease(Duration::ZERO).unwrap_err().to_string(),
        "lease must be between 100ms and 365d, got 0s"
    );
}

#[test]
fn messages_name_the_setting_the_range_and_the_value() {
    assert_eq!(
        limits::check_ttl(Duration::ZERO).unwrap_err().to_string(),
        "ttl must be between 1ms and 365d, got 0s"
    );
    assert_eq!(
        limits::check_ttl(Duration::from_secs(366 * 24 * 3600))
            .unwrap_err()
            .to_string(),
        "ttl must be between 1ms and 365d, got 366d"
    );
    assert_eq!(
        limits::check_record_retry(Duration::MAX)
            .unwrap_err()
            .to_string(),
        "record_retry must be between 0s and 365d, got 18446744073709551615.999999999s"
    );
}

/// A setting written in the program is clamped into its range, never a panic: a zero or
/// sub-millisecond lease is the shortest (100 ms: a shorter one would lapse while its owner
/// runs, and concurrent duplicates both ran), `Duration::MAX` or 366 days the longest.
#[test]
fn setters_clamp_durations_out_of_range() {
    let days = |n: u64| Duration::from_secs(n * 24 * 3600);
    for (given, expected) in [
        (Duration::ZERO, limits::MIN_LEASE),
        (Duration::from_micros(500), limits::MIN_LEASE),
        (Duration::from_millis(1), limits::MIN_LEASE),
        (days(366), limits::MAX_LEASE),
        (Duration::MAX, limits::MAX_LEASE),
    ] {
        assert_eq!(
            Defaults::new().lease(given),
            Defaults::new().lease(expected),
            "{given:?}"
        );
        assert_eq!(
            CallOptions::new().lease(given),
            CallOptions::new().lease(expected),
            "{given:?}"
        );
    }
    for (given, expected) in [
        (Duration::ZERO, limits::MIN_TTL),
        (days(366), limits::MAX_TTL),
        (Duration::MAX, limits::MAX_TTL),
    ] {
        assert_eq!(
            Defaults::new().ttl(given),
            Defaults::new().ttl(expected),
            "{given:?}"
        );
        assert_eq!(
            CallOptions::new().ttl(given),
            CallOptions::new().ttl(expected),
            "{given:?}"
        );
        assert_eq!(
            Defaults::new().session_idle(given),
            Defaults::new().session_idle(expected),
            "{given:?}"
        );
    }
    let most = idempotent_core::session::MAX_SESSION_WINDOW;
    assert_eq!(
        Defaults::new().session_window(0),
        Defaults::new().session_window(1)
    );
    assert_eq!(
        Defaults::new().session_window(u64::MAX),
        Defaults::new().session_window(most)
    );
    let _ = Idempotency::builder(MemoryStore::new())
        .record_retry(Duration::MAX)
        .defaults(Defaults::new().lease(Duration::ZERO))
        .build();
    let _ = call("k").options(CallOptions::new().ttl(Duration::MAX));
}

/// A lease written as zero is the shortest, not none: two duplicates of a call at once still
/// run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_lease_written_in_the_program_still_runs_duplicates_once() {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().lease(Duration::ZERO))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let once = || {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            idempotency
                .run(&call("zero-lease"), async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                })
                .await
        })
    };
    let (a, b) = (once(), once());
    let _ = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn setters_accept_both_ends_of_every_range() {
    let _ = Idempotency::builder(MemoryStore::new())
        .defaults(
            Defaults::new()
                .ttl(limits::MIN_TTL)
                .ttl(limits::MAX_TTL)
                .lease(limits::MIN_LEASE)
                .lease(limits::MAX_LEASE)
                .in_flight(InFlightPolicy::Wait {
                    max: Duration::ZERO,
                })
                .in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
        )
        .record_retry(Duration::ZERO)
        .record_retry(limits::MAX_RECORD_RETRY)
        .build();
    let _ = call("k").options(
        CallOptions::new()
            .ttl(limits::MIN_TTL)
            .ttl(limits::MAX_TTL)
            .lease(limits::MIN_LEASE)
            .lease(limits::MAX_LEASE)
            .in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_without_a_deadline_gets_the_replay() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_millis(300)));
        async move { idem.run(&call("k"), work).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = call("k")
        .options(CallOptions::new().in_flight(InFlightPolicy::Wait { max: Duration::MAX }));
    let second = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::ZERO));
        async move { idem.run(&waiting, work).await }
    });
    let second = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the duplicate waits for the owner, not forever")
        .expect("the duplicate does not panic")
        .unwrap();
    assert!(second.is_replayed());
    assert_eq!(second.into_inner(), 1);
    assert!(!first.await.unwrap().unwrap().is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_waiting_without_a_deadline_replays_to_every_duplicate() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().in_flight(InFlightPolicy::Wait { max: Duration::MAX }))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut calls = Vec::new();
    for _ in 0..8 {
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_millis(200)));
        calls.push(tokio::spawn(
            async move { idem.run(&call("k"), work).await },
        ));
    }
    let mut replayed = 0;
    for answer in calls {
        let answer = answer.await.unwrap().unwrap();
        assert_eq!(*answer.get(), 1);
        replayed += usize::from(answer.is_replayed());
    }
    assert_eq!(replayed, 7);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_zero_answers_at_once_like_reject() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, Duration::from_millis(300)));
        async move { idem.run(&call("k"), work).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    let waiting = call("k").options(CallOptions::new().in_flight(InFlightPolicy::Wait {
        max: Duration::ZERO,
    }));
    let err = idem
        .run(&waiting, slow(&runs, Duration::ZERO))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InFlight { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_millis(200));
    first.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn the_shortest_lease_keeps_a_long_call_claimed() {
    let idem = Idempotency::builder(MemoryStore::new())
        .defaults(Defaults::new().lease(limits::MIN_LEASE))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (idem, work) = (idem.clone(), slow(&runs, limits::MIN_LEASE * 5));
        async move { idem.run(&call("k"), work).await }
    });
    // Past several leases: the renewal kept the claim, so duplicates are refused.
    for _ in 0..4 {
        tokio::time::sleep(limits::MIN_LEASE).await;
        let err = idem
            .run(&call("k"), slow(&runs, Duration::ZERO))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InFlight { .. }), "{err:?}");
    }
    assert!(!first.await.unwrap().unwrap().is_replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `record_retry(Duration::ZERO)`: a result the store refused is written once more, then
/// given up.
#[tokio::test(start_paused = true)]
async fn a_zero_record_retry_writes_once_more_then_gives_up() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let idem = Idempotency::builder(store)
        .record_retry(Duration::ZERO)
        .build();
    faults.fail(Op::Complete, Fault::Unavailable);
    let runs = Arc::new(AtomicUsize::new(0));
    let fresh = idem.run(&call("k"), slow(&runs, Duration::ZERO)).await;
    assert!(!fresh.unwrap().is_replayed());
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        faults.calls(Op::Complete),
        2,
        "the first write and one more"
    );
}

fn key(n: u8) -> StorageKey {
    StorageKey::from_bytes([n; 32])
}

fn manual_store() -> (ManualClock, MemoryStore) {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .build();
    (clock, store)
}

/// A store called directly with a `Duration::MAX` lease records the ceiling: the claim ends
/// after `MAX_LEASE`, not never.
#[tokio::test]
async fn memory_store_records_an_endless_lease_as_the_ceiling() {
    let (clock, store) = manual_store();
    let fp = Fingerprint::empty();
    let Claim::Claimed(token) = store
        .claim(&key(1), &fp, Duration::MAX, Duration::MAX)
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    match store
        .claim(&key(1), &fp, Duration::MAX, Duration::MAX)
        .await
        .unwrap()
    {
        Claim::InFlight { retry_after, .. } => assert_eq!(retry_after, limits::MAX_LEASE),
        other => panic!("expected InFlight, got {other:?}"),
    }
    clock.advance(Duration::from_secs(1));
    store
        .renew(&key(1), token, Duration::MAX)
        .await
        .expect("the owner renews");
    clock.advance(limits::MAX_LEASE - NANO);
    assert!(matches!(
        store
            .claim(&key(1), &fp, Duration::MAX, Duration::MAX)
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    clock.advance(NANO);
    assert!(
        matches!(
            store
                .claim(&key(1), &fp, limits::MIN_LEASE, limits::MIN_LEASE)
                .await
                .unwrap(),
            Claim::Claimed(_)
        ),
        "the renewed claim ended with the longest lease"
    );
}

/// A store called directly with a `Duration::MAX` TTL records the ceiling: the completed
/// record ends after `MAX_TTL`, not never.
#[tokio::test]
async fn memory_store_records_an_endless_ttl_as_the_ceiling() {
    let (clock, store) = manual_store();
    let fp = Fingerprint::empty();
    let Claim::Claimed(token) = store
        .claim(&key(2), &fp, limits::MIN_LEASE, limits::MIN_LEASE)
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    store
        .complete(&key(2), token, Bytes::from_static(b"done"), Duration::MAX)
        .await
        .expect("the owner completes");
    clock.advance(limits::MAX_TTL - NANO);
    assert!(matches!(
        store
            .claim(&key(2), &fp, limits::MIN_LEASE, limits::MIN_LEASE)
            .await
            .unwrap(),
        Claim::Completed { .. }
    ));
    clock.advance(NANO);
    assert!(
        matches!(
            store
                .claim(&key(2), &fp, limits::MIN_LEASE, limits::MIN_LEASE)
                .await
                .unwrap(),
            Claim::Claimed(_)
        ),
        "the record ended with the longest TTL"
    );
}

/// A clock far from its origin cannot overflow the store's arithmetic.
#[tokio::test]
async fn memory_store_saturates_instead_of_overflowing() {
    let (clock, store) = manual_store();
    clock.advance(Duration::from_secs(u64::MAX / 1_000_000_000 - 1));
    let fp = Fingerprint::empty();
    let Claim::Claimed(token) = store
        .claim(&key(3), &fp, Duration::MAX, Duration::MAX)
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    store
        .complete(&key(3), token, Bytes::from_static(b"done"), Duration::MAX)
        .await
        .expect("the owner completes");
    assert!(matches!(
        store
            .claim(&key(3), &fp, Duration::MAX, Duration::MAX)
            .await
            .unwrap(),
        Claim::Completed { .. }
    ));
}
