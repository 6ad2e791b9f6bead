//! Every outcome of a client session (`Idempotency-Session`), through the layer, over HTTP and
//! gRPC, on the memory store, Redis and PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CheckpointStore, Defaults, Idempotency, SessionStore};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use idempotent_test_kit::backend::{postgres_url, redis_url};
use idempotent_test_kit::names::unique;
use idempotent_tower::{IdempotencyLayer, Principal, RequestBody, ResponseBody};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder, ServiceExt, service_fn};

type Svc = BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, BoxError>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wire {
    Http,
    Grpc,
}

/// A handler that counts its runs, answers with `run <n>: <body>`, and sleeps 400 ms first
/// on `/slow`.
struct Stack {
    service: Svc,
    runs: Arc<AtomicUsize>,
    wire: Wire,
}

impl Stack {
    fn new(idempotency: Idempotency, wire: Wire) -> Self {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let handler = service_fn(move |request: Request<RequestBody<Full<Bytes>>>| {
            let runs = Arc::clone(&counted);
            async move {
                let slow = request.uri().path().ends_with("/slow");
                let body = request.into_body().collect().await?.to_bytes();
                if slow {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let text = format!("run {n}: {}", String::from_utf8_lossy(&body));
                let mut response = Response::builder();
                response = match wire {
                    Wire::Http => response.status(201),
                    Wire::Grpc => response
                        .header(CONTENT_TYPE, "application/grpc")
                        .header("grpc-status", "0"),
                };
                Ok::<_, BoxError>(response.body(Full::new(Bytes::from(text))).unwrap())
            }
        });
        let service = match wire {
            Wire::Http => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(IdempotencyLayer::http(idempotency))
                    .service(handler),
            ),
            Wire::Grpc => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(
                        IdempotencyLayer::grpc(idempotency)
                            .methods(["/pay.Payments/Charge", "/pay.Payments/slow"]),
                    )
                    .service(handler),
            ),
        };
        Stack {
            service,
            runs,
            wire,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn request(&self, session: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
        self.request_to("charge", session, body, "alice")
    }

    fn request_to(
        &self,
        path: &str,
        session: Option<&str>,
        body: &'static str,
        principal: &str,
    ) -> Request<Full<Bytes>> {
        let uri = match (self.wire, path) {
            (Wire::Http, _) => format!("/payments/{path}"),
            (Wire::Grpc, "slow") => "/pay.Payments/slow".to_owned(),
            (Wire::Grpc, _) => "/pay.Payments/Charge".to_owned(),
        };
        let mut builder = Request::post(uri).extension(Principal::new(principal));
        if self.wire == Wire::Grpc {
            builder = builder.header(CONTENT_TYPE, "application/grpc");
        }
        if let Some(session) = session {
            builder = builder.header("idempotency-session", session);
        }
        builder
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    }

    async fn send(&self, request: Request<Full<Bytes>>) -> Answer {
        let response = self.service.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
            wire: self.wire,
        }
    }
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    wire: Wire,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed") == Some(&HeaderValue::from_static("true"))
    }

    /// The refusal's code, checked against its HTTP status or gRPC status.
    fn refused(&self, code: &str, http: u16, grpc: u8) {
        match self.wire {
            Wire::Http => {
                assert_eq!(self.status.as_u16(), http, "{code}: {self:?}");
                let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
                assert_eq!(doc["code"], code, "{doc}");
                assert_eq!(doc["status"], http);
            }
            Wire::Grpc => {
                assert_eq!(self.headers["idempotent-error"], code, "{self:?}");
                assert_eq!(self.headers["grpc-status"], grpc.to_string().as_str());
            }
        }
        assert!(!self.replayed());
    }

    fn fresh(&self) -> String {
        assert!(
            self.status.is_success() && !self.replayed(),
            "expected a fresh answer: {self:?}"
        );
        String::from_utf8(self.body.to_vec()).unwrap()
    }
}

fn header(id: &str, seq: u64, ack: u64) -> String {
    format!(r#"id="{id}", seq={seq}, ack={ack}"#)
}

fn runtime(store: impl SessionStore + CheckpointStore, window: u64, idle: Duration) -> Idempotency {
    Idempotency::builder(store)
        .defaults(Defaults::new().session_window(window).session_idle(idle))
        .build()
}

/// Every outcome of the session protocol, in order, on one store and wire.
async fn every_outcome(store: impl SessionStore + CheckpointStore + Clone, wire: Wire) {
    let stack = Stack::new(runtime(store, 4, Duration::from_secs(60)), wire);
    let id = unique("device");
    let s = |seq, ack| Some(header(&id, seq, ack));

    // A new seq runs; the same seq again is a replay, byte for byte, whatever its ack.
    let first = stack.send(stack.request(s(1, 0).as_deref(), "a")).await;
    let body = first.fresh();
    assert_eq!(body, "run 1: a");
    let again = stack.send(stack.request(s(1, 0).as_deref(), "a")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(stack.runs(), 1);
    // Another request for the same seq is refused.
    stack
        .send(stack.request(s(1, 0).as_deref(), "b"))
        .await
        .refused("fingerprint_mismatch", 422, 9);

    // A seq in flight: its duplicate is refused with a time to retry, then replayed.
    let slow = {
        let (service, request) = (
            stack.service.clone(),
            stack.request_to("slow", s(2, 0).as_deref(), "s", "alice"),
        );
        tokio::spawn(async move {
            service
                .oneshot(request)
                .await
                .unwrap()
                .into_parts()
                .0
                .status
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let busy = stack
        .send(stack.request_to("slow", s(2, 1).as_deref(), "s", "alice"))
        .await;
    busy.refused("in_flight", 409, 10);
    if wire == Wire::Http {
        assert!(busy.headers.contains_key(RETRY_AFTER), "{busy:?}");
    }
    assert!(slow.await.unwrap().is_success());
    let done = stack
        .send(stack.request_to("slow", s(2, 1).as_deref(), "s", "alice"))
        .await;
    assert!(done.replayed(), "{done:?}");
    assert_eq!(stack.runs(), 2);

    // Past the window (mark 1 + window 4 = 5): refused with a time to retry, nothing runs.
    let full = stack.send(stack.request(s(6, 1).as_deref(), "f")).await;
    full.refused("session_window_full", 429, 8);
    if wire == Wire::Http {
        assert!(full.headers.contains_key(RETRY_AFTER), "{full:?}");
    }
    assert_eq!(stack.runs(), 2);

    // ack=2 drops answers 1 and 2: both are refused from now on, and nothing runs.
    assert_eq!(
        stack
            .send(stack.request(s(3, 2).as_deref(), "c"))
            .await
            .fresh(),
        "run 3: c"
    );
    for seq in [1, 2] {
        stack
            .send(stack.request(s(seq, 2).as_deref(), "a"))
            .await
            .refused("sequence_acknowledged", 410, 11);
    }
    // Within the moved window now (mark 2 + 4 = 6).
    assert_eq!(
        stack
            .send(stack.request(s(6, 2).as_deref(), "f"))
            .await
            .fresh(),
        "run 4: f"
    );
    // A retry carrying a newer ack still replays: the session header is not fingerprinted.
    let retried = stack.send(stack.request(s(6, 3).as_deref(), "f")).await;
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, "run 4: f");
    assert_eq!(stack.runs(), 4);

    // The same session id is another session for another principal.
    let other = stack
        .send(stack.request_to("charge", s(1, 0).as_deref(), "a", "bob"))
        .await;
    assert_eq!(other.fresh(), "run 5: a");
    stack
        .send(stack.request_to("charge", s(9, 8).as_deref(), "a", "carol"))
        .await
        .refused("session_expired", 410, 5);

    // An unknown session whose request says it holds answers: refused, nothing runs.
    let stranger = header(&unique("unknown"), 3, 2);
    stack
        .send(stack.request(Some(&stranger), "x"))
        .await
        .refused("session_expired", 410, 5);
    assert_eq!(stack.runs(), 5);

    // Both a key and a session; a malformed session.
    let mut both = stack.request(s(7, 3).as_deref(), "k");
    both.headers_mut()
        .insert("idempotency-key", HeaderValue::from_static("k-1"));
    stack
        .send(both)
        .await
        .refused("conflicting_idempotency_headers", 400, 3);
    for malformed in [
        r#"id="x", seq=0, ack=0"#,
        r#"id=x, seq=1, ack=0"#,
        r#"seq=1, ack=0"#,
        "garbage,,",
    ] {
        stack
            .send(stack.request(Some(malformed), "m"))
            .await
            .refused("invalid_session", 400, 3);
    }
    assert_eq!(stack.runs(), 5);
}

/// A session nobody sends to for its idle time is forgotten: a request holding answers is
/// refused as expired; one holding none starts it anew.
async fn expiry(store: impl SessionStore + CheckpointStore + Clone, wire: Wire) {
    let stack = Stack::new(runtime(store, 64, Duration::from_millis(800)), wire);
    let id = unique("idle");
    let one = header(&id, 1, 0);
    stack.send(stack.request(Some(&one), "a")).await.fresh();
    // Kept alive by its requests: each within the idle time of the one before.
    for seq in 2..=4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        stack
            .send(stack.request(Some(&header(&id, seq, 0)), "b"))
            .await
            .fresh();
    }
    // 1.2 s after request 1 was answered, it is still replayed.
    assert!(stack.send(stack.request(Some(&one), "a")).await.replayed());
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    stack
        .send(stack.request(Some(&header(&id, 5, 4)), "c"))
        .await
        .refused("session_expired", 410, 5);
    let runs = stack.runs();
    assert_eq!(runs, 4);
    assert_eq!(
        stack.send(stack.request(Some(&one), "a")).await.fresh(),
        "run 5: a"
    );
}

async fn redis() -> Option<RedisStore> {
    let url = redis_url()?;
    Some(
        RedisStore::builder(url)
            .key_prefix(format!("{}:", unique("sessions")))
            .connect()
            .await
            .expect("Redis"),
    )
}

async fn postgres() -> Option<PostgresStore> {
    let url = postgres_url()?;
    let pool = idempotent_test_kit::postgres::pool(&url, 8).await;
    let store = PostgresStore::builder(pool)
        .table(unique("sessions").replace('-', "_"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

#[tokio::test]
async fn memory_http() {
    every_outcome(MemoryStore::new(), Wire::Http).await;
    expiry(MemoryStore::new(), Wire::Http).await;
}

#[tokio::test]
async fn memory_grpc() {
    every_outcome(MemoryStore::new(), Wire::Grpc).await;
    expiry(MemoryStore::new(), Wire::Grpc).await;
}

#[tokio::test]
async fn redis_http() {
    let Some(store) = redis().await else { return };
    every_outcome(store.clone(), Wire::Http).await;
    expiry(store, Wire::Http).await;
}

#[tokio::test]
async fn redis_grpc() {
    let Some(store) = redis().await else { return };
    every_outcome(store.clone(), Wire::Grpc).await;
    expiry(store, Wire::Grpc).await;
}

#[tokio::test]
async fn postgres_http() {
    let Some(store) = postgres().await else {
        return;
    };
    every_outcome(store.clone(), Wire::Http).await;
    expiry(store, Wire::Http).await;
}

#[tokio::test]
async fn postgres_grpc() {
    let Some(store) = postgres().await else {
        return;
    };
    every_outcome(store.clone(), Wire::Grpc).await;
    expiry(store, Wire::Grpc).await;
}

/// With sessions turned off the header is not read: a request with only a session has no key.
/// Another header name can carry sessions instead.
#[tokio::test]
async fn sessions_can_be_turned_off_or_renamed() {
    let handler = service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
        Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"ran"))))
    });
    let session = header(&unique("off"), 1, 0);
    let send = |layer: IdempotencyLayer, name: &'static str| {
        let service = ServiceBuilder::new().layer(layer).service(handler);
        let request = Request::post("/payments")
            .extension(Principal::new("alice"))
            .header(name, session.as_str())
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        async move {
            let response = service.oneshot(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        }
    };
    let idempotency = Idempotency::new(MemoryStore::new());
    let (status, body) = send(
        IdempotencyLayer::http(idempotency.clone()).sessions(false),
        "idempotency-session",
    )
    .await;
    assert_eq!(status, 400);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["code"], "missing_key");
    let renamed = IdempotencyLayer::http(idempotency.clone())
        .session_header_name(http::HeaderName::from_static("x-session"));
    let (status, body) = send(renamed.clone(), "x-session").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ran"[..]));
    let (status, _) = send(renamed, "idempotency-session").await;
    assert_eq!(status, 400, "the default name is not read once renamed");
}
