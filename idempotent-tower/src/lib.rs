//! Idempotency for HTTP services on tower: the `Idempotency-Key` header with IETF draft
//! semantics, for axum routers and any tower stack.
//!
//! DOCS_PLACEHOLDER

#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod future;
mod key;
mod layer;
mod problem;
mod record;
mod service;

pub use body::{RequestBody, ResponseBody};
pub use future::ResponseFuture;
pub use layer::{
    DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY, IDEMPOTENCY_KEY, IDEMPOTENT_BYPASSED,
    IDEMPOTENT_REPLAYED, IdempotencyLayer, default_retain, scope_by_authorization,
};
pub use service::IdempotencyService;
