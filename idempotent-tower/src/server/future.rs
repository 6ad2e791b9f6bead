//! [`ResponseFuture`]: the future returned by [`IdempotencyService`](crate::IdempotencyService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use http_body::Body;
use idempotent_core::RunToEnd;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

type Output<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService).
    ///
    /// Dropping it does not stop a protected request: if the client goes away before the
    /// response is ready, the rest of the request (the handler and the recording of its
    /// response) moves to a task of its own and runs to completion, so a retry gets the replay
    /// ([`RunToEnd`]). Without a tokio runtime, or while a panic unwinds, it is dropped
    /// instead: its claim is released (or ends with its lease) and the retry runs it.
    pub struct ResponseFuture<F, B, E>
    where
        B: Body,
        B: 'static,
        E: 'static,
    {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E>
    where
        B: Body,
        B: 'static,
        E: 'static,
    {
        PassThrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        // Polled in place, which costs nothing extra when the client waits for its response;
        // only an abandoned request pays for a task of its own.
        Protected { #[pin] request: RunToEnd<Output<B, E>> },
    }
}

impl<F, B: Body + 'static, E: 'static> ResponseFuture<F, B, E> {
    pub(crate) fn pass_through(future: F) -> Self {
        ResponseFuture {
            kind: Kind::PassThrough { future },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> ResponseFuture<F, B, E>
where
    B: Body + Send + 'static,
    E: Send + 'static,
{
    pub(crate) fn protected(request: impl Future<Output = Output<B, E>> + Send + 'static) -> Self {
        Self::protected_with(|| request)
    }

    /// A protected request whose future `make` returns is made for its box (see
    /// [`RunToEnd::new_with`]).
    pub(crate) fn protected_with<R>(make: impl FnOnce() -> R) -> Self
    where
        R: Future<Output = Output<B, E>> + Send + 'static,
    {
        ResponseFuture {
            kind: Kind::Protected {
                request: RunToEnd::new_with(make),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body + Send + 'static,
    E: Send + 'static,
{
    type Output = Output<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(ResponseBody::streaming)))
            }
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProj::Protected { request } => request.poll(cx),
        }
    }
}

impl<F, B: Body + 'static, E: 'static> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::PassThrough { .. } => "pass-through",
            Kind::Ready { .. } => "ready",
            Kind::Protected { .. } => "protected",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
