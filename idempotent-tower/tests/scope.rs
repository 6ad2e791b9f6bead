//! Whose key it is: the scope comes from the authenticated principal an authentication
//! middleware puts in the request extensions, never from the credential, and a request
//! without one is refused rather than pooled with every other anonymous caller.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use http::StatusCode;
use http::header::{AUTHORIZATION, CONTENT_TYPE, COOKIE};
use http_body_util::Full;
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::{IdempotencyLayer, Principal};
use support::{Answer, memory, send};
use tower::ServiceExt;

/// Sessions and tokens the test's authentication middleware knows: two cookie sessions, and
/// two bearer tokens of one user (before and after a refresh).
fn identities() -> HashMap<&'static str, &'static str> {
    HashMap::from([
        ("session=s-alice", "alice"),
        ("session=s-bob", "bob"),
        ("Bearer token-1-of-carol", "carol"),
        ("Bearer token-2-of-carol", "carol"),
    ])
}

/// Verifies the cookie or bearer token and puts the principal in the extensions; unknown or
/// missing credentials pass through without one.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let identities = identities();
    let credential = request
        .headers()
        .get(COOKIE)
        .or_else(|| request.headers().get(AUTHORIZATION))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| identities.get(v).copied());
    if let Some(user) = credential {
        request.extensions_mut().insert(Principal::new(user));
    }
    next.run(request).await
}

/// A router whose `/orders` handler counts its runs and answers with the principal it saw.
fn app(layer: IdempotencyLayer, runs: &Arc<AtomicUsize>) -> Router {
    let runs = Arc::clone(runs);
    Router::new()
        .route(
            "/orders",
            post(move |request: Request| async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let user = request
                    .extensions()
                    .get::<Principal>()
                    .map(|p| String::from_utf8_lossy(p.id()).into_owned())
                    .unwrap_or_else(|| "nobody".into());
                (StatusCode::CREATED, format!("order {n} for {user}"))
            }),
        )
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
}

/// An order from whoever `credential` (a header) authenticates, with `key`.
async fn order(app: &Router, credential: Option<(&str, &str)>, key: &str) -> Answer {
    let mut request = http::Request::post("/orders")
        .header("idempotency-key", key)
        .header(CONTENT_TYPE, "application/json");
    if let Some((name, value)) = credential {
        request = request.header(name, value);
    }
    let body = Full::new(Bytes::from_static(br#"{"sku":"A-1","qty":1}"#));
    send(app, request.body(body).unwrap()).await
}

const ALICE: (&str, &str) = ("cookie", "session=s-alice");
const BOB: (&str, &str) = ("cookie", "session=s-bob");

#[tokio::test]
async fn two_cookie_users_with_the_same_key_and_body_each_run_once_and_never_see_the_other() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(memory(), &runs);
    let alice = order(&app, Some(ALICE), "order-1").await;
    let bob = order(&app, Some(BOB), "order-1").await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(
        !bob.replayed(),
        "bob must not receive alice's stored response"
    );
    assert!(alice.text().ends_with("for alice"), "{}", alice.text());
    assert!(bob.text().ends_with("for bob"), "{}", bob.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Each one's retry replays their own response.
    let alice_retry = order(&app, Some(ALICE), "order-1").await;
    let bob_retry = order(&app, Some(BOB), "order-1").await;
    assert!(alice_retry.replayed() && bob_retry.replayed());
    assert_eq!(alice_retry.body, alice.body);
    assert_eq!(bob_retry.body, bob.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_refreshed_bearer_token_keeps_the_principals_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(memory(), &runs);
    let first = order(
        &app,
        Some(("authorization", "Bearer token-1-of-carol")),
        "o-7",
    )
    .await;
    // The token was refreshed before the client retried.
    let retry = order(
        &app,
        Some(("authorization", "Bearer token-2-of-carol")),
        "o-7",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the retry must replay, not run again");
    assert_eq!(retry.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Why the credential is the wrong scope: the same refresh under `scope_by_authorization`
/// runs the operation twice.
#[tokio::test]
async fn scoped_by_the_credential_a_refreshed_token_runs_again() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(
        memory().scope(idempotent_tower::scope_by_authorization),
        &runs,
    );
    order(
        &app,
        Some(("authorization", "Bearer token-1-of-carol")),
        "o-7",
    )
    .await;
    let retry = order(
        &app,
        Some(("authorization", "Bearer token-2-of-carol")),
        "o-7",
    )
    .await;
    assert!(!retry.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_request_without_a_principal_is_refused_before_the_handler_runs() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(memory(), &runs);
    for credential in [None, Some(("cookie", "session=forged"))] {
        let refused = order(&app, credential, "order-1").await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN);
        assert_eq!(
            refused.headers[CONTENT_TYPE],
            "application/problem+json",
            "{}",
            refused.text()
        );
        let problem: serde_json::Value = serde_json::from_str(refused.text()).unwrap();
        assert_eq!(problem["code"], "missing_scope");
        assert_eq!(problem["status"], 403);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // An authenticated user's request with the same key is unaffected.
    let alice = order(&app, Some(ALICE), "order-1").await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert!(!alice.replayed());
}

#[tokio::test]
async fn anonymous_requests_share_one_scope_only_when_explicitly_allowed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(memory().allow_anonymous(true), &runs);
    let first = order(&app, None, "guest-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.text().ends_with("for nobody"));
    // Any other anonymous caller with the key gets the stored response: that is the risk
    // `allow_anonymous` accepts.
    assert!(order(&app, None, "guest-1").await.replayed());
    // Authenticated users keep their own scopes.
    assert!(!order(&app, Some(ALICE), "guest-1").await.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[test]
fn a_principals_tenant_is_part_of_its_scope() {
    let plain = Principal::new("u-1").scope();
    let acme = Principal::new("u-1").tenant("acme").scope();
    let globex = Principal::new("u-1").tenant("globex").scope();
    assert_ne!(plain, acme);
    assert_ne!(acme, globex);
    assert_eq!(acme, Principal::new("u-1").tenant("acme").scope());
}

#[tokio::test]
async fn grpc_calls_without_a_principal_get_permission_denied() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
        .methods(["/orders.v1.Orders/Create"]);
    let counter = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders.v1.Orders/Create",
            post(move || async move {
                counter.fetch_add(1, Ordering::SeqCst);
                (
                    [("content-type", "application/grpc"), ("grpc-status", "0")],
                    Body::from(&b"\0\0\0\0\0"[..]),
                )
            }),
        )
        .layer(layer)
        .layer(middleware::from_fn(authenticate));
    let call = |credential: Option<&'static str>| {
        let mut request = http::Request::post("/orders.v1.Orders/Create")
            .header(CONTENT_TYPE, "application/grpc")
            .header("idempotency-key", "o-1");
        if let Some(cookie) = credential {
            request = request.header(COOKIE, cookie);
        }
        app.clone()
            .oneshot(request.body(Body::from(&b"\0\0\0\0\0"[..])).unwrap())
    };
    let refused = call(None).await.unwrap();
    assert_eq!(refused.headers()["grpc-status"], "7", "PERMISSION_DENIED");
    assert_eq!(refused.headers()["idempotent-error"], "missing_scope");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let served = call(Some("session=s-alice")).await.unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let replayed = call(Some("session=s-alice")).await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
