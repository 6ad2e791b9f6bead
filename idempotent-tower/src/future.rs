//! [`ResponseFuture`]: the future returned by [`IdempotencyService`](crate::IdempotencyService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::task::JoinHandle;

use crate::body::ResponseBody;
use crate::layer::Protocol;
use crate::problem::Problem;

type Output<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService).
    ///
    /// Dropping it does not stop a protected request: the handler runs to completion on its own
    /// task and its response is recorded, so a retry gets the replay.
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        PassThrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Spawned { task: JoinHandle<Output<B, E>>, protocol: Protocol },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
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

    pub(crate) fn spawned(task: JoinHandle<Output<B, E>>, protocol: Protocol) -> Self {
        ResponseFuture {
            kind: Kind::Spawned { task, protocol },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
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
            KindProj::Spawned { task, protocol } => match ready!(Pin::new(task).poll(cx)) {
                Ok(output) => Poll::Ready(output),
                // The handler panicked: surface it to the caller as if it had run inline (so a
                // panic-catching layer outside still sees it). The claim was released.
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                Err(_) => Poll::Ready(Ok(Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "shutting_down",
                    "Server shutting down",
                    "the server is shutting down; retry the request",
                )
                .into_response(*protocol))),
            },
        }
    }
}

impl<F, B: Body, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::PassThrough { .. } => "pass-through",
            Kind::Ready { .. } => "ready",
            Kind::Spawned { .. } => "spawned",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
