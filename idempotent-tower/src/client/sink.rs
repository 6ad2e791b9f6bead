//! The outbox relay's HTTP sink: each message POSTed through the client layer with its key.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_postgres::outbox::{BoxFuture, Relayed, Sink, SinkError};
use tower_layer::Layer as _;
use tower_service::Service as _;

use super::error::ClientError;
use super::key::IdempotencyKey;
use super::layer::ClientLayer;
use super::policy::RetryPolicy;
use super::service::ClientService;
use crate::server::config::IDEMPOTENCY_KEY;

/// An outbox [`Sink`] that POSTs each message to one URL (feature `outbox`): the payload as
/// the body, the message's headers, and its key as `Idempotency-Key`, through the client layer
/// ([`ClientLayer::http`]), whose retries are those of one delivery attempt; the
/// [`Relay`](idempotent_postgres::outbox::Relay) retries failed attempts later with its own
/// backoff, with the same key.
///
/// ```no_run
/// use idempotent_postgres::outbox::{Outbox, Relay};
/// use idempotent_postgres::PostgresStore;
/// use idempotent_tower::client::HttpSink;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://app@db/app").await?;
/// let sink = HttpSink::new("http://notifier.internal/notifications")?
///     .header("authorization", "Bearer ledger-relay")?;
/// let relay = Relay::builder(store.pool().clone(), Outbox::new())
///     .sink("notifications", sink)
///     .build();
/// # Ok(())
/// # }
/// ```
///
/// An answer is judged as follows:
///
/// | answer | outcome |
/// |---|---|
/// | 2xx | delivered |
/// | 408, 409, 425, 429, 5xx, no answer | tried again later ([`SinkError::retry`]) |
/// | any other (400, 401, 403, 404, 422, …) | dead-lettered at once ([`SinkError::permanent`]): the receiver refuses this message, and sending it again cannot change that |
///
/// A 3xx is not followed and counts as a refusal. Messages whose key is not a valid
/// idempotency key are dead-lettered too.
#[derive(Clone)]
pub struct HttpSink {
    url: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    client: ClientService<Client<HttpConnector, Full<Bytes>>>,
}

impl fmt::Debug for HttpSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpSink")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Why an [`HttpSink`] could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpSinkError {
    /// The URL is not an `http://` URL.
    #[error("not an http:// URL: {0}")]
    Url(String),
    /// A header name or value is not valid.
    #[error("invalid header: {0}")]
    Header(String),
}

impl HttpSink {
    /// A sink POSTing to `url` (`http://`; TLS is not built in), with the relay's default
    /// policy: 3 attempts within 20 s, each within 5 s.
    pub fn new(url: &str) -> Result<Self, HttpSinkError> {
        let uri: Uri = url
            .parse()
            .map_err(|_| HttpSinkError::Url(url.to_owned()))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(HttpSinkError::Url(url.to_owned()));
        }
        let policy = RetryPolicy::new()
            .max_attempts(3)
            .deadline(Duration::from_secs(20))
            .attempt_timeout(Duration::from_secs(5))
            .backoff(Duration::from_millis(100), Duration::from_secs(2))
            .max_request_body(idempotent_postgres::outbox::MAX_OUTBOX_PAYLOAD);
        Ok(HttpSink {
            url: uri,
            headers: Vec::new(),
            client: Self::client(policy),
        })
    }

    fn client(policy: RetryPolicy) -> ClientService<Client<HttpConnector, Full<Bytes>>> {
        let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        ClientLayer::http().policy(policy).layer(http)
    }

    /// The client's policy for one delivery attempt (see [`RetryPolicy`]). Keep its deadline
    /// below the relay's [`delivery_timeout`](idempotent_postgres::outbox::RelayBuilder::delivery_timeout).
    #[must_use]
    pub fn policy(mut self, mut policy: RetryPolicy) -> Self {
        // Every payload the outbox accepts can be sent.
        policy.max_request_body = policy
            .max_request_body
            .max(idempotent_postgres::outbox::MAX_OUTBOX_PAYLOAD);
        self.client = Self::client(policy);
        self
    }

    /// A header sent with every message (credentials, say); a message's own header of the
    /// same name is sent as well. `Idempotency-Key` is refused: each message has its own.
    pub fn header(mut self, name: &str, value: &str) -> Result<Self, HttpSinkError> {
        let name = HeaderName::from_bytes(name.as_bytes())
            .ok()
            .filter(|name| *name != IDEMPOTENCY_KEY)
            .ok_or_else(|| HttpSinkError::Header(name.to_owned()))?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| HttpSinkError::Header(format!("value of {name}")))?;
        self.headers.push((name, value));
        Ok(self)
    }

    fn request(&self, message: &Relayed) -> Result<Request<Full<Bytes>>, SinkError> {
        let key = IdempotencyKey::new(message.key.as_str())
            .map_err(|e| SinkError::permanent(format!("the message key is not valid: {e}")))?;
        let mut request = Request::new(Full::new(message.payload.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.url.clone();
        let headers = request.headers_mut();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        for (name, value) in &message.headers {
            let name = HeaderName::from_bytes(name.as_bytes());
            let value = HeaderValue::from_str(value);
            let (Ok(name), Ok(value)) = (name, value) else {
                return Err(SinkError::permanent(
                    "a header of the message is not valid HTTP",
                ));
            };
            if name == IDEMPOTENCY_KEY {
                return Err(SinkError::permanent(
                    "the message carries its own Idempotency-Key header",
                ));
            }
            headers.append(name, value);
        }
        request.extensions_mut().insert(key);
        Ok(request)
    }
}

impl Sink for HttpSink {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let request = self.request(message)?;
            let mut client = self.client.clone();
            match client.call(request).await {
                Ok(response) => {
                    let status = response.status();
                    match status.as_u16() {
                        200..=299 => Ok(()),
                        408 | 409 | 425 | 429 | 500..=599 => {
                            Err(SinkError::retry(format!("{} answered {status}", self.url)))
                        }
                        _ => Err(SinkError::permanent(format!(
                            "{} refused the message: {status}",
                            self.url
                        ))),
                    }
                }
                Err(error @ ClientError::BodyTooLarge { .. }) => Err(SinkError::permanent(error)),
                Err(error) => Err(SinkError::retry(format!("{}: {error}", self.url))),
            }
        })
    }
}
