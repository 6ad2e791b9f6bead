//! What remains of a request body the layer refuses as too large: read and thrown away, so
//! that an HTTP/1 client still sending it can read the `413`.
//!
//! Over HTTP/1 the connection carries the body, and only the body's end says where the next
//! request starts. A server that answers before reading the body and then closes the connection
//! leaves the unread bytes in its socket, and the kernel answers them with a reset: a client
//! still sending (curl, most HTTP libraries) fails on its next write and never reads the answer
//! (RFC 9112 §9.6). So the layer reads the rest of a refused body before answering, up to a
//! bound; past the bound it stops reading, answers, and closes the connection. HTTP/2 and HTTP/3
//! refuse the one stream and leave the connection alone, so nothing is read there.

use std::pin::Pin;
use std::time::Duration;

use bytes::Buf;
use http::header::{CONNECTION, EXPECT};
use http::{HeaderMap, HeaderValue, Response, Version};
use http_body::Body;
use http_body_util::BodyExt;

/// What becomes of the connection of a refused request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Connection {
    /// The body was read to its end, or the protocol ends only the request's own stream: the
    /// connection carries the next request.
    Reusable,
    /// The body was not read to its end: the answer carries `Connection: close`, and the
    /// server closes the connection after it.
    Close,
}

impl Connection {
    /// `response`, marked `Connection: close` if the connection must not carry another request.
    pub(crate) fn mark<B>(self, mut response: Response<B>) -> Response<B> {
        if self == Connection::Close {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// What the layer does with a body whose declared length is over the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Declared {
    /// Answer without reading it.
    AnswerNow(Connection),
    /// Read and discard it first, up to this many bytes.
    Discard(u64),
}

/// The plan for a request declaring a `Content-Length` over `limit`.
///
/// Over HTTP/1 a body no longer than `limit + allowance` is read to its end first; a longer
/// one, or one the client will only send after a `100 Continue` (which the layer never asks
/// for), is answered at once on a connection that then closes.
pub(crate) fn declared(
    version: Version,
    headers: &HeaderMap,
    declared: u64,
    limit: usize,
    allowance: usize,
) -> Declared {
    if !is_http1(version) {
        return Declared::AnswerNow(Connection::Reusable);
    }
    if expects_continue(headers) {
        return Declared::AnswerNow(Connection::Close);
    }
    let bound = (limit as u64).saturating_add(allowance as u64);
    if declared <= bound {
        Declared::Discard(bound)
    } else {
        Declared::AnswerNow(Connection::Close)
    }
}

/// Finishes a body that went over the limit while it was read: over HTTP/1, reads on until it
/// ends or `allowance` more bytes have been read.
pub(crate) async fn over_limit<B: Body>(
    version: Version,
    body: Pin<&mut B>,
    allowance: usize,
) -> Connection {
    if !is_http1(version) {
        return Connection::Reusable;
    }
    discard(body, allowance as u64).await
}

/// The default for [`IdempotencyLayer::max_discarded_body`](crate::IdempotencyLayer::max_discarded_body):
/// 4 MiB.
pub(crate) const DEFAULT_MAX_DISCARDED_BODY: usize = 4 << 20;

/// How long the layer goes on reading a body it refused: a client that stalls half-way
/// through its body cannot hold the refusal (or a graceful shutdown waiting for it) open.
pub(crate) const DISCARD_TIME_LIMIT: Duration = Duration::from_secs(10);

/// Reads `body` and drops what it reads, until it ends ([`Connection::Reusable`]) or fails, or
/// more than `up_to` bytes have been read, or [`DISCARD_TIME_LIMIT`] has passed
/// ([`Connection::Close`]). Reads at most one frame past `up_to`, which is how the end of a
/// chunked body shows.
pub(crate) async fn discard<B: Body>(body: Pin<&mut B>, up_to: u64) -> Connection {
    tokio::time::timeout(DISCARD_TIME_LIMIT, read_to(body, up_to))
        .await
        .unwrap_or(Connection::Close)
}

async fn read_to<B: Body>(mut body: Pin<&mut B>, up_to: u64) -> Connection {
    let mut read: u64 = 0;
    while read <= up_to {
        match body.frame().await {
            None => return Connection::Reusable,
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    read = read.saturating_add(data.remaining() as u64);
                }
            }
            // The client is gone or sent a malformed body: nothing more can be read.
            Some(Err(_)) => return Connection::Close,
        }
    }
    if body.is_end_stream() {
        Connection::Reusable
    } else {
        Connection::Close
    }
}

/// HTTP/1.x: the protocols where a request's body and the connection end together.
fn is_http1(version: Version) -> bool {
    matches!(
        version,
        Version::HTTP_09 | Version::HTTP_10 | Version::HTTP_11
    )
}

/// Whether the client waits for `100 Continue` before it sends the body.
fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get_all(EXPECT)
        .iter()
        .any(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body::{Frame, SizeHint};

    use super::*;

    /// A body of `frames` frames of `size` bytes, then optionally an error; counts what was
    /// read. Reports its end only once polled past it, like a chunked body.
    struct Frames {
        frames: usize,
        size: usize,
        fail: bool,
        read: u64,
    }

    impl Frames {
        fn new(frames: usize, size: usize) -> Self {
            Frames {
                frames,
                size,
                fail: false,
                read: 0,
            }
        }
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            if self.frames == 0 {
                return Poll::Ready(self.fail.then_some(Err("reset")));
            }
            self.frames -= 1;
            self.read += self.size as u64;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![0; self.size])))))
        }
    }

    /// A body of known length, which reports its end as soon as its last byte is read.
    struct Exact(Option<Bytes>);

    impl Body for Exact {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.take().map(|data| Ok(Frame::data(data))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_none()
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0.as_ref().map_or(0, |d| d.len() as u64))
        }
    }

    #[tokio::test]
    async fn a_body_that_ends_within_the_bound_is_read_to_its_end() {
        for (frames, up_to) in [(0, 0), (4, 4096), (4, 100_000), (1, 1024)] {
            let mut body = std::pin::pin!(Frames::new(frames, 1024));
            assert_eq!(
                discard(body.as_mut(), up_to).await,
                Connection::Reusable,
                "{frames} frames, up to {up_to}"
            );
            assert_eq!(body.read, frames as u64 * 1024);
        }
    }

    #[tokio::test]
    async fn a_body_longer_than_the_bound_is_read_one_frame_past_it() {
        let mut body = std::pin::pin!(Frames::new(1000, 1024));
        assert_eq!(discard(body.as_mut(), 4096).await, Connection::Close);
        assert_eq!(body.read, 5 * 1024);
        let mut body = std::pin::pin!(Frames::new(1000, 1024));
        assert_eq!(discard(body.as_mut(), 0).await, Connection::Close);
        assert_eq!(body.read, 1024);
    }

    #[tokio::test]
    async fn a_body_whose_last_frame_crosses_the_bound_still_ends() {
        let body = std::pin::pin!(Exact(Some(Bytes::from(vec![0; 10_000]))));
        assert_eq!(discard(body, 4096).await, Connection::Reusable);
    }

    /// A client that stops sending half-way.
    struct Stalled;

    impl Body for Stalled {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_is_given_up_after_the_time_limit() {
        let started = tokio::time::Instant::now();
        assert_eq!(
            discard(std::pin::pin!(Stalled), 1 << 20).await,
            Connection::Close
        );
        assert_eq!(started.elapsed(), DISCARD_TIME_LIMIT);
    }

    #[tokio::test]
    async fn a_body_that_fails_closes_the_connection() {
        let mut body = Frames::new(2, 10);
        body.fail = true;
        assert_eq!(
            discard(std::pin::pin!(body), 1 << 20).await,
            Connection::Close
        );
    }

    #[tokio::test]
    async fn nothing_is_read_past_the_limit_over_http2_and_later() {
        for version in [Version::HTTP_2, Version::HTTP_3] {
            let mut body = std::pin::pin!(Frames::new(10, 1024));
            assert_eq!(
                over_limit(version, body.as_mut(), 1 << 20).await,
                Connection::Reusable
            );
            assert_eq!(body.read, 0);
        }
        let mut body = std::pin::pin!(Frames::new(10, 1024));
        assert_eq!(
            over_limit(Version::HTTP_11, body.as_mut(), 1 << 20).await,
            Connection::Reusable
        );
        assert_eq!(body.read, 10 * 1024);
    }

    #[test]
    fn declared_bodies_are_read_up_to_the_limit_plus_the_allowance() {
        let plain = HeaderMap::new();
        let mut expecting = HeaderMap::new();
        expecting.insert(EXPECT, HeaderValue::from_static("100-Continue"));
        let (limit, allowance) = (1000, 500);
        for version in [Version::HTTP_10, Version::HTTP_11] {
            assert_eq!(
                declared(version, &plain, 1001, limit, allowance),
                Declared::Discard(1500)
            );
            assert_eq!(
                declared(version, &plain, 1500, limit, allowance),
                Declared::Discard(1500)
            );
            assert_eq!(
                declared(version, &plain, 1501, limit, allowance),
                Declared::AnswerNow(Connection::Close)
            );
            assert_eq!(
                declared(version, &plain, u64::MAX, usize::MAX, usize::MAX),
                Declared::Discard(u64::MAX)
            );
            assert_eq!(
                declared(version, &plain, 1001, limit, 0),
                Declared::AnswerNow(Connection::Close)
            );
            assert_eq!(
                declared(version, &expecting, 1001, limit, allowance),
                Declared::AnswerNow(Connection::Close)
            );
        }
        for version in [Version::HTTP_2, Version::HTTP_3] {
            assert_eq!(
                declared(version, &plain, 1001, limit, allowance),
                Declared::AnswerNow(Connection::Reusable)
            );
            assert_eq!(
                declared(version, &expecting, u64::MAX, limit, allowance),
                Declared::AnswerNow(Connection::Reusable)
            );
        }
    }

    #[test]
    fn only_close_marks_the_response() {
        let marked = Connection::Close.mark(Response::new(()));
        assert_eq!(marked.headers()[CONNECTION], "close");
        let kept = Connection::Reusable.mark(Response::new(()));
        assert!(kept.headers().get(CONNECTION).is_none());
    }
}
