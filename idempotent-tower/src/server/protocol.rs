//! The protocols the layer speaks, as types: [`Http`] and [`Grpc`], and their defaults.
//!
//! The protocol is a type parameter of [`IdempotencyLayer`](crate::IdempotencyLayer), so an
//! option that only one protocol has (the HTTP methods, a gRPC outcome policy) is a method of
//! that protocol's layer alone, and setting it on the other does not compile.

use std::fmt;
use std::sync::Arc;

use http::{Method, Response, StatusCode};
use http_body::Body;
use idempotent_core::{GrpcCode, Retain};

use super::body::ResponseBody;
use super::capture::Captured;
use super::discard::DEFAULT_MAX_DISCARDED_BODY;
use super::problem::Problem;

/// A protocol the layer speaks: [`Http`] or [`Grpc`]. Sealed: no other type implements it.
///
/// It decides which requests are protected, which outcomes are kept for replay, and how a
/// refusal is answered (a problem document, or a gRPC status).
pub trait Protocol: sealed::Sealed + Clone + Copy + fmt::Debug + Send + Sync + 'static {}

/// Plain HTTP: [`IdempotencyLayer::http`](crate::IdempotencyLayer::http) and
/// [`ClientLayer::http`](crate::client::ClientLayer::http).
///
/// Protects requests by method (POST and PATCH by default), keeps outcomes by status
/// ([`Http::default_retain`]) and answers refusals with `application/problem+json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Http {}

/// gRPC (tonic): [`IdempotencyLayer::grpc`](crate::IdempotencyLayer::grpc) and
/// [`ClientLayer::grpc`](crate::client::ClientLayer::grpc).
///
/// Protects the unary methods named by their full paths, keeps outcomes by `grpc-status`
/// ([`Grpc::default_retain`]) and answers refusals as trailers-only gRPC statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Grpc {}

impl Http {
    /// The default outcome policy: keep 2xx, 3xx and deterministic 4xx; release 5xx and the
    /// 4xx that mean "try again" (408, 409, 425, 429).
    pub fn default_retain(status: StatusCode) -> Retain {
        match status.as_u16() {
            408 | 409 | 425 | 429 => Retain::Release,
            200..=499 => Retain::Keep,
            _ => Retain::Release,
        }
    }
}

impl Grpc {
    /// The default gRPC outcome policy: keep OK and the deterministic failures
    /// (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION,
    /// OUT_OF_RANGE, UNAUTHENTICATED); release everything else (UNAVAILABLE, INTERNAL, UNKNOWN,
    /// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, CANCELLED, UNIMPLEMENTED, DATA_LOSS), so
    /// the retry runs again.
    pub fn default_retain(code: GrpcCode) -> Retain {
        match code {
            GrpcCode::Ok
            | GrpcCode::InvalidArgument
            | GrpcCode::NotFound
            | GrpcCode::AlreadyExists
            | GrpcCode::PermissionDenied
            | GrpcCode::FailedPrecondition
            | GrpcCode::OutOfRange
            | GrpcCode::Unauthenticated => Retain::Keep,
            GrpcCode::Cancelled
            | GrpcCode::Unknown
            | GrpcCode::DeadlineExceeded
            | GrpcCode::ResourceExhausted
            | GrpcCode::Aborted
            | GrpcCode::Unimplemented
            | GrpcCode::Internal
            | GrpcCode::Unavailable
            | GrpcCode::DataLoss => Retain::Release,
        }
    }
}

impl Protocol for Http {}
impl Protocol for Grpc {}

type HttpRetainFn = dyn Fn(StatusCode) -> Retain + Send + Sync;
type GrpcRetainFn = dyn Fn(GrpcCode) -> Retain + Send + Sync;

/// The settings only an HTTP layer has.
#[derive(Clone)]
pub struct HttpSettings {
    pub(crate) methods: Vec<Method>,
    pub(crate) retain: Arc<HttpRetainFn>,
    pub(crate) max_discarded_body: usize,
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            methods: vec![Method::POST, Method::PATCH],
            retain: Arc::new(Http::default_retain),
            max_discarded_body: DEFAULT_MAX_DISCARDED_BODY,
        }
    }
}

impl fmt::Debug for HttpSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("methods", &self.methods)
            .field("max_discarded_body", &self.max_discarded_body)
            .finish_non_exhaustive()
    }
}

/// The settings only a gRPC layer has.
#[derive(Clone)]
pub struct GrpcSettings {
    /// Full method paths, such as `/payments.v1.Payments/Charge`.
    pub(crate) methods: Vec<String>,
    pub(crate) retain: Arc<GrpcRetainFn>,
}

impl Default for GrpcSettings {
    fn default() -> Self {
        GrpcSettings {
            methods: Vec::new(),
            retain: Arc::new(Grpc::default_retain),
        }
    }
}

impl fmt::Debug for GrpcSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grpc")
            .field("methods", &self.methods)
            .finish_non_exhaustive()
    }
}

pub(crate) mod sealed {
    use super::*;

    /// What the layer asks of its protocol. In a private module, so that [`Protocol`] cannot
    /// be implemented outside this crate and none of this is public API.
    pub trait Sealed {
        /// The settings only this protocol has.
        type Settings: Clone + Default + fmt::Debug + Send + Sync + 'static;

        /// Whether a request with this method and path is protected.
        fn protects(settings: &Self::Settings, method: &Method, path: &str) -> bool;

        /// Whether the outcome policy keeps this response for replay.
        fn retains<B: Body>(settings: &Self::Settings, captured: &Captured<B>) -> bool;

        /// How much of a refused HTTP/1 request body is read past the limit.
        fn max_discarded_body(settings: &Self::Settings) -> usize;

        /// The answer to a refusal.
        fn answer<B: Body>(problem: Problem) -> Response<ResponseBody<B>>;

        /// The `protocol` label of this protocol's requests in the metrics.
        const METRICS: idempotent_core::metrics::ProtocolLabel;
    }

    impl Sealed for Http {
        type Settings = HttpSettings;
        const METRICS: idempotent_core::metrics::ProtocolLabel =
            idempotent_core::metrics::ProtocolLabel::Http;

        fn protects(settings: &HttpSettings, method: &Method, _path: &str) -> bool {
            settings.methods.iter().any(|m| m == method)
        }

        fn retains<B: Body>(settings: &HttpSettings, captured: &Captured<B>) -> bool {
            (settings.retain)(captured.status()) == Retain::Keep
        }

        fn max_discarded_body(settings: &HttpSettings) -> usize {
            settings.max_discarded_body
        }

        fn answer<B: Body>(problem: Problem) -> Response<ResponseBody<B>> {
            problem.into_http()
        }
    }

    impl Sealed for Grpc {
        const METRICS: idempotent_core::metrics::ProtocolLabel =
            idempotent_core::metrics::ProtocolLabel::Grpc;
        type Settings = GrpcSettings;

        fn protects(settings: &GrpcSettings, method: &Method, path: &str) -> bool {
            method == Method::POST && settings.methods.iter().any(|m| m == path)
        }

        fn retains<B: Body>(settings: &GrpcSettings, captured: &Captured<B>) -> bool {
            let keeps = |code: GrpcCode| (settings.retain)(code) == Retain::Keep;
            captured.status() == StatusCode::OK
                && match captured {
                    Captured::Complete { .. } => captured.grpc_status().is_some_and(keeps),
                    // The body was not read whole, so the grpc-status in its trailers is
                    // unknown; the handler ran and answered, so the call is recorded rather
                    // than released unless a trailers-only status says it failed transiently.
                    Captured::TooLarge { .. } | Captured::Failed { .. } => {
                        captured.grpc_status().is_none_or(keeps)
                    }
                }
        }

        fn max_discarded_body(_: &GrpcSettings) -> usize {
            DEFAULT_MAX_DISCARDED_BODY
        }

        fn answer<B: Body>(problem: Problem) -> Response<ResponseBody<B>> {
            problem.into_grpc()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_default_retain_keeps_deterministic_codes_and_releases_transient_ones() {
        let kept = [0, 3, 5, 6, 7, 9, 11, 16];
        let released = [1, 2, 4, 8, 10, 12, 13, 14, 15];
        for code in kept {
            assert_eq!(
                Grpc::default_retain(GrpcCode::from_u8(code)),
                Retain::Keep,
                "code {code} should be kept"
            );
        }
        for code in released {
            assert_eq!(
                Grpc::default_retain(GrpcCode::from_u8(code)),
                Retain::Release,
                "code {code} should be released"
            );
        }
    }

    #[test]
    fn http_default_retain_releases_server_errors_and_retryable_client_errors() {
        for status in [200, 201, 204, 301, 400, 402, 404, 422] {
            assert_eq!(
                Http::default_retain(StatusCode::from_u16(status).unwrap()),
                Retain::Keep,
                "{status}"
            );
        }
        for status in [408, 409, 425, 429, 500, 502, 503] {
            assert_eq!(
                Http::default_retain(StatusCode::from_u16(status).unwrap()),
                Retain::Release,
                "{status}"
            );
        }
    }
}
