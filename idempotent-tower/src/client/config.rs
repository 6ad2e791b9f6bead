//! What a client layer is configured with, shared by its services and the reqwest middleware,
//! and the decisions read from it: which requests are keyed, which key they carry, what an
//! answer means, and the count of each call.

use std::fmt;
use std::future::Future;

use http::{HeaderMap, HeaderName, Method, StatusCode};
use idempotent_core::BoxError;

use super::error::ClientError;
use super::key::{Delivery, IdempotencyKey};
use super::metrics::ClientMetrics;
use super::policy::{Delivered, RetryPolicy, deliver};
use super::protocol::ClientProtocol;
use super::verdict::Verdict;
use crate::config::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};

/// Everything a client layer is configured with; its services share it behind an `Arc`.
#[derive(Clone)]
pub(crate) struct Config<P: ClientProtocol> {
    pub(crate) header: HeaderName,
    pub(crate) policy: RetryPolicy,
    pub(crate) metrics: ClientMetrics,
    /// What only this protocol has.
    pub(crate) protocol: P::ClientSettings,
}

impl<P: ClientProtocol> Config<P> {
    /// The defaults: the `Idempotency-Key` header, [`RetryPolicy::default`], the protocol's
    /// own defaults, and the client's metrics registered with the recorder installed now.
    pub(crate) fn new() -> Self {
        Config {
            header: IDEMPOTENCY_KEY,
            policy: RetryPolicy::default(),
            metrics: ClientMetrics::register(P::LABEL),
            protocol: P::ClientSettings::default(),
        }
    }

    /// Whether a request of `method` gets a key and retries.
    pub(crate) fn protects(&self, method: &Method) -> bool {
        P::keyed(&self.protocol, method)
    }

    /// The request's key: the one its headers already carry, else the caller's `chosen` key
    /// or a fresh one, added to the headers.
    pub(crate) fn key(&self, headers: &mut HeaderMap, chosen: Option<IdempotencyKey>) -> String {
        match headers.get(&self.header) {
            Some(given) => String::from_utf8_lossy(given.as_bytes()).into_owned(),
            None => {
                let key = chosen.unwrap_or_else(IdempotencyKey::random);
                headers.insert(self.header.clone(), key.header_value());
                key.as_str().to_owned()
            }
        }
    }

    /// What an answer with this head means for the call.
    pub(crate) fn verdict(&self, status: StatusCode, headers: &HeaderMap) -> Verdict {
        P::verdict(status, headers)
    }

    /// Sends one logical call by the policy, counting it.
    pub(crate) async fn deliver<R, F, Fut>(
        &self,
        key: &str,
        send: F,
        verdict: impl Fn(&R) -> Verdict,
    ) -> Result<Delivered<R>, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<R, BoxError>>,
    {
        let delivered = deliver(&self.policy, &self.metrics, key, send, verdict).await;
        if let Err(error) = &delivered {
            self.metrics.failed(error);
        }
        delivered
    }

    /// The [`Delivery`] of a call that got an answer with `headers`, counted.
    pub(crate) fn delivery<R>(
        &self,
        key: String,
        delivered: &Delivered<R>,
        headers: &HeaderMap,
    ) -> Delivery {
        let replayed = headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v == "true");
        self.metrics.answered(delivered.ended, replayed);
        Delivery {
            key,
            attempts: delivered.attempts,
            replayed,
        }
    }
}

impl<P: ClientProtocol> fmt::Debug for Config<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientLayer")
            .field("protocol", &P::LABEL)
            .field("settings", &self.protocol)
            .field("header", &self.header)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}
