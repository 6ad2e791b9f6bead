//! What the layer's tests share: a handler stack behind a layer, the requests they send, the
//! answer they read back, and stores that fail.
// Each test file uses a part of it.
#![allow(dead_code)]

use std::convert::Infallible;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Claim, FencingToken, Fingerprint, Idempotency, StorageKey, Store, StoreError,
};
use idempotent_tower::{IdempotencyLayer, Principal, Protocol, RequestBody, ResponseBody};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

/// A response body: data, then optional trailers.
pub(crate) struct TestBody {
    pub(crate) data: Option<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
}

impl TestBody {
    /// `data`, without trailers.
    pub(crate) fn new(data: impl Into<Bytes>) -> Self {
        TestBody {
            data: Some(data.into()),
            trailers: None,
        }
    }
}

impl Body for TestBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

/// The request a handler behind the layer receives.
pub(crate) type Req = Request<RequestBody<Full<Bytes>>>;

/// A handler behind a layer, boxed: what [`stack`] builds.
pub(crate) type Svc<B = TestBody> =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<B>>, BoxError>;

/// `handler` (a `service_fn`, say) behind `layer`, with `ServiceBuilder`.
pub(crate) fn stack<P, C, H, B>(layer: IdempotencyLayer<P, C>, handler: H) -> Svc<B>
where
    P: Protocol,
    H: Service<Req, Response = Response<B>, Error = BoxError> + Clone + Send + Sync + 'static,
    H::Future: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Send,
{
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(handler))
}

/// An HTTP layer over a fresh memory store, with the defaults.
pub(crate) fn memory() -> IdempotencyLayer {
    IdempotencyLayer::http(Idempotency::new(MemoryStore::new()))
}

/// A POST of `body` to `path`, with `key` if given, from the principal `client`.
pub(crate) fn post(path: &str, key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    request(Method::POST, path, key, body)
}

/// A request of `method` with `body` to `path`, with `key` if given, from the principal
/// `client` (as an authentication layer in front of the idempotency layer would put it).
pub(crate) fn request(
    method: Method,
    path: &str,
    key: Option<&str>,
    body: &'static str,
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder().method(method).uri(path);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .extension(Principal::new("client"))
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// A unary gRPC call of the method at `path` (an empty message), with `key`, from the
/// principal `client`.
pub(crate) fn grpc(path: &str, key: &str) -> Request<Full<Bytes>> {
    Request::post(path)
        .header(CONTENT_TYPE, "application/grpc")
        .header("idempotency-key", key)
        .extension(Principal::new("client"))
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

/// A response, read to its end.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

impl Answer {
    /// The body, as text.
    pub(crate) fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// Whether it is a replay (`Idempotent-Replayed: true`).
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// Its problem document, checked to be one: `application/problem+json`, never stored or
    /// replayed, with every field.
    pub(crate) fn problem(&self) -> serde_json::Value {
        assert_eq!(self.headers[CONTENT_TYPE], "application/problem+json");
        assert_eq!(self.headers[CACHE_CONTROL], "no-store");
        assert!(!self.replayed(), "problems are never replays");
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], self.status.as_u16());
        for field in ["type", "title", "detail", "code"] {
            assert!(doc[field].is_string(), "problem lacks {field}: {doc}");
        }
        doc
    }

    /// The stable code of a refusal: its `idempotent-error` (gRPC), or its problem's `code`.
    pub(crate) fn code(&self) -> String {
        if let Some(code) = self.headers.get("idempotent-error") {
            return code.to_str().unwrap().to_owned();
        }
        self.problem()["code"].as_str().unwrap().to_owned()
    }
}

/// Sends `request` through a clone of `service` and reads the answer to its end.
pub(crate) async fn send<S, B>(service: &S, request: Request<Full<Bytes>>) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: Body,
    B::Error: fmt::Debug,
{
    let response = service.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// A store whose backend is down: every operation answers "unavailable", after `delay`.
#[derive(Clone)]
pub(crate) struct DownStore {
    pub(crate) delay: Duration,
}

impl DownStore {
    /// Answers at once.
    pub(crate) fn new() -> Self {
        DownStore {
            delay: Duration::ZERO,
        }
    }

    async fn fail<T>(&self) -> Result<T, StoreError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Err(StoreError::Unavailable("connection refused".into()))
    }
}

impl Store for DownStore {
    async fn claim(
        &self,
        _: &StorageKey,
        _: &Fingerprint,
        _: Duration,
        _: Duration,
    ) -> Result<Claim, StoreError> {
        self.fail().await
    }
    async fn complete(
        &self,
        _: &StorageKey,
        _: FencingToken,
        _: Bytes,
        _: Duration,
    ) -> Result<(), StoreError> {
        self.fail().await
    }
    async fn release(&self, _: &StorageKey, _: FencingToken) -> Result<(), StoreError> {
        self.fail().await
    }
    async fn renew(&self, _: &StorageKey, _: FencingToken, _: Duration) -> Result<(), StoreError> {
        self.fail().await
    }
}
