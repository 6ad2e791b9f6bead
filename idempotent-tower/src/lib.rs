//! Idempotency for HTTP services on tower: the `Idempotency-Key` header with IETF draft
//! semantics, for axum routers and any tower stack.
//!
//! A client sends `Idempotency-Key: "<unique key>"` with a POST; if the request times out, it
//! sends the same request with the same key again. The first request runs the handler; a
//! duplicate arriving while it runs gets `409 Conflict`; every later retry gets the first
//! response back, byte for byte, with `Idempotent-Replayed: true`. The handler runs once.
//!
//! ```no_run
//! use axum::{Json, Router, routing::post};
//! use idempotent_core::Idempotency;
//! use idempotent_core::memory::MemoryStore;
//! use idempotent_tower::IdempotencyLayer;
//! use serde_json::{Value, json};
//!
//! async fn charge(Json(request): Json<Value>) -> (axum::http::StatusCode, Json<Value>) {
//!     // ... call the payment provider exactly once per key ...
//!     (axum::http::StatusCode::CREATED, Json(json!({ "charged": request["amount"] })))
//! }
//!
//! #[tokio::main]
//! async fn main() {
//!     let idempotency = Idempotency::new(MemoryStore::new());
//!     let app = Router::new()
//!         .route("/payments", post(charge))
//!         .layer(IdempotencyLayer::http(idempotency));
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//!     axum::serve(listener, app).await.unwrap();
//! }
//! ```
//!
//! `Router::route_layer` protects only the routes defined before it, and
//! `tower::ServiceBuilder` works the same way for any `Service<http::Request<B>>`. The inner
//! service receives `http::Request<RequestBody<B>>`; axum routes and tonic servers accept any
//! body type, so nothing changes for them.
//!
//! # Semantics
//!
//! - **Key**: from the `Idempotency-Key` header ([`header_name`](IdempotencyLayer::header_name)
//!   to change it): an RFC 8941 sf-string (`"…"`, with `\"` and `\\` escapes; parameters after
//!   the closing quote are ignored) or, by default, the same key unquoted
//!   ([`strict`](IdempotencyLayer::strict) refuses that). 1–255 bytes of printable ASCII, no
//!   leading or trailing space. An unquoted key is taken verbatim and may not contain a space,
//!   `"`, `\` or `;`: `abc;x` → 400 `invalid_key` asking for the key to be quoted, since reading
//!   `;x` as parameters would make `abc;x` and `abc;y` the same key. Send `"abc;x"` for a key
//!   holding `;`, or `"abc";x` for the key `abc` with a parameter. Empty, too long, non-ASCII,
//!   unparsable, or given twice (two fields or a list) → 400.
//! - **Or a session**: a request may carry `Idempotency-Session: id="…", seq=N, ack=M`
//!   ([`SessionHeader`]; gRPC: the `idempotency-session` metadata entry) instead of a key:
//!   request `N` of a client session that holds every answer up to `M` (see
//!   [`idempotent_core::session`]). Both headers on one request → 400
//!   `conflicting_idempotency_headers`; a malformed session → 400 `invalid_session`.
//!   [`sessions(false)`](IdempotencyLayer::sessions) stops reading it;
//!   [`session_header_name`](IdempotencyLayer::session_header_name) renames it. The
//!   handler's answer to a session request, fresh or replayed, carries
//!   `Idempotency-Session-Seq: N` ([`IDEMPOTENCY_SESSION_SEQ`]; gRPC: the
//!   `idempotency-session-seq` metadata entry), never stored: the client acknowledges `N`
//!   only with an answer so marked, never with one a proxy gave. Of the layer's own
//!   refusals, only the final ones of a number that reached its session are marked (`422
//!   fingerprint_mismatch`, `result_not_retained`, `corrupt_record`: sent again, the request
//!   gets the same); refusals to retry (`409`, `503`, `429`) and those made before the
//!   request reaches its session (`413`, `403 missing_scope`, an unreadable body) are not.
//! - **Protected methods**: POST and PATCH ([`methods`](IdempotencyLayer::<Http>::methods)).
//!   Other methods pass through untouched, even with a key. A protected request without a key
//!   → 400 ([`require_key(false)`](IdempotencyLayer::require_key) lets it through unprotected).
//! - **Fingerprint**: method, path, query pairs sorted (so `?a=1&b=2` equals `?b=2&a=1`; values
//!   are compared as sent, not percent-decoded), the body bytes, and any
//!   [`fingerprint_headers`](IdempotencyLayer::fingerprint_headers). The same key with another
//!   fingerprint → 422, and the stored record stays as it was.
//! - **Scope**: the authenticated [`Principal`] that the application's authentication
//!   middleware put in the request extensions ([`scope_by_principal`]; [`scope`](IdempotencyLayer::scope)
//!   to derive it otherwise). A protected request without one → 403 `missing_scope`, before
//!   the handler runs, unless [`allow_anonymous(true)`](IdempotencyLayer::allow_anonymous) puts
//!   such requests in one shared anonymous scope. Two scopes never share records, and a
//!   request never learns whether a key exists in another scope: it simply runs. The scope is
//!   the principal, not the credential: a client whose token is refreshed between two attempts
//!   of one operation is still the same principal, so its retry replays instead of running
//!   again ([`scope_by_authorization`] scopes by the credential, for static API keys only).
//! - **In flight**: 409 with `Retry-After`; or [`call_options`](IdempotencyLayer::call_options)
//!   with an [`in_flight`](idempotent_core::CallOptions::in_flight) policy of
//!   [`InFlightPolicy::Wait`](idempotent_core::InFlightPolicy::Wait) to wait (bounded) and
//!   replay. The same options set the TTL, the lease and the result limit; the runtime's
//!   [`Defaults`](idempotent_core::Defaults) apply to what they leave unset.
//! - **Outcome policy**: 2xx, 3xx and 4xx are stored, except 408, 409, 425 and 429, which are
//!   released like every 5xx: the retry runs the handler again
//!   ([`retain`](IdempotencyLayer::<Http>::retain) to change it; [`Http::default_retain`] is
//!   the default).
//! - **Replay**: the stored status, headers, body and trailers, plus `Idempotent-Replayed: true`.
//!   Hop-by-hop headers, `Date` and `Set-Cookie` are never stored, so never replayed
//!   ([`exclude_header`](IdempotencyLayer::exclude_header) and
//!   [`replay_header`](IdempotencyLayer::replay_header) adjust the list). A first response never
//!   carries `Idempotent-Replayed`.
//! - **Limits**: a protected request body over 1 MiB → 413 before anything runs
//!   ([`max_request_body`](IdempotencyLayer::max_request_body)). Over HTTP/1.1 the layer first
//!   reads and throws away the rest of the refused body, up to 4 MiB past the limit
//!   ([`max_discarded_body`](IdempotencyLayer::max_discarded_body)), so that a client still
//!   sending it reads the 413 instead of a connection reset and keeps its connection; a longer
//!   body, or one the client holds back for `100 Continue`, is answered as soon as it is known
//!   with `Connection: close`, and a client still sending may then see a reset. Over HTTP/2 and
//!   gRPC only the request's stream ends. Every other refusal before the handler (400
//!   `missing_key`/`invalid_key`, 403 `missing_scope`, 503 `shutting_down`) reads what is left
//!   of the body the same way, up to the limit plus that allowance. Reading a refused body
//!   stops after 10 seconds, and the answer then closes the connection: a client that stalls
//!   half-way cannot hold it open. A response body over the result limit (the runtime's
//!   [`Defaults::max_result_bytes`](idempotent_core::Defaults::max_result_bytes), 1 MiB by
//!   default, or the one in the layer's [`call_options`](IdempotencyLayer::call_options))
//!   still streams to the client, and the key is recorded as done without a result: retries
//!   get 410 `result_not_retained` instead of a second execution. A response with more than
//!   4,096 header fields or 4,096 trailer fields (after the headers that are never stored), or
//!   a body of 4 GiB or more, is recorded the same way. Idempotent endpoints should return
//!   small bodies.
//! - **Client disconnect**: the handler keeps running on its own task until it completes, and
//!   its response is recorded; the client's retry gets the replay.
//! - **Handler panics and service errors** release the key (the next retry runs) and propagate
//!   as if the layer were not there.
//! - **Store unavailable**: 503 with `Retry-After`; the handler does not run (fail closed).
//!   [`fail_open(true)`](IdempotencyLayer::fail_open) runs it unprotected instead, marks the
//!   response `Idempotent-Bypassed: store-unavailable` and logs a warning.
//! - **Logging**: one `tracing` event per outcome (`outcome` = `fresh`, `replayed`,
//!   `in_flight`, `fingerprint_mismatch`, `invalid_key`, `bypassed`, `store_unavailable`, …),
//!   with the storage key digest, never the raw key.
//! - **Metrics**: each protected request is counted once in `idempotency.requests` with
//!   `protocol` `http` or `grpc` and its `outcome` (the runtime under the layer does not count
//!   it again), with the runtime's recorder; the runtime times the store operations and the
//!   handler. Requests the layer does not protect are not counted. The names, labels and
//!   outcomes are in [`idempotent_core::metrics`].
//!
//! # Responses the layer produces
//!
//! Every one is `application/problem+json` (RFC 9457) with `type`, `title`, `status`, `detail`
//! and a stable `code`, carries `Cache-Control: no-store`, and is never stored.
//!
//! | status | `code` | when | client should |
//! |---|---|---|---|
//! | 400 | `missing_key` | a protected request has no key | add a key |
//! | 400 | `invalid_key` | the key is empty, too long, not ASCII, unparsable, unquoted with a `;`, or given twice | send one valid key, quoted if it holds a `;` |
//! | 400 | `request_body_unreadable` | the request body could not be read | retry |
//! | 400 | `invalid_session` | the session header is not a dictionary with an `id` string, a `seq` from 1 and an `ack` from 0 | send a valid session |
//! | 400 | `conflicting_idempotency_headers` | the request has both a key and a session | send one of them |
//! | 409 | `in_flight` | the same key is still being processed (with `Retry-After`) | retry after the delay |
//! | 403 | `missing_scope` | a protected request carries no [`Principal`] (or the custom scope found none); nothing ran | authenticate |
//! | 410 | `result_not_retained` | the key was processed but its response was too large to keep | not retry; look the result up |
//! | 410 | `sequence_acknowledged` | the session request is at or below the session's acknowledged mark: its answer was dropped; nothing ran | not retry: a new request needs a new number |
//! | 410 | `session_expired` | the session is unknown (forgotten after its idle time) and the request says it holds answers; nothing ran | find out what its unanswered requests did, then start a new session |
//! | 413 | `request_too_large` | the body exceeds the limit; nothing ran. Over HTTP/1.1, sent once the rest of the body is read (up to 4 MiB past the limit), with `Connection: close` when it was not read to its end | send a smaller body |
//! | 422 | `fingerprint_mismatch` | the key was used for a different request | use a new key |
//! | 429 | `session_window_full` | the session request is numbered more than the window past the acknowledged mark (with `Retry-After`); nothing ran | acknowledge earlier answers, then retry |
//! | 500 | `corrupt_record` | the stored record cannot be read; nothing ran | contact the operator |
//! | 500 | `operation_failed` | the client went away, and the [`Completer`] gave up finishing the operation after its attempts; recorded, so every retry gets it | look the operation up; use a new key to try again |
//! | 503 | `store_unavailable` | the store cannot be reached (with `Retry-After`); nothing ran | retry after the delay |
//! | 503 | `claim_lost` | only with [`OnClaimLost::Cancel`]: the request's claim was lost while its handler ran, and the handler was stopped (with `Retry-After`) | retry with the same key: the owner that holds it now answers |
//! | 503 | `store_capacity` | the store is full of live records (with `Retry-After`); nothing ran | retry after the delay |
//! | 503 | `shutting_down` | the server is shutting down: the request arrived after shutdown began, or its handler was still running at the shutdown's deadline and was stopped (with `Retry-After`) | retry with the same key, on another instance |
//!
//! # The running claim: protecting the effect
//!
//! The layer makes the *record* exactly-once. To make the *effect* exactly-once when the store
//! stalls past the lease (see the `idempotent_core` *Failure model*), a protected handler reads
//! the running [`ClaimHandle`](idempotent_core::ClaimHandle) from the request extensions and
//! passes its operation key to the system it calls, or fences a resource with its token:
//!
//! ```no_run
//! use axum::Extension;
//! use idempotent_core::ClaimHandle;
//!
//! # struct Provider;
//! # impl Provider { async fn charge(&self, _key: &str, _cents: u64) -> u64 { 1 } }
//! # static PROVIDER: Provider = Provider;
//! async fn create_payment(Extension(claim): Extension<ClaimHandle>) -> String {
//!     // The same key for every owner and attempt of this request: one charge.
//!     let charge = PROVIDER.charge(claim.operation_key().as_str(), 1999).await;
//!     format!("{{\"id\":{charge}}}")
//! }
//! ```
//!
//! In tonic, `request.extensions().get::<ClaimHandle>()`. The extension is there for every
//! request the layer protects; requests it passes through (unprotected methods, key-less
//! requests when the key is optional, fail-open bypasses) have none, so a handler that serves
//! those too takes `Option<Extension<ClaimHandle>>`.
//!
//! If the claim is lost while the handler runs, [`on_claim_lost`](IdempotencyLayer::on_claim_lost)
//! decides: [`OnClaimLost::Finish`] (the default) lets the handler finish and answer its client;
//! [`OnClaimLost::Cancel`] stops it and answers `503 claim_lost`.
//!
//! # gRPC (tonic)
//!
//! [`IdempotencyLayer::grpc`] speaks gRPC over the same machinery: the key is the
//! `idempotency-key` metadata entry, the scope the [`Principal`] a tower layer in front of the
//! server put in the request extensions (the same rules as HTTP), and only the unary
//! methods named with the gRPC layer's `methods` are protected — streaming calls and every
//! other method pass through untouched (a layer cannot tell a unary call from a streaming one
//! on the wire, so the list is explicit).
//!
//! ```no_run
//! use idempotent_core::Idempotency;
//! use idempotent_core::memory::MemoryStore;
//! use idempotent_tower::IdempotencyLayer;
//!
//! # async fn run(service: tonic::service::Routes) -> Result<(), tonic::transport::Error> {
//! let idempotency = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
//!     .methods(["/payments.v1.Payments/Charge"]);
//! tonic::transport::Server::builder()
//!     .layer(idempotency)
//!     .add_routes(service)
//!     .serve("127.0.0.1:50051".parse().unwrap())
//!     .await
//! # }
//! ```
//!
//! - **Replay**: the identical response message bytes, `grpc-status`, `grpc-message` and every
//!   other trailer, plus the metadata entry `idempotent-replayed: true`. A stored error status
//!   (say `INVALID_ARGUMENT: card_declined`) is replayed as that status.
//! - **Outcome policy** by `grpc-status` ([`Grpc::default_retain`]; the gRPC layer's
//!   `retain`, a function of the [`GrpcCode`](idempotent_core::GrpcCode), to change it): OK
//!   and the deterministic codes `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
//!   `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE` and `UNAUTHENTICATED` are
//!   stored; `UNAVAILABLE`, `INTERNAL`, `UNKNOWN`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`,
//!   `ABORTED`, `CANCELLED` and the rest are released, so the retry runs again.
//! - **Refusals** are trailers-only responses carrying a gRPC status, a percent-encoded
//!   `grpc-message` with the same detail as the HTTP problem, and the problem's stable code in
//!   the `idempotent-error` metadata entry:
//!
//! | `idempotent-error` | gRPC status | notes |
//! |---|---|---|
//! | `missing_key`, `invalid_key`, `request_body_unreadable`, `invalid_session`, `conflicting_idempotency_headers` | `INVALID_ARGUMENT` | |
//! | `sequence_acknowledged` | `OUT_OF_RANGE` | a session number at or below its acknowledged mark |
//! | `session_expired` | `NOT_FOUND` | an unknown session whose request holds answers |
//! | `session_window_full` | `RESOURCE_EXHAUSTED` | `grpc-retry-pushback-ms` says when to retry |
//! | `missing_scope` | `PERMISSION_DENIED` | no principal in the request extensions |
//! | `fingerprint_mismatch` | `FAILED_PRECONDITION` | same key, different request message |
//! | `in_flight` | `ABORTED` | `grpc-retry-pushback-ms` says when to retry |
//! | `result_not_retained` | `ALREADY_EXISTS` | processed; response too large to keep |
//! | `request_too_large` | `RESOURCE_EXHAUSTED` | request message over the limit |
//! | `store_unavailable`, `store_capacity`, `shutting_down`, `claim_lost` | `UNAVAILABLE` | `grpc-retry-pushback-ms` where a delay is known |
//! | `corrupt_record` | `INTERNAL` | |
//!
//! # Graceful shutdown
//!
//! On SIGTERM, call [`Idempotency::shutdown`](idempotent_core::Idempotency::shutdown) on the
//! runtime the layer uses, inside the server's graceful-shutdown signal: from then on new
//! protected requests get `503 shutting_down` with `Retry-After` (gRPC `UNAVAILABLE`), so the
//! load balancer's retries go to another instance; requests in flight finish and record their
//! responses, so their retries replay anywhere instead of meeting a key locked for a lease;
//! handlers still running at the deadline are stopped and their keys released, while a handler
//! that has already answered is left to finish its response body, which is recorded (stopping
//! it would let the retry run the handler again). A protected request that arrives during the
//! shutdown is refused even in [`fail_open`](IdempotencyLayer::fail_open) mode. Unprotected
//! routes (health checks) keep being served until the server stops.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use axum::{Router, routing::post};
//! # use idempotent_core::Idempotency;
//! # use idempotent_core::memory::MemoryStore;
//! # use idempotent_tower::IdempotencyLayer;
//! # async fn sigterm() {}
//! # async fn run(listener: tokio::net::TcpListener) -> std::io::Result<()> {
//! let idempotency = Idempotency::new(MemoryStore::new());
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::http(idempotency.clone()));
//! axum::serve(listener, app)
//!     .with_graceful_shutdown(async move {
//!         sigterm().await;
//!         idempotency.shutdown(Duration::from_secs(10)).await;
//!     })
//!     .await
//! # }
//! ```
//!
//! # Where to put the layer
//!
//! - **Authentication** before (outside) it, so that the [`Principal`] it puts in the request
//!   extensions scopes the keys, and unauthenticated requests never reach the store:
//!   `Router::new().route(..).layer(IdempotencyLayer::http(..)).layer(auth)`.
//! - **Body limits** (`DefaultBodyLimit`, `RequestBodyLimitLayer`) before it are fine; the
//!   layer's own limit applies to protected requests in any case.
//! - **Compression** outside it, so the stored response is the uncompressed one and each replay
//!   is compressed per the retry's own `Accept-Encoding`.
//! - **Timeouts** outside it stop waiting for the response, but not the handler, which runs on
//!   and records its response for the retry. A timeout *inside* (around the handler) turns
//!   slow requests into errors that are released, so the retry runs again.
//! - **Rate limiting** outside it, so that rejected requests never claim a key.
//!
//! ```no_run
//! # use axum::{Router, routing::post, extract::Request, middleware::Next, response::Response};
//! # use idempotent_core::Idempotency;
//! # use idempotent_core::memory::MemoryStore;
//! # use idempotent_tower::{IdempotencyLayer, Principal};
//! async fn authenticate(mut request: Request, next: Next) -> Response {
//!     // ... verify the session cookie, token or certificate, then:
//!     request.extensions_mut().insert(Principal::new("user-42"));
//!     next.run(request).await
//! }
//!
//! let idempotency = IdempotencyLayer::http(Idempotency::new(MemoryStore::new()));
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(idempotency)
//!     .layer(axum::middleware::from_fn(authenticate));
//! ```
//!
//! # Public API
//!
//! - [`IdempotencyLayer`]`<P = Http>`, for one [`Protocol`]:
//!   - built with [`IdempotencyLayer::http`] or [`IdempotencyLayer::grpc`];
//!   - for every protocol: [`header_name`](IdempotencyLayer::header_name),
//!     [`strict`](IdempotencyLayer::strict), [`require_key`](IdempotencyLayer::require_key),
//!     [`fingerprint_headers`](IdempotencyLayer::fingerprint_headers),
//!     [`scope`](IdempotencyLayer::scope),
//!     [`allow_anonymous`](IdempotencyLayer::allow_anonymous),
//!     [`call_options`](IdempotencyLayer::call_options) (an
//!     [`idempotent_core::CallOptions`]: TTL, lease, in-flight policy, result limit),
//!     [`exclude_header`](IdempotencyLayer::exclude_header),
//!     [`replay_header`](IdempotencyLayer::replay_header),
//!     [`max_request_body`](IdempotencyLayer::max_request_body),
//!     [`fail_open`](IdempotencyLayer::fail_open),
//!     [`on_claim_lost`](IdempotencyLayer::on_claim_lost) (an [`OnClaimLost`]);
//!   - HTTP only: `methods` (of [`http::Method`]), `retain` (a function of the status),
//!     `max_discarded_body`, `keep_requests` (for a [`Completer`]);
//!   - gRPC only: `methods` (full paths), `retain` (a function of the
//!     [`idempotent_core::GrpcCode`]).
//! - The protocols: the sealed trait [`Protocol`] and its two types, [`Http`] and [`Grpc`],
//!   with their default outcome policies [`Http::default_retain`] and
//!   [`Grpc::default_retain`]. Every outcome policy returns an [`idempotent_core::Retain`].
//! - [`IdempotencyService`]`<S, P = Http>`, what the layer wraps around the inner service
//!   ([`get_ref`](IdempotencyService::get_ref), [`get_mut`](IdempotencyService::get_mut),
//!   [`into_inner`](IdempotencyService::into_inner)),
//!   its [`ResponseFuture`], the [`RequestBody`] the inner service receives and the
//!   [`ResponseBody`] it answers with.
//! - The completer: [`Completer`] (finishes in the background the operations whose clients
//!   never retried, from the kept request and their [steps](idempotent_core::steps)), its
//!   [`CompleterHandle`], [`CompleterPass`], the [`Completing`] request extension,
//!   [`DEFAULT_COMPLETER_AFTER`] and [`DEFAULT_COMPLETER_ATTEMPTS`].
//! - Scopes: [`Principal`], [`scope_by_principal`] (the default) and
//!   [`scope_by_authorization`].
//! - Header names: [`IDEMPOTENCY_KEY`], [`IDEMPOTENT_REPLAYED`], [`IDEMPOTENT_BYPASSED`].
//! - Limits: [`DEFAULT_MAX_REQUEST_BODY`] (the result limit is the runtime's:
//!   [`idempotent_core::DEFAULT_MAX_RESULT_BYTES`]).
//! - [`BoxError`], the boxed error of the client's errors (the core's, re-exported).
//! - [`client`]: the client side, [`client::ClientLayer`]`<P = Http>` (built with
//!   [`client::ClientLayer::http`] or [`client::ClientLayer::grpc`]) and the
//!   [`client::ClientService`] it wraps around a client, with its retry policy, keys, errors
//!   and metrics; the reqwest middleware (feature `reqwest`) and the outbox relay's HTTP sink
//!   (feature `outbox`).
//!
//! Every refusal carries an [`idempotent_core::ProblemCode`], which gives its HTTP status,
//! title, gRPC status and string.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
mod completer;
mod key;
mod server;
mod session;

pub use completer::{
    Completer, CompleterHandle, CompleterPass, Completing, DEFAULT_COMPLETER_AFTER,
    DEFAULT_COMPLETER_ATTEMPTS,
};
pub use idempotent_core::BoxError;
pub use server::body::{RequestBody, ResponseBody};
pub use server::config::{
    DEFAULT_MAX_REQUEST_BODY, IDEMPOTENCY_KEY, IDEMPOTENT_BYPASSED, IDEMPOTENT_REPLAYED,
    OnClaimLost,
};
pub use server::future::ResponseFuture;
pub use server::layer::IdempotencyLayer;
pub use server::principal::{Principal, scope_by_authorization, scope_by_principal};
pub use server::protocol::{Grpc, Http, Protocol};
pub use server::service::IdempotencyService;
pub use session::{IDEMPOTENCY_SESSION, IDEMPOTENCY_SESSION_SEQ, SessionHeader, SessionProblem};
