//! The running claim behind the layer: the handler reads it as a request extension (HTTP and
//! gRPC), what a stale owner's client receives under each `OnClaimLost` policy, and a response
//! whose record could not be written at first is still replayed, never run again.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;
use idempotent_core::conformance::{Fault, Faults, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{Call, ClaimHandle, Defaults, FencingToken, Idempotency, Key};
use idempotent_tower::{IdempotencyLayer, OnClaimLost, Principal, Protocol};
use support::{Req, Svc, grpc, post, send, stack};
use tower::{BoxError, service_fn};

/// A handler that answers with what it saw of its claim, after `delay`; counts runs and
/// handlers that were stopped before they finished.
#[derive(Clone, Default)]
struct Handler {
    runs: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

impl Handler {
    fn stack<P: Protocol>(&self, layer: IdempotencyLayer<P>, delay: Duration) -> Svc<Full<Bytes>> {
        let this = self.clone();
        stack(
            layer,
            service_fn(move |req: Req| {
                let this = this.clone();
                async move {
                    this.runs.fetch_add(1, Ordering::SeqCst);
                    let claim = req.extensions().get::<ClaimHandle>().cloned();
                    tokio::time::sleep(delay).await;
                    this.finished.fetch_add(1, Ordering::SeqCst);
                    let text = match claim {
                        Some(claim) => format!(
                            "token={} op={} lost={}",
                            claim.token().get(),
                            claim.operation_key().as_str(),
                            claim.is_lost()
                        ),
                        None => "no claim".to_owned(),
                    };
                    Ok::<_, BoxError>(
                        Response::builder()
                            .status(201)
                            .header(CONTENT_TYPE, "application/grpc")
                            .header("grpc-status", "0")
                            .body(Full::new(Bytes::from(text)))
                            .unwrap(),
                    )
                }
            }),
        )
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

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

#[tokio::test]
async fn the_handler_reads_the_claim_as_a_request_extension() {
    let handler = Handler::default();
    let idempotency = Idempotency::new(MemoryStore::new());
    let svc = handler.stack(IdempotencyLayer::http(idempotency.clone()), Duration::ZERO);
    let response = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let body = response.text();
    assert_eq!(response.status, StatusCode::CREATED);
    // The layer's storage key for this request: its scope is the request's principal.
    let scope = Principal::new("client").scope();
    let key = idempotency.storage_key(&Call::new(Key::new("order-1").unwrap()).scope(scope));
    // The first claim of the key begins the record's lifetime: its token names it.
    let token: u64 = body
        .strip_prefix("token=")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|token| token.parse().ok())
        .unwrap_or_else(|| panic!("{body}"));
    let expected = format!(
        "op={} lost=false",
        key.operation_key(FencingToken::new(token)).as_str()
    );
    assert!(body.contains(&expected), "{body}");
}

#[tokio::test]
async fn a_grpc_handler_reads_the_claim_too() {
    let handler = Handler::default();
    let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
        .methods(["/payments.v1.Payments/Charge"]);
    let svc = handler.stack(layer, Duration::ZERO);
    let request = grpc("/payments.v1.Payments/Charge", "order-1");
    let answer = send(&svc, request).await;
    let body = answer.text();
    assert!(
        body.contains("lost=false") && body.contains("op="),
        "{body}"
    );
}

#[tokio::test(start_paused = true)]
async fn by_default_a_stale_owner_finishes_and_its_client_gets_its_response() {
    let lease = Duration::from_secs(3);
    let (idempotency, faults) = faulty(lease);
    // The store stalls for every renewal: the claim ends with its lease while the handler runs.
    faults.fail(Op::Renew, Fault::Hang);
    let handler = Handler::default();
    let svc = handler.stack(IdempotencyLayer::http(idempotency), lease * 2);
    let response = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let body = response.text();
    assert_eq!(response.status, StatusCode::CREATED);
    assert!(
        body.contains("lost=true"),
        "the handler saw the loss: {body}"
    );
    assert_eq!(handler.finished.load(Ordering::SeqCst), 1);
    // Its record was refused (the lease had ended), so the retry is a new owner: without a
    // downstream key, the handler runs again, and both runs passed the same operation key.
    faults.heal_all();
    let retry = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let retry_body = retry.text();
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.headers.contains_key("idempotent-replayed"));
    assert_eq!(handler.runs(), 2);
    let op = |body: &str| body.split(' ').nth(1).unwrap().to_owned();
    assert_eq!(op(body), op(retry_body));
    let replay = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let replay_body = replay.text();
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay_body, retry_body);
}

#[tokio::test(start_paused = true)]
async fn with_cancel_a_stale_owner_is_stopped_and_its_client_told_to_retry() {
    let lease = Duration::from_secs(3);
    let (idempotency, faults) = faulty(lease);
    // Stalled for renewals and for the release that follows the stop.
    faults.fail(Op::Renew, Fault::Hang);
    faults.fail(Op::Release, Fault::Hang);
    let handler = Handler::default();
    let layer = IdempotencyLayer::http(idempotency.clone()).on_claim_lost(OnClaimLost::Cancel);
    let svc = handler.stack(layer, lease * 10);
    let started = tokio::time::Instant::now();
    let response = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    assert!(
        started.elapsed() <= lease + lease / 6,
        "stopped when the lease ended: {:?}",
        started.elapsed()
    );
    assert_eq!(response.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.code(), "claim_lost");
    assert!(response.headers.contains_key(RETRY_AFTER));
    assert_eq!(
        handler.finished.load(Ordering::SeqCst),
        0,
        "the handler was stopped"
    );
    // The retry is answered by whoever holds the key now: here nobody (the stopped owner's
    // lease ended), so it runs, once, and is then replayed.
    faults.heal_all();
    let fast = handler.stack(
        IdempotencyLayer::http(idempotency).on_claim_lost(OnClaimLost::Cancel),
        Duration::ZERO,
    );
    let retry = send(&fast, post("/pay", Some("order-1"), "{}")).await;
    let retry_body = retry.text();
    assert_eq!(retry.status, StatusCode::CREATED);
    let replay = send(&fast, post("/pay", Some("order-1"), "{}")).await;
    let replay_body = replay.text();
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay_body, retry_body);
    assert_eq!(handler.runs(), 2);
    assert_eq!(handler.finished.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn grpc_clients_of_a_cancelled_stale_owner_get_unavailable() {
    let lease = Duration::from_secs(3);
    let (idempotency, faults) = faulty(lease);
    faults.fail(Op::Renew, Fault::Hang);
    let handler = Handler::default();
    let layer = IdempotencyLayer::grpc(idempotency)
        .methods(["/payments.v1.Payments/Charge"])
        .on_claim_lost(OnClaimLost::Cancel);
    let svc = handler.stack(layer, lease * 10);
    let request = grpc("/payments.v1.Payments/Charge", "order-1");
    let response = send(&svc, request).await;
    assert_eq!(response.headers["grpc-status"], "14");
    assert_eq!(response.code(), "claim_lost");
}

#[tokio::test(start_paused = true)]
async fn a_response_whose_record_failed_at_first_is_replayed_not_run_again() {
    let lease = Duration::from_secs(3);
    let (idempotency, faults) = faulty(lease);
    faults.fail(Op::Complete, Fault::Unavailable);
    let handler = Handler::default();
    let svc = handler.stack(IdempotencyLayer::http(idempotency), Duration::ZERO);
    let first = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let first_body = first.text();
    assert_eq!(first.status, StatusCode::CREATED);
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let retry = send(&svc, post("/pay", Some("order-1"), "{}")).await;
        let body = retry.text();
        assert_eq!(retry.status, StatusCode::CONFLICT, "{body}");
        assert_eq!(retry.code(), "in_flight");
    }
    faults.heal(Op::Complete);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let retry = send(&svc, post("/pay", Some("order-1"), "{}")).await;
    let body = retry.text();
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(body, first_body);
    assert_eq!(handler.runs(), 1);
}
