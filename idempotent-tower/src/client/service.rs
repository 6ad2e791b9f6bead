//! [`ClientService`]: the service a [`ClientLayer`](super::ClientLayer) wraps around a client,
//! and the flow of one logical call: key, buffered body, attempts, [`Delivery`](super::Delivery).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotent_core::BoxError;
use tower_service::Service;

use super::body::ResendBody;
use super::config::Config;
use super::error::ClientError;
use super::key::IdempotencyKey;
use super::protocol::ClientProtocol;
use crate::protocol::Http;

/// The service a [`ClientLayer`](super::ClientLayer) wraps around a client
/// ([`Layer::layer`](tower_layer::Layer::layer)).
pub struct ClientService<S, P: ClientProtocol = Http> {
    inner: S,
    config: Arc<Config<P>>,
}

impl<S, P: ClientProtocol> ClientService<S, P> {
    /// `inner` behind the client configured by `config`.
    pub(crate) fn new(inner: S, config: Arc<Config<P>>) -> Self {
        ClientService { inner, config }
    }

    /// The wrapped client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, P: ClientProtocol> Clone for ClientService<S, P> {
    fn clone(&self) -> Self {
        ClientService {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug, P: ClientProtocol> fmt::Debug for ClientService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

/// The future of [`ClientService`].
pub type ClientFuture<T> = Pin<Box<dyn Future<Output = Result<T, ClientError>> + Send>>;

impl<S, P, B, RB> Service<Request<B>> for ClientService<S, P>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    P: ClientProtocol,
    B: ResendBody + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = ClientError;
    type Future = ClientFuture<Response<RB>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        // Every attempt waits for a clone of the client to be ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let config = Arc::clone(&self.config);
        Box::pin(call(inner, config, request))
    }
}

/// One attempt on a clone of the client once it is ready.
async fn attempt<S, B, RB>(mut inner: S, request: Request<B>) -> Result<Response<RB>, BoxError>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    inner.call(request).await.map_err(Into::into)
}

async fn call<S, P, B, RB>(
    inner: S,
    config: Arc<Config<P>>,
    request: Request<B>,
) -> Result<Response<RB>, ClientError>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    P: ClientProtocol,
    B: ResendBody,
    B::Error: Into<BoxError>,
{
    if !config.protects(request.method()) {
        return attempt(inner, request)
            .await
            .map_err(ClientError::Unprotected);
    }
    let (mut parts, body) = request.into_parts();
    let chosen = parts.extensions.remove::<IdempotencyKey>();
    let key = config.key(&mut parts.headers, chosen);
    let limit = config.policy.max_request_body;
    let body = match Limited::new(body, limit).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            let error = if error.is::<LengthLimitError>() {
                ClientError::BodyTooLarge { limit }
            } else {
                ClientError::Body(error)
            };
            config.metrics.failed(&error);
            return Err(error);
        }
    };
    let verdict = |response: &Response<RB>| config.verdict(response.status(), response.headers());
    let send = move || {
        let mut request = Request::new(B::from_bytes(body.clone()));
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = parts.uri.clone();
        *request.version_mut() = parts.version;
        *request.headers_mut() = parts.headers.clone();
        *request.extensions_mut() = parts.extensions.clone();
        attempt(inner.clone(), request)
    };
    let delivered = config.deliver(&key, send, verdict).await?;
    let delivery = config.delivery(key, &delivered, delivered.answer.headers());
    let mut response = delivered.answer;
    response.extensions_mut().insert(delivery);
    Ok(response)
}
