//! The client side: one idempotency key per logical call, and every retry of the call sent
//! with that same key and body, so a server that is idempotent runs it at most once.
//!
//! [`ClientLayer`] wraps any tower HTTP client (`hyper_util`'s legacy `Client`, a tonic
//! `Channel`, anything implementing `Service<http::Request<B>>` whose body `B` is a
//! [`ResendBody`]):
//!
//! - **Key**: a request of a protected method (HTTP: POST and PATCH; gRPC: every call) gets
//!   the `Idempotency-Key` header (gRPC: the `idempotency-key` metadata entry): the key in
//!   its [`IdempotencyKey`] extension if the caller put one there, else a fresh UUIDv4. A
//!   request that already carries the header keeps it. The key is sent as an RFC 8941
//!   string (`"…"`), which the server layer accepts in every mode.
//! - **Retried, with the same key and body**: connection errors and attempts that time out;
//!   HTTP `409` with `Retry-After` (a duplicate still in flight: waited out), `429` and `503`
//!   (after their `Retry-After` when given), `502`, `504`; gRPC `UNAVAILABLE` and `ABORTED`
//!   (after `grpc-retry-pushback-ms`; a negative pushback means "do not retry"). Never any
//!   other answer: `400`, `422` and the rest are the call's answer. A `422` (gRPC
//!   `FAILED_PRECONDITION` with `idempotent-error: fingerprint_mismatch`) means the key was
//!   used for a different request, a bug in the caller: it is returned and logged as an
//!   error.
//! - **Bounded**: [`RetryPolicy`]: attempts, a total deadline, a per-attempt timeout,
//!   exponential backoff with full jitter, and tower's retry budget shared by every clone.
//!   The request body is buffered (up to [`RetryPolicy::max_request_body`]) to be resent. A
//!   wait that would end after the deadline (the backoff, or a server's `Retry-After` or
//!   pushback however large) is not begun: the call ends at once, its deadline reached.
//!   `Retry-After` is read as a number of seconds (ASCII digits; too many for a `u64` is the
//!   largest); a date or anything else is ignored, and the backoff applies. No answer and no
//!   setting (`Duration::MAX` anywhere) makes the client panic.
//! - **Reported**: the answer carries a [`Delivery`] extension (the key, the attempts, whether
//!   the answer was a replay). When the attempts, the deadline or the budget run out, the
//!   last answer is returned if it had one (a `503` is an answer), and
//!   [`ClientError::GaveUp`] if the last attempt got none; either way the key is known, and
//!   sending the same request with it later learns the call's outcome without running it
//!   twice.
//! - **Counted**: [`CLIENT_CALLS`] (by outcome: `answered`, `replayed`, `key_reused`,
//!   `attempts_exhausted`, `deadline_reached`, `budget_spent`, `not_sent`),
//!   [`CLIENT_ATTEMPTS`] and [`CLIENT_RETRIES`] (by reason: `error`, `timeout`, `in_flight`,
//!   `throttled`, `unavailable`, `aborted`, `bad_gateway`), each labelled with `protocol`
//!   (`http` or `grpc`), through the [`metrics`](https://docs.rs/metrics) facade. A layer
//!   registers them with the recorder installed when it is created; requests of methods it
//!   does not protect are not counted.
//!
//! With reqwest, [`IdempotencyMiddleware`] (feature `reqwest`) does the same as a
//! `reqwest-middleware` middleware.
//!
//! The guarantee, with a server that is idempotent for the key (this crate's
//! [`IdempotencyLayer`](crate::IdempotencyLayer), or any server honouring the IETF
//! `Idempotency-Key` draft): at most one effect per logical call, however many attempts it
//! takes; at least one attempt; and, after the deadline, an answer or a clear error naming
//! the key.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use idempotent_tower::client::{ClientLayer, Delivery, RetryPolicy};
//! use std::time::Duration;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let mut client = ServiceBuilder::new()
//!     .layer(ClientLayer::http().policy(RetryPolicy::new().deadline(Duration::from_secs(20))))
//!     .service(http);
//! let request = http::Request::post("http://127.0.0.1:3000/payments")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"amount":1999,"currency":"EUR"}"#)))?;
//! let response = client.ready().await?.call(request).await?;
//! let delivery = response.extensions().get::<Delivery>().unwrap();
//! println!("{} after {} attempts (key {})", response.status(), delivery.attempts(), delivery.key());
//! # Ok(())
//! # }
//! ```

mod metrics;
mod policy;
#[cfg(feature = "reqwest")]
mod reqwest;
#[cfg(feature = "outbox")]
mod sink;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use idempotent_core::{Key, KeyError};
use tower_layer::Layer;
use tower_service::Service;

use crate::IDEMPOTENCY_KEY;
use crate::config::IDEMPOTENT_REPLAYED;
use metrics::ClientMetrics;
pub use metrics::{CLIENT_ATTEMPTS, CLIENT_CALLS, CLIENT_RETRIES};
pub use policy::{
    DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_REQUEST_BODY,
    RetryPolicy,
};
use policy::{deliver, grpc_verdict, http_verdict};
#[cfg(feature = "reqwest")]
pub use reqwest::IdempotencyMiddleware;
#[cfg(feature = "outbox")]
pub use sink::{HttpSink, HttpSinkError};

/// A boxed error, as tower services return them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The key of one logical call, chosen by the caller: put it in a request's extensions and
/// the client sends it instead of a fresh UUID. Keep it to retry the call later.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Key);

impl IdempotencyKey {
    /// `key` as a key, by the rules the server applies ([`Key`]): 1–255 bytes of printable
    /// ASCII, no leading or trailing space.
    pub fn new(key: impl AsRef<str> + Into<String>) -> Result<Self, ClientError> {
        Ok(IdempotencyKey(Key::new(key)?))
    }

    /// A fresh random key (a UUIDv4).
    pub fn random() -> Self {
        IdempotencyKey(Key::new(uuid::Uuid::new_v4().to_string()).expect("a UUID is a valid key"))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The header value: an RFC 8941 string.
    fn header_value(&self) -> HeaderValue {
        let mut quoted = String::with_capacity(self.as_str().len() + 2);
        quoted.push('"');
        for c in self.as_str().chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        HeaderValue::from_str(&quoted).expect("printable ASCII is a valid header value")
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the client did for one logical call: an extension of the answer it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    key: String,
    attempts: u32,
    replayed: bool,
}

impl Delivery {
    /// The key the call was sent with (as sent, for a key the request already carried).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Requests sent for the call, retries included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the answer was a replay of an earlier attempt's answer
    /// (`Idempotent-Replayed: true`): an earlier attempt ran, and its answer was lost.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

/// Why a call through the client layer failed without an answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request body is larger than [`RetryPolicy::max_request_body`]: it could not be
    /// kept for a retry, and nothing was sent.
    #[error(
        "the request body is over the client's limit of {limit} bytes; nothing was sent (raise RetryPolicy::max_request_body)"
    )]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The request body could not be read; nothing was sent.
    #[error("the request body could not be read; nothing was sent")]
    Body(#[source] BoxError),
    /// The key given in [`IdempotencyKey::new`] is not a valid key.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// No attempt got an answer before the attempts, the deadline or the budget ran out. The
    /// call may or may not have run: send the same request with `key` to find out (it will
    /// not run twice).
    #[error(
        "no answer after {attempts} attempts ({reason}); the call may have run: send the same request with the key {key:?} to learn its outcome"
    )]
    GaveUp {
        /// The call's key.
        key: String,
        /// Requests sent.
        attempts: u32,
        /// What ran out.
        reason: GiveUp,
        /// The last attempt's error.
        #[source]
        last: BoxError,
    },
    /// A request the layer does not protect (another method) failed.
    #[error("the request failed")]
    Unprotected(#[source] BoxError),
}

/// What ended the retries of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUp {
    /// [`RetryPolicy::max_attempts`] were sent.
    Attempts,
    /// The next attempt would start after [`RetryPolicy::deadline`].
    Deadline,
    /// The retry budget was spent.
    Budget,
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GiveUp::Attempts => "attempts exhausted",
            GiveUp::Deadline => "deadline reached",
            GiveUp::Budget => "retry budget spent",
        })
    }
}

/// A request body the client layer can rebuild from the bytes it buffered, to send the same
/// body again.
pub trait ResendBody: Body + Sized {
    /// A body of `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;
}

impl ResendBody for Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

impl<E: 'static> ResendBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes).map_err(|never| match never {}).boxed()
    }
}

impl<E: 'static> ResendBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "tonic")]
impl ResendBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        tonic::body::Body::new(Full::new(bytes))
    }
}

/// Which wire the client speaks.
#[derive(Debug, Clone)]
enum Wire {
    Http { methods: Vec<Method> },
    Grpc,
}

#[derive(Debug, Clone)]
struct Config {
    wire: Wire,
    header: HeaderName,
    policy: RetryPolicy,
    metrics: ClientMetrics,
}

/// The client-side layer: see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ClientLayer {
    config: Arc<Config>,
}

impl ClientLayer {
    /// For HTTP: POST and PATCH requests get a key and are retried; others pass through.
    pub fn http() -> Self {
        Self::with(Wire::Http {
            methods: vec![Method::POST, Method::PATCH],
        })
    }

    /// For gRPC: every call gets a key and is retried (gRPC calls are POSTs). Meant for unary
    /// calls: a streamed request is buffered whole, and an answer whose status arrives in
    /// trailers (after messages) is not retried.
    pub fn grpc() -> Self {
        Self::with(Wire::Grpc)
    }

    fn with(wire: Wire) -> Self {
        let protocol = match wire {
            Wire::Http { .. } => "http",
            Wire::Grpc => "grpc",
        };
        ClientLayer {
            config: Arc::new(Config {
                wire,
                header: IDEMPOTENCY_KEY,
                policy: RetryPolicy::default(),
                metrics: ClientMetrics::register(protocol),
            }),
        }
    }

    fn config(mut self, change: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config::clone(&self.config);
        change(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// The retry policy (default [`RetryPolicy::default`]).
    pub fn policy(self, policy: RetryPolicy) -> Self {
        self.config(|c| c.policy = policy)
    }

    /// The HTTP methods that get a key and retries (default POST and PATCH). No effect on a
    /// gRPC layer.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().collect();
        self.config(|c| {
            if let Wire::Http { methods: m } = &mut c.wire {
                *m = methods;
            }
        })
    }

    /// The header carrying the key (default `Idempotency-Key`), to match a server configured
    /// with another.
    pub fn header_name(self, name: HeaderName) -> Self {
        self.config(|c| c.header = name)
    }
}

impl<S> Layer<S> for ClientLayer {
    type Service = IdempotentClient<S>;

    fn layer(&self, inner: S) -> IdempotentClient<S> {
        IdempotentClient {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service [`ClientLayer`] wraps around a client.
#[derive(Debug, Clone)]
pub struct IdempotentClient<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotentClient<S> {
    /// The wrapped client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// The future of [`IdempotentClient`].
pub type ClientFuture<T> = Pin<Box<dyn Future<Output = Result<T, ClientError>> + Send>>;

impl<S, B, RB> Service<Request<B>> for IdempotentClient<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: ResendBody + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = ClientError;
    type Future = ClientFuture<Response<RB>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        // Every attempt waits for a clone of the client to be ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let config = Arc::clone(&self.config);
        Box::pin(call(inner, config, request))
    }
}

/// One attempt on a clone of the client once it is ready.
async fn attempt<S, B, RB>(mut inner: S, request: Request<B>) -> Result<Response<RB>, BoxError>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    inner.call(request).await.map_err(Into::into)
}

async fn call<S, B, RB>(
    inner: S,
    config: Arc<Config>,
    request: Request<B>,
) -> Result<Response<RB>, ClientError>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    B: ResendBody,
    B::Error: Into<BoxError>,
{
    if !config.protects(request.method()) {
        return attempt(inner, request)
            .await
            .map_err(ClientError::Unprotected);
    }
    let (mut parts, body) = request.into_parts();
    let chosen = parts.extensions.remove::<IdempotencyKey>();
    let key = config.key(&mut parts.headers, chosen);
    let limit = config.policy.max_request_body;
    let body = match Limited::new(body, limit).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            let error = if error.is::<LengthLimitError>() {
                ClientError::BodyTooLarge { limit }
            } else {
                ClientError::Body(error)
            };
            config.metrics.failed(&error);
            return Err(error);
        }
    };
    let verdict = |response: &Response<RB>| config.verdict(response.status(), response.headers());
    let send = move || {
        let mut request = Request::new(B::from_bytes(body.clone()));
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = parts.uri.clone();
        *request.version_mut() = parts.version;
        *request.headers_mut() = parts.headers.clone();
        *request.extensions_mut() = parts.extensions.clone();
        attempt(inner.clone(), request)
    };
    let delivered = config.deliver(&key, send, verdict).await?;
    let delivery = config.delivery(key, &delivered, delivered.answer.headers());
    let mut response = delivered.answer;
    response.extensions_mut().insert(delivery);
    Ok(response)
}

impl Config {
    /// Whether a request of `method` gets a key and retries.
    fn protects(&self, method: &Method) -> bool {
        match &self.wire {
            Wire::Http { methods } => methods.contains(method),
            Wire::Grpc => true,
        }
    }

    /// The request's key: the one its headers already carry, else the caller's `chosen` key
    /// or a fresh one, added to the headers.
    fn key(&self, headers: &mut http::HeaderMap, chosen: Option<IdempotencyKey>) -> String {
        match headers.get(&self.header) {
            Some(given) => String::from_utf8_lossy(given.as_bytes()).into_owned(),
            None => {
                let key = chosen.unwrap_or_else(IdempotencyKey::random);
                headers.insert(self.header.clone(), key.header_value());
                key.as_str().to_owned()
            }
        }
    }

    fn verdict(&self, status: http::StatusCode, headers: &http::HeaderMap) -> policy::Verdict {
        match &self.wire {
            Wire::Http { .. } => http_verdict(status, headers),
            Wire::Grpc => grpc_verdict(status, headers),
        }
    }

    /// Sends one logical call by the policy, counting it.
    async fn deliver<R, F, Fut>(
        &self,
        key: &str,
        send: F,
        verdict: impl Fn(&R) -> policy::Verdict,
    ) -> Result<policy::Delivered<R>, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<R, BoxError>>,
    {
        let delivered = deliver(&self.policy, &self.metrics, key, send, verdict).await;
        if let Err(error) = &delivered {
            self.metrics.failed(error);
        }
        delivered
    }

    /// The [`Delivery`] of a call that got an answer with `headers`, counted.
    fn delivery<R>(
        &self,
        key: String,
        delivered: &policy::Delivered<R>,
        headers: &http::HeaderMap,
    ) -> Delivery {
        let replayed = headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v == "true");
        self.metrics.answered(delivered.ended, replayed);
        Delivery {
            key,
            attempts: delivered.attempts,
            replayed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_sent_quoted() {
        for bad in ["", " a", "a ", "é", "a\nb", &"k".repeat(256)] {
            assert!(
                matches!(IdempotencyKey::new(bad), Err(ClientError::InvalidKey(_))),
                "{bad:?}"
            );
        }
        let key = IdempotencyKey::new(r#"order "7"\x"#).unwrap();
        assert_eq!(key.header_value(), r#""order \"7\"\\x""#);
        let random = IdempotencyKey::random();
        assert_eq!(random.as_str().len(), 36);
        assert_ne!(random, IdempotencyKey::random());
    }
}
