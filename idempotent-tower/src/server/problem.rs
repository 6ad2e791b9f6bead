//! The responses the layer produces itself: RFC 9457 problem documents over HTTP, trailers-only
//! statuses over gRPC. Each carries a [`ProblemCode`], which gives its status, title, gRPC
//! status and string.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Response};
use http_body::Body;
use idempotent_core::{Error, ProblemCode};

use super::body::ResponseBody;
use crate::key::KeyProblem;

/// A problem the layer answers itself. Never stored.
///
/// `pub` only so that the sealed [`Protocol`](crate::Protocol) can name it; not reachable
/// from outside the crate.
#[derive(Debug, Clone)]
pub struct Problem {
    pub(crate) code: ProblemCode,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
}

impl Problem {
    pub(crate) fn new(code: ProblemCode, detail: impl Into<String>) -> Self {
        Problem {
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, after: Option<Duration>) -> Self {
        self.retry_after = after;
        self
    }

    /// The problem for a runtime error.
    pub(crate) fn from_error(error: &Error) -> Self {
        let code = error.code();
        let detail = match error {
            Error::InvalidKey(e) => e.to_string(),
            Error::SequenceAcknowledged { seq, ack } => format!(
                "request {seq} of this idempotency session is at or below its acknowledged mark {ack}: the client said it holds that response, which was then dropped; the request was not processed, and a new request needs a new sequence number"
            ),
            Error::SessionWindowFull { seq, ack, window } => format!(
                "request {seq} of this idempotency session is more than {window} past its acknowledged mark {ack}; it was not processed; acknowledge earlier responses (ack=) and retry"
            ),
            Error::SessionExpired => "this idempotency session is unknown or expired after its idle time, and the request says it holds responses (ack > 0); what ran in it cannot be told, so the request was not processed; start a new session".to_owned(),
            _ => runtime_detail(code).to_owned(),
        };
        let retry_after = match code {
            // A store that gives no hint is retried after a second.
            ProblemCode::StoreUnavailable => error.retry_after().or(Some(Duration::from_secs(1))),
            _ => error.retry_after(),
        };
        Problem::new(code, detail).retry_after(retry_after)
    }

    /// A protected request without a usable key: `missing_key` or `invalid_key`.
    pub(crate) fn key(problem: &KeyProblem, header: &HeaderName) -> Self {
        let code = match problem {
            KeyProblem::Missing => ProblemCode::MissingKey,
            _ => ProblemCode::InvalidKey,
        };
        Problem::new(code, problem.detail(header))
    }

    /// A request whose session header is unusable.
    pub(crate) fn session(problem: &crate::session::SessionProblem, header: &HeaderName) -> Self {
        Problem::new(ProblemCode::InvalidSession, problem.detail(header))
    }

    /// A request with both a key and a session.
    pub(crate) fn conflicting_headers(key: &HeaderName, session: &HeaderName) -> Self {
        Problem::new(
            ProblemCode::ConflictingIdempotencyHeaders,
            format!(
                "this request carries both an {key} and an {session} header; send one of them (a key per request, or a session and a sequence number)"
            ),
        )
    }

    /// A protected request without a scope.
    pub(crate) fn missing_scope() -> Self {
        Problem::new(
            ProblemCode::MissingScope,
            "this request carries no authenticated principal to scope its idempotency key by, so it was not processed; authenticate and retry",
        )
    }

    /// A protected request whose body is over `limit` bytes.
    pub(crate) fn request_too_large(limit: usize) -> Self {
        Problem::new(
            ProblemCode::RequestTooLarge,
            format!(
                "the request body exceeds the {limit}-byte limit for idempotent requests; it was not processed"
            ),
        )
    }

    /// A protected request whose body failed while it was read.
    pub(crate) fn request_body_unreadable() -> Self {
        Problem::new(
            ProblemCode::RequestBodyUnreadable,
            "the request body could not be read; the request was not processed",
        )
    }

    /// The gRPC answer: a trailers-only response with the problem's gRPC status, its detail as
    /// `grpc-message`, its code as `idempotent-error` and its delay as `grpc-retry-pushback-ms`.
    pub(crate) fn into_grpc<B: Body>(self) -> Response<ResponseBody<B>> {
        let mut response = Response::new(ResponseBody::full(Bytes::new(), None));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.code.grpc_code().as_u8())),
        );
        if let Ok(message) = HeaderValue::from_str(&percent_encode(&self.detail)) {
            headers.insert("grpc-message", message);
        }
        headers.insert(
            "idempotent-error",
            HeaderValue::from_static(self.code.as_str()),
        );
        if let Some(after) = self.retry_after {
            let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
            // The standard gRPC retry pushback, read by clients' retry policies.
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(millis));
        }
        response
    }

    /// The HTTP answer: an `application/problem+json` document, never cached.
    pub(crate) fn into_http<B: Body>(self) -> Response<ResponseBody<B>> {
        let (status, headers, body) = self.http_parts();
        let mut response = Response::new(ResponseBody::full(body, None));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }

    /// The HTTP answer's status, headers and body.
    pub(crate) fn http_parts(self) -> (http::StatusCode, http::HeaderMap, Bytes) {
        let code = self.code.as_str();
        let document = serde_json::json!({
            "type": format!("urn:idempotent:problem:{code}"),
            "title": self.code.title(),
            "status": self.code.status().as_u16(),
            "detail": self.detail,
            "code": code,
        });
        let body = Bytes::from(document.to_string());
        let mut headers = http::HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up: a client must not retry before the hint.
            let secs = after
                .as_secs()
                .saturating_add(u64::from(after.subsec_nanos() > 0));
            headers.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        (self.code.status(), headers, body)
    }
}

/// The detail of a problem the runtime reports.
fn runtime_detail(code: ProblemCode) -> &'static str {
    match code {
        ProblemCode::FingerprintMismatch => {
            "this idempotency key was already used for a request with a different method, path, query or body; use a new key for a new request"
        }
        ProblemCode::InFlight => {
            "a request with this idempotency key is still being processed; retry after the Retry-After delay to receive its response"
        }
        ProblemCode::ResultNotRetained => {
            "a request with this idempotency key was already processed, but its response was too large to keep for replay; it will not be processed again"
        }
        ProblemCode::CorruptRecord => {
            "the stored record for this idempotency key cannot be read; the request was not processed again"
        }
        ProblemCode::StoreCapacity => {
            "the idempotency store cannot accept new keys right now; the request was not processed; retry later"
        }
        ProblemCode::StoreUnavailable => {
            "the idempotency store cannot be reached; the request was not processed; retry later"
        }
        ProblemCode::ClaimLost => {
            "the idempotency store stalled or another request took this key over while the request ran, so it was stopped; retry with the same key to receive the outcome"
        }
        ProblemCode::ShuttingDown => {
            "this server is shutting down and did not process the request; retry with the same idempotency key"
        }
        // Codes the runtime never reports to the layer (the fingerprint is built from bytes,
        // the result is not serialized), and the layer's own.
        _ => "the request could not be processed idempotently",
    }
}

/// Percent-encodes a `grpc-message` value: bytes outside printable ASCII and `%` itself.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_follow_the_documented_table() {
        let answer =
            |code: ProblemCode| Problem::new(code, "d").into_grpc::<http_body_util::Empty<Bytes>>();
        for (problem, grpc) in [
            (ProblemCode::MissingKey, 3),
            (ProblemCode::InvalidKey, 3),
            (ProblemCode::RequestBodyUnreadable, 3),
            (ProblemCode::MissingScope, 7),
            (ProblemCode::ClaimLost, 14),
            (ProblemCode::FingerprintMismatch, 9),
            (ProblemCode::InFlight, 10),
            (ProblemCode::ResultNotRetained, 6),
            (ProblemCode::RequestTooLarge, 8),
            (ProblemCode::StoreUnavailable, 14),
            (ProblemCode::StoreCapacity, 14),
            (ProblemCode::ShuttingDown, 14),
            (ProblemCode::CorruptRecord, 13),
            (ProblemCode::InvalidFingerprint, 13),
            (ProblemCode::PayloadError, 13),
        ] {
            let response = answer(problem);
            assert_eq!(
                response.headers()["grpc-status"],
                grpc.to_string(),
                "{problem}"
            );
            assert_eq!(
                response.headers()["idempotent-error"],
                problem.as_str(),
                "{problem}"
            );
        }
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("a b%c\n\u{e9}"), "a b%25c%0A%C3%A9");
    }
}
