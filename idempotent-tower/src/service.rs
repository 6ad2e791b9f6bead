//! [`IdempotencyService`]: the middleware itself.

use std::fmt;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotent_core::{
    Call, ClaimHandle, Error, Execution, Fingerprint, Idempotency, Key, Retain, Scope, StoreError,
};
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::discard::{self, Declared};
use crate::future::ResponseFuture;
use crate::key::{KeyProblem, key_from_headers};
use crate::layer::{Config, IDEMPOTENT_BYPASSED, IDEMPOTENT_REPLAYED, OnClaimLost, Protocol};
use crate::problem::Problem;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The middleware created by [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        IdempotencyService { inner, config }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Send,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let config = &self.config;
        if !config.protects(request.method(), request.uri().path()) {
            return self.pass_through(request, "method not protected");
        }
        if config.idempotency.is_shutting_down() {
            tracing::info!(
                outcome = "shutting_down",
                "protected request refused: shutting down"
            );
            let refused = Problem::from_error(&Error::ShuttingDown).into_response(config.protocol);
            return refuse(config, request, refused);
        }
        let key = match key_from_headers(request.headers(), &config.header, config.strict) {
            Ok(key) => key,
            Err(KeyProblem::Missing) if !config.require_key => {
                return self.pass_through(request, "no key");
            }
            Err(problem) => {
                let (code, title) = match problem {
                    KeyProblem::Missing => ("missing_key", "Idempotency key required"),
                    _ => ("invalid_key", "Invalid idempotency key"),
                };
                tracing::info!(outcome = "invalid_key", code, "idempotency key refused");
                let detail = problem.detail(&config.header);
                let refused = Problem::new(StatusCode::BAD_REQUEST, code, title, detail)
                    .into_response(config.protocol);
                return refuse(config, request, refused);
            }
        };
        if let Some(declared) =
            declared_length(request.headers()).filter(|&len| len > config.max_request_body as u64)
        {
            let limit = config.max_request_body;
            tracing::info!(
                outcome = "request_too_large",
                declared,
                limit,
                "protected request refused: its declared body is over the limit"
            );
            return refuse(
                config,
                request,
                too_large(limit).into_response(config.protocol),
            );
        }
        let (parts, body) = request.into_parts();
        let scope = (config.scope)(&parts).or_else(|| config.allow_anonymous.then(Scope::new));
        let request = Request::from_parts(parts, body);
        let Some(scope) = scope else {
            tracing::info!(
                outcome = "missing_scope",
                "protected request refused: no principal to scope its key by"
            );
            let refused = missing_scope().into_response(config.protocol);
            return refuse(config, request, refused);
        };
        // The ready service goes with this request; a clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // Polled in place; if the client goes away first, the response future hands the rest
        // to a task, so the handler runs to completion and its response is recorded: the retry
        // then gets a replay, not a second execution.
        ResponseFuture::protected(Box::pin(handle(
            Arc::clone(config),
            inner,
            request,
            key,
            scope,
        )))
    }
}

impl<S> IdempotencyService<S> {
    fn pass_through<B, ResBody>(
        &mut self,
        request: Request<B>,
        why: &'static str,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResBody>>,
        ResBody: Body,
    {
        tracing::trace!(outcome = "bypassed", why, "request passed through");
        ResponseFuture::pass_through(self.inner.call(request.map(RequestBody::streaming)))
    }
}

/// Answers `refused` to a protected request the layer will not run, after reading and dropping
/// what is left of its body: answering first and closing the connection with the body unread
/// would let the kernel reset it under an HTTP/1 client still sending, which then never reads
/// the answer. At most `max_request_body` plus `max_discarded_body` bytes are read; a body
/// declared longer is answered at once, and one that turns out longer gets `Connection: close`.
fn refuse<F, B, ResBody, E>(
    config: &Config,
    request: Request<B>,
    refused: Response<ResponseBody<ResBody>>,
) -> ResponseFuture<F, ResBody, E>
where
    E: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Send,
{
    if request.body().is_end_stream() {
        return ResponseFuture::ready(refused);
    }
    let declared = declared_length(request.headers()).unwrap_or(0);
    match discard::declared(
        request.version(),
        request.headers(),
        declared,
        config.max_request_body,
        config.max_discarded_body,
    ) {
        Declared::AnswerNow(connection) => ResponseFuture::ready(connection.mark(refused)),
        Declared::Discard(up_to) => ResponseFuture::protected(Box::pin(async move {
            let body = std::pin::pin!(request.into_body());
            Ok(discard::discard(body, up_to).await.mark(refused))
        })),
    }
}

fn missing_scope() -> Problem {
    Problem::new(
        StatusCode::FORBIDDEN,
        "missing_scope",
        "No principal for the idempotency key",
        "this request carries no authenticated principal to scope its idempotency key by, so it was not processed; authenticate and retry",
    )
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        "Request body too large",
        format!(
            "the request body exceeds the {limit}-byte limit for idempotent requests; it was not processed"
        ),
    )
}

/// What the handler produced, as far as the layer read it.
enum Captured<B: Body> {
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

impl Config {
    /// Whether the outcome policy keeps this response for replay.
    fn retains<B: Body>(&self, captured: &Captured<B>) -> bool {
        match self.protocol {
            Protocol::Http => (self.retain)(captured.status()),
            Protocol::Grpc => match captured {
                Captured::Complete { .. } => {
                    captured.status() == StatusCode::OK
                        && captured
                            .grpc_status()
                            .is_some_and(|code| (self.grpc_retain)(code))
                }
                // The body was not read whole, so the grpc-status in its trailers is unknown;
                // the handler ran and answered, so the call is recorded rather than released
                // unless a trailers-only status says it failed transiently.
                Captured::TooLarge { .. } | Captured::Failed { .. } => {
                    captured.status() == StatusCode::OK
                        && captured
                            .grpc_status()
                            .is_none_or(|code| (self.grpc_retain)(code))
                }
            },
        }
    }
}

impl<B: Body> Captured<B> {
    /// The `grpc-status` of a gRPC response: from its trailers, or from its headers in a
    /// trailers-only response. `None` when absent or malformed, or when the body was not
    /// read whole.
    fn grpc_status(&self) -> Option<u8> {
        let read = |headers: &HeaderMap| -> Option<u8> {
            headers.get("grpc-status")?.to_str().ok()?.parse().ok()
        };
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

    fn status(&self) -> StatusCode {
        match self {
            Captured::Complete { parts, .. }
            | Captured::TooLarge { parts, .. }
            | Captured::Failed { parts, .. } => parts.status,
        }
    }

    fn into_response(self) -> Response<ResponseBody<B>> {
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
async fn capture<B: Body>(response: Response<B>, max: usize) -> Captured<B> {
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

/// The fingerprint of an HTTP request: method, path, query pairs in sorted order, the
/// configured headers and the body. Each part is a delimited field.
pub(crate) fn fingerprint(parts: &Parts, body: &[u8], headers: &[http::HeaderName]) -> Fingerprint {
    let mut f = Fingerprint::builder();
    f.push_field(parts.method.as_str().as_bytes());
    f.push_field(parts.uri.path().as_bytes());
    let mut pairs: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
        .collect();
    pairs.sort_unstable();
    f.push_field(&(pairs.len() as u64).to_le_bytes());
    for pair in pairs {
        f.push_field(pair.as_bytes());
    }
    for name in headers {
        f.push_field(name.as_str().as_bytes());
        let values: Vec<_> = parts.headers.get_all(name).iter().collect();
        f.push_field(&(values.len() as u64).to_le_bytes());
        for value in values {
            f.push_field(value.as_bytes());
        }
    }
    f.push_field(body);
    f.finish()
}

async fn handle<S, B, ResBody>(
    config: Arc<Config>,
    inner: S,
    request: Request<B>,
    key: Key,
    scope: Scope,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
{
    let (parts, body) = request.into_parts();
    let body = {
        // Pinned here rather than moved into `Limited`, so that what is left of an over-limit
        // body can still be read.
        let mut body = std::pin::pin!(body);
        match Limited::new(body.as_mut(), config.max_request_body)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
                let limit = config.max_request_body;
                let connection =
                    discard::over_limit(parts.version, body, config.max_discarded_body).await;
                tracing::info!(
                    outcome = "request_too_large",
                    limit,
                    ?connection,
                    "protected request refused: its body went over the limit"
                );
                return Ok(connection.mark(too_large(limit).into_response(config.protocol)));
            }
            Err(error) => {
                tracing::info!(outcome = "request_body_unreadable", error = %error, "could not read a protected request body");
                return Ok(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "request_body_unreadable",
                    "Request body unreadable",
                    "the request body could not be read; the request was not processed",
                )
                .into_response(config.protocol));
            }
        }
    };

    // The layer bounds the response body itself (`max_response_body`); the record around it
    // (status, headers, trailers) adds what the server's header limits allow, so the runtime's
    // own result limit must not refuse a body within the layer's.
    let mut call = Call::new(key)
        .scope(scope)
        .fingerprint(fingerprint(&parts, &body, &config.fingerprint_headers))
        .max_result_bytes(usize::MAX);
    if let Some(ttl) = config.ttl {
        call = call.ttl(ttl);
    }
    if let Some(lease) = config.lease {
        call = call.lease(lease);
    }
    if let Some(policy) = config.in_flight {
        call = call.in_flight(policy);
    }
    let storage_key = LoggedKey(&config.idempotency, &call);
    let fallback = config
        .fail_open
        .then(|| (inner.clone(), parts.clone(), body.clone()));

    let request = Request::from_parts(parts, RequestBody::buffered(body));
    let max_response = config.max_response_body;
    let cancel_on_loss = config.on_claim_lost == OnClaimLost::Cancel;
    let work = async move {
        let mut inner = inner;
        let mut request = request;
        // The handler reads the claim (fencing token, downstream operation key, loss signal)
        // as a request extension.
        let claim = ClaimHandle::current();
        if let Some(claim) = &claim {
            request.extensions_mut().insert(claim.clone());
        }
        let answering = claim.clone();
        let answered = async move {
            match inner.call(request).await {
                Ok(response) => {
                    // The handler has answered: its effect is done. A graceful shutdown lets
                    // the response be read to its end rather than stop the call, which would
                    // release the key and let a retry run the handler again.
                    if let Some(claim) = &answering {
                        claim.finish_on_shutdown();
                    }
                    Ok(capture(response, max_response).await)
                }
                Err(error) => Err(error),
            }
        };
        match claim.filter(|_| cancel_on_loss) {
            Some(claim) => {
                let mut answered = std::pin::pin!(answered);
                let mut lost = std::pin::pin!(claim.lost());
                poll_fn(|cx| {
                    if let Poll::Ready(out) = answered.as_mut().poll(cx) {
                        return Poll::Ready(Some(out));
                    }
                    lost.as_mut().poll(cx).map(|()| None)
                })
                .await
            }
            None => Some(answered.await),
        }
    };
    let classify = |output: &Option<Result<Captured<ResBody>, S::Error>>| match output {
        // Stopped because the claim was lost: nothing of this request is recorded.
        None | Some(Err(_)) => Retain::Release,
        Some(Ok(captured)) if !config.retains(captured) => Retain::Release,
        Some(Ok(Captured::Complete {
            parts,
            body,
            trailers,
        })) => match crate::record::encode(
            parts.status,
            &parts.headers,
            body,
            trailers.as_ref(),
            |name| config.is_not_replayed(name),
        ) {
            Ok(record) => Retain::Store(record),
            // A response the stored form cannot give back exactly is kept like one too large
            // to buffer: recorded as done, without its result.
            Err(error) => {
                tracing::warn!(%storage_key, %error, "response not retained for replay");
                Retain::CompleteWithoutResult
            }
        },
        // The handler ran and answered; without its whole response, the call is recorded as
        // done so that a retry does not run it again.
        Some(Ok(Captured::TooLarge { .. } | Captured::Failed { .. })) => {
            Retain::CompleteWithoutResult
        }
    };

    match config.idempotency.execute(&call, work, classify).await {
        Ok(Execution::Fresh(Some(Ok(captured)))) => {
            tracing::debug!(outcome = "fresh", %storage_key, status = captured.status().as_u16(), "idempotent request executed");
            Ok(captured.into_response())
        }
        Ok(Execution::Fresh(Some(Err(error)))) => Err(error),
        Ok(Execution::Fresh(None)) => {
            tracing::warn!(outcome = "claim_lost", %storage_key, "request stopped: its claim was lost while the handler ran");
            Ok(Problem::from_error(&Error::ClaimLost).into_response(config.protocol))
        }
        Ok(Execution::Replayed(stored)) => Ok(replay(stored, storage_key, config.protocol)),
        // Only an unreachable store is bypassed: a record that exists but cannot be read is a
        // conflict, never "absent".
        // Never once shutdown has begun: the handler would run after the drain counted it out.
        Err(Error::Store(error @ StoreError::Unavailable(_)))
            if fallback.is_some() && !config.idempotency.is_shutting_down() =>
        {
            let Some((mut inner, parts, body)) = fallback else {
                unreachable!("checked by the guard")
            };
            tracing::warn!(
                outcome = "bypassed",
                %storage_key,
                error = &error as &dyn std::error::Error,
                "idempotency store unavailable; running the request without protection (fail-open)"
            );
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            let response = inner
                .call(Request::from_parts(parts, RequestBody::buffered(body)))
                .await?;
            let mut response = response.map(ResponseBody::streaming);
            response.headers_mut().insert(
                IDEMPOTENT_BYPASSED,
                HeaderValue::from_static("store-unavailable"),
            );
            Ok(response)
        }
        Err(error) => {
            let outcome = error.code();
            match &error {
                Error::Store(e) => tracing::error!(
                    outcome,
                    %storage_key,
                    error = e as &dyn std::error::Error,
                    "idempotency store failed; request refused (fail closed)"
                ),
                _ => tracing::info!(outcome, %storage_key, "idempotent request refused"),
            }
            Ok(Problem::from_error(&error).into_response(config.protocol))
        }
    }
}

/// A call's storage key as a log field: derived only when an event is actually recorded, so
/// that requests do not pay for a second digest (the runtime derives its own) just to log.
#[derive(Clone, Copy)]
struct LoggedKey<'a>(&'a Idempotency, &'a Call);

impl fmt::Display for LoggedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.storage_key(self.1), f)
    }
}

fn replay<B: Body>(
    stored: Bytes,
    storage_key: LoggedKey<'_>,
    protocol: Protocol,
) -> Response<ResponseBody<B>> {
    match crate::record::decode(stored) {
        Ok(stored) => {
            tracing::debug!(outcome = "replayed", %storage_key, status = stored.status.as_u16(), "idempotent response replayed");
            let mut response = Response::new(ResponseBody::full(stored.body, stored.trailers));
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
        }
        Err(error) => {
            tracing::error!(outcome = "corrupt_record", %storage_key, %error, "stored response cannot be decoded");
            Problem::from_error(&Error::CorruptRecord(Box::new(error))).into_response(protocol)
        }
    }
}
