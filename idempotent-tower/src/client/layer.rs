//! [`ClientLayer`] and its builder methods: those of every protocol, then those of [`Http`]
//! alone.

use std::fmt;
use std::sync::Arc;

use http::{HeaderName, Method};
use tower_layer::Layer;

use super::config::Config;
use super::policy::RetryPolicy;
use super::protocol::ClientProtocol;
use super::service::ClientService;
use super::session::ClientSession;
use crate::server::protocol::{Grpc, Http};

/// The client-side layer: see the [module docs](super).
///
/// Built for one protocol, [`http`](ClientLayer::http) or [`grpc`](ClientLayer::grpc), like
/// the server's [`IdempotencyLayer`](crate::IdempotencyLayer), and configured with consuming
/// builder methods. An option only HTTP has is not a method of a gRPC layer:
///
/// ```compile_fail
/// use http::Method;
/// use idempotent_tower::client::ClientLayer;
///
/// // error: no method `methods` on `ClientLayer<Grpc>`
/// let layer = ClientLayer::grpc().methods([Method::PUT]);
/// ```
pub struct ClientLayer<P: ClientProtocol = Http> {
    pub(crate) config: Arc<Config<P>>,
}

impl ClientLayer<Http> {
    /// For HTTP: POST and PATCH requests get a key and are retried; others pass through.
    pub fn http() -> Self {
        ClientLayer::with_defaults()
    }

    /// The HTTP methods that get a key and retries (default POST and PATCH).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().protocol.methods = methods.into_iter().collect();
        self
    }
}

impl ClientLayer<Grpc> {
    /// For gRPC: every call gets a key and is retried (gRPC calls are POSTs). Meant for unary
    /// calls: a streamed request is buffered whole, and an answer whose status arrives in
    /// trailers (after messages) is not retried.
    pub fn grpc() -> Self {
        ClientLayer::with_defaults()
    }
}

impl<P: ClientProtocol> ClientLayer<P> {
    fn with_defaults() -> Self {
        ClientLayer {
            config: Arc::new(Config::new()),
        }
    }

    fn config(&mut self) -> &mut Config<P> {
        Arc::make_mut(&mut self.config)
    }

    /// The retry policy (default [`RetryPolicy::default`]).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.config().policy = policy;
        self
    }

    /// The header carrying the key (default `Idempotency-Key`), to match a server configured
    /// with another.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header = name;
        self
    }

    /// Sends every protected request in `session` (HTTP: the `Idempotency-Session` header;
    /// gRPC: the `idempotency-session` metadata entry) instead of with a key of its own: see
    /// the [module docs](super)'s "Sessions". Every clone of the layer, and every service
    /// built with it, shares the session.
    pub fn session(mut self, session: ClientSession) -> Self {
        self.config().session = Some(session);
        self
    }
}

impl<S, P: ClientProtocol> Layer<S> for ClientLayer<P> {
    type Service = ClientService<S, P>;

    fn layer(&self, inner: S) -> ClientService<S, P> {
        ClientService::new(inner, Arc::clone(&self.config))
    }
}

impl<P: ClientProtocol> Clone for ClientLayer<P> {
    fn clone(&self) -> Self {
        ClientLayer {
            config: Arc::clone(&self.config),
        }
    }
}

impl<P: ClientProtocol> fmt::Debug for ClientLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}
