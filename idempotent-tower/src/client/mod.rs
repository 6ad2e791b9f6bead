//! The client side: one idempotency key per logical call, and every retry of the call sent
//! with that same key and body, so a server that is idempotent runs it at most once.
//!
//! [`ClientLayer::http`] or [`ClientLayer::grpc`] (a `ClientLayer<Http>` or
//! `ClientLayer<Grpc>`: the protocol is a type, the same [`Http`](crate::Http) and
//! [`Grpc`](crate::Grpc) as the server layer's) wraps any tower client (`hyper_util`'s legacy
//! `Client`, a tonic `Channel`, anything implementing `Service<http::Request<B>>` whose body
//! `B` is a [`ResendBody`]) in a [`ClientService`]:
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

mod body;
mod config;
mod error;
mod key;
mod layer;
mod metrics;
mod policy;
mod protocol;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;
#[cfg(feature = "outbox")]
mod sink;
mod verdict;

pub use body::ResendBody;
pub use error::{ClientError, GiveUp};
pub use key::{Delivery, IdempotencyKey};
pub use layer::ClientLayer;
pub use metrics::{CLIENT_ATTEMPTS, CLIENT_CALLS, CLIENT_RETRIES};
pub use policy::{
    DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_REQUEST_BODY,
    RetryPolicy,
};
pub use protocol::ClientProtocol;
#[cfg(feature = "reqwest")]
pub use reqwest::IdempotencyMiddleware;
pub use service::{ClientFuture, ClientService};
#[cfg(feature = "outbox")]
pub use sink::{HttpSink, HttpSinkError};
