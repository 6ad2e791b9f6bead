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
//! # Where to read on
//!
//! - **The server layer**, [`IdempotencyLayer`] (HTTP and gRPC): what it does with a key or a
//!   session, the fingerprint, scopes, requests in flight, which outcomes are kept, replays,
//!   limits, every response it produces (HTTP and gRPC), the running claim that protects the
//!   effect, graceful shutdown, and where to put the layer among the others.
//! - **The client side**, [`client`]: one key per logical call, every retry sent with it, a
//!   bounded retry policy, for any tower client and reqwest; calls numbered in a client
//!   session instead of keyed: [`client::ClientSession`].
//! - **Operations whose clients went away**: [`Completer`] finishes them in the background.
//! - **The session header** both sides speak: [`SessionHeader`].
//! - **The runtime underneath** (stores, TTLs, leases, the failure model):
//!   [`idempotent_core`].
//! - Every public item: [Public API](#public-api), below.
//!
//! The sources: `src/server/` holds the server layer, `src/client/` the client side,
//! `src/completer/` the completer; `src/key.rs` and `src/session.rs`, the grammar of the
//! `Idempotency-Key` and `Idempotency-Session` headers, stay at the top, shared by the server
//! (which reads them) and the client (which writes them). The longer texts are in the
//! repository's `docs/tower-*.md`.
//!
#![doc = include_str!("../docs/tower-api.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
mod completer;
mod key;
mod server;
mod session;

pub use completer::{
    Completer, CompleterHandle, CompleterPass, Completing, DEFAULT_COMPLETER_AFTER,
    DEFAULT_COMPLETER_ATTEMPTS, RecordedResponse, RecordedResponseError, operation_failed_record,
};
pub use idempotent_core::BoxError;
pub use server::body::{RequestBody, ResponseBody};
pub use server::config::{
    DEFAULT_MAX_REQUEST_BODY, IDEMPOTENCY_KEY, IDEMPOTENT_BYPASSED, IDEMPOTENT_REPLAYED,
    OnClaimLost,
};
pub use server::future::ResponseFuture;
pub use server::kept::{
    CodeVersion, InvalidCodeVersion, KeptRequest, KeptRequestError, MAX_CODE_VERSION_LEN,
};
pub use server::layer::IdempotencyLayer;
pub use server::principal::{Principal, scope_by_authorization, scope_by_principal};
pub use server::protocol::{Grpc, Http, Protocol};
pub use server::service::IdempotencyService;
pub use session::{IDEMPOTENCY_SESSION, IDEMPOTENCY_SESSION_SEQ, SessionHeader, SessionProblem};
