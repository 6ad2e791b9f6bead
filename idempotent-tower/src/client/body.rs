//! [`ResendBody`]: a request body the client can send again, rebuilt from its bytes; and
//! [`rebuild`]: an answer's body, read, made a body of its type again where the type allows.

use std::any::{Any, TypeId};
use std::convert::Infallible;

use bytes::Bytes;
use http_body::Body;
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Full};
use idempotent_core::BoxError;

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

/// A response body of type `B` holding `bytes`, for the types that can be made from bytes:
/// `Full<Bytes>`, `String`, `http_body_util`'s boxed bodies with a `BoxError` or `Infallible`
/// error, and tonic's `Body` (feature `tonic`). `None` for any other (hyper's `Incoming`,
/// which only hyper makes).
pub(crate) fn rebuild<B: 'static>(bytes: Bytes) -> Option<B> {
    fn made<B: 'static, T: 'static>(make: impl FnOnce() -> T) -> Option<B> {
        if TypeId::of::<B>() != TypeId::of::<T>() {
            return None;
        }
        (Box::new(make()) as Box<dyn Any>)
            .downcast::<B>()
            .ok()
            .map(|body| *body)
    }
    let full = || Full::new(bytes.clone());
    made::<B, _>(full)
        .or_else(|| made::<B, _>(|| String::from_utf8_lossy(&bytes).into_owned()))
        .or_else(|| made::<B, BoxBody<Bytes, BoxError>>(|| BoxBody::from_bytes(bytes.clone())))
        .or_else(|| made::<B, BoxBody<Bytes, Infallible>>(|| BoxBody::from_bytes(bytes.clone())))
        .or_else(|| {
            made::<B, UnsyncBoxBody<Bytes, BoxError>>(|| UnsyncBoxBody::from_bytes(bytes.clone()))
        })
        .or_else(|| {
            made::<B, UnsyncBoxBody<Bytes, Infallible>>(|| UnsyncBoxBody::from_bytes(bytes.clone()))
        })
        .or_else(|| tonic_body(&bytes))
}

#[cfg(feature = "tonic")]
fn tonic_body<B: 'static>(bytes: &Bytes) -> Option<B> {
    if TypeId::of::<B>() != TypeId::of::<tonic::body::Body>() {
        return None;
    }
    (Box::new(tonic::body::Body::from_bytes(bytes.clone())) as Box<dyn Any>)
        .downcast::<B>()
        .ok()
        .map(|body| *body)
}

#[cfg(not(feature = "tonic"))]
fn tonic_body<B: 'static>(_: &Bytes) -> Option<B> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_made_from_bytes_are_rebuilt() {
        let bytes = Bytes::from_static(b"gone");
        let read = |body: Option<Full<Bytes>>| body.map(data_of);
        assert_eq!(read(rebuild(bytes.clone())), Some(bytes.clone()));
        assert_eq!(rebuild::<String>(bytes.clone()).as_deref(), Some("gone"));
        assert!(rebuild::<BoxBody<Bytes, BoxError>>(bytes.clone()).is_some());
        assert!(rebuild::<UnsyncBoxBody<Bytes, Infallible>>(bytes.clone()).is_some());
        assert!(rebuild::<BoxBody<Bytes, std::io::Error>>(bytes.clone()).is_none());
        assert!(rebuild::<Vec<u8>>(bytes).is_none());
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
