//! The layer during a graceful shutdown of its runtime: new protected requests get
//! `503 shutting_down` with `Retry-After`, requests in flight get their responses and have
//! them recorded, unprotected routes keep working.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing;
use http::header::RETRY_AFTER;
use http::{Method, Response, StatusCode};
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;
use support::{DownStore, post, request, send};

fn app(idempotency: Idempotency, runs: &Arc<AtomicUsize>) -> Router {
    let runs = Arc::clone(runs);
    Router::new()
        .route(
            "/slow",
            routing::post(move || async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(400)).await;
                (StatusCode::CREATED, format!("run {n}"))
            }),
        )
        .route("/health", routing::get(|| async { "ok" }))
        .layer(IdempotencyLayer::http(idempotency))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_refuses_new_requests_and_records_the_one_in_flight() {
    let store = MemoryStore::new();
    let (this, other) = (
        Idempotency::new(store.clone()),
        Idempotency::new(store.clone()),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let (app, other_app) = (app(this.clone(), &runs), app(other, &runs));

    let in_flight = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, post("/slow", Some("long"), "{}")).await })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let shutdown = tokio::spawn(async move { this.shutdown(Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;

    let refused = send(&app, post("/slow", Some("new"), "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers[RETRY_AFTER], "1");
    assert_eq!(refused.code(), "shutting_down", "a problem document");
    let health = send(&app, request(Method::GET, "/health", Some("unused"), "{}")).await;
    assert_eq!(
        health.status,
        StatusCode::OK,
        "unprotected routes are served"
    );

    let first = in_flight.await.unwrap();

    let first_body = first.text();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(shutdown.await.unwrap().is_clean());

    // The client retries on another instance and gets the recorded response.
    let retry = send(&other_app, post("/slow", Some("long"), "{}")).await;
    let retry_body = retry.text();
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry_body, first_body);
    // The refused request was never claimed: it runs on the other instance.
    let fresh = send(&other_app, post("/slow", Some("new"), "{}")).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(!fresh.headers.contains_key("idempotent-replayed"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_still_running_at_the_deadline_is_stopped_and_its_key_released() {
    let store = MemoryStore::new();
    let (this, other) = (Idempotency::new(store.clone()), Idempotency::new(store));
    let runs = Arc::new(AtomicUsize::new(0));
    let (app, other_app) = (app(this.clone(), &runs), app(other, &runs));
    let in_flight = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, post("/slow", Some("long"), "{}")).await })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drained = this.shutdown(Duration::from_millis(100)).await;
    assert_eq!(drained.stopped, 1, "{drained:?}");
    let stopped = in_flight.await.unwrap();
    let body = stopped.text();
    assert_eq!(stopped.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("shutting_down"), "{body}");
    let retry = send(&other_app, post("/slow", Some("long"), "{}")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the key was released: no 409"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A response body that arrives `after` the handler answered.
struct SlowBody {
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    sent: bool,
}

impl http_body::Body for SlowBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        if self.sent {
            return std::task::Poll::Ready(None);
        }
        std::task::ready!(self.sleep.as_mut().poll(cx));
        self.sent = true;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"receipt",
        )))))
    }
}

/// A handler that has answered has run: a shutdown's deadline while its response body is
/// still being read does not stop the call (which would release the key and let the retry run
/// the handler again); the client gets the whole response and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_has_answered_is_not_stopped_while_its_body_is_read() {
    let store = MemoryStore::new();
    let (this, other) = (Idempotency::new(store.clone()), Idempotency::new(store));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = |idempotency: Idempotency| {
        let runs = Arc::clone(&runs);
        Router::new()
            .route(
                "/stream",
                routing::post(move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Response::new(Body::new(SlowBody {
                        sleep: Box::pin(tokio::time::sleep(Duration::from_millis(600))),
                        sent: false,
                    }))
                }),
            )
            .layer(IdempotencyLayer::http(idempotency))
    };
    let (app, other_app) = (app(this.clone()), app(other));
    let in_flight = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, post("/stream", Some("k"), "{}")).await })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drained = this.shutdown(Duration::from_millis(100)).await;
    assert_eq!((drained.stopped, drained.remaining), (0, 0), "{drained:?}");
    let first = in_flight.await.unwrap();
    let body = first.text();
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(body, "receipt");
    let retry = send(&other_app, post("/stream", Some("k"), "{}")).await;
    let retry_body = retry.text();
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry_body, "receipt");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// In fail-open mode a store failure runs the handler unprotected, but never once shutdown has
/// begun: the drain no longer counts the request, and the process may be gone before the
/// handler ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_does_not_bypass_the_store_during_shutdown() {
    let idempotency = Idempotency::keys_only(DownStore {
        delay: Duration::from_millis(300),
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/p",
            routing::post(move || async move {
                counter.fetch_add(1, Ordering::SeqCst);
                StatusCode::CREATED
            }),
        )
        .layer(IdempotencyLayer::http(idempotency.clone()).fail_open(true));
    // Before shutdown, the store being down means "run unprotected".
    let bypassed = send(&app, post("/p", Some("before"), "{}")).await;
    assert_eq!(bypassed.headers["idempotent-bypassed"], "store-unavailable");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A request whose claim fails after shutdown began is refused instead.
    let request = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, post("/p", Some("during"), "{}")).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    idempotency.shutdown(Duration::from_secs(5)).await;
    let response = request.await.unwrap();
    let body = response.text();
    assert_eq!(response.status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(!response.headers.contains_key("idempotent-bypassed"));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler did not run again"
    );
}
