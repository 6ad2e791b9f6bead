//! The layer on axum routers: `Router::layer` and `Router::route_layer`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;
use tower::ServiceExt;

fn counting_router(runs: &Arc<AtomicUsize>) -> Router {
    let (a, b) = (Arc::clone(runs), Arc::clone(runs));
    Router::new()
        .route(
            "/protected",
            post(move || async move {
                (
                    StatusCode::CREATED,
                    a.fetch_add(1, Ordering::SeqCst).to_string(),
                )
            }),
        )
        .route_layer(IdempotencyLayer::new_for_http(Idempotency::new(
            MemoryStore::new(),
        )))
        .route(
            "/unprotected",
            post(move || async move { b.fetch_add(1, Ordering::SeqCst).to_string() }),
        )
}

async fn call(router: &Router, path: &str, key: Option<&str>) -> (StatusCode, bool, String) {
    let mut request = Request::post(path).extension(idempotent_tower::Principal::new("client"));
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from("{}")).unwrap())
        .await
        .unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn route_layer_protects_only_the_routes_before_it() {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = counting_router(&runs);
    let first = call(&router, "/protected", Some("k")).await;
    let retry = call(&router, "/protected", Some("k")).await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    assert_eq!(
        (retry.0, retry.1, &retry.2),
        (StatusCode::CREATED, true, &first.2)
    );
    assert_eq!(
        call(&router, "/protected", None).await.0,
        StatusCode::BAD_REQUEST
    );
    // The route added after route_layer is not wrapped: no key needed, nothing replayed.
    assert_eq!(call(&router, "/unprotected", None).await.0, StatusCode::OK);
    assert!(!call(&router, "/unprotected", Some("k")).await.1);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Unknown routes are untouched by route_layer.
    assert_eq!(
        call(&router, "/missing", None).await.0,
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
            post(move || async move {
                (
                    StatusCode::CREATED,
                    counter.fetch_add(1, Ordering::SeqCst).to_string(),
                )
            }),
        )
        .layer(IdempotencyLayer::new_for_http(Idempotency::new(
            MemoryStore::new(),
        )));
    assert!(!call(&router, "/orders", Some("k")).await.1);
    assert!(call(&router, "/orders", Some("k")).await.1);
    // A 404 from the fallback is a deterministic client error: stored and replayed.
    let missing = call(&router, "/nowhere", Some("k2")).await;
    assert_eq!(missing.0, StatusCode::NOT_FOUND);
    assert!(call(&router, "/nowhere", Some("k2")).await.1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
