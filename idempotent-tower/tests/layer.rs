//! Every rule of the layer, at the tower level: `ServiceBuilder` + `service_fn` + `oneshot`.
//!
//! (Longer than most files here, on purpose: one case per rule of the layer, on one shared
//! stack.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    CallOptions, Claim, Defaults, FencingToken, Fingerprint, Idempotency, InFlightPolicy, Retain,
    Scope, StorageKey, Store, StoreError,
};
use idempotent_tower::IdempotencyLayer;
use support::{DownStore, Req, TestBody, memory, post, request, send, stack};
use tower::{BoxError, Service, ServiceExt, service_fn};

/// A handler that counts executions and answers per path: `/fail` 500, `/declined` 402,
/// `/busy` 429, `/big` a 4 KiB body, `/trailers` a body and trailers, `/cookie` sets a cookie,
/// `/slow` sleeps 300 ms first, `/panic` panics the first time, `/error` fails the service;
/// anything else 201.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    panics: Arc<AtomicUsize>,
}

impl Handler {
    fn new() -> Self {
        Handler {
            runs: Arc::new(AtomicUsize::new(0)),
            panics: Arc::new(AtomicUsize::new(1)),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// The handler, for [`stack`].
    fn service(
        &self,
    ) -> impl Service<Req, Response = Response<TestBody>, Error = BoxError, Future: Send + 'static>
    + Clone
    + Send
    + Sync
    + 'static {
        let (runs, panics) = (Arc::clone(&self.runs), Arc::clone(&self.panics));
        service_fn(move |req| Handler::handle(Arc::clone(&runs), Arc::clone(&panics), req))
    }

    async fn handle(
        runs: Arc<AtomicUsize>,
        panics: Arc<AtomicUsize>,
        req: Req,
    ) -> Result<Response<TestBody>, BoxError> {
        let path = req.uri().path().to_owned();
        let body = req.into_body().collect().await?.to_bytes();
        if path == "/slow" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if path == "/panic" && panics.fetch_sub(1, Ordering::SeqCst) == 1 {
            panic!("handler bug");
        }
        if path == "/error" {
            return Err("service failed".into());
        }
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        let (status, text) = match path.as_str() {
            "/fail" => (500, format!("failure {n}")),
            "/declined" => (402, format!("declined {n}")),
            "/busy" => (429, format!("busy {n}")),
            "/big" | "/grpc-big" => (200, "x".repeat(4096)),
            // A body of as many bytes as the request body says.
            "/sized" => (
                200,
                "y".repeat(String::from_utf8_lossy(&body).parse().unwrap_or(0)),
            ),
            _ => (201, format!("run {n}: {}", String::from_utf8_lossy(&body))),
        };
        let mut response = Response::builder()
            .status(status)
            .header("x-run", n.to_string())
            .header("date", "Tue, 01 Jan 2030 00:00:00 GMT")
            .header(CONTENT_TYPE, "text/plain");
        if path == "/cookie" {
            response = response.header("set-cookie", "session=secret");
        }
        if path == "/grpc-big" {
            response = response.header(CONTENT_TYPE, "application/grpc");
        }
        let trailers = (path == "/trailers" || path == "/grpc-big").then(|| {
            let mut trailers = HeaderMap::new();
            trailers.insert("x-checksum", HeaderValue::from(n));
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            trailers
        });
        Ok(response
            .body(TestBody {
                data: Some(Bytes::from(text)),
                trailers,
            })
            .unwrap())
    }
}

#[tokio::test]
async fn retry_replays_status_headers_and_body_with_the_replay_header() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let first = send(&svc, post("/payments", Some("k1"), "{\"amount\":5}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        !first.replayed(),
        "a first response never carries the replay header"
    );
    let retry = send(&svc, post("/payments", Some("k1"), "{\"amount\":5}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers["x-run"], "1");
    assert_eq!(retry.headers[CONTENT_TYPE], "text/plain");
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key_and_parameters_are_ignored() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    send(&svc, post("/p", Some("abc-1"), "x")).await;
    assert!(
        send(&svc, post("/p", Some("\"abc-1\""), "x"))
            .await
            .replayed()
    );
    assert!(
        send(&svc, post("/p", Some("\"abc-1\";v=1"), "x"))
            .await
            .replayed()
    );
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn strict_mode_refuses_bare_keys() {
    let handler = Handler::new();
    let svc = stack(memory().strict(true), handler.service());
    let bare = send(&svc, post("/p", Some("abc"), "x")).await;
    assert_eq!(bare.status, StatusCode::BAD_REQUEST);
    assert_eq!(bare.code(), "invalid_key");
    assert_eq!(
        send(&svc, post("/p", Some("\"abc\""), "x")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn missing_key_on_a_protected_method_is_400() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    for method in [Method::POST, Method::PATCH] {
        let answer = send(&svc, request(method, "/p", None, "x")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(answer.code(), "missing_key");
    }
    assert_eq!(handler.runs(), 0);
}

#[tokio::test]
async fn malformed_keys_are_400_and_run_nothing() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let long = "k".repeat(256);
    for bad in [
        "",
        "\"\"",
        long.as_str(),
        "\"unterminated",
        "a, b",
        "\"a\", \"b\"",
        "two words",
        "\"x\";BAD=1",
    ] {
        let answer = send(&svc, post("/p", Some(bad), "x")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "key {bad:?}");
        assert_eq!(answer.code(), "invalid_key", "key {bad:?}");
    }
    let mut non_ascii = post("/p", None, "x");
    non_ascii.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
    );
    assert_eq!(send(&svc, non_ascii).await.code(), "invalid_key");
    let mut twice = post("/p", Some("a"), "x");
    twice
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static("a"));
    assert_eq!(send(&svc, twice).await.code(), "invalid_key");
    assert_eq!(handler.runs(), 0);
}

#[tokio::test]
async fn unprotected_methods_pass_through_even_with_a_key() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    for _ in 0..2 {
        for method in [Method::GET, Method::PUT, Method::DELETE] {
            let answer = send(&svc, request(method, "/p", Some("k"), "")).await;
            assert!(!answer.replayed());
        }
    }
    assert_eq!(handler.runs(), 6);
    let svc = stack(memory().methods([Method::PUT]), handler.service());
    send(&svc, request(Method::PUT, "/p", Some("k"), "")).await;
    assert!(
        send(&svc, request(Method::PUT, "/p", Some("k"), ""))
            .await
            .replayed()
    );
    assert_eq!(
        send(&svc, post("/p", None, "")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn optional_key_mode_passes_keyless_requests_through() {
    let handler = Handler::new();
    let svc = stack(memory().require_key(false), handler.service());
    assert_eq!(
        send(&svc, post("/p", None, "x")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&svc, post("/p", None, "x")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(handler.runs(), 2);
    // A malformed key is still an error: the client meant to be protected.
    assert_eq!(
        send(&svc, post("/p", Some("a, b"), "x")).await.status,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn a_different_body_query_path_or_method_is_422_and_keeps_the_record() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let original = || post("/p?a=1&b=2", Some("k"), "{\"amount\":5}");
    send(&svc, original()).await;
    for changed in [
        post("/p?a=1&b=2", Some("k"), "{\"amount\":6}"),
        post("/p?a=1&b=3", Some("k"), "{\"amount\":5}"),
        post("/p?a=1", Some("k"), "{\"amount\":5}"),
        post("/q?a=1&b=2", Some("k"), "{\"amount\":5}"),
        request(Method::PATCH, "/p?a=1&b=2", Some("k"), "{\"amount\":5}"),
    ] {
        let answer = send(&svc, changed).await;
        assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(answer.code(), "fingerprint_mismatch");
    }
    // The query is canonical: the same pairs in another order are the same request.
    let reordered = send(&svc, post("/p?b=2&a=1", Some("k"), "{\"amount\":5}")).await;
    assert!(reordered.replayed());
    assert!(send(&svc, original()).await.replayed());
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn selected_headers_are_part_of_the_fingerprint() {
    let handler = Handler::new();
    let svc = stack(
        memory().fingerprint_headers([HeaderName::from_static("x-account")]),
        handler.service(),
    );
    let with = |account: &'static str| {
        let mut req = post("/p", Some("k"), "x");
        req.headers_mut()
            .insert("x-account", HeaderValue::from_static(account));
        req
    };
    send(&svc, with("a")).await;
    assert!(send(&svc, with("a")).await.replayed());
    assert_eq!(
        send(&svc, with("b")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
}

#[tokio::test]
async fn scopes_by_authorization_never_share_or_reveal_keys() {
    let handler = Handler::new();
    let svc = stack(
        memory().scope(idempotent_tower::scope_by_authorization),
        handler.service(),
    );
    let as_user = |auth: Option<&'static str>, body: &'static str| {
        let mut req = post("/p", Some("shared-key"), body);
        if let Some(auth) = auth {
            req.headers_mut()
                .insert(AUTHORIZATION, HeaderValue::from_static(auth));
        }
        req
    };
    let alice = send(&svc, as_user(Some("Bearer alice"), "alice's body")).await;
    // Bob uses the same key with another body: no 422, no replay, no hint alice exists.
    let bob = send(&svc, as_user(Some("Bearer bob"), "bob's body")).await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed());
    assert!(bob.text().contains("bob's body"));
    // Without a credential there is no scope: refused, not pooled with other anonymous callers.
    let anonymous = send(&svc, as_user(None, "anon")).await;
    assert_eq!(anonymous.status, StatusCode::FORBIDDEN);
    assert_eq!(anonymous.problem()["code"], "missing_scope");
    let alice_again = send(&svc, as_user(Some("Bearer alice"), "alice's body")).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(handler.runs(), 2);
}

#[derive(Clone)]
struct Account(&'static str);

#[tokio::test]
async fn custom_scope_can_use_an_auth_layers_own_type() {
    let handler = Handler::new();
    let layer = memory().scope(|parts| {
        let Account(id) = parts.extensions.get::<Account>()?;
        Some(Scope::new().principal(id))
    });
    let svc = stack(layer, handler.service());
    let as_principal = |id: &'static str| {
        let mut req = post("/p", Some("k"), "x");
        req.extensions_mut().insert(Account(id));
        req
    };
    send(&svc, as_principal("u1")).await;
    assert!(!send(&svc, as_principal("u2")).await.replayed());
    assert!(send(&svc, as_principal("u1")).await.replayed());
}

#[tokio::test]
async fn concurrent_duplicate_is_409_with_retry_after_then_replays() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post("/slow", Some("k"), "x")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dup = send(&svc, post("/slow", Some("k"), "x")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(dup.code(), "in_flight");
    assert_eq!(dup.headers[RETRY_AFTER], "1");
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&svc, post("/slow", Some("k"), "x")).await.replayed());
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn wait_policy_replays_to_the_concurrent_duplicate() {
    let handler = Handler::new();
    let layer = memory().call_options(CallOptions::new().in_flight(InFlightPolicy::Wait {
        max: Duration::from_secs(5),
    }));
    let svc = stack(layer, handler.service());
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post("/slow", Some("k"), "x")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dup = send(&svc, post("/slow", Some("k"), "x")).await;
    assert_eq!(dup.status, StatusCode::CREATED);
    assert!(dup.replayed());
    assert_eq!(dup.body, first.await.unwrap().body);
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn server_errors_are_released_and_client_errors_stored() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    for (path, key, stored) in [
        ("/fail", "a", false),
        ("/busy", "b", false),
        ("/declined", "c", true),
    ] {
        let first = send(&svc, post(path, Some(key), "x")).await;
        let retry = send(&svc, post(path, Some(key), "x")).await;
        assert_eq!(retry.replayed(), stored, "{path}");
        assert_eq!(retry.status, first.status, "{path}");
        assert_eq!(retry.body == first.body, stored, "{path}");
    }
    assert_eq!(handler.runs(), 5);
}

#[tokio::test]
async fn outcome_policy_is_configurable() {
    let handler = Handler::new();
    let svc = stack(
        memory().retain(|status| {
            if status.is_success() {
                Retain::Keep
            } else {
                Retain::Release
            }
        }),
        handler.service(),
    );
    send(&svc, post("/declined", Some("k"), "x")).await;
    assert!(
        !send(&svc, post("/declined", Some("k"), "x"))
            .await
            .replayed()
    );
    assert_eq!(handler.runs(), 2);
}

#[tokio::test]
async fn hop_by_hop_date_and_set_cookie_are_not_replayed() {
    let handler = Handler::new();
    let svc = stack(
        memory().exclude_header(HeaderName::from_static("x-run")),
        handler.service(),
    );
    let first = send(&svc, post("/cookie", Some("k"), "x")).await;
    assert_eq!(first.headers["set-cookie"], "session=secret");
    assert!(first.headers.contains_key("date"));
    let retry = send(&svc, post("/cookie", Some("k"), "x")).await;
    assert!(retry.replayed());
    for gone in ["set-cookie", "date", "x-run"] {
        assert!(!retry.headers.contains_key(gone), "{gone} was replayed");
    }
    assert_eq!(retry.headers[CONTENT_TYPE], "text/plain");

    let svc = stack(
        memory().replay_header(http::header::SET_COOKIE),
        handler.service(),
    );
    send(&svc, post("/cookie", Some("k"), "x")).await;
    let retry = send(&svc, post("/cookie", Some("k"), "x")).await;
    assert_eq!(retry.headers["set-cookie"], "session=secret");
}

#[tokio::test]
async fn trailers_are_replayed() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let first = send(&svc, post("/trailers", Some("k"), "x")).await;
    let retry = send(&svc, post("/trailers", Some("k"), "x")).await;
    assert!(retry.replayed());
    assert_eq!(first.trailers.as_ref().unwrap()["x-checksum"], "1");
    assert_eq!(retry.trailers, first.trailers);
}

#[tokio::test]
async fn oversized_request_body_is_413_before_anything_runs() {
    let handler = Handler::new();
    let svc = stack(memory().max_request_body(16), handler.service());
    let declared = send(
        &svc,
        post("/p", Some("k"), "this body is longer than sixteen bytes"),
    )
    .await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(declared.code(), "request_too_large");
    // Without a Content-Length the limit applies while reading.
    let mut streamed = post("/p", Some("k2"), "this body is longer than sixteen bytes");
    streamed.headers_mut().remove(http::header::CONTENT_LENGTH);
    let streamed = send(&svc, streamed).await;
    assert_eq!(streamed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(handler.runs(), 0);
    // The key was never claimed: a corrected request runs.
    assert_eq!(
        send(&svc, post("/p", Some("k"), "short")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn oversized_response_reaches_the_client_and_the_retry_gets_410() {
    let handler = Handler::new();
    let svc = stack(
        memory().call_options(CallOptions::new().max_result_bytes(1024)),
        handler.service(),
    );
    let first = send(&svc, post("/big", Some("k"), "x")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 4096, "the client gets the whole response");
    let retry = send(&svc, post("/big", Some("k"), "x")).await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.code(), "result_not_retained");
    assert_eq!(handler.runs(), 1);
}

/// The result limit bounds the response body, wherever it is set (the layer's call options or
/// the runtime's defaults): a body of exactly that size is replayed although the record around
/// it (status and headers) is larger, and a body one byte larger is recorded as not retained.
#[tokio::test]
async fn the_result_limit_bounds_the_body_wherever_it_is_set() {
    const LIMIT: usize = 4 << 20;
    let by_layer = memory().call_options(CallOptions::new().max_result_bytes(LIMIT));
    let by_runtime = IdempotencyLayer::http(
        Idempotency::builder(MemoryStore::new())
            .defaults(Defaults::new().max_result_bytes(LIMIT))
            .build(),
    );
    for layer in [by_layer, by_runtime] {
        let handler = Handler::new();
        let svc = stack(layer, handler.service());
        let at_limit: &'static str = Box::leak(LIMIT.to_string().into_boxed_str());
        let first = send(&svc, post("/sized", Some("at"), at_limit)).await;
        assert_eq!(first.body.len(), LIMIT);
        let retry = send(&svc, post("/sized", Some("at"), at_limit)).await;
        assert!(retry.replayed(), "a body at the limit is replayed");
        assert_eq!(retry.body, first.body);
        let over: &'static str = Box::leak((LIMIT + 1).to_string().into_boxed_str());
        let first = send(&svc, post("/sized", Some("over"), over)).await;
        assert_eq!(
            first.body.len(),
            LIMIT + 1,
            "the client gets the whole response"
        );
        let retry = send(&svc, post("/sized", Some("over"), over)).await;
        assert_eq!(retry.status, StatusCode::GONE);
        assert_eq!(retry.code(), "result_not_retained");
        assert_eq!(handler.runs(), 2);
    }
}

#[tokio::test]
async fn fail_open_runs_unprotected_and_says_so() {
    let handler = Handler::new();
    let svc = stack(
        IdempotencyLayer::http(Idempotency::keys_only(DownStore::new())).fail_open(true),
        handler.service(),
    );
    let answer = send(&svc, post("/p", Some("k"), "payload")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.headers["idempotent-bypassed"], "store-unavailable");
    assert!(
        answer.text().contains("payload"),
        "the handler got the body"
    );
    assert_eq!(handler.runs(), 1);
}

/// The ready service goes with the request, and the bypass readies another: under a
/// concurrency limit of one below the layer, the first must be let go first, or the bypass
/// waits for ever.
#[tokio::test]
async fn fail_open_bypass_is_served_under_a_concurrency_limit_of_one() {
    let handler = Handler::new();
    let svc = stack(
        IdempotencyLayer::http(Idempotency::keys_only(DownStore::new())).fail_open(true),
        tower::limit::ConcurrencyLimit::new(handler.service(), 1),
    );
    for key in ["k1", "k2"] {
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            send(&svc, post("/p", Some(key), "payload")),
        )
        .await
        .expect("the bypass is served, not left waiting for the limit");
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(answer.headers["idempotent-bypassed"], "store-unavailable");
    }
    assert_eq!(handler.runs(), 2);
}

#[tokio::test]
async fn dropped_response_future_still_records_the_response() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        svc.clone().oneshot(post("/slow", Some("k"), "x")),
    )
    .await;
    assert!(abandoned.is_err(), "the client gave up");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(handler.runs(), 1, "the handler ran to completion");
    let retry = send(&svc, post("/slow", Some("k"), "x")).await;
    assert!(retry.replayed());
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn handler_panic_propagates_and_releases_the_key() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let panicked = tokio::spawn({
        let svc = svc.clone();
        async move { svc.oneshot(post("/panic", Some("k"), "x")).await }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    // Released (in the background): the key is free again soon after.
    for _ in 0..50 {
        let answer = send(&svc, post("/panic", Some("k"), "x")).await;
        match answer.status {
            StatusCode::CONFLICT => tokio::time::sleep(Duration::from_millis(10)).await,
            StatusCode::CREATED => {
                assert!(!answer.replayed());
                return;
            }
            other => panic!("unexpected {other}"),
        }
    }
    panic!("the key stayed locked after the panic");
}

#[tokio::test]
async fn service_error_propagates_and_releases_the_key() {
    let handler = Handler::new();
    let svc = stack(memory(), handler.service());
    let error = svc
        .clone()
        .oneshot(post("/error", Some("k"), "x"))
        .await
        .unwrap_err();
    assert_eq!(error.to_string(), "service failed");
    // Released: the same request runs again (and fails again), never a 409.
    let again = svc
        .clone()
        .oneshot(post("/error", Some("k"), "x"))
        .await
        .unwrap_err();
    assert_eq!(again.to_string(), "service failed");
    // The key stays the first request's while its record lives: another request is 422.
    assert_eq!(
        send(&svc, post("/ok", Some("k"), "x")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        send(&svc, post("/ok", Some("k2"), "x")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn problems_are_never_stored() {
    let handler = Handler::new();
    let store = MemoryStore::new();
    let svc = stack(
        IdempotencyLayer::http(Idempotency::new(store.clone())),
        handler.service(),
    );
    send(&svc, post("/p", None, "x")).await;
    send(&svc, post("/p", Some(""), "x")).await;
    assert_eq!(store.stats().records, 0);
    send(&svc, post("/p", Some("k"), "x")).await;
    send(&svc, post("/p", Some("k"), "other")).await; // 422
    assert_eq!(store.stats().records, 1);
    assert!(send(&svc, post("/p", Some("k"), "x")).await.replayed());
}

/// Regression: an OK gRPC response too large to retain carries its grpc-status in trailers the
/// layer never reads; it was released, and the retry ran the handler again.
#[tokio::test]
async fn oversized_grpc_response_is_recorded_not_released() {
    let handler = Handler::new();
    let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
        .methods(["/grpc-big"])
        .call_options(CallOptions::new().max_result_bytes(1024));
    let svc = stack(layer, handler.service());
    let first = send(&svc, post("/grpc-big", Some("k"), "x")).await;
    assert_eq!(first.body.len(), 4096, "the client gets the whole response");
    let retry = send(&svc, post("/grpc-big", Some("k"), "x")).await;
    assert_eq!(retry.headers["grpc-status"], "6", "ALREADY_EXISTS");
    assert_eq!(retry.headers["idempotent-error"], "result_not_retained");
    assert_eq!(handler.runs(), 1);
}

/// A store holding a record it cannot decode.
#[derive(Clone)]
struct CorruptStore;

impl Store for CorruptStore {
    async fn claim(
        &self,
        _: &StorageKey,
        _: &Fingerprint,
        _: Duration,
        _: Duration,
    ) -> Result<Claim, StoreError> {
        Err(StoreError::Corrupt("fingerprint is not 32 bytes".into()))
    }
    async fn complete(
        &self,
        _: &StorageKey,
        _: FencingToken,
        _: Bytes,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::TokenRejected)
    }
    async fn release(&self, _: &StorageKey, _: FencingToken) -> Result<(), StoreError> {
        Err(StoreError::TokenRejected)
    }
    async fn renew(&self, _: &StorageKey, _: FencingToken, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::TokenRejected)
    }
}

/// Regression: fail-open bypassed a record that exists but cannot be read (a conflict, never
/// "absent"), running a possibly completed request again; it was also reported as a retryable
/// 503.
#[tokio::test]
async fn corrupt_record_is_never_bypassed_even_in_fail_open_mode() {
    let handler = Handler::new();
    for fail_open in [false, true] {
        let layer =
            IdempotencyLayer::http(Idempotency::keys_only(CorruptStore)).fail_open(fail_open);
        let svc = stack(layer, handler.service());
        let answer = send(&svc, post("/p", Some("k"), "x")).await;
        assert_eq!(
            answer.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "fail_open={fail_open}"
        );
        assert_eq!(answer.code(), "corrupt_record");
        assert!(!answer.headers.contains_key(RETRY_AFTER));
    }
    assert_eq!(handler.runs(), 0);
}
