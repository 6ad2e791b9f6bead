//! The request body the inner service sees, and the response body the layer returns.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use idempotent_core::BoxError;
use pin_project_lite::pin_project;

pin_project! {
    /// The request body handed to the inner service.
    ///
    /// Protected requests are buffered (their bytes are part of the fingerprint), so the inner
    /// service receives them whole; every other request streams through untouched.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Buffered { data: Option<Bytes> },
        Streaming { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        RequestBody {
            kind: RequestKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        RequestBody {
            kind: RequestKind::Streaming { body },
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RequestKind::Buffered { data } => f
                .debug_struct("RequestBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            RequestKind::Streaming { .. } => f.write_str("RequestBody::Streaming"),
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Buffered { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            RequestKindProj::Streaming { body } => body.poll_frame(cx).map(map_frame),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { data } => data.is_none(),
            RequestKind::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestKind::Streaming { body } => body.size_hint(),
        }
    }
}

fn map_frame<D: Buf, E>(frame: Option<Result<Frame<D>, E>>) -> Option<Result<Frame<Bytes>, E>> {
    frame.map(|r| r.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining()))))
}

pin_project! {
    /// The response body the layer returns: the inner service's body streamed through, a
    /// buffered or replayed body (with its trailers), or a problem document.
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B: Body> {
        Streaming { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        // A response too large to retain: the part read so far, then the rest of the stream.
        Partial { prefix: Option<Bytes>, rest: Pin<Box<B>> },
        // A response whose body failed while being read: the part read so far, then the error.
        Failed { prefix: Option<Bytes>, error: Option<B::Error> },
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn failed(prefix: Bytes, error: B::Error) -> Self {
        ResponseBody {
            kind: ResponseKind::Failed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                error: Some(error),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Streaming { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        ResponseBody {
            kind: ResponseKind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    pub(crate) fn partial(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        ResponseBody {
            kind: ResponseKind::Partial {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ResponseKind::Streaming { .. } => f.write_str("ResponseBody::Streaming"),
            ResponseKind::Full { data, trailers } => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .field("trailers", trailers)
                .finish(),
            ResponseKind::Partial { .. } => f.write_str("ResponseBody::Partial"),
            ResponseKind::Failed { .. } => f.write_str("ResponseBody::Failed"),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Streaming { body } => body.poll_frame(cx).map(map_frame),
            ResponseKindProj::Full { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            ResponseKindProj::Partial { prefix, rest } => {
                if let Some(prefix) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(prefix))));
                }
                rest.as_mut().poll_frame(cx).map(map_frame)
            }
            ResponseKindProj::Failed { prefix, error } => {
                if let Some(prefix) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(prefix))));
                }
                Poll::Ready(error.take().map(Err))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Streaming { body } => body.is_end_stream(),
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseKind::Partial { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            ResponseKind::Failed { prefix, error } => prefix.is_none() && error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Streaming { body } => body.size_hint(),
            ResponseKind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseKind::Partial { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            ResponseKind::Failed { .. } => SizeHint::new(),
        }
    }
}

/// Why a body was not read whole ([`read_within`]).
pub(crate) enum Unread {
    /// It has more than the limit's bytes of data; what is left of it is unread.
    TooLarge,
    /// It failed to be read.
    Failed(BoxError),
}

/// Reads `body` to its end, trailers ignored, if its data is at most `limit` bytes: a body
/// declared or found longer stops being read at once (so the caller can read or drop what is
/// left). One chunk is returned as it came; more are joined.
pub(crate) async fn read_within<B>(mut body: Pin<&mut B>, limit: usize) -> Result<Bytes, Unread>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit_u64 = u64::try_from(limit).unwrap_or(u64::MAX);
    if body.size_hint().lower() > limit_u64 {
        return Err(Unread::TooLarge);
    }
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    let mut len = 0usize;
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|error| Unread::Failed(error.into()))?;
        let Ok(mut data) = frame.into_data() else {
            continue;
        };
        len = len.saturating_add(data.remaining());
        if len > limit {
            return Err(Unread::TooLarge);
        }
        match &first {
            None => first = Some(data.copy_to_bytes(data.remaining())),
            Some(_) => rest.extend_from_slice(&data.copy_to_bytes(data.remaining())),
        }
    }
    Ok(match first {
        None => Bytes::new(),
        Some(first) if rest.is_empty() => first,
        Some(first) => {
            let mut joined = BytesMut::with_capacity(len);
            joined.extend_from_slice(&first);
            joined.extend_from_slice(&rest);
            joined.freeze()
        }
    })
}
