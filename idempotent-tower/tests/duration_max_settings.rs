//! Every public duration setting of the tower crate, besides the client's (covered by
//! `client::every_setting_at_its_maximum_is_safe`), set to `Duration::MAX` (issue 39: "no
//! `Duration::MAX` setting of any builder panics"), then the code path that uses it
//! exercised: the layer's call options, a shutdown, the completer's passes and its task, and
//! the outbox's HTTP sink with an endless policy. The runtime's and the stores' settings are
//! in `idempotent-core/tests/duration_max_settings.rs`.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::{Router, routing};
use http::StatusCode;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CallOptions, Defaults, Idempotency, InFlightPolicy, limits};
use idempotent_tower::{Completer, IdempotencyLayer};
use support::{post, send};
use tokio::time::timeout;

/// Longer than any path below takes; a "no limit" setting must never make a test wait this long.
const BOUND: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: still waiting after {BOUND:?}"))
}

/// An order endpoint that answers 502 while `failing` (so the operation is released and left
/// for a completer), else 201; `gate`, while set, holds every run until it is cleared.
#[derive(Default)]
struct Shop {
    runs: AtomicUsize,
    failing: AtomicBool,
    gate: AtomicBool,
}

async fn order(State(shop): State<Arc<Shop>>) -> (StatusCode, String) {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    while shop.gate.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if shop.failing.load(Ordering::SeqCst) {
        (StatusCode::BAD_GATEWAY, format!("run {n} failed"))
    } else {
        (StatusCode::CREATED, format!("run {n}"))
    }
}

fn routes(shop: &Arc<Shop>) -> Router {
    Router::new()
        .route("/orders", routing::post(order))
        .with_state(Arc::clone(shop))
}

/// The runtime and the layer at the longest settings they accept, waiting without a deadline.
fn longest() -> (Idempotency, IdempotencyLayer) {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .defaults(
            Defaults::new()
                .ttl(limits::MAX_TTL)
                .lease(limits::MAX_LEASE)
                .in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
        )
        .record_retry(limits::MAX_RECORD_RETRY)
        .build();
    let layer = IdempotencyLayer::http(idempotency.clone())
        .keep_requests("1.0.0".parse().unwrap())
        .call_options(
            CallOptions::new()
                .ttl(limits::MAX_TTL)
                .lease(limits::MAX_LEASE)
                .in_flight(InFlightPolicy::Wait { max: Duration::MAX }),
        );
    (idempotency, layer)
}

/// The layer's call options at their longest and a wait without a deadline: a request runs
/// once, a duplicate sent while it runs waits for it and gets the replay; then
/// `Idempotency::shutdown(Duration::MAX)` waits for the request in flight, answers new ones
/// `503 shutting_down`, and returns once it is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_and_shutdown() {
    let (idempotency, layer) = longest();
    let shop = Arc::new(Shop::default());
    let app = routes(&shop).layer(layer);

    shop.gate.store(true, Ordering::SeqCst);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/orders", Some("o-1"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicate = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/orders", Some("o-1"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!duplicate.is_finished(), "the duplicate waits");
    shop.gate.store(false, Ordering::SeqCst);
    let first = bounded("first", first).await.unwrap();
    assert_eq!((first.status, first.text()), (StatusCode::CREATED, "run 1"));
    let duplicate = bounded("duplicate", duplicate).await.unwrap();
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.text(), "run 1");

    shop.gate.store(true, Ordering::SeqCst);
    let in_flight = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/orders", Some("o-2"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let shutdown = tokio::spawn({
        let idempotency = idempotency.clone();
        async move { idempotency.shutdown(Duration::MAX).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!shutdown.is_finished(), "waits for the request in flight");
    let late = bounded("late", send(&app, post("/orders", Some("o-3"), "{}"))).await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(late.code(), "shutting_down");
    shop.gate.store(false, Ordering::SeqCst);
    let in_flight = bounded("in flight", in_flight).await.unwrap();
    assert_eq!(in_flight.status, StatusCode::CREATED);
    let drained = bounded("shutdown", shutdown).await.unwrap();
    assert!(drained.is_clean(), "{drained:?}");
    assert_eq!(shop.runs.load(Ordering::SeqCst), 2);
}

/// `Completer::after(Duration::MAX)` (never abandoned long enough: a pass finds nothing),
/// with its derived pass interval and with `scan_every(Duration::MAX)` (the task never
/// passes, and stops when told); the operation is there, as a completer with a short `after`
/// shows by finishing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer() {
    let (_, layer) = longest();
    let shop = Arc::new(Shop::default());
    let inner = routes(&shop);
    let app = inner.clone().layer(layer.clone());
    // The client gives up after a 502: released, its request kept for a completer.
    shop.failing.store(true, Ordering::SeqCst);
    let failed = bounded("order", send(&app, post("/orders", Some("o-1"), "{}"))).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    shop.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;

    let endless = Completer::new(&layer, inner.clone()).after(Duration::MAX);
    let pass = bounded("pass", endless.pass()).await.unwrap();
    assert_eq!(pass.found, 0, "{pass:?}");
    for completer in [
        endless.clone(),
        endless.clone().scan_every(Duration::MAX),
        Completer::new(&layer, inner.clone()).scan_every(Duration::MAX),
    ] {
        let running = completer.spawn();
        tokio::time::sleep(Duration::from_millis(50)).await;
        bounded("stop", running.stop()).await;
    }
    // Passes every 10 ms that look for operations abandoned "forever": none.
    let running = endless
        .clone()
        .scan_every(Duration::from_millis(10))
        .spawn();
    tokio::time::sleep(Duration::from_millis(100)).await;
    bounded("stop", running.stop()).await;
    assert_eq!(shop.runs.load(Ordering::SeqCst), 1, "nothing finished it");

    let short = Completer::new(&layer, inner).after(Duration::from_millis(10));
    let pass = bounded("pass", short.pass()).await.unwrap();
    assert_eq!((pass.found, pass.completed), (1, 1), "{pass:?}");
    let retry = bounded("retry", send(&app, post("/orders", Some("o-1"), "{}"))).await;
    assert_eq!((retry.status, retry.text()), (StatusCode::CREATED, "run 2"));
    assert!(retry.replayed());
}

/// The outbox's HTTP sink with every duration of its policy endless: a delivery is answered
/// at once; a retryable answer is retried (after a short first backoff) or, with an endless
/// backoff, returned at once for the relay to retry later.
#[cfg(feature = "outbox")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_sink() {
    use idempotent_postgres::outbox::{Relayed, Sink};
    use idempotent_tower::client::{HttpSink, RetryPolicy};

    let received = Arc::new(AtomicUsize::new(0));
    // The body names the status to answer.
    let app = Router::new().route(
        "/notify",
        routing::post({
            let received = Arc::clone(&received);
            move |body: String| async move {
                received.fetch_add(1, Ordering::SeqCst);
                StatusCode::from_u16(body.parse().unwrap()).unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/notify", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let message = |status: &str| {
        let mut message = Relayed::default();
        message.id = 1;
        message.destination = "hook".into();
        message.key = "m-1".into();
        message.payload = status.to_owned().into();
        message.attempt = 1;
        message
    };
    let endless = || {
        RetryPolicy::new()
            .max_attempts(2)
            .deadline(Duration::MAX)
            .attempt_timeout(Duration::MAX)
            .budget(Duration::MAX, u32::MAX, 100.0)
    };

    for (label, policy, attempts) in [
        (
            "short first backoff",
            endless().backoff(Duration::from_millis(10), Duration::MAX),
            2,
        ),
        (
            "endless backoff",
            endless().backoff(Duration::MAX, Duration::MAX),
            1,
        ),
    ] {
        let sink = HttpSink::new(&url).unwrap().policy(policy);
        received.store(0, Ordering::SeqCst);
        bounded(label, sink.deliver(&message("201")))
            .await
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(received.load(Ordering::SeqCst), 1, "{label}");
        received.store(0, Ordering::SeqCst);
        let retry = bounded(label, sink.deliver(&message("503")))
            .await
            .unwrap_err();
        assert!(!retry.is_permanent(), "{label}: {retry}");
        assert_eq!(received.load(Ordering::SeqCst), attempts, "{label}");
    }
    server.abort();
}
