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
//!   string (`"…"`), which the server layer accepts in every mode. With a
//!   [session](#sessions), a number in it instead.
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
//! - **Reported**: the answer carries a [`Delivery`] extension (the key or session number,
//!   the attempts, whether the answer was a replay). When the attempts, the deadline or the
//!   budget run out, the last answer is returned if it had one (a `503` is an answer), and
//!   [`ClientError::GaveUp`] if the last attempt got none; either way the key (or session
//!   number) is known, and sending the same request with it later learns the call's outcome
//!   without running it twice.
//! - **Counted**: [`CLIENT_CALLS`] (by outcome: `answered`, `replayed`, `key_reused`,
//!   `attempts_exhausted`, `deadline_reached`, `budget_spent`, `not_sent`, and for
//!   [sessions](#sessions) `sequence_acknowledged` and `session_expired`),
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
//!
//! # Sessions
//!
//! Instead of a key per call, a layer given a [`ClientSession`]
//! ([`ClientLayer::session`]) sends every protected request in that session, as the server
//! layer accepts it (see [`SessionHeader`](crate::SessionHeader)):
//!
//! ```text
//! Idempotency-Session: id="<session id>", seq=<n>, ack=<mark>
//! ```
//!
//! (gRPC: the `idempotency-session` metadata entry, same value.)
//!
//! - **Numbers**: each logical call takes the session's next number, `1, 2, 3, …`, once its
//!   body is buffered (a request refused before it is sent spends none). Every attempt of the
//!   call carries that same `seq`, and the session's `ack` at the time of the attempt: the
//!   highest `n` such that every call numbered `n` or lower has its answer
//!   ([`ClientSession::ack`]). The server drops the answers at or below it. A retry carrying a
//!   newer `ack` still replays (the header is not part of the request's fingerprint).
//! - **When the mark advances**: a call's number counts as answered when the call ends with
//!   an answer it returns that the server marked as its own for that number: the server
//!   layer puts `Idempotency-Session-Seq: <seq>`
//!   ([`IDEMPOTENCY_SESSION_SEQ`](crate::IDEMPOTENCY_SESSION_SEQ); gRPC: the
//!   `idempotency-session-seq` metadata entry) on its handler's answers, fresh or replayed,
//!   with any status that is not retried (a `400` too). An answer without that mark, or
//!   naming another number, is returned as the call's answer but leaves the number
//!   unanswered ([`Delivery::session_answered`] is `false`), as below: a proxy's or load
//!   balancer's `500`, the layer's own refusals (a `413`, say), or a `422` (the number was
//!   used for another request, a resend whose body changed, and the answer of the first
//!   stays the server's to give). The answer carries its number ([`Delivery::session_seq`]).
//!   A server that does not mark its answers (not this crate's layer, or one built before
//!   the mark) gets nothing acknowledged: the client never acknowledges what it cannot
//!   prove, and the mark advances only as the caller sends such numbers again or
//!   [abandons](ClientSession::abandon) the ones whose answers it holds; upgrade servers
//!   before clients.
//! - **Giving up**: a call that ends without its answer, [`ClientError::GaveUp`] (or with
//!   a retryable answer such as a `503` once its retries ran out), leaves its number
//!   unanswered: the mark stays below it, so the server keeps what it may hold for it. Send
//!   the same request again later with a [`SessionSeq`]`(seq)` in its extensions (the `seq`
//!   of the error, or of the answer's `Delivery`): it goes out with that number, not a new
//!   one, and gets the replay if the call ran, or runs it once if it did not. A number left
//!   unanswered holds the mark back: after the server's window (64 by default) of further
//!   calls, it refuses new ones with `429 session_window_full`, retried like any `429` until
//!   the call is sent again or [abandoned](ClientSession::abandon). A call whose future is
//!   dropped before its end (its caller never learns its number) is abandoned.
//! - **Refusals**, never retried: `410 sequence_acknowledged` (gRPC `OUT_OF_RANGE`) is
//!   [`ClientError::SequenceAcknowledged`]: the number is at or below the session's mark (a
//!   `SessionSeq` sent again after it was acknowledged, or another client using the same
//!   id); nothing ran. `410 session_expired` (gRPC `NOT_FOUND`) is
//!   [`ClientError::SessionExpired`]: the server forgot the session after its idle time, and
//!   nothing ran; the session is then expired ([`ClientSession::is_expired`]), and every later
//!   call through it fails at once with the same error, unsent: open a new session. Over
//!   HTTP the client reads the body of a `410 application/problem+json` answer (up to 64 KiB)
//!   to learn its `code`, and of no other answer; one with another code is returned as the
//!   answer, its body rebuilt from the bytes read (or [`ClientError::Gone`] for a response
//!   body type that cannot be rebuilt, such as hyper's `Incoming`). gRPC reads the
//!   `idempotent-error` entry.
//! - A request that carries its own `Idempotency-Key` header is sent with that key, outside
//!   the session; an [`IdempotencyKey`] extension is ignored.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use idempotent_tower::client::{ClientError, ClientLayer, ClientSession, Delivery, SessionSeq};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let session = ClientSession::new(); // keep it for the life of the process
//! let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let mut client = ServiceBuilder::new()
//!     .layer(ClientLayer::http().session(session.clone()))
//!     .service(http);
//! let pay = || {
//!     http::Request::post("http://127.0.0.1:3000/payments")
//!         .header("content-type", "application/json")
//!         .body(Full::new(Bytes::from_static(br#"{"amount":1999,"currency":"EUR"}"#)))
//! };
//! match client.ready().await?.call(pay()?).await {
//!     Ok(response) => {
//!         let seq = response.extensions().get::<Delivery>().unwrap().session_seq();
//!         let id = session.id().as_str();
//!         println!("{} as call {seq:?} of session {id}", response.status());
//!     }
//!     Err(ClientError::GaveUp { seq: Some(seq), .. }) => {
//!         // Later: the same request with the same number learns what became of it.
//!         let mut again = pay()?;
//!         again.extensions_mut().insert(SessionSeq(seq));
//!         let response = client.ready().await?.call(again).await?;
//!         println!("call {seq}: {}", response.status());
//!     }
//!     Err(ClientError::SessionExpired { .. }) => { /* open a new ClientSession */ }
//!     Err(error) => return Err(error.into()),
//! }
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
mod session;
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
pub use session::{ClientSession, SessionSeq};
#[cfg(feature = "outbox")]
pub use sink::{HttpSink, HttpSinkError};
