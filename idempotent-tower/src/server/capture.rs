//! Reading the handler's response for the record: the whole of it up to the retention limit,
//! trailers included ([`capture`]), and what was read ([`Captured`]).

use std::pin::Pin;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use idempotent_core::GrpcCode;

use super::body::ResponseBody;

/// What the handler produced, as far as the layer read it.
///
/// `pub` only so that the sealed [`Protocol`](crate::Protocol) can name it; not reachable
/// from outside the crate.
pub enum Captured<B: Body> {
    /// The whole response.
    Complete {
        parts: http::response::Parts,
        body: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// A response larger than the retention limit: the part read, and the rest.
    TooLarge {
        parts: http::response::Parts,
        prefix: Bytes,
        rest: Pin<Box<B>>,
    },
    /// A response whose body failed while being read.
    Failed {
        parts: http::response::Parts,
        prefix: Bytes,
        error: B::Error,
    },
}

impl<B: Body> Captured<B> {
    /// The `grpc-status` of a gRPC response: from its trailers, or from its headers in a
    /// trailers-only response. `None` when absent or malformed, or when the body was not
    /// read whole.
    pub(crate) fn grpc_status(&self) -> Option<GrpcCode> {
        let read = |headers: &HeaderMap| GrpcCode::parse(headers.get("grpc-status")?.as_bytes());
        match self {
            Captured::Complete {
                parts, trailers, ..
            } => trailers
                .as_ref()
                .and_then(read)
                .or_else(|| read(&parts.headers)),
            Captured::TooLarge { parts, .. } | Captured::Failed { parts, .. } => {
                read(&parts.headers)
            }
        }
    }

    /// The response's HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Captured::Complete { parts, .. }
            | Captured::TooLarge { parts, .. }
            | Captured::Failed { parts, .. } => parts.status,
        }
    }

    /// The response to send on: what was read, then the rest of the body.
    pub(crate) fn into_response(self) -> Response<ResponseBody<B>> {
        match self {
            Captured::Complete {
                parts,
                body,
                trailers,
            } => Response::from_parts(parts, ResponseBody::full(body, trailers)),
            Captured::TooLarge {
                parts,
                prefix,
                rest,
            } => Response::from_parts(parts, ResponseBody::partial(prefix, rest)),
            Captured::Failed {
                parts,
                prefix,
                error,
            } => Response::from_parts(parts, ResponseBody::failed(prefix, error)),
        }
    }
}

/// Reads the response body up to `max` bytes, keeping its trailers.
pub(crate) async fn capture<B: Body>(response: Response<B>, max: usize) -> Captured<B> {
    let (parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    // Most bodies are one chunk: keep it as is and copy only when a second arrives.
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    let read =
        |first: &mut Option<Bytes>, rest: &mut BytesMut| match (first.take(), rest.is_empty()) {
            (Some(first), true) => first,
            (Some(first), false) => {
                let mut all = BytesMut::with_capacity(first.len() + rest.len());
                all.put(first);
                all.put(rest.split());
                all.freeze()
            }
            (None, _) => rest.split().freeze(),
        };
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                let prefix = read(&mut first, &mut rest);
                return Captured::Failed {
                    parts,
                    prefix,
                    error,
                };
            }
        };
        match frame.into_data() {
            Ok(mut data) => {
                let len = first.as_ref().map_or(0, Bytes::len) + rest.len();
                let chunk = data.copy_to_bytes(data.remaining());
                if len + chunk.len() > max {
                    if let Some(first) = first.take() {
                        let mut all = BytesMut::with_capacity(first.len() + rest.len());
                        all.put(first);
                        all.put(rest.split());
                        rest = all;
                    }
                    rest.put(chunk);
                    return Captured::TooLarge {
                        parts,
                        prefix: rest.freeze(),
                        rest: body,
                    };
                }
                if first.is_none() && rest.is_empty() {
                    first = Some(chunk);
                } else {
                    if let Some(first) = first.take() {
                        rest.put(first);
                    }
                    rest.put(chunk);
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Captured::Complete {
        parts,
        body: read(&mut first, &mut rest),
        trailers,
    }
}
