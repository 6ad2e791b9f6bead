//! [`IdempotencyService`]: the middleware itself, and the flow of a protected request.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use idempotent_core::capability::{KeysAndSessions, KeysOnly, NeedsSessions};
use idempotent_core::metrics::RequestOutcome;
use idempotent_core::{
    BoxError, Call, Error, Execution, Idempotency, Key, KeyClaim, Lent, ProblemCode, Retain, Scope,
    StoreError,
};
use tower_service::Service;

use super::body::{RequestBody, ResponseBody, Unread, read_within};
use super::capture::{Captured, capture};
use super::config::{Config, IDEMPOTENT_BYPASSED, IDEMPOTENT_REPLAYED, OnClaimLost};
use super::discard::{self, Declared};
use super::fingerprint::fingerprint;
use super::future::ResponseFuture;
use super::problem::Problem;
use super::protocol::{Http, Protocol};
use crate::key::{KeyProblem, key_from_headers};
use crate::session::{SessionHeader, session_from_headers};

/// The middleware an [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around a service
/// ([`Layer::layer`](tower_layer::Layer::layer)).
pub struct IdempotencyService<S, P: Protocol = Http> {
    inner: S,
    config: Arc<Config<P>>,
}

impl<S, P: Protocol> IdempotencyService<S, P> {
    /// `inner` behind the idempotency configured by `config`.
    pub(crate) fn new(inner: S, config: Arc<Config<P>>) -> Self {
        IdempotencyService { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, without the layer.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, P: Protocol> Clone for IdempotencyService<S, P> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug, P: Protocol> fmt::Debug for IdempotencyService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, P, B, ResBody> Service<Request<B>> for IdempotencyService<S, P>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    P: Protocol,
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
        if config.keys.is_shutting_down() {
            tracing::info!(
                outcome = ProblemCode::ShuttingDown.as_str(),
                "protected request refused: shutting down"
            );
            return refuse(config, request, Problem::from_error(&Error::ShuttingDown));
        }
        let session = config
            .session_header
            .as_ref()
            .and_then(|name| Some((name, session_from_headers(request.headers(), name)?)));
        let target = match session {
            Some((name, _)) if request.headers().contains_key(&config.header) => {
                let problem = Problem::conflicting_headers(&config.header, name);
                tracing::info!(
                    outcome = problem.code.as_str(),
                    "protected request refused: it has both a key and a session"
                );
                return refuse(config, request, problem);
            }
            Some((_, Ok(session))) => Target::Session(session),
            Some((name, Err(problem))) => {
                let problem = Problem::session(&problem, name);
                tracing::info!(
                    outcome = problem.code.as_str(),
                    "idempotency session header refused"
                );
                return refuse(config, request, problem);
            }
            None => match key_from_headers(request.headers(), &config.header, config.strict) {
                Ok(key) => Target::Key(key),
                Err(KeyProblem::Missing) if !config.require_key => {
                    return self.pass_through(request, "no key");
                }
                Err(problem) => {
                    let problem = Problem::key(&problem, &config.header);
                    tracing::info!(
                        outcome = ProblemCode::InvalidKey.as_str(),
                        code = problem.code.as_str(),
                        "idempotency key refused"
                    );
                    return refuse(config, request, problem);
                }
            },
        };
        if let Some(declared) =
            declared_length(request.headers()).filter(|&len| len > config.max_request_body as u64)
        {
            let limit = config.max_request_body;
            tracing::info!(
                outcome = ProblemCode::RequestTooLarge.as_str(),
                declared,
                limit,
                "protected request refused: its declared body is over the limit"
            );
            return refuse(config, request, Problem::request_too_large(limit));
        }
        let (parts, body) = request.into_parts();
        let scope = (config.scope)(&parts).or_else(|| config.allow_anonymous.then(Scope::new));
        let request = Request::from_parts(parts, body);
        let Some(scope) = scope else {
            tracing::info!(
                outcome = ProblemCode::MissingScope.as_str(),
                "protected request refused: no principal to scope its key by"
            );
            return refuse(config, request, Problem::missing_scope());
        };
        // The ready service goes with this request; a clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // Polled in place; if the client goes away first, the response future hands the rest
        // to a task, so the handler runs to completion and its response is recorded: the retry
        // then gets a replay, not a second execution.
        let config = Arc::clone(config);
        ResponseFuture::protected_with(move || handle(config, inner, request, target, scope))
    }
}

impl<S, P: Protocol> IdempotencyService<S, P> {
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

/// Counts one protected request that ended with `outcome`.
fn count<P: Protocol>(config: &Config<P>, outcome: RequestOutcome) {
    config.keys.count(P::METRICS, outcome);
}

/// Answers `problem` to a protected request the layer will not run (and counts it), after
/// reading and dropping
/// what is left of its body: answering first and closing the connection with the body unread
/// would let the kernel reset it under an HTTP/1 client still sending, which then never reads
/// the answer. At most `max_request_body` plus `max_discarded_body` bytes are read; a body
/// declared longer is answered at once, and one that turns out longer gets `Connection: close`.
fn refuse<P, F, B, ResBody, E>(
    config: &Config<P>,
    request: Request<B>,
    problem: Problem,
) -> ResponseFuture<F, ResBody, E>
where
    P: Protocol,
    E: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Send,
{
    count(config, RequestOutcome::Refused(problem.code));
    let refused = P::answer(problem);
    if request.body().is_end_stream() {
        return ResponseFuture::ready(refused);
    }
    let declared = declared_length(request.headers()).unwrap_or(0);
    match discard::declared(
        request.version(),
        request.headers(),
        declared,
        config.max_request_body,
        config.max_discarded_body(),
    ) {
        Declared::AnswerNow(connection) => ResponseFuture::ready(connection.mark(refused)),
        Declared::Discard(up_to) => ResponseFuture::protected(async move {
            let body = std::pin::pin!(request.into_body());
            Ok(discard::discard(body, up_to).await.mark(refused))
        }),
    }
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

async fn handle<S, P, B, ResBody>(
    config: Arc<Config<P>>,
    inner: S,
    request: Request<B>,
    target: Target,
    scope: Scope,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    P: Protocol,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
{
    // A session's answers name their number, so that its client acknowledges only answers
    // the server gave (never, say, a proxy's 500).
    let session_seq = target.session_seq();
    let (parts, body) = request.into_parts();
    let body = {
        // Pinned here, so that what is left of an over-limit body can still be read.
        let mut body = std::pin::pin!(body);
        match read_within(body.as_mut(), config.max_request_body).await {
            Ok(read) => read,
            Err(Unread::TooLarge) => {
                let limit = config.max_request_body;
                let connection =
                    discard::over_limit(parts.version, body, config.max_discarded_body()).await;
                tracing::info!(
                    outcome = ProblemCode::RequestTooLarge.as_str(),
                    limit,
                    ?connection,
                    "protected request refused: its body went over the limit"
                );
                count(
                    &config,
                    RequestOutcome::Refused(ProblemCode::RequestTooLarge),
                );
                return Ok(connection.mark(P::answer(Problem::request_too_large(limit))));
            }
            Err(Unread::Failed(error)) => {
                tracing::info!(outcome = ProblemCode::RequestBodyUnreadable.as_str(), error = %error, "could not read a protected request body");
                count(
                    &config,
                    RequestOutcome::Refused(ProblemCode::RequestBodyUnreadable),
                );
                return Ok(P::answer(Problem::request_body_unreadable()));
            }
        }
    };

    // Kept for a completer: only a request with a key (a session's requests are not kept).
    let kept = config
        .keep_requests
        .as_ref()
        .filter(|_| matches!(target, Target::Key(_)))
        .map(|keeper| super::kept::KeptRequest::of(keeper, &parts, &body).encode());
    let fingerprint = fingerprint(&parts, &body, &config.fingerprint_headers);
    // The result limit bounds the response body, which the layer reads itself; the record
    // around it (status, headers, trailers) adds what the server's header limits allow, so the
    // runtime must not refuse again, by the record's size, a body within the limit. The limit
    // is read from the call as configured, before that override.
    let unbounded = config.call_options.max_result_bytes(usize::MAX);
    let (call, max_response) = match target {
        Target::Key(key) => {
            let call = Call::new(key)
                .scope(scope)
                .fingerprint(fingerprint)
                .options(config.call_options);
            let max_response = config.keys.max_result_bytes(&call);
            (Typed::Key(call.options(unbounded)), max_response)
        }
        Target::Session(session) => {
            let Some(runtime) = &config.sessions else {
                // The session header is read only where the store serves sessions.
                let error = Error::Store(StoreError::Backend(
                    "this server's store keeps no client sessions".into(),
                ));
                count(&config, RequestOutcome::of_error(&error));
                return Ok(P::answer(Problem::from_error(&error)));
            };
            let call = Call::in_session(session.id().clone(), session.place())
                .scope(scope)
                .fingerprint(fingerprint)
                .options(config.call_options);
            let max_response = config.keys.max_result_bytes(&call);
            (
                Typed::Session(call.options(unbounded), runtime.clone()),
                max_response,
            )
        }
    };
    let storage_key = LoggedKey(&config.keys, &call);
    // Boxed: held across the whole call, and only where fail-open is on.
    let fallback = config
        .fail_open
        .then(|| Box::new((inner.clone(), parts.clone(), body.clone())));

    let request = Request::from_parts(parts, RequestBody::buffered(body));
    let cancel_on_loss = config.on_claim_lost == OnClaimLost::Cancel;
    let work = async move {
        let mut inner = inner;
        let mut request = request;
        // The handler reads the claim (fencing token, downstream operation key, loss signal)
        // as a request extension.
        // A `KeyClaim` always; a `ClaimHandle` (with steps) where the store keeps checkpoints.
        let claim = KeyClaim::current();
        if let Some(claim) = &claim {
            request.extensions_mut().insert(claim.clone());
            let steps = claim.clone().with_steps();
            if let Some(steps) = &steps {
                request.extensions_mut().insert(steps.clone());
            }
            // Kept requests need checkpoints, which `keep_requests` asks of the runtime's type.
            if let Some(kept) = kept
                && let Some(steps) = steps
                && let Err(error) = steps.save_request(kept).await
            {
                // Not kept, not run, the claim released: the client's retry runs it. A store
                // failure (or a claim lost before the handler began), never "lost while the
                // handler ran".
                return Err(error);
            }
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
        Ok(match claim.filter(|_| cancel_on_loss) {
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
        })
    };
    // The work's output: `Err` if the request could not be kept for a completer (the handler
    // never ran); `Ok(None)` if the handler was stopped because the claim was lost.
    type Output<B, E> = Result<Option<Result<Captured<B>, E>>, Error>;
    let retain = |output: &Output<ResBody, S::Error>| match output {
        Ok(Some(Ok(captured))) if config.retains(captured) => Retain::Keep,
        // Not kept by the outcome policy, failed, stopped because the claim was lost, or never
        // run: the key is released and nothing of this request is recorded.
        _ => Retain::Release,
    };
    let encode = |output: &Output<ResBody, S::Error>| match output {
        Ok(output) => record_of(&config, output, storage_key),
        Err(_) => None,
    };

    // Pinned here and lent to the runtime: the work, with the handler's future in it, is the
    // largest part of this request's state, and is then neither moved into the runtime's
    // future nor held a second time by it. The runtime drops it (`Lent`) as it would drop a
    // work of its own; the block ends its place before the answer is made, so the ready
    // service it holds is gone before a fail-open bypass readies another.
    let execution = {
        let mut work = std::pin::pin!(Some(work));
        match &call {
            Typed::Key(call) => {
                config
                    .keys
                    .execute(call, Lent::new(work.as_mut()), retain, encode)
                    .await
            }
            Typed::Session(call, runtime) => {
                runtime
                    .execute(call, Lent::new(work.as_mut()), retain, encode)
                    .await
            }
        }
    };
    match execution {
        Ok(Execution::Fresh(Ok(Some(Ok(captured))))) => {
            tracing::debug!(outcome = "fresh", %storage_key, status = captured.status().as_u16(), "idempotent request executed");
            count(&config, RequestOutcome::Fresh);
            Ok(mark_session_answer(captured.into_response(), session_seq))
        }
        // The handler ran; the inner service's own error is its answer.
        Ok(Execution::Fresh(Ok(Some(Err(error))))) => {
            count(&config, RequestOutcome::Fresh);
            Err(error)
        }
        Ok(Execution::Fresh(Ok(None))) => {
            tracing::warn!(outcome = ProblemCode::ClaimLost.as_str(), %storage_key, "request stopped: its claim was lost while the handler ran");
            count(&config, RequestOutcome::Refused(ProblemCode::ClaimLost));
            Ok(P::answer(Problem::from_error(&Error::ClaimLost)))
        }
        // The request could not be kept for a completer: not run, its claim released.
        Ok(Execution::Fresh(Err(error))) => {
            let outcome = error.code().as_str();
            match &error {
                Error::Store(e) => tracing::error!(
                    outcome,
                    %storage_key,
                    error = e as &dyn std::error::Error,
                    "could not keep the request for the completer; it was not run (fail closed)"
                ),
                _ => tracing::info!(
                    outcome,
                    %storage_key,
                    "could not keep the request for the completer; it was not run"
                ),
            }
            count(&config, RequestOutcome::of_error(&error));
            Ok(P::answer(Problem::from_error(&error)))
        }
        Ok(Execution::Replayed(stored)) => {
            let (response, outcome) = replay::<P, _>(stored, storage_key);
            count(&config, outcome);
            let response = match outcome {
                RequestOutcome::Replayed => mark_session_answer(response, session_seq),
                RequestOutcome::Refused(code) => mark_final_refusal(response, session_seq, code),
                _ => response,
            };
            Ok(response)
        }
        // Only an unreachable store is bypassed: a record that exists but cannot be read is a
        // conflict, never "absent".
        // Never once shutdown has begun: the handler would run after the drain counted it out.
        Err(Error::Store(error @ StoreError::Unavailable(_)))
            if fallback.is_some() && !config.keys.is_shutting_down() =>
        {
            let Some(fallback) = fallback else {
                unreachable!("checked by the guard")
            };
            let (mut inner, parts, body) = *fallback;
            tracing::warn!(
                outcome = "bypassed",
                %storage_key,
                error = &error as &dyn std::error::Error,
                "idempotency store unavailable; running the request without protection (fail-open)"
            );
            count(&config, RequestOutcome::Bypassed);
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
            let outcome = error.code().as_str();
            match &error {
                Error::Store(e) => tracing::error!(
                    outcome,
                    %storage_key,
                    error = e as &dyn std::error::Error,
                    "idempotency store failed; request refused (fail closed)"
                ),
                _ => tracing::info!(outcome, %storage_key, "idempotent request refused"),
            }
            count(&config, RequestOutcome::of_error(&error));
            let code = error.code();
            Ok(mark_final_refusal(
                P::answer(Problem::from_error(&error)),
                session_seq,
                code,
            ))
        }
    }
}

/// The record of a handler's output: its response as stored for replay, or `None` (recorded
/// as done without a result, or never recorded because `retain` released it).
pub(crate) fn record_of<P: Protocol, B: Body, E>(
    config: &Config<P>,
    output: &Option<Result<Captured<B>, E>>,
    storage_key: impl fmt::Display,
) -> Option<Bytes> {
    match output {
        Some(Ok(captured)) => record_of_captured(config, captured, storage_key),
        // Released by `retain`, so never encoded.
        None | Some(Err(_)) => None,
    }
}

/// The record of a response the handler gave: see [`record_of`].
pub(crate) fn record_of_captured<P: Protocol, B: Body>(
    config: &Config<P>,
    captured: &Captured<B>,
    storage_key: impl fmt::Display,
) -> Option<Bytes> {
    match captured {
        Captured::Complete {
            parts,
            body,
            trailers,
        } => match super::stored::encode(
            parts.status,
            &parts.headers,
            body,
            trailers.as_ref(),
            |name| config.is_not_replayed(name),
        ) {
            Ok(record) => Some(record),
            // A response the stored form cannot give back exactly is kept like one too large
            // to buffer: recorded as done, without its result.
            Err(error) => {
                tracing::warn!(%storage_key, %error, "response not retained for replay");
                None
            }
        },
        // The handler ran and answered; without its whole response, the call is recorded as
        // done so that a retry does not run it again.
        Captured::TooLarge { .. } | Captured::Failed { .. } => None,
    }
}

/// Marks `response` as the server's answer to number `seq` of a client session
/// ([`IDEMPOTENCY_SESSION_SEQ`](crate::IDEMPOTENCY_SESSION_SEQ)): its handler's answer, fresh
/// or replayed. Never stored with the record (added after capture, and again on each replay);
/// a handler's own field of that name is replaced.
fn mark_session_answer<B>(mut response: Response<B>, seq: Option<u64>) -> Response<B> {
    if let Some(seq) = seq {
        response
            .headers_mut()
            .insert(crate::IDEMPOTENCY_SESSION_SEQ, HeaderValue::from(seq));
    }
    response
}

/// Marks `response`, the refusal `code` of number `seq` of a client session, as the server's
/// answer when the refusal is final: the number reached the session (its gate let it in), and
/// the same request sent again gets the same refusal and never runs (another request's
/// number, a result not retained, a record that cannot be read). Its client acknowledges it,
/// so the session's window moves on. A refusal to retry (in flight, store failures, a full
/// window) is not marked, and the call sent again runs. Nor are the refusals made before the
/// request reaches its session (too large, no principal, a body that cannot be read): its
/// session may not have begun on the server, whose gate would take an acknowledgement of such
/// a number as a session it forgot (`session_expired`); the caller gives those numbers up
/// with `ClientSession::abandon` once the session holds an answer.
fn mark_final_refusal<B>(
    response: Response<B>,
    seq: Option<u64>,
    code: ProblemCode,
) -> Response<B> {
    let last = matches!(
        code,
        ProblemCode::FingerprintMismatch
            | ProblemCode::ResultNotRetained
            | ProblemCode::CorruptRecord
    );
    if last {
        mark_session_answer(response, seq)
    } else {
        response
    }
}

/// What names a protected request's record: its key, or its place in a client session.
enum Target {
    Key(Key),
    Session(SessionHeader),
}

impl Target {
    /// The request's number in its client session, if it is in one.
    fn session_seq(&self) -> Option<u64> {
        match self {
            Target::Session(session) => Some(session.seq()),
            Target::Key(_) => None,
        }
    }
}

/// A call's storage key as a log field: derived only when an event is actually recorded, so
/// that requests do not pay for a second digest (the runtime derives its own) just to log.
#[derive(Clone, Copy)]
struct LoggedKey<'a>(&'a Idempotency<KeysOnly>, &'a Typed);

impl fmt::Display for LoggedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = match self.1 {
            Typed::Key(call) => self.0.storage_key(call),
            Typed::Session(call, _) => self.0.storage_key(call),
        };
        fmt::Display::fmt(&key, f)
    }
}

/// A request's call, typed by what it needs of the store: a key any runtime runs, or a
/// session's, run by the runtime's sessions.
enum Typed {
    Key(Call),
    Session(Call<NeedsSessions>, Idempotency<KeysAndSessions>),
}

/// The replayed response, and how the request ended: replayed, or refused if the record
/// cannot be decoded.
fn replay<P: Protocol, B: Body>(
    stored: Bytes,
    storage_key: LoggedKey<'_>,
) -> (Response<ResponseBody<B>>, RequestOutcome) {
    match super::stored::decode(stored) {
        Ok(stored) => {
            tracing::debug!(outcome = "replayed", %storage_key, status = stored.status.as_u16(), "idempotent response replayed");
            let mut response = Response::new(ResponseBody::full(stored.body, stored.trailers));
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            (response, RequestOutcome::Replayed)
        }
        Err(error) => {
            tracing::error!(outcome = ProblemCode::CorruptRecord.as_str(), %storage_key, %error, "stored response cannot be decoded");
            (
                P::answer(Problem::from_error(&Error::CorruptRecord(Box::new(error)))),
                RequestOutcome::Refused(ProblemCode::CorruptRecord),
            )
        }
    }
}
