//! [`ResendBody`]: a request body the client can send again, rebuilt from its bytes.

use bytes::Bytes;
use http_body::Body;
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
