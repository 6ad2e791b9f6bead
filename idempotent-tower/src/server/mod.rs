//! The server side: [`IdempotencyLayer`](crate::IdempotencyLayer) and the
//! [`IdempotencyService`](crate::IdempotencyService) it wraps around a service, for HTTP and
//! gRPC. Its public items are re-exported at the crate root; none of these paths is public.
//!
//! - `layer.rs`: the layer and its builder methods; `config.rs`: its settings, the header
//!   names and defaults; `protocol.rs`: [`Http`](crate::Http), [`Grpc`](crate::Grpc) and the
//!   sealed [`Protocol`](crate::Protocol) (the client's protocols build on them).
//! - `service.rs`: the request flow; `future.rs`: its response future; `body.rs`: the request
//!   and response bodies the inner service sees.
//! - `capture.rs`: reading the response for the record; `stored.rs`: the stored response
//!   format; `kept.rs`: the kept request a completer runs again.
//! - `fingerprint.rs`, `principal.rs` (scopes), `problem.rs` (the refusals),
//!   `discard.rs` (reading away a refused body).

pub(crate) mod body;
pub(crate) mod capture;
pub(crate) mod config;
pub(crate) mod discard;
pub(crate) mod fingerprint;
pub(crate) mod future;
pub(crate) mod kept;
pub(crate) mod layer;
pub(crate) mod principal;
pub(crate) mod problem;
pub(crate) mod protocol;
pub(crate) mod service;
pub(crate) mod stored;
