//! The layer's duration settings (its `CallOptions`) are clamped where they are written: a
//! zero or sub-millisecond lease used to be accepted (concurrent duplicates both ran), and
//! `InFlightPolicy::Wait { max: Duration::MAX }` panicked on `Instant + max`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Response, StatusCode};
use idempotent_core::{CallOptions, InFlightPolicy, limits};
use support::{Req, TestBody, memory, post, send, stack};
use tower::{BoxError, service_fn};

/// The layer's settings written in the program are clamped into their ranges, never a
/// panic: a zero or sub-millisecond lease is the shortest (100 ms), a zero TTL the shortest
/// (1 ms), `Duration::MAX` the longest.
#[test]
fn settings_out_of_range_are_clamped() {
    for (given, expected) in [
        (Duration::ZERO, limits::MIN_LEASE),
        (Duration::from_micros(500), limits::MIN_LEASE),
        (Duration::MAX, limits::MAX_LEASE),
    ] {
        assert_eq!(
            CallOptions::new().lease(given),
            CallOptions::new().lease(expected)
        );
    }
    for (given, expected) in [
        (Duration::ZERO, limits::MIN_TTL),
        (Duration::MAX, limits::MAX_TTL),
    ] {
        assert_eq!(
            CallOptions::new().ttl(given),
            CallOptions::new().ttl(expected)
        );
    }
    let _ = memory().call_options(CallOptions::new().lease(Duration::ZERO).ttl(Duration::MAX));
}

#[test]
fn both_ends_of_every_range_are_accepted() {
    let _ = memory().call_options(
        CallOptions::new()
            .ttl(limits::MIN_TTL)
            .ttl(limits::MAX_TTL)
            .lease(limits::MIN_LEASE)
            .lease(limits::MAX_LEASE)
            .in_flight(InFlightPolicy::Wait {
                max: Duration::ZERO,
            })
            .in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_without_a_deadline_gets_the_replay() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        service_fn(move |_: Req| {
            let runs = Arc::clone(&runs);
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Ok::<_, BoxError>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .body(TestBody::new(format!("run {n}")))
                        .unwrap(),
                )
            }
        })
    };
    let svc = stack(
        memory().call_options(
            CallOptions::new().in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
        ),
        handler,
    );
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post("/payments", Some("k"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let duplicate = tokio::time::timeout(
        Duration::from_secs(10),
        send(&svc, post("/payments", Some("k"), "{}")),
    )
    .await
    .expect("the duplicate waits for the first request, not forever");
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.text(), "run 1");
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
