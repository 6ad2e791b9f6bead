//! The peer crates in front of the same handler, each on its in-memory store, configured as
//! their documentation shows for an `Idempotency-Key` API.

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, Session, SessionLayer};
use tower_cookies::CookieManagerLayer;

use crate::fixture::{SESSION, Tally, payments};

const DAY_SECS: i64 = 24 * 3600;

/// `idempotent` 2.0: `middleware::IdempotencyLayer` over `memory::MemoryStore` (an actor task
/// behind a channel), keys required, default leases (60 s processing, 24 h completed), default
/// xxHash3 fingerprint of method, path, query and body. Must be called inside a runtime.
pub(crate) fn idempotent2() -> Result<Router<Arc<Tally>>, String> {
    let store = idempotent::memory::MemoryStore::builder()
        .try_build()
        .map_err(|e| format!("idempotent 2.0 memory store: {e}"))?;
    let layer = idempotent::middleware::IdempotencyLayer::new(store).require_key(true);
    Ok(payments().route_layer(layer))
}

/// `axum-idempotent` 0.6 in its "direct key" mode (the `Idempotency-Key` header is the cache
/// key, required), responses kept 24 h, on a `ruts` session in `MokaStore` — the crate keeps
/// its records in the caller's session, so it needs `SessionLayer` and `CookieManagerLayer`
/// outside it and a client that already has a session (opened with `POST /session`).
pub(crate) fn axum_idempotent() -> Router<Arc<Tally>> {
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), true)
        .expire_after(DAY_SECS);
    let sessions = SessionLayer::new(Arc::new(MokaStore::builder().build()))
        .with_cookie_options(CookieOptions::build().name("session").path("/"));
    payments()
        .route_layer(IdempotentLayer::<MokaStore>::new(options))
        .route(SESSION, post(open_session))
        .layer(sessions)
        .layer(CookieManagerLayer::new())
}

/// Opens a session for the client: its cookie comes back in `Set-Cookie`.
async fn open_session(session: Session<MokaStore>) -> StatusCode {
    let ttl = Ttl::new(DAY_SECS).expect("a day is a valid TTL");
    match session.set("client", &true, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}
