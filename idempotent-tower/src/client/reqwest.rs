//! The client's policy for reqwest, as a [`reqwest_middleware`] middleware.

use std::sync::Arc;

use ::reqwest::{Request, Response};
use http::Extensions;
use http_body_util::{BodyExt, Limited};
use idempotent_core::BoxError;
use reqwest_middleware::{Middleware, Next};

use super::config::{Config, MAX_PROBLEM_DOCUMENT};
use super::error::ClientError;
use super::key::IdempotencyKey;
use super::layer::ClientLayer;
use super::policy::RetryPolicy;
use super::session::{ClientSession, SessionSeq};
use super::verdict::Verdict;
use crate::server::protocol::Http;

/// The client layer's behaviour for [`reqwest`](::reqwest), as a
/// [`reqwest_middleware::Middleware`] (feature `reqwest`): the same keys, retries, policy,
/// [`Delivery`](super::Delivery) extension on the answer and metrics as
/// [`ClientLayer::http`].
///
/// ```no_run
/// use idempotent_tower::client::{IdempotencyKey, IdempotencyMiddleware, RetryPolicy};
/// use std::time::Duration;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new().policy(RetryPolicy::new().deadline(Duration::from_secs(20))))
///     .build();
/// let response = client
///     .post("http://127.0.0.1:3000/payments")
///     .header("content-type", "application/json")
///     .body(r#"{"amount":1999,"currency":"EUR"}"#)
///     .with_extension(IdempotencyKey::new("order-7-payment")?) // else a fresh UUIDv4
///     .send()
///     .await?;
/// # Ok(())
/// # }
/// ```
///
/// - The caller's own key goes in the request's middleware extensions
///   (`RequestBuilder::with_extension`); a request that already has the header keeps it. So
///   does a [`SessionSeq`] to send a call of the [`session`](Self::session) again.
/// - The body must be bytes (a string, a `Vec<u8>`, JSON, a form): a streamed body cannot be
///   sent twice, and is refused with [`ClientError::Body`] before anything is sent; a body
///   over [`RetryPolicy::max_request_body`](super::RetryPolicy::max_request_body) with
///   [`ClientError::BodyTooLarge`].
/// - An error of the call is a [`reqwest_middleware::Error::Middleware`] holding the
///   [`ClientError`] (`error.downcast_ref::<ClientError>()` on the `anyhow::Error`);
///   reqwest's own error of the last attempt is the `source` of [`ClientError::GaveUp`].
/// - Add it last of the middlewares that change the request (it sends the request it is
///   given, as it is, on every attempt), and not together with another retrying middleware
///   (`reqwest-retry`): retries multiply, and that one does not keep the key.
#[derive(Debug, Clone)]
pub struct IdempotencyMiddleware {
    config: Arc<Config<Http>>,
}

impl IdempotencyMiddleware {
    /// The middleware of [`ClientLayer::http`]: POST and PATCH get a key and retries.
    pub fn new() -> Self {
        ClientLayer::http().into()
    }

    fn layer(self, change: impl FnOnce(ClientLayer<Http>) -> ClientLayer<Http>) -> Self {
        change(ClientLayer {
            config: self.config,
        })
        .into()
    }

    /// The retry policy (see [`ClientLayer::policy`]).
    pub fn policy(self, policy: RetryPolicy) -> Self {
        self.layer(|layer| layer.policy(policy))
    }

    /// The methods that get a key and retries (see [`ClientLayer::methods`]).
    pub fn methods(self, methods: impl IntoIterator<Item = http::Method>) -> Self {
        self.layer(|layer| layer.methods(methods))
    }

    /// The header carrying the key (see [`ClientLayer::header_name`]).
    pub fn header_name(self, name: http::HeaderName) -> Self {
        self.layer(|layer| layer.header_name(name))
    }

    /// Sends every protected request in `session` (see [`ClientLayer::session`]). A `410`
    /// problem document that is not a session refusal is returned with the body read, and
    /// without the URL (`Response::url` is a placeholder).
    pub fn session(self, session: ClientSession) -> Self {
        self.layer(|layer| layer.session(session))
    }
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

/// A layer's configuration as a middleware: `ClientLayer::http().policy(…).into()`.
impl From<ClientLayer<Http>> for IdempotencyMiddleware {
    fn from(layer: ClientLayer<Http>) -> Self {
        IdempotencyMiddleware {
            config: layer.config,
        }
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let config = &self.config;
        if !config.protects(request.method()) {
            return next.run(request, extensions).await;
        }
        let refuse = |error: ClientError| {
            config.metrics.failed(&error);
            Err(reqwest_middleware::Error::middleware(error))
        };
        let limit = config.policy.max_request_body;
        match request.body().map(|body| body.as_bytes()) {
            None => {}
            Some(Some(bytes)) if bytes.len() > limit => {
                return refuse(ClientError::BodyTooLarge { limit });
            }
            Some(Some(_)) => {}
            Some(None) => {
                return refuse(ClientError::Body(
                    "a streamed request body cannot be sent again: give the request its body as bytes"
                        .into(),
                ));
            }
        }
        let chosen = extensions.remove::<IdempotencyKey>();
        let resend = extensions.remove::<SessionSeq>();
        let name = config
            .name(request.headers_mut(), chosen, resend)
            .map_err(reqwest_middleware::Error::middleware)?;
        let named = &name;
        let send = || {
            // Each attempt gets a copy of the request and of the extensions; a body of bytes
            // always clones.
            let request = request.try_clone();
            let mut extensions = extensions.clone();
            let next = next.clone();
            async move {
                let mut request =
                    request.ok_or("the request could not be copied for an attempt")?;
                named.apply(request.headers_mut());
                let response = next
                    .run(request, &mut extensions)
                    .await
                    .map_err(|error| Box::new(error) as BoxError)?;
                if named.reads::<Http>(response.status(), response.headers()) {
                    return read_document(response).await;
                }
                Ok(response)
            }
        };
        let verdict = |response: &Response| match response.extensions().get::<Document>() {
            Some(Document(verdict)) => *verdict,
            None => config.verdict(&name, response.status(), response.headers()),
        };
        let delivered = config.deliver(&name, send, verdict).await;
        let (mut response, delivery) = config
            .conclude(name, delivered, Response::headers)
            .map_err(reqwest_middleware::Error::middleware)?;
        response.extensions_mut().remove::<Document>();
        response.extensions_mut().insert(delivery);
        Ok(response)
    }
}

/// The verdict on a problem document read whole, kept with the answer rebuilt from it.
#[derive(Clone, Copy)]
struct Document(Verdict);

/// A `410` problem document in a session, read whole (up to [`MAX_PROBLEM_DOCUMENT`]) to
/// learn its `code`, and made an answer again with the bytes read.
async fn read_document(response: Response) -> Result<Response, BoxError> {
    let (mut parts, body) = http::Response::<::reqwest::Body>::from(response).into_parts();
    let document = Limited::new(body, MAX_PROBLEM_DOCUMENT)
        .collect()
        .await?
        .to_bytes();
    parts
        .extensions
        .insert(Document(Config::<Http>::document_verdict(&document)));
    Ok(Response::from(http::Response::from_parts(
        parts,
        ::reqwest::Body::from(document),
    )))
}
