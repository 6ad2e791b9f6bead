//! What an answer means for a call ([`Verdict`]): retry it with the same key (and why, the
//! [`RetryReason`]), take it as the call's answer, or as a session's [`Refusal`]; and how a
//! call that got an answer ended ([`Ended`]).

use std::time::Duration;

use http::{HeaderMap, StatusCode};
use idempotent_core::ProblemCode;

use super::error::GiveUp;

/// What an answer means for the call.
///
/// `pub` only so that the sealed [`ClientProtocol`](super::ClientProtocol) can name it; not
/// reachable from outside the crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The call's answer (a success, a replay, or a refusal retrying cannot change).
    Done,
    /// The key was used for another request (HTTP 422, gRPC `FAILED_PRECONDITION` with
    /// `fingerprint_mismatch`): a bug in the caller, answered as it is and logged.
    KeyReused,
    /// Worth another attempt with the same key, after the server's delay if it gave one.
    Retry(Option<Duration>, RetryReason),
    /// A session's call refused for good: the call ends with a typed error.
    Refused(Refusal),
}

/// Why the server refused a call of a client session for good (HTTP `410`, with this `code`
/// in its problem document; gRPC with it in `idempotent-error`).
///
/// `pub` only as part of [`Verdict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `sequence_acknowledged`: the number is at or below the session's mark.
    SequenceAcknowledged,
    /// `session_expired`: the server knows the session no more.
    SessionExpired,
}

impl Refusal {
    /// The refusal a problem `code` names, if it is one.
    pub(crate) fn from_code(code: &str) -> Option<Self> {
        if code == ProblemCode::SequenceAcknowledged.as_str() {
            Some(Refusal::SequenceAcknowledged)
        } else if code == ProblemCode::SessionExpired.as_str() {
            Some(Refusal::SessionExpired)
        } else {
            None
        }
    }

    /// The refusal of a problem document (`application/problem+json`), by its `code`.
    pub(crate) fn from_document(document: &[u8]) -> Option<Self> {
        let document: serde_json::Value = serde_json::from_slice(document).ok()?;
        Self::from_code(document.get("code")?.as_str()?)
    }
}

/// Whether an answer is a problem document (`application/problem+json`, parameters aside).
pub(crate) fn is_problem_document(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| {
            media
                .trim()
                .eq_ignore_ascii_case("application/problem+json")
        })
}

/// Why an attempt is retried: the `reason` label of the client's retries metric.
///
/// `pub` only as part of [`Verdict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// No answer: the connection failed, or the client returned an error.
    Error,
    /// No answer within the attempt timeout.
    Timeout,
    /// HTTP 409 with `Retry-After`: a duplicate still in flight on the server.
    InFlight,
    /// HTTP 429.
    Throttled,
    /// HTTP 503, gRPC `UNAVAILABLE`.
    Unavailable,
    /// gRPC `ABORTED`.
    Aborted,
    /// HTTP 502 or 504 (a proxy could not reach the server, or gave up on it).
    BadGateway,
}

impl RetryReason {
    pub(crate) const ALL: [RetryReason; 7] = [
        RetryReason::Error,
        RetryReason::Timeout,
        RetryReason::InFlight,
        RetryReason::Throttled,
        RetryReason::Unavailable,
        RetryReason::Aborted,
        RetryReason::BadGateway,
    ];

    /// The label value.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            RetryReason::Error => "error",
            RetryReason::Timeout => "timeout",
            RetryReason::InFlight => "in_flight",
            RetryReason::Throttled => "throttled",
            RetryReason::Unavailable => "unavailable",
            RetryReason::Aborted => "aborted",
            RetryReason::BadGateway => "bad_gateway",
        }
    }
}

/// The verdict on an HTTP answer: 409 with `Retry-After` (a duplicate still in flight),
/// 429 and 503 (with or without `Retry-After`), 502 and 504 are retried; 422 is a reused key;
/// everything else is the answer.
pub(crate) fn http_verdict(status: StatusCode, headers: &HeaderMap) -> Verdict {
    match status.as_u16() {
        409 => match retry_after(headers) {
            Some(after) => Verdict::Retry(Some(after), RetryReason::InFlight),
            // A 409 without a delay is the application's own conflict, not ours.
            None => Verdict::Done,
        },
        429 => Verdict::Retry(retry_after(headers), RetryReason::Throttled),
        503 => Verdict::Retry(retry_after(headers), RetryReason::Unavailable),
        502 | 504 => Verdict::Retry(None, RetryReason::BadGateway),
        422 => Verdict::KeyReused,
        _ => Verdict::Done,
    }
}

/// `Retry-After` in whole seconds (`delay-seconds`: ASCII digits only). An HTTP date is not
/// read, nor is anything else (a sign, a fraction, garbage): the backoff applies instead. A
/// number of seconds too large for a `u64` is `u64::MAX` seconds (RFC 9111 §1.2.2), which
/// ends the call rather than being waited.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .as_bytes()
        .trim_ascii();
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let secs = value
        .iter()
        .try_fold(0u64, |secs, digit| {
            secs.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
        })
        .unwrap_or(u64::MAX);
    Some(Duration::from_secs(secs))
}

/// The verdict on a gRPC answer, from its head: a status in the headers (a trailers-only
/// answer, which is how servers refuse and fail unary calls) `UNAVAILABLE` or `ABORTED` is
/// retried after its `grpc-retry-pushback-ms` (a negative or unreadable pushback means "do
/// not retry"), and so is `RESOURCE_EXHAUSTED` with `idempotent-error: session_window_full`;
/// `FAILED_PRECONDITION` with `idempotent-error: fingerprint_mismatch` is a reused key;
/// `OUT_OF_RANGE` with `sequence_acknowledged` and `NOT_FOUND` with `session_expired` are a
/// session's refusals; HTTP 502, 503 and 504 from a proxy are retried. An answer whose status
/// comes in trailers carries messages, and is the answer.
pub(crate) fn grpc_verdict(status: StatusCode, headers: &HeaderMap) -> Verdict {
    match status.as_u16() {
        502 | 504 => return Verdict::Retry(None, RetryReason::BadGateway),
        503 => return Verdict::Retry(None, RetryReason::Unavailable),
        _ => {}
    }
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u8>().ok());
    let error = |code: ProblemCode| {
        headers
            .get("idempotent-error")
            .is_some_and(|v| v == code.as_str())
    };
    let retry = |reason| match headers.get("grpc-retry-pushback-ms") {
        None => Verdict::Retry(None, reason),
        Some(value) => match value.to_str().ok().and_then(|v| v.parse::<i64>().ok()) {
            Some(ms) if ms >= 0 => {
                Verdict::Retry(Some(Duration::from_millis(ms.unsigned_abs())), reason)
            }
            _ => Verdict::Done,
        },
    };
    match code {
        // ABORTED
        Some(10) => retry(RetryReason::Aborted),
        // UNAVAILABLE
        Some(14) => retry(RetryReason::Unavailable),
        // RESOURCE_EXHAUSTED
        Some(8) if error(ProblemCode::SessionWindowFull) => retry(RetryReason::Throttled),
        // FAILED_PRECONDITION
        Some(9) if error(ProblemCode::FingerprintMismatch) => Verdict::KeyReused,
        // OUT_OF_RANGE
        Some(11) if error(ProblemCode::SequenceAcknowledged) => {
            Verdict::Refused(Refusal::SequenceAcknowledged)
        }
        // NOT_FOUND
        Some(5) if error(ProblemCode::SessionExpired) => Verdict::Refused(Refusal::SessionExpired),
        _ => Verdict::Done,
    }
}

/// Why the call ended with the answer it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// An answer not to be retried.
    Answered,
    /// A `422`: the key was used for another request.
    KeyReused,
    /// A retryable answer, with no retry left.
    GaveUp(GiveUp),
    /// A session's refusal.
    Refused(Refusal),
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn http_answers_are_judged_by_status_and_retry_after() {
        use RetryReason::*;
        let none = HeaderMap::new();
        let later = headers(&[("retry-after", "3")]);
        let three = Some(Duration::from_secs(3));
        for ok in [200, 201, 204, 301, 400, 401, 403, 404, 500, 501] {
            assert_eq!(
                http_verdict(StatusCode::from_u16(ok).unwrap(), &none),
                Verdict::Done,
                "{ok}"
            );
        }
        assert_eq!(http_verdict(StatusCode::CONFLICT, &none), Verdict::Done);
        assert_eq!(
            http_verdict(StatusCode::CONFLICT, &later),
            Verdict::Retry(three, InFlight)
        );
        for (retried, why) in [(429, Throttled), (503, Unavailable)] {
            let status = StatusCode::from_u16(retried).unwrap();
            assert_eq!(http_verdict(status, &none), Verdict::Retry(None, why));
            assert_eq!(http_verdict(status, &later), Verdict::Retry(three, why));
        }
        for retried in [502, 504] {
            let status = StatusCode::from_u16(retried).unwrap();
            assert_eq!(
                http_verdict(status, &none),
                Verdict::Retry(None, BadGateway)
            );
        }
        assert_eq!(
            http_verdict(StatusCode::UNPROCESSABLE_ENTITY, &none),
            Verdict::KeyReused
        );
        // A date is not read: the backoff applies.
        let dated = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]);
        assert_eq!(
            http_verdict(StatusCode::SERVICE_UNAVAILABLE, &dated),
            Verdict::Retry(None, Unavailable)
        );
    }

    #[test]
    fn grpc_answers_are_judged_by_status_and_pushback() {
        use RetryReason::*;
        let ok = StatusCode::OK;
        assert_eq!(grpc_verdict(ok, &HeaderMap::new()), Verdict::Done);
        assert_eq!(
            grpc_verdict(ok, &headers(&[("grpc-status", "0")])),
            Verdict::Done
        );
        assert_eq!(
            grpc_verdict(ok, &headers(&[("grpc-status", "14")])),
            Verdict::Retry(None, Unavailable)
        );
        assert_eq!(
            grpc_verdict(
                ok,
                &headers(&[("grpc-status", "10"), ("grpc-retry-pushback-ms", "250")])
            ),
            Verdict::Retry(Some(Duration::from_millis(250)), Aborted)
        );
        for refused in ["-1", "soon"] {
            assert_eq!(
                grpc_verdict(
                    ok,
                    &headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", refused)])
                ),
                Verdict::Done,
                "{refused}"
            );
        }
        assert_eq!(
            grpc_verdict(
                ok,
                &headers(&[
                    ("grpc-status", "9"),
                    ("idempotent-error", "fingerprint_mismatch")
                ])
            ),
            Verdict::KeyReused
        );
        for (status, error, verdict) in [
            (
                "8",
                "session_window_full",
                Verdict::Retry(Some(Duration::from_millis(250)), Throttled),
            ),
            (
                "11",
                "sequence_acknowledged",
                Verdict::Refused(Refusal::SequenceAcknowledged),
            ),
            (
                "5",
                "session_expired",
                Verdict::Refused(Refusal::SessionExpired),
            ),
        ] {
            let with = |error| {
                headers(&[
                    ("grpc-status", status),
                    ("idempotent-error", error),
                    ("grpc-retry-pushback-ms", "250"),
                ])
            };
            assert_eq!(grpc_verdict(ok, &with(error)), verdict, "{error}");
            // Another code with the same status is the answer.
            assert_eq!(grpc_verdict(ok, &with("other")), Verdict::Done, "{status}");
        }
        for done in ["3", "9", "13", "2", "4", "5", "8", "11"] {
            assert_eq!(
                grpc_verdict(ok, &headers(&[("grpc-status", done)])),
                Verdict::Done,
                "{done}"
            );
        }
        for (status, why) in [(502, BadGateway), (503, Unavailable), (504, BadGateway)] {
            assert_eq!(
                grpc_verdict(StatusCode::from_u16(status).unwrap(), &HeaderMap::new()),
                Verdict::Retry(None, why)
            );
        }
    }

    #[test]
    fn session_refusals_are_read_from_problem_documents() {
        let problem = |code: &str| {
            format!(r#"{{"type":"urn:idempotent:problem:{code}","status":410,"code":"{code}"}}"#)
        };
        assert_eq!(
            Refusal::from_document(problem("sequence_acknowledged").as_bytes()),
            Some(Refusal::SequenceAcknowledged)
        );
        assert_eq!(
            Refusal::from_document(problem("session_expired").as_bytes()),
            Some(Refusal::SessionExpired)
        );
        for other in [
            problem("gone_for_good"),
            r#"{"code": 410}"#.to_owned(),
            "not json".to_owned(),
            String::new(),
        ] {
            assert_eq!(Refusal::from_document(other.as_bytes()), None, "{other}");
        }
        for (value, problem) in [
            ("application/problem+json", true),
            ("Application/Problem+JSON; charset=utf-8", true),
            ("application/json", false),
            ("text/plain", false),
        ] {
            assert_eq!(
                is_problem_document(&headers(&[("content-type", value)])),
                problem,
                "{value}"
            );
        }
        assert!(!is_problem_document(&HeaderMap::new()));
    }

    // A `Retry-After` too large for the clock ends the call rather than being waited, and
    // anything that is not whole seconds is not read.
    #[test]
    fn huge_and_malformed_retry_after_saturate_or_are_ignored() {
        let forever = Some(Duration::from_secs(u64::MAX));
        for huge in [
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999999999999999999999999",
        ] {
            let owned = HeaderValue::from_str(huge).unwrap();
            let mut map = HeaderMap::new();
            map.insert("retry-after", owned);
            assert_eq!(retry_after(&map), forever, "{huge}");
        }
        let mut long = HeaderMap::new();
        long.insert(
            "retry-after",
            HeaderValue::from_str(&"9".repeat(64 * 1024)).unwrap(),
        );
        assert_eq!(retry_after(&long), forever);
        assert_eq!(
            retry_after(&headers(&[("retry-after", " 7 ")])),
            Some(Duration::from_secs(7))
        );
        for garbage in [
            "",
            " ",
            "-1",
            "+5",
            "1.5",
            "1e3",
            "0x10",
            "5 s",
            "Fri, 31 Dec 9999 23:59:59 GMT",
            "Thu, 01 Jan 1970 00:00:00 GMT",
        ] {
            assert_eq!(
                retry_after(&headers(&[("retry-after", garbage)])),
                None,
                "{garbage:?}"
            );
        }
        let mut opaque = HeaderMap::new();
        opaque.insert("retry-after", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
        assert_eq!(retry_after(&opaque), None);
    }
}
