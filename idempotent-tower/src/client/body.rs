//! [`ResendBody`]: a request body the client can send again, rebuilt from its bytes; and
//! [`RebuildBody`]: an answer's body, read, made a body of its type again where the type allows.

use bytes::Bytes;
use http_body::Body;
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Full};

/// A request body the client layer can rebuild from the bytes it buffered, to send the same
/// body again.
pub trait ResendBody: Body + Sized {
    /// A body of `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;
}

impl ResendBody for Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

impl<E: 'static> ResendBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes).map_err(|never| match never {}).boxed()
    }
}

impl<E: 'static> ResendBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "tonic")]
impl ResendBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        tonic::body::Body::new(Full::new(bytes))
    }
}

/// A response body the client layer can make from bytes: how it returns, as a response of the
/// inner service's body type, an answer it read whole (a problem document it had to look
/// into). `None` for a type only its transport makes (hyper's `Incoming`): the layer then
/// returns such an answer as [`ClientError::Gone`](crate::client::ClientError::Gone).
///
/// Implemented for `Full<Bytes>`, `String`, `http_body_util`'s boxed bodies, the server
/// layer's [`ResponseBody`](crate::ResponseBody), tonic's `Body` (feature `tonic`), and as
/// `None` for hyper's `Incoming` and `http_body_util`'s `MapErr`. A body type of your own
/// implements it (returning `None` if it cannot be made from bytes) to be wrapped by the
/// client layer. (It replaces a check of the body's type at run time.)
pub trait RebuildBody: Sized {
    /// A body of `bytes`, or `None` if this type cannot be made from bytes.
    fn rebuild(bytes: Bytes) -> Option<Self>;
}

impl RebuildBody for Full<Bytes> {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(Full::new(bytes))
    }
}

impl RebuildBody for String {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
}

impl<E: 'static> RebuildBody for BoxBody<Bytes, E> {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(BoxBody::from_bytes(bytes))
    }
}

impl<E: 'static> RebuildBody for UnsyncBoxBody<Bytes, E> {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(UnsyncBoxBody::from_bytes(bytes))
    }
}

/// The server layer's own body: an answer read through a client layer stacked on it (in one
/// process) is returned as a response.
impl<B: Body> RebuildBody for crate::ResponseBody<B> {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(crate::ResponseBody::full(bytes, None))
    }
}

/// A mapped body cannot be made again without its function.
impl<B, F> RebuildBody for http_body_util::combinators::MapErr<B, F> {
    fn rebuild(_: Bytes) -> Option<Self> {
        None
    }
}

/// Only hyper makes an `Incoming`.
impl RebuildBody for hyper::body::Incoming {
    fn rebuild(_: Bytes) -> Option<Self> {
        None
    }
}

#[cfg(feature = "tonic")]
impl RebuildBody for tonic::body::Body {
    fn rebuild(bytes: Bytes) -> Option<Self> {
        Some(tonic::body::Body::from_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotent_core::BoxError;

    #[test]
    fn bodies_made_from_bytes_are_rebuilt() {
        let bytes = Bytes::from_static(b"gone");
        let read = |body: Option<Full<Bytes>>| body.map(data_of);
        assert_eq!(read(Full::rebuild(bytes.clone())), Some(bytes.clone()));
        assert_eq!(String::rebuild(bytes.clone()).as_deref(), Some("gone"));
        assert!(BoxBody::<Bytes, BoxError>::rebuild(bytes.clone()).is_some());
        assert!(UnsyncBoxBody::<Bytes, std::convert::Infallible>::rebuild(bytes.clone()).is_some());
        assert!(BoxBody::<Bytes, std::io::Error>::rebuild(bytes.clone()).is_some());
        assert!(hyper::body::Incoming::rebuild(bytes).is_none());
    }

    /// The bytes of a `Full` body, polled once.
    fn data_of(body: Full<Bytes>) -> Bytes {
        let mut body = std::pin::pin!(body);
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        match body.as_mut().poll_frame(&mut cx) {
            std::task::Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap(),
            _ => panic!("a Full body is ready"),
        }
    }
}
