//! The responses the layer produces itself: RFC 9457 problem documents.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use http_body::Body;
use idempotent_core::{Error, StoreError};

use crate::body::ResponseBody;
use crate::layer::Protocol;

/// A problem the layer answers itself. Never stored.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Problem {
            status,
            code,
            title,
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
        match error {
            Error::FingerprintMismatch => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                code,
                "Idempotency key reused with a different request",
                "this idempotency key was already used for a request with a different method, path, query or body; use a new key for a new request",
            ),
            Error::InFlight { retry_after } => Problem::new(
                StatusCode::CONFLICT,
                code,
                "Request with this idempotency key is in progress",
                "a request with this idempotency key is still being processed; retry after the Retry-After delay to receive its response",
            )
            .retry_after(Some(*retry_after)),
            Error::ResultNotRetained => Problem::new(
                StatusCode::GONE,
                code,
                "Response not retained",
                "a request with this idempotency key was already processed, but its response was too large to keep for replay; it will not be processed again",
            ),
            Error::CorruptRecord(_) | Error::Store(StoreError::Corrupt(_)) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                code,
                "Idempotency record unreadable",
                "the stored record for this idempotency key cannot be read; the request was not processed again",
            ),
            Error::Store(StoreError::Capacity { .. }) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                "Idempotency store full",
                "the idempotency store cannot accept new keys right now; the request was not processed; retry later",
            )
            .retry_after(error.retry_after()),
            Error::Store(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                "Idempotency store unavailable",
                "the idempotency store cannot be reached; the request was not processed; retry later",
            )
            .retry_after(error.retry_after().or(Some(Duration::from_secs(1)))),
            Error::ClaimLost => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                "Request lost its idempotency claim",
                "the idempotency store stalled or another request took this key over while the request ran, so it was stopped; retry with the same key to receive the outcome",
            )
            .retry_after(error.retry_after()),
            Error::ShuttingDown => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                "Service shutting down",
                "this server is shutting down and did not process the request; retry with the same idempotency key",
            )
            .retry_after(error.retry_after()),
            Error::InvalidKey(e) => Problem::new(
                StatusCode::BAD_REQUEST,
                code,
                "Invalid idempotency key",
                e.to_string(),
            ),
            _ => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "Idempotency layer error",
                "the request could not be processed idempotently",
            ),
        }
    }

    /// The response for `protocol`: a problem document over HTTP, a trailers-only status
    /// response over gRPC.
    pub(crate) fn into_response<B: Body>(self, protocol: Protocol) -> Response<ResponseBody<B>> {
        match protocol {
            Protocol::Http => self.into_http(),
            Protocol::Grpc => self.into_grpc(),
        }
    }

    /// The gRPC status code for this problem.
    pub(crate) fn grpc_code(&self) -> u8 {
        match self.code {
            "missing_key" | "invalid_key" | "request_body_unreadable" => 3, // INVALID_ARGUMENT
            "missing_scope" => 7,                                           // PERMISSION_DENIED
            "fingerprint_mismatch" => 9,                                    // FAILED_PRECONDITION
            "in_flight" => 10,                                              // ABORTED
            "result_not_retained" => 6,                                     // ALREADY_EXISTS
            "request_too_large" => 8,                                       // RESOURCE_EXHAUSTED
            "store_unavailable" | "store_capacity" | "shutting_down" | "claim_lost" => 14, // UNAVAILABLE
            _ => 13, // INTERNAL
        }
    }

    fn into_grpc<B: Body>(self) -> Response<ResponseBody<B>> {
        let mut response = Response::new(ResponseBody::full(Bytes::new(), None));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.grpc_code())),
        );
        if let Ok(message) = HeaderValue::from_str(&percent_encode(&self.detail)) {
            headers.insert("grpc-message", message);
        }
        headers.insert("idempotent-error", HeaderValue::from_static(self.code));
        if let Some(after) = self.retry_after {
            let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
            // The standard gRPC retry pushback, read by clients' retry policies.
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(millis));
        }
        response
    }

    fn into_http<B: Body>(self) -> Response<ResponseBody<B>> {
        let document = serde_json::json!({
            "type": format!("urn:idempotent:problem:{}", self.code),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        let body = Bytes::from(document.to_string());
        let mut response = Response::new(ResponseBody::full(body, None));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up: a client must not retry before the hint.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
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
        let code = |c: &'static str| Problem::new(StatusCode::BAD_REQUEST, c, "t", "d").grpc_code();
        for (problem, grpc) in [
            ("missing_key", 3),
            ("invalid_key", 3),
            ("request_body_unreadable", 3),
            ("missing_scope", 7),
            ("claim_lost", 14),
            ("fingerprint_mismatch", 9),
            ("in_flight", 10),
            ("result_not_retained", 6),
            ("request_too_large", 8),
            ("store_unavailable", 14),
            ("store_capacity", 14),
            ("shutting_down", 14),
            ("corrupt_record", 13),
            ("internal_error", 13),
        ] {
            assert_eq!(code(problem), grpc, "{problem}");
        }
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("a b%c\n\u{e9}"), "a b%25c%0A%C3%A9");
    }
}
