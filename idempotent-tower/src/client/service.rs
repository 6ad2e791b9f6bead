//! [`ClientService`]: the service a [`ClientLayer`](super::ClientLayer) wraps around a client,
//! and the flow of one logical call: buffered body, key or session number, attempts,
//! [`Delivery`](super::Delivery).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use idempotent_core::BoxError;
use tower_service::Service;

use super::body::{RebuildBody, ResendBody};
use super::config::{Config, MAX_PROBLEM_DOCUMENT};
use super::error::ClientError;
use super::key::IdempotencyKey;
use super::protocol::ClientProtocol;
use super::session::SessionSeq;
use crate::server::body::{Unread, read_within};
use crate::server::protocol::Http;

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
    RB: Body + RebuildBody + Send + 'static,
    RB::Data: Send,
    RB::Error: Into<BoxError>,
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

/// One attempt's answer: as it came or, when it is a `410` problem document in a session,
/// its head and its body, read to learn its `code`.
enum Attempted<RB> {
    Response(Response<RB>),
    Read(http::response::Parts, Bytes),
}

impl<RB> Attempted<RB> {
    fn headers(&self) -> &HeaderMap {
        match self {
            Attempted::Response(response) => response.headers(),
            Attempted::Read(parts, _) => &parts.headers,
        }
    }
}

/// The body of a problem document, read whole; an error (the attempt's) if it fails or is
/// over [`MAX_PROBLEM_DOCUMENT`].
async fn read_document<RB>(body: RB) -> Result<Bytes, BoxError>
where
    RB: Body,
    RB::Error: Into<BoxError>,
{
    let body = std::pin::pin!(body);
    match read_within(body, MAX_PROBLEM_DOCUMENT).await {
        Ok(read) => Ok(read),
        Err(Unread::TooLarge) => {
            Err(format!("the answer's document is over {MAX_PROBLEM_DOCUMENT} bytes").into())
        }
        Err(Unread::Failed(error)) => Err(error),
    }
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
    RB: Body + RebuildBody + 'static,
    RB::Error: Into<BoxError>,
{
    if !config.protects(request.method()) {
        return attempt(inner, request)
            .await
            .map_err(ClientError::Unprotected);
    }
    let (mut parts, body) = request.into_parts();
    let chosen = parts.extensions.remove::<IdempotencyKey>();
    let resend = parts.extensions.remove::<SessionSeq>();
    let limit = config.policy.max_request_body;
    let body = std::pin::pin!(body);
    let body = match read_within(body, limit).await {
        Ok(body) => body,
        Err(unread) => {
            let error = match unread {
                Unread::TooLarge => ClientError::BodyTooLarge { limit },
                Unread::Failed(error) => ClientError::Body(error),
            };
            config.metrics.failed(&error);
            return Err(error);
        }
    };
    // Named once the request can be sent: a session's number is not spent on a request that
    // never leaves.
    let name = config.name(&mut parts.headers, chosen, resend)?;
    let verdict = |answer: &Attempted<RB>| match answer {
        Attempted::Response(response) => {
            config.verdict(&name, response.status(), response.headers())
        }
        Attempted::Read(_, document) => Config::<P>::document_verdict(document),
    };
    let named = &name;
    let send = move || {
        let mut request = Request::new(B::from_bytes(body.clone()));
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = parts.uri.clone();
        *request.version_mut() = parts.version;
        *request.headers_mut() = parts.headers.clone();
        *request.extensions_mut() = parts.extensions.clone();
        named.apply(request.headers_mut());
        let answer = attempt(inner.clone(), request);
        async move {
            let response = answer.await?;
            let small = response.body().size_hint().lower() <= MAX_PROBLEM_DOCUMENT as u64;
            if small && named.reads::<P>(response.status(), response.headers()) {
                let (parts, body) = response.into_parts();
                return Ok(Attempted::Read(parts, read_document(body).await?));
            }
            Ok(Attempted::Response(response))
        }
    };
    let delivered = config.deliver(&name, send, verdict).await;
    let (answer, delivery) = config.conclude(name, delivered, Attempted::headers)?;
    let mut response = match answer {
        Attempted::Response(response) => response,
        Attempted::Read(parts, document) => match RB::rebuild(document.clone()) {
            Some(body) => Response::from_parts(parts, body),
            None => {
                let mut answer = Response::from_parts(parts, document);
                answer.extensions_mut().insert(delivery.clone());
                return Err(ClientError::Gone {
                    seq: delivery.session_seq().unwrap_or_default(),
                    answer: Box::new(answer),
                });
            }
        },
    };
    response.extensions_mut().insert(delivery);
    Ok(response)
}
