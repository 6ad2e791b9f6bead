//! The protocols the client layer speaks, as types: what [`Http`] and [`Grpc`] mean to a
//! client ([`ClientProtocol`]): which requests get a key, and how an answer is judged.

use http::{HeaderMap, Method, StatusCode};

use super::verdict::{Verdict, grpc_verdict, http_verdict};
use crate::server::protocol::{Grpc, Http, Protocol};

/// A protocol the client layer speaks: [`Http`] or [`Grpc`], the types the server layer
/// takes too. Sealed: no other type implements it.
///
/// It decides which requests get a key and retries, and which answers are retried. The
/// protocol is a type parameter of [`ClientLayer`](super::ClientLayer), so an option only
/// one protocol has (the HTTP methods) is a method of that protocol's layer alone.
pub trait ClientProtocol: Protocol + sealed::Sealed {}

impl ClientProtocol for Http {}
impl ClientProtocol for Grpc {}

pub(crate) mod sealed {
    use super::*;

    /// What the client layer asks of its protocol. In a private module, so that
    /// [`ClientProtocol`] cannot be implemented outside this crate and none of this is public
    /// API.
    pub trait Sealed {
        /// The client settings only this protocol has. (Named apart from the server layer's
        /// `Settings`: both traits are bounds of every client protocol.)
        type ClientSettings: Clone + Default + std::fmt::Debug + Send + Sync + 'static;

        /// The `protocol` label of this protocol's calls in the client's metrics.
        const LABEL: &'static str;

        /// Whether a session's refusals come as problem documents, to be read (HTTP), rather
        /// than in the head (gRPC's `idempotent-error`).
        const READS_PROBLEMS: bool;

        /// Whether a request of `method` is keyed: gets a key and retries.
        fn keyed(settings: &Self::ClientSettings, method: &Method) -> bool;

        /// What an answer with this head means for the call.
        fn verdict(status: StatusCode, headers: &HeaderMap) -> Verdict;
    }

    /// The settings only an HTTP client has: the methods that get a key and retries.
    #[derive(Debug, Clone)]
    pub struct HttpClientSettings {
        pub(crate) methods: Vec<Method>,
    }

    impl Default for HttpClientSettings {
        fn default() -> Self {
            HttpClientSettings {
                methods: vec![Method::POST, Method::PATCH],
            }
        }
    }

    impl Sealed for Http {
        type ClientSettings = HttpClientSettings;
        const LABEL: &'static str = "http";
        const READS_PROBLEMS: bool = true;

        fn keyed(settings: &HttpClientSettings, method: &Method) -> bool {
            settings.methods.contains(method)
        }

        fn verdict(status: StatusCode, headers: &HeaderMap) -> Verdict {
            http_verdict(status, headers)
        }
    }

    impl Sealed for Grpc {
        /// Every call is protected: gRPC calls are POSTs.
        type ClientSettings = ();
        const LABEL: &'static str = "grpc";
        const READS_PROBLEMS: bool = false;

        fn keyed((): &(), _method: &Method) -> bool {
            true
        }

        fn verdict(status: StatusCode, headers: &HeaderMap) -> Verdict {
            grpc_verdict(status, headers)
        }
    }
}
