//! The layer on axum routers: `Router::layer` and `Router::route_layer`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing;
use http::StatusCode;
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;
use support::{post, send};

fn counting_router(runs: &Arc<AtomicUsize>) -> Router {
    let (a, b) = (Arc::clone(runs), Arc::clone(runs));
    Router::new()
        .route(
            "/protected",
            routing::post(move || async move {
                (
                    StatusCode::CREATED,
                    a.fetch_add(1, Ordering::SeqCst).to_string(),
                )
            }),
        )
        .route_layer(IdempotencyLayer::http(Idempotency::new(MemoryStore::new())))
        .route(
            "/unprotected",
            routing::post(move || async move { b.fetch_add(1, Ordering::SeqCst).to_string() }),
        )
}

#[tokio::test]
async fn route_layer_protects_only_the_routes_before_it() {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = counting_router(&runs);
    let first = send(&router, post("/protected", Some("k"), "{}")).await;
    let retry = send(&router, post("/protected", Some("k"), "{}")).await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(
        (retry.status, retry.replayed(), &retry.body),
        (StatusCode::CREATED, true, &first.body)
    );
    assert_eq!(
        send(&router, post("/protected", None, "{}")).await.status,
        StatusCode::BAD_REQUEST
    );
    // The route added after route_layer is not wrapped: no key needed, nothing replayed.
    assert_eq!(
        send(&router, post("/unprotected", None, "{}")).await.status,
        StatusCode::OK
    );
    assert!(
        !send(&router, post("/unprotected", Some("k"), "{}"))
            .await
            .replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Unknown routes are untouched by route_layer.
    assert_eq!(
        send(&router, post("/missing", None, "{}")).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn router_layer_wraps_every_route_including_fallbacks() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let router = Router::new()
        .route(
            "/orders",
            routing::post(move || async move {
                (
                    StatusCode::CREATED,
                    counter.fetch_add(1, Ordering::SeqCst).to_string(),
                )
            }),
        )
        .layer(IdempotencyLayer::http(Idempotency::new(MemoryStore::new())));
    assert!(
        !send(&router, post("/orders", Some("k"), "{}"))
            .await
            .replayed()
    );
    assert!(
        send(&router, post("/orders", Some("k"), "{}"))
            .await
            .replayed()
    );
    // A 404 from the fallback is a deterministic client error: stored and replayed.
    let missing = send(&router, post("/nowhere", Some("k2"), "{}")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(
        send(&router, post("/nowhere", Some("k2"), "{}"))
            .await
            .replayed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
