//! [`IdempotencyLayer`] and its configuration.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName};
use http::request::Parts;
use http::{Method, StatusCode};
use idempotent_core::{Idempotency, InFlightPolicy, Scope, limits};
use tower_layer::Layer;

use crate::service::IdempotencyService;

/// The default request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The header every replayed response carries, with value `true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The header a response carries when the store was down and the request ran without
/// idempotency protection (fail-open mode only), with value `store-unavailable`.
pub const IDEMPOTENT_BYPASSED: HeaderName = HeaderName::from_static("idempotent-bypassed");
/// Default limit on a protected request's body: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1 << 20;
/// Default limit on a response retained for replay: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1 << 20;

type ScopeFn = dyn Fn(&Parts) -> Option<Scope> + Send + Sync;
type RetainFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type GrpcRetainFn = dyn Fn(u8) -> bool + Send + Sync;

/// Which protocol the layer speaks: how it answers problems and classifies outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    Grpc,
}

/// Applies idempotency to requests: see the [crate docs](crate) for the semantics and every
/// response it produces.
///
/// Configured with consuming builder methods:
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::{Idempotency, InFlightPolicy, MemoryStore};
/// use idempotent_tower::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
///     .ttl(Duration::from_secs(24 * 3600))
///     .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(10) })
///     .max_request_body(256 * 1024);
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) idempotency: Idempotency,
    pub(crate) protocol: Protocol,
    pub(crate) grpc_methods: Vec<String>,
    pub(crate) grpc_retain: Arc<GrpcRetainFn>,
    pub(crate) header: HeaderName,
    pub(crate) strict: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) allow_anonymous: bool,
    pub(crate) retain: Arc<RetainFn>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) lease: Option<Duration>,
    pub(crate) in_flight: Option<InFlightPolicy>,
    pub(crate) not_replayed: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) max_discarded_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) fail_open: bool,
    pub(crate) on_claim_lost: OnClaimLost,
}

/// What the layer does with a request whose claim is lost while its handler runs: the store
/// stalled or was unreachable past the lease, or another owner took the key over. See
/// [`IdempotencyLayer::on_claim_lost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnClaimLost {
    /// Let the handler finish and send its response to its client (the default). Its result
    /// is recorded only if no other owner took the key over meanwhile (the store refuses a
    /// stale token); otherwise retries are answered by the owner that holds the key now. Right when the handler protects its effect downstream (it
    /// passes [`ClaimHandle::operation_key`](idempotent_core::ClaimHandle::operation_key) to
    /// the system it calls, or fences the resource with the token): both owners then describe
    /// the same single effect, and cancelling half-way could leave work undone.
    #[default]
    Finish,
    /// Stop the handler (its future is dropped at its next await point) and answer `503`
    /// `claim_lost` with `Retry-After` (gRPC `UNAVAILABLE`): the client retries with the same
    /// key and gets the outcome of the owner that holds the key now. Right when the handler's
    /// effects are not protected downstream and stopping early is safe.
    Cancel,
}

/// The default outcome policy: keep 2xx, 3xx and deterministic 4xx; release 5xx and the 4xx
/// that mean "try again" (408, 409, 425, 429).
pub fn default_retain(status: StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 425 | 429 => false,
        200..=499 => true,
        _ => false,
    }
}

/// The default gRPC outcome policy: keep OK and the deterministic failures (INVALID_ARGUMENT,
/// NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION, OUT_OF_RANGE,
/// UNAUTHENTICATED); release everything else (UNAVAILABLE, INTERNAL, UNKNOWN,
/// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, CANCELLED, UNIMPLEMENTED, DATA_LOSS), so
/// the retry runs again.
pub fn default_grpc_retain(code: u8) -> bool {
    matches!(code, 0 | 3 | 5 | 6 | 7 | 9 | 11 | 16)
}

/// The authenticated principal of a request, as the application's authentication middleware
/// establishes it: the default scope of every protected request.
///
/// Put the middleware outside (before) [`IdempotencyLayer`] and have it insert a `Principal`
/// into the request's extensions once it has verified the credential (a session cookie, a
/// bearer token, an mTLS certificate, an API key). Keys are then per principal: two users
/// sending the same key never see each other's responses, and a client whose token is
/// refreshed between two attempts keeps its key (the principal, unlike the credential, does
/// not change).
///
/// ```
/// use http::Request;
/// use idempotent_tower::Principal;
///
/// let mut request = Request::new(());
/// // in the authentication middleware, after verifying the session:
/// request.extensions_mut().insert(Principal::new("user-4711").tenant("acme"));
/// ```
///
/// With tonic the same extension works: a tower layer in front of the server inserts it into
/// the `http::Request`, and handlers read it with `request.extensions()`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal {
    tenant: Option<Box<[u8]>>,
    id: Box<[u8]>,
}

impl Principal {
    /// The principal with this stable identifier (a user or account id, not a credential).
    pub fn new(id: impl AsRef<[u8]>) -> Self {
        Principal {
            tenant: None,
            id: id.as_ref().into(),
        }
    }

    /// The tenant the principal acts for, when ids are only unique within a tenant.
    pub fn tenant(mut self, tenant: impl AsRef<[u8]>) -> Self {
        self.tenant = Some(tenant.as_ref().into());
        self
    }

    /// The identifier.
    pub fn id(&self) -> &[u8] {
        &self.id
    }

    /// The scope of this principal's keys.
    pub fn scope(&self) -> Scope {
        let scope = Scope::new().principal(&self.id);
        match &self.tenant {
            Some(tenant) => scope.tenant(tenant),
            None => scope,
        }
    }
}

/// The default scope: the [`Principal`] in the request's extensions, or none (the request is
/// refused with `403 missing_scope` unless the layer
/// [allows anonymous requests](IdempotencyLayer::allow_anonymous)).
pub fn scope_by_principal(parts: &Parts) -> Option<Scope> {
    parts.extensions.get::<Principal>().map(Principal::scope)
}

/// A scope from a digest of the `Authorization` header, or none without one.
///
/// Only right when the credential *is* the identity and never changes, such as a static API
/// key: a bearer token that is refreshed between two attempts of one operation puts the retry
/// in a new scope, where it runs again. Prefer [`scope_by_principal`].
pub fn scope_by_authorization(parts: &Parts) -> Option<Scope> {
    let value = parts.headers.get(header::AUTHORIZATION)?;
    let digest = blake3::derive_key("idempotent-tower authorization scope v1", value.as_bytes());
    Some(Scope::new().principal(digest))
}

impl Config {
    pub(crate) fn protects(&self, method: &Method, path: &str) -> bool {
        match self.protocol {
            Protocol::Http => self.methods.iter().any(|m| m == method),
            Protocol::Grpc => method == Method::POST && self.grpc_methods.iter().any(|m| m == path),
        }
    }

    /// Whether a response header is left out of the stored record (and so of replays).
    pub(crate) fn is_not_replayed(&self, name: &HeaderName) -> bool {
        self.not_replayed.iter().any(|n| n == name)
    }
}

impl IdempotencyLayer {
    /// A layer over `idempotency` with the defaults: key header `Idempotency-Key` (bare tokens
    /// accepted), required on POST and PATCH, scope by the [`Principal`] extension (requests
    /// without one refused), 1 MiB request and response limits, reject in-flight duplicates
    /// with 409, fail closed.
    pub fn new(idempotency: Idempotency) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                idempotency,
                protocol: Protocol::Http,
                grpc_methods: Vec::new(),
                grpc_retain: Arc::new(default_grpc_retain),
                header: IDEMPOTENCY_KEY,
                strict: false,
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                fingerprint_headers: Vec::new(),
                scope: Arc::new(scope_by_principal),
                allow_anonymous: false,
                retain: Arc::new(default_retain),
                ttl: None,
                lease: None,
                in_flight: None,
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
                max_discarded_body: crate::discard::DEFAULT_MAX_DISCARDED_BODY,
                max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                fail_open: false,
                on_claim_lost: OnClaimLost::Finish,
            }),
        }
    }

    /// What to do when a request's claim is lost while its handler runs (default
    /// [`OnClaimLost::Finish`]). Either way the handler can watch the loss itself through the
    /// [`ClaimHandle`](idempotent_core::ClaimHandle) request extension.
    pub fn on_claim_lost(mut self, policy: OnClaimLost) -> Self {
        self.config().on_claim_lost = policy;
        self
    }

    /// A layer for a gRPC server (tonic), protecting the unary methods named with
    /// [`grpc_methods`](Self::grpc_methods); every other call, streaming ones included, passes
    /// through untouched.
    ///
    /// The key comes from the `idempotency-key` metadata entry (the same header), the scope from
    /// the [`Principal`] in the request extensions (as over HTTP). Problems are answered as gRPC statuses (`INVALID_ARGUMENT`,
    /// `FAILED_PRECONDITION`, `ABORTED` with `grpc-retry-pushback-ms`, `RESOURCE_EXHAUSTED`,
    /// `UNAVAILABLE`, …) with the stable code in the `idempotent-error` metadata entry; outcomes
    /// are classified by `grpc-status` ([`default_grpc_retain`]). See the crate docs.
    pub fn grpc(idempotency: Idempotency) -> Self {
        let mut layer = Self::new(idempotency);
        layer.config().protocol = Protocol::Grpc;
        layer
    }

    /// The full paths of the unary gRPC methods to protect, such as
    /// `/payments.v1.Payments/Charge` (only with [`grpc`](Self::grpc)).
    pub fn grpc_methods<I, P>(mut self, paths: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.config().grpc_methods = paths.into_iter().map(Into::into).collect();
        self
    }

    /// Which `grpc-status` codes are stored for replay (default [`default_grpc_retain`]); a
    /// code for which it returns false releases the key, so the retry runs again.
    pub fn grpc_retain(mut self, retain: impl Fn(u8) -> bool + Send + Sync + 'static) -> Self {
        self.config().grpc_retain = Arc::new(retain);
        self
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The request header carrying the key (default `Idempotency-Key`).
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header = name;
        self
    }

    /// Refuses keys that are not quoted RFC 8941 strings (default: bare keys are accepted as
    /// the same key; a bare key containing `;` is refused either way, since `abc;x` would
    /// otherwise read as the key `abc` with a parameter).
    pub fn strict(mut self, strict: bool) -> Self {
        self.config().strict = strict;
        self
    }

    /// The methods the layer protects (default POST and PATCH). Other methods pass through
    /// untouched, key or not.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().methods = methods.into_iter().collect();
        self
    }

    /// Whether a protected request without a key is refused with 400 (default `true`) or
    /// passes through unprotected (`false`).
    pub fn require_key(mut self, required: bool) -> Self {
        self.config().require_key = required;
        self
    }

    /// Request headers that are part of the fingerprint besides method, path, query and body
    /// (default none).
    pub fn fingerprint_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config().fingerprint_headers = names.into_iter().collect();
        self
    }

    /// Who a key belongs to (default [`scope_by_principal`]). The function sees the
    /// request's parts, extensions included, so it can use what an authentication layer
    /// placed there — put that layer outside (before) this one. `None` means the request has
    /// no scope: it is refused with `403 missing_scope` (gRPC `PERMISSION_DENIED`) before the
    /// handler runs, unless anonymous requests are [allowed](Self::allow_anonymous).
    pub fn scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    ) -> Self {
        self.config().scope = Arc::new(scope);
        self
    }

    /// Whether protected requests without a scope are run in one shared anonymous scope
    /// (default `false`: refused with `403 missing_scope`).
    ///
    /// Every anonymous caller shares that key space: one caller sending another's key with
    /// the same body receives the other's stored response, and can probe which keys exist.
    /// Allow it only where requests carry no identity at all and keys are unguessable.
    pub fn allow_anonymous(mut self, allow: bool) -> Self {
        self.config().allow_anonymous = allow;
        self
    }

    /// Which response statuses are stored for replay (default [`default_retain`]). A status
    /// for which it returns false releases the key: the next retry runs the handler again.
    pub fn retain(mut self, retain: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.config().retain = Arc::new(retain);
        self
    }

    /// How long responses are replayed (default: the runtime's TTL).
    ///
    /// # Panics
    ///
    /// If `ttl` is outside [`limits::MIN_TTL`] to [`limits::MAX_TTL`] (1 ms to 365 days), with
    /// the message of [`limits::check_ttl`], which checks a value read from outside the
    /// program without panicking.
    #[track_caller]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        let ttl = match limits::check_ttl(ttl) {
            Ok(ttl) => ttl,
            Err(error) => panic!("{error}"),
        };
        self.config().ttl = Some(ttl);
        self
    }

    /// The lease of an in-flight request (default: the runtime's lease).
    ///
    /// # Panics
    ///
    /// If `lease` is outside [`limits::MIN_LEASE`] to [`limits::MAX_LEASE`] (100 ms to 365
    /// days), with the message of [`limits::check_lease`], which checks a value read from
    /// outside the program without panicking.
    #[track_caller]
    pub fn lease(mut self, lease: Duration) -> Self {
        let lease = match limits::check_lease(lease) {
            Ok(lease) => lease,
            Err(error) => panic!("{error}"),
        };
        self.config().lease = Some(lease);
        self
    }

    /// What a duplicate arriving while the first is in flight gets (default: the runtime's
    /// policy, which defaults to 409 at once). Every [`InFlightPolicy::Wait`] `max` is
    /// accepted: [`Duration::MAX`] waits for as long as the first request holds its key.
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.config().in_flight = Some(policy);
        self
    }

    /// Also leaves `name` out of stored responses and replays.
    pub fn exclude_header(mut self, name: HeaderName) -> Self {
        self.config().not_replayed.push(name);
        self
    }

    /// Stores and replays `name` even though it is excluded by default (e.g. `Set-Cookie`).
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.config().not_replayed.retain(|n| *n != name);
        self
    }

    /// The largest protected request body (default [`DEFAULT_MAX_REQUEST_BODY`]); larger ones
    /// get 413 `request_too_large` before the handler runs, whether the body declares its
    /// length (`Content-Length`) or goes over the limit while it is read (chunked).
    ///
    /// Over HTTP/1.1 the layer reads and throws away the rest of a refused body before it
    /// answers, up to [`max_discarded_body`](Self::max_discarded_body) bytes past the limit: a
    /// client still sending its body then reads the 413 instead of a connection reset, and the
    /// connection stays open for its next request. A longer body is answered with
    /// `Connection: close` as soon as it is known to be longer: at once when its declared
    /// length says so (nothing of it is read), after the limit and the allowance when it is
    /// chunked. A client still sending such a body may see the connection reset before it
    /// reads the answer. A request with `Expect: 100-continue` is answered at once with
    /// `Connection: close`: its client waits for `100 Continue` before sending the body, and
    /// gets the 413 instead. Over HTTP/2, and so for gRPC, a refusal ends only the request's
    /// stream: nothing more of the body is read, and the connection carries on.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// How many bytes past [`max_request_body`](Self::max_request_body) the layer reads and
    /// throws away from a refused HTTP/1.1 request body so that its client can read the 413
    /// (default 4 MiB, so bodies up to 5 MiB with the default limit). With `0`, every body
    /// declared over the limit is answered at once, with `Connection: close`.
    ///
    /// Reading costs bandwidth and time, not memory: the bytes are dropped as they arrive, and
    /// the bound (give or take one read from the connection) keeps a client from making the
    /// server read without end, and the reading stops after 10 seconds (the answer then
    /// closes the connection), so a client that stalls half-way cannot hold it open.
    pub fn max_discarded_body(mut self, bytes: usize) -> Self {
        self.config().max_discarded_body = bytes;
        self
    }

    /// The largest response body retained for replay (default
    /// [`DEFAULT_MAX_RESPONSE_BODY`]). A larger response still streams to the client, and the
    /// key is recorded so that a retry gets 410 `result_not_retained` instead of a second
    /// execution. This is the only limit on what the layer retains: the runtime's
    /// [`max_result_bytes`](idempotent_core::IdempotencyBuilder::max_result_bytes) does not
    /// apply to requests behind the layer, so every body up to this size is replayed (the
    /// stored record adds the status, headers and trailers to it).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config().max_response_body = bytes;
        self
    }

    /// When the store is unavailable, run requests unprotected instead of answering 503
    /// (default `false`: fail closed). Each such response carries
    /// `Idempotent-Bypassed: store-unavailable` and a warning is logged.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config().fail_open = fail_open;
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.config))
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("idempotency", &self.idempotency)
            .field("protocol", &self.protocol)
            .field("grpc_methods", &self.grpc_methods)
            .field("header", &self.header)
            .field("strict", &self.strict)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("allow_anonymous", &self.allow_anonymous)
            .field("max_request_body", &self.max_request_body)
            .field("max_discarded_body", &self.max_discarded_body)
            .field("max_response_body", &self.max_response_body)
            .field("fail_open", &self.fail_open)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_grpc_policy_stores_deterministic_codes_and_releases_transient_ones() {
        let stored = [0, 3, 5, 6, 7, 9, 11, 16];
        let released = [1, 2, 4, 8, 10, 12, 13, 14, 15];
        for code in stored {
            assert!(default_grpc_retain(code), "code {code} should be stored");
        }
        for code in released {
            assert!(!default_grpc_retain(code), "code {code} should be released");
        }
    }

    #[test]
    fn default_http_policy_releases_server_errors_and_retryable_client_errors() {
        for status in [200, 201, 204, 301, 400, 402, 404, 422] {
            assert!(
                default_retain(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
        for status in [408, 409, 425, 429, 500, 502, 503] {
            assert!(
                !default_retain(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }

    #[test]
    fn grpc_mode_protects_only_the_listed_paths_over_post() {
        let layer = IdempotencyLayer::grpc(Idempotency::new(idempotent_core::MemoryStore::new()))
            .grpc_methods(["/p.v1.S/Charge"]);
        assert!(layer.config.protects(&Method::POST, "/p.v1.S/Charge"));
        assert!(!layer.config.protects(&Method::POST, "/p.v1.S/Stream"));
        assert!(!layer.config.protects(&Method::GET, "/p.v1.S/Charge"));
        let http = IdempotencyLayer::new(Idempotency::new(idempotent_core::MemoryStore::new()));
        assert!(http.config.protects(&Method::PATCH, "/anything"));
        assert!(!http.config.protects(&Method::GET, "/anything"));
    }
}
