//! The layer's settings, shared by every service it wraps, with their defaults and the
//! decisions read from them.

use std::fmt;
use std::sync::Arc;

use http::Method;
use http::header::{self, HeaderName};
use http::request::Parts;
use http_body::Body;
use idempotent_core::capability::{Capabilities, KeysAndSessions, KeysOnly};
use idempotent_core::{CallOptions, Idempotency, Scope};

use super::capture::Captured;
use super::principal::scope_by_principal;
use super::protocol::Protocol;

/// The default request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The header every replayed response carries, with value `true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The header a response carries when the store was down and the request ran without
/// idempotency protection (fail-open mode only), with value `store-unavailable`.
pub const IDEMPOTENT_BYPASSED: HeaderName = HeaderName::from_static("idempotent-bypassed");
/// Default limit on a protected request's body: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1 << 20;

type ScopeFn = dyn Fn(&Parts) -> Option<Scope> + Send + Sync;

/// What the layer does with a request whose claim is lost while its handler runs: the store
/// stalled or was unreachable past the lease, or another owner took the key over. See
/// [`IdempotencyLayer::on_claim_lost`](crate::IdempotencyLayer::on_claim_lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnClaimLost {
    /// Let the handler finish and send its response to its client (the default). Its result
    /// is recorded only if no other owner took the key over meanwhile (the store refuses a
    /// stale token); otherwise retries are answered by the owner that holds the key now. Right
    /// when the handler protects its effect downstream (it passes
    /// [`KeyClaim::operation_key`](idempotent_core::KeyClaim::operation_key) to the
    /// system it calls, or fences the resource with the token): both owners then describe the
    /// same single effect, and cancelling half-way could leave work undone.
    #[default]
    Finish,
    /// Stop the handler (its future is dropped at its next await point) and answer `503`
    /// `claim_lost` with `Retry-After` (gRPC `UNAVAILABLE`): the client retries with the same
    /// key and gets the outcome of the owner that holds the key now. Right when the handler's
    /// effects are not protected downstream and stopping early is safe.
    Cancel,
}

/// Everything a layer is configured with; its services share it behind an `Arc`.
#[derive(Clone)]
pub(crate) struct Config<P: Protocol> {
    /// The runtime, as one of keys (every runtime is).
    pub(crate) keys: Idempotency<KeysOnly>,
    /// The runtime with its sessions, if its store serves them.
    pub(crate) sessions: Option<Idempotency<KeysAndSessions>>,
    pub(crate) header: HeaderName,
    /// The header carrying a client session, or `None` when sessions are not accepted.
    pub(crate) session_header: Option<HeaderName>,
    pub(crate) strict: bool,
    pub(crate) require_key: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) allow_anonymous: bool,
    pub(crate) call_options: CallOptions,
    pub(crate) not_replayed: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) fail_open: bool,
    pub(crate) on_claim_lost: OnClaimLost,
    /// Whether a protected request is kept on its record for a completer, and the version and
    /// owner its kept requests carry (see `kept::owner`).
    pub(crate) keep_requests: Option<super::kept::Keeper>,
    /// What only this protocol has.
    pub(crate) protocol: P::Settings,
}

impl<P: Protocol> Config<P> {
    /// The defaults: key header `Idempotency-Key` (bare tokens accepted) and required, scope
    /// by the [`Principal`](crate::Principal) extension (requests without one refused), the
    /// runtime's call settings (its result limit bounds retained responses), a 1 MiB request
    /// limit, fail closed, let a handler that lost its claim finish, and the protocol's own
    /// defaults.
    pub(crate) fn new<C: Capabilities>(idempotency: &Idempotency<C>) -> Self {
        let sessions = idempotency.sessions();
        Config {
            keys: idempotency.keys(),
            // Read only where the store serves sessions.
            session_header: sessions
                .is_some()
                .then_some(crate::session::IDEMPOTENCY_SESSION),
            sessions,
            header: IDEMPOTENCY_KEY,
            strict: false,
            require_key: true,
            fingerprint_headers: Vec::new(),
            scope: Arc::new(scope_by_principal),
            allow_anonymous: false,
            call_options: CallOptions::new(),
            not_replayed: vec![
                header::CONNECTION,
                HeaderName::from_static("keep-alive"),
                HeaderName::from_static("proxy-connection"),
                header::PROXY_AUTHENTICATE,
                header::PROXY_AUTHORIZATION,
                header::TE,
                header::TRAILER,
                header::TRANSFER_ENCODING,
                header::UPGRADE,
                header::DATE,
                header::SET_COOKIE,
                IDEMPOTENT_REPLAYED,
                IDEMPOTENT_BYPASSED,
            ],
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            fail_open: false,
            on_claim_lost: OnClaimLost::Finish,
            keep_requests: None,
            protocol: P::Settings::default(),
        }
    }

    /// Whether the layer protects a request with this method and path.
    pub(crate) fn protects(&self, method: &Method, path: &str) -> bool {
        P::protects(&self.protocol, method, path)
    }

    /// Whether the outcome policy keeps this response for replay.
    pub(crate) fn retains<B: Body>(&self, captured: &Captured<B>) -> bool {
        P::retains(&self.protocol, captured)
    }

    /// How many bytes past `max_request_body` are read from a refused HTTP/1 request body.
    pub(crate) fn max_discarded_body(&self) -> usize {
        P::max_discarded_body(&self.protocol)
    }

    /// Whether a response header is left out of the stored record (and so of replays).
    pub(crate) fn is_not_replayed(&self, name: &HeaderName) -> bool {
        self.not_replayed.iter().any(|n| n == name)
    }
}

impl<P: Protocol> fmt::Debug for Config<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("idempotency", &self.keys)
            .field("protocol", &self.protocol)
            .field("header", &self.header)
            .field("strict", &self.strict)
            .field("require_key", &self.require_key)
            .field("allow_anonymous", &self.allow_anonymous)
            .field("call_options", &self.call_options)
            .field("max_request_body", &self.max_request_body)
            .field("fail_open", &self.fail_open)
            .field(
                "keep_requests",
                &self.keep_requests.as_ref().map(|keeper| &keeper.version),
            )
            .finish_non_exhaustive()
    }
}
