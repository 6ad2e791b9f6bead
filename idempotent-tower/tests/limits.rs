//! The layer's duration settings (its `CallOptions`) are checked where they are written: a
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

#[test]
#[should_panic(expected = "lease must be between 100ms and 365d, got 0s")]
fn a_zero_lease_is_refused() {
    let _ = memory().call_options(CallOptions::new().lease(Duration::ZERO));
}

#[test]
#[should_panic(expected = "lease must be between 100ms and 365d, got 500µs")]
fn a_sub_millisecond_lease_is_refused() {
    let _ = memory().call_options(CallOptions::new().lease(Duration::from_micros(500)));
}

#[test]
#[should_panic(expected = "ttl must be between 1ms and 365d, got 0s")]
fn a_zero_ttl_is_refused() {
    let _ = memory().call_options(CallOptions::new().ttl(Duration::ZERO));
}

#[test]
#[should_panic(expected = "ttl must be between 1ms and 365d, got 18446744073709551615.999999999s")]
fn an_endless_ttl_is_refused() {
    let _ = memory().call_options(CallOptions::new().ttl(Duration::MAX));
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
