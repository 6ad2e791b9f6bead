//! The layer's metrics: each protected request counted once, by protocol and outcome, for
//! every way it can end (read back through a recorder).

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idempotent_core::Idempotency;
use idempotent_core::conformance::{Fault, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::{REQUESTS, Recorded};
use idempotent_tower::{IdempotencyLayer, Protocol};
use support::{Req, Svc, grpc, post, send, stack};
use tower::{BoxError, service_fn};

/// A handler that answers 201 (gRPC: 200 with `grpc-status: 0`) after `?delay_ms=N`, behind
/// `layer`.
fn delayed<P: Protocol>(layer: IdempotencyLayer<P>) -> Svc<Full<Bytes>> {
    stack(
        layer,
        service_fn(|req: Req| async move {
            let grpc = req
                .headers()
                .get(CONTENT_TYPE)
                .is_some_and(|t| t == "application/grpc");
            let delay = req
                .uri()
                .query()
                .and_then(|q| q.strip_prefix("delay_ms="))
                .and_then(|ms| ms.parse().ok())
                .unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            Ok::<_, BoxError>(
                Response::builder()
                    .status(if grpc { 200 } else { 201 })
                    .header(CONTENT_TYPE, "application/grpc")
                    .header("grpc-status", "0")
                    .body(Full::new(Bytes::from_static(b"done")))
                    .unwrap(),
            )
        }),
    )
}

fn http(recorded: &Recorded, outcome: &str) -> u64 {
    recorded.counter(REQUESTS, &[("protocol", "http"), ("outcome", outcome)])
}

#[tokio::test]
async fn every_way_a_protected_request_ends_is_counted_once() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let svc = delayed(IdempotencyLayer::http(idempotency).max_request_body(16));

    assert_eq!(
        send(&svc, post("/pay", Some("a"), "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&svc, post("/pay", Some("a"), "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&svc, post("/pay", Some("a"), "{\"other\":1}"))
            .await
            .status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let slow = tokio::spawn({
        let svc = svc.clone();
        async move {
            send(&svc, post("/pay?delay_ms=300", Some("b"), "{}"))
                .await
                .status
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        send(&svc, post("/pay?delay_ms=300", Some("b"), "{}"))
            .await
            .status,
        StatusCode::CONFLICT
    );
    assert_eq!(slow.await.unwrap(), StatusCode::CREATED);
    assert_eq!(
        send(&svc, post("/pay", None, "{}")).await.status,
        StatusCode::BAD_REQUEST
    );
    let too_long = "k".repeat(300);
    assert_eq!(
        send(&svc, post("/pay", Some(&too_long), "{}")).await.status,
        StatusCode::BAD_REQUEST
    );
    let anonymous = Request::post("/pay")
        .header("idempotency-key", "c")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    assert_eq!(send(&svc, anonymous).await.status, StatusCode::FORBIDDEN);
    assert_eq!(
        send(&svc, post("/pay", Some("d"), "a body over sixteen bytes"))
            .await
            .status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // Not protected: not counted.
    let get = Request::get("/pay").body(Full::new(Bytes::new())).unwrap();
    assert_eq!(send(&svc, get).await.status, StatusCode::CREATED);

    assert_eq!(http(&recorded, "fresh"), 2);
    assert_eq!(http(&recorded, "replayed"), 1);
    assert_eq!(http(&recorded, "mismatch"), 1);
    assert_eq!(http(&recorded, "in_flight"), 1);
    assert_eq!(http(&recorded, "missing_key"), 1);
    assert_eq!(http(&recorded, "invalid_key"), 1);
    assert_eq!(http(&recorded, "missing_scope"), 1);
    assert_eq!(http(&recorded, "request_too_large"), 1);
    assert_eq!(
        recorded.counter(REQUESTS, &[]),
        9,
        "no request counted twice"
    );
    assert_eq!(
        recorded.counter(REQUESTS, &[("protocol", "call")]),
        0,
        "the runtime under the layer does not count them again"
    );
}

#[tokio::test]
async fn a_store_outage_is_counted_as_a_store_error_or_as_bypassed_under_fail_open() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(store));
    faults.fail(Op::Claim, Fault::Unavailable);
    let closed = delayed(IdempotencyLayer::http(idempotency.clone()));
    assert_eq!(
        send(&closed, post("/pay", Some("a"), "{}")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let open = delayed(IdempotencyLayer::http(idempotency.clone()).fail_open(true));
    assert_eq!(
        send(&open, post("/pay", Some("a"), "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(http(&recorded, "store_error"), 1);
    assert_eq!(http(&recorded, "bypassed"), 1);
    assert_eq!(recorded.counter(REQUESTS, &[]), 2);

    idempotency.shutdown(Duration::from_secs(1)).await;
    assert_eq!(
        send(&closed, post("/pay", Some("b"), "{}")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(http(&recorded, "shutting_down"), 1);
}

#[tokio::test]
async fn grpc_requests_are_counted_under_their_own_protocol() {
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
    let layer = IdempotencyLayer::grpc(idempotency).methods(["/payments.v1.Payments/Charge"]);
    let svc = delayed(layer);
    send(&svc, grpc("/payments.v1.Payments/Charge", "order-1")).await;
    send(&svc, grpc("/payments.v1.Payments/Charge", "order-1")).await;
    let counted =
        |outcome| recorded.counter(REQUESTS, &[("protocol", "grpc"), ("outcome", outcome)]);
    assert_eq!(counted("fresh"), 1);
    assert_eq!(counted("replayed"), 1);
    assert_eq!(recorded.counter(REQUESTS, &[("protocol", "http")]), 0);
}

/// A request the layer could not keep for a completer (`save_request` failed) did not run and
/// its claim was released: a store failure (`503 store_unavailable`, or the store's own code),
/// counted as one, never `claim_lost` (which says the handler ran and lost its claim). The
/// retry runs it.
#[tokio::test]
async fn a_request_that_could_not_be_kept_is_a_store_failure_not_a_lost_claim() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(store));
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = stack(
        IdempotencyLayer::http(idempotency).keep_requests("1.0.0".parse().unwrap()),
        service_fn({
            let runs = Arc::clone(&runs);
            move |_: Req| {
                runs.fetch_add(1, Ordering::SeqCst);
                async {
                    Ok::<_, BoxError>(
                        Response::builder()
                            .status(201)
                            .body(Full::new(Bytes::from_static(b"done")))
                            .unwrap(),
                    )
                }
            }
        }),
    );

    faults.fail_next(Op::SaveRequest, 1, Fault::Unavailable);
    let refused = send(&svc, post("/pay", Some("a"), "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.code(), "store_unavailable");
    assert!(
        refused.headers.contains_key("retry-after"),
        "a 503 says when to retry"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");
    assert_eq!(http(&recorded, "store_error"), 1);
    assert_eq!(http(&recorded, "claim_lost"), 0);

    faults.fail_next(Op::SaveRequest, 1, Fault::Full);
    let full = send(&svc, post("/pay", Some("a"), "{}")).await;
    assert_eq!(full.code(), "store_capacity", "the store's own code");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");
    assert_eq!(http(&recorded, "store_full"), 1);
    assert_eq!(http(&recorded, "claim_lost"), 0);

    // The claim was released: the retry runs the request.
    let retried = send(&svc, post("/pay", Some("a"), "{}")).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(http(&recorded, "fresh"), 1);
    assert_eq!(faults.calls(Op::SaveRequest), 3);
}
