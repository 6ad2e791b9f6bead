//! [`IdempotencyLayer`] and its builder methods: those of every protocol, then those of
//! [`Http`] and of [`Grpc`] alone.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};
use idempotent_core::capability::{Capabilities, Full, KeepsCheckpoints, ServesSessions};
use idempotent_core::{CallOptions, GrpcCode, Idempotency, Retain, Scope};
use tower_layer::Layer;

use super::config::{Config, OnClaimLost};
use super::protocol::{Grpc, Http, Protocol};
use super::service::IdempotencyService;

/// Applies idempotency to requests: the server layer, for HTTP
/// ([`http`](IdempotencyLayer::http)) and gRPC ([`grpc`](IdempotencyLayer::grpc)). What it
/// does with each request and every response it produces are below.
///
#[doc = include_str!("../../docs/tower-server.md")]
///
/// # Building a layer
///
/// Built for one protocol, [`http`](IdempotencyLayer::http) or
/// [`grpc`](IdempotencyLayer::grpc), and configured with consuming builder methods:
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::{CallOptions, Idempotency, InFlightPolicy};
/// use idempotent_tower::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::http(Idempotency::new(MemoryStore::new()))
///     .call_options(
///         CallOptions::new()
///             .ttl(Duration::from_secs(24 * 3600))
///             .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(10) }),
///     )
///     .max_request_body(256 * 1024);
/// ```
///
/// An option only HTTP has is not a method of a gRPC layer:
///
/// ```compile_fail
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::Idempotency;
/// use idempotent_tower::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
///     .max_discarded_body(0); // error: no method `max_discarded_body` on `IdempotencyLayer<Grpc>`
/// ```
///
/// nor is an HTTP outcome policy:
///
/// ```compile_fail
/// use http::StatusCode;
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::{Idempotency, Retain};
/// use idempotent_tower::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
///     .retain(|status: StatusCode| Retain::Keep); // error: a gRPC policy takes a `GrpcCode`
/// ```
///
/// The layer's type carries its runtime's [capabilities](idempotent_core::capability):
/// [`keep_requests`](Self::keep_requests) (and so a [`Completer`](crate::Completer)) needs a
/// store that keeps checkpoints, [`sessions`](Self::sessions) one that serves sessions. Over a
/// store of keys only, those do not compile and the session header is not read:
///
/// ```compile_fail
/// use idempotent_core::conformance::KeysOnlyStore;
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::Idempotency;
/// use idempotent_tower::IdempotencyLayer;
///
/// let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
/// let version: idempotent_tower::CodeVersion = "1.4.2".parse().unwrap();
/// let layer = IdempotencyLayer::http(keys).keep_requests(version); // error: no checkpoints
/// ```
pub struct IdempotencyLayer<P: Protocol = Http, C = Full> {
    pub(crate) config: Arc<Config<P>>,
    pub(crate) runtime: Idempotency<C>,
}

impl<C: Capabilities> IdempotencyLayer<Http, C> {
    /// A layer for plain HTTP over `idempotency`, with the defaults: key header
    /// `Idempotency-Key` (bare tokens accepted), required on POST and PATCH, scope by the
    /// [`Principal`](crate::Principal) extension (requests without one refused), a 1 MiB
    /// request limit, the runtime's TTL, lease, in-flight policy and result limit, outcomes
    /// kept by [`Http::default_retain`], fail closed.
    pub fn http(idempotency: Idempotency<C>) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config::new(&idempotency)),
            runtime: idempotency,
        }
    }

    /// The methods the layer protects (default POST and PATCH). Other methods pass through
    /// untouched, key or not.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().protocol.methods = methods.into_iter().collect();
        self
    }

    /// Which response statuses are stored for replay (default [`Http::default_retain`]). A
    /// status for which it returns [`Retain::Release`] releases the key: the next retry runs
    /// the handler again.
    pub fn retain(mut self, retain: impl Fn(StatusCode) -> Retain + Send + Sync + 'static) -> Self {
        self.config().protocol.retain = Arc::new(retain);
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
        self.config().protocol.max_discarded_body = bytes;
        self
    }
}

impl<C: KeepsCheckpoints> IdempotencyLayer<Http, C> {
    /// Keeps every protected request with a key (method, URI, headers but `Authorization`,
    /// `Proxy-Authorization` and `Cookie`, and the body, which the request limit bounds) on its
    /// in-flight record, with `version`, the version of the code that serves it, so that a
    /// [`Completer`](crate::Completer) that runs this version can finish the operation if its
    /// client never retries (default: requests are not kept). Costs one store write per
    /// protected request that runs its handler; the record drops the request when it
    /// completes. Requests in a client session are not kept.
    ///
    /// The version is what makes a deploy safe: a completer runs only the requests of the
    /// [versions](crate::Completer::versions) it is told it can run (by default, the one its
    /// layer keeps), so an instance of a new release never runs a request an old release
    /// kept, whose body or steps it may read differently, and the old release's instances
    /// still finish their own. Give each release its own version (its crate version, a build
    /// number, a commit id); two releases that keep the same version are one version to every
    /// completer. A client's own retry resumes the operation whatever its version, as
    /// without a completer.
    ///
    /// The request is kept before the handler runs. If that write fails, the handler does not
    /// run, the claim is released and the client gets the store's failure (`503
    /// store_unavailable`, or `store_capacity`), counted under that outcome; its retry runs
    /// the request.
    ///
    /// ```
    /// use idempotent_core::Idempotency;
    /// use idempotent_core::memory::MemoryStore;
    /// use idempotent_tower::{CodeVersion, IdempotencyLayer};
    ///
    /// # fn main() -> Result<(), idempotent_tower::InvalidCodeVersion> {
    /// let version = CodeVersion::new(env!("CARGO_PKG_VERSION"))?;
    /// let layer = IdempotencyLayer::http(Idempotency::new(MemoryStore::new())).keep_requests(version);
    /// # Ok(())
    /// # }
    /// ```
    pub fn keep_requests(mut self, version: crate::CodeVersion) -> Self {
        let keeper = super::kept::Keeper::new(&self.config.keys, version);
        self.config().keep_requests = Some(keeper);
        self
    }
}

impl<C: Capabilities> IdempotencyLayer<Grpc, C> {
    /// A layer for a gRPC server (tonic), protecting the unary methods named with its
    /// `methods` (below); every other call, streaming ones included, passes through
    /// untouched. The other defaults are those of [`http`](IdempotencyLayer::http), and
    /// outcomes are kept by [`Grpc::default_retain`].
    ///
    /// The key comes from the `idempotency-key` metadata entry (the same header), the scope
    /// from the [`Principal`](crate::Principal) in the request extensions (as over HTTP).
    /// Problems are answered as gRPC statuses (`INVALID_ARGUMENT`, `FAILED_PRECONDITION`,
    /// `ABORTED` with `grpc-retry-pushback-ms`, `RESOURCE_EXHAUSTED`, `UNAVAILABLE`, …) with
    /// the stable code in the `idempotent-error` metadata entry; outcomes are classified by
    /// `grpc-status`. See [gRPC (tonic)](IdempotencyLayer#grpc-tonic).
    pub fn grpc(idempotency: Idempotency<C>) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config::new(&idempotency)),
            runtime: idempotency,
        }
    }

    /// The full paths of the unary gRPC methods to protect, such as
    /// `/payments.v1.Payments/Charge` (default none).
    pub fn methods(mut self, paths: impl IntoIterator<Item: Into<String>>) -> Self {
        self.config().protocol.methods = paths.into_iter().map(Into::into).collect();
        self
    }

    /// Which `grpc-status` codes are stored for replay (default [`Grpc::default_retain`]); a
    /// code for which it returns [`Retain::Release`] releases the key, so the retry runs
    /// again.
    pub fn retain(mut self, retain: impl Fn(GrpcCode) -> Retain + Send + Sync + 'static) -> Self {
        self.config().protocol.retain = Arc::new(retain);
        self
    }
}

impl<P: Protocol, C: ServesSessions> IdempotencyLayer<P, C> {
    /// The request header carrying a [client session](crate::SessionHeader) (default
    /// `Idempotency-Session`; the gRPC layer reads the `idempotency-session` metadata entry).
    pub fn session_header_name(mut self, name: HeaderName) -> Self {
        self.config().session_header = Some(name);
        self
    }

    /// Whether requests may name a [client session](crate::SessionHeader) instead of a key
    /// (default `true`). With `false`, the session header is not read: a request with only a
    /// session is a request without a key.
    pub fn sessions(mut self, accept: bool) -> Self {
        let config = self.config();
        config.session_header = match (accept, config.session_header.take()) {
            (true, None) => Some(crate::session::IDEMPOTENCY_SESSION),
            (true, Some(name)) => Some(name),
            (false, _) => None,
        };
        self
    }
}

impl<P: Protocol, C: Capabilities> IdempotencyLayer<P, C> {
    fn config(&mut self) -> &mut Config<P> {
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

    /// Who a key belongs to (default [`scope_by_principal`](crate::scope_by_principal)). The
    /// function sees the request's parts, extensions included, so it can use what an
    /// authentication layer placed there — put that layer outside (before) this one. `None`
    /// means the request has no scope: it is refused with `403 missing_scope` (gRPC
    /// `PERMISSION_DENIED`) before the handler runs, unless anonymous requests are
    /// [allowed](Self::allow_anonymous).
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

    /// The TTL, lease, in-flight policy and result limit of every protected request, over the
    /// runtime's [`Defaults`](idempotent_core::Defaults) (default: none set, so the runtime's
    /// apply). Durations are checked where the options are built (see [`CallOptions`]).
    ///
    /// The result limit ([`CallOptions::max_result_bytes`], else the runtime's
    /// [`Defaults::max_result_bytes`](idempotent_core::Defaults::max_result_bytes), 1 MiB by
    /// default) is the largest response body retained for replay. A larger response still
    /// streams to the client, and the key is recorded so that a retry gets 410
    /// `result_not_retained` instead of a second execution. Every body up to the limit is
    /// replayed: the stored record adds the status, headers and trailers to it.
    ///
    /// ```
    /// use idempotent_core::memory::MemoryStore;
    /// use idempotent_core::{CallOptions, Idempotency};
    /// use idempotent_tower::IdempotencyLayer;
    ///
    /// // Responses up to 64 KiB are kept for replay behind this layer.
    /// let layer = IdempotencyLayer::http(Idempotency::new(MemoryStore::new()))
    ///     .call_options(CallOptions::new().max_result_bytes(64 * 1024));
    /// ```
    pub fn call_options(mut self, options: CallOptions) -> Self {
        self.config().call_options = options;
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

    /// The largest protected request body (default
    /// [`DEFAULT_MAX_REQUEST_BODY`](crate::DEFAULT_MAX_REQUEST_BODY)); larger ones get 413
    /// `request_too_large` before the handler runs, whether the body declares its length
    /// (`Content-Length`) or goes over the limit while it is read (chunked).
    ///
    /// Over HTTP/1.1 the layer reads and throws away the rest of a refused body before it
    /// answers, up to [`max_discarded_body`](IdempotencyLayer::max_discarded_body) bytes past
    /// the limit: a client still sending its body then reads the 413 instead of a connection
    /// reset, and the connection stays open for its next request. A longer body is answered
    /// with `Connection: close` as soon as it is known to be longer: at once when its declared
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

    /// When the store is unavailable, run requests unprotected instead of answering 503
    /// (default `false`: fail closed). Each such response carries
    /// `Idempotent-Bypassed: store-unavailable` and a warning is logged.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config().fail_open = fail_open;
        self
    }

    /// What to do when a request's claim is lost while its handler runs (default
    /// [`OnClaimLost::Finish`]). Either way the handler can watch the loss itself through the
    /// [`ClaimHandle`](idempotent_core::ClaimHandle) request extension.
    pub fn on_claim_lost(mut self, policy: OnClaimLost) -> Self {
        self.config().on_claim_lost = policy;
        self
    }
}

impl<S, P: Protocol, C> Layer<S> for IdempotencyLayer<P, C> {
    type Service = IdempotencyService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.config))
    }
}

impl<P: Protocol, C> Clone for IdempotencyLayer<P, C> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: Arc::clone(&self.config),
            runtime: self.runtime.clone(),
        }
    }
}

impl<P: Protocol, C> fmt::Debug for IdempotencyLayer<P, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use idempotent_core::memory::MemoryStore;

    use super::*;

    #[test]
    fn a_grpc_layer_protects_only_the_listed_paths_over_post() {
        let layer = IdempotencyLayer::grpc(Idempotency::new(MemoryStore::new()))
            .methods(["/p.v1.S/Charge"]);
        assert!(layer.config.protects(&Method::POST, "/p.v1.S/Charge"));
        assert!(!layer.config.protects(&Method::POST, "/p.v1.S/Stream"));
        assert!(!layer.config.protects(&Method::GET, "/p.v1.S/Charge"));
        let http = IdempotencyLayer::http(Idempotency::new(MemoryStore::new()));
        assert!(http.config.protects(&Method::PATCH, "/anything"));
        assert!(!http.config.protects(&Method::GET, "/anything"));
    }
}
