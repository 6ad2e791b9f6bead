//! The stable codes of every refusal, with what each means on the wire: [`ProblemCode`], and
//! the gRPC status codes they map to ([`GrpcCode`]).

use std::fmt;

use http::StatusCode;

/// The stable, machine-readable code of a refusal: what [`Error::code`](crate::Error::code)
/// returns, what the HTTP layer writes in a problem document's `code` (and `type`), what the
/// gRPC layer sends in the `idempotent-error` metadata entry, and what the `tracing` events
/// carry as `outcome`, so logs and clients see the same code.
///
/// One `match` gives each code its string, HTTP status, gRPC status and title:
///
/// | code | HTTP | gRPC | produced by |
/// |---|---|---|---|
/// | `missing_key` | 400 | `INVALID_ARGUMENT` | the layer: a protected request has no key |
/// | `invalid_key` | 400 | `INVALID_ARGUMENT` | [`Error::InvalidKey`](crate::Error::InvalidKey), the layer |
/// | `request_body_unreadable` | 400 | `INVALID_ARGUMENT` | the layer: the request body failed while read |
/// | `missing_scope` | 403 | `PERMISSION_DENIED` | the layer: no principal to scope the key by |
/// | `in_flight` | 409 | `ABORTED` | [`Error::InFlight`](crate::Error::InFlight) |
/// | `result_not_retained` | 410 | `ALREADY_EXISTS` | [`Error::ResultNotRetained`](crate::Error::ResultNotRetained) |
/// | `request_too_large` | 413 | `RESOURCE_EXHAUSTED` | the layer: the request body is over its limit |
/// | `fingerprint_mismatch` | 422 | `FAILED_PRECONDITION` | [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch) |
/// | `corrupt_record` | 500 | `INTERNAL` | [`Error::CorruptRecord`](crate::Error::CorruptRecord), [`StoreError::Corrupt`](crate::StoreError::Corrupt) |
/// | `invalid_fingerprint` | 500 | `INTERNAL` | [`Error::Fingerprint`](crate::Error::Fingerprint) |
/// | `payload_error` | 500 | `INTERNAL` | [`Error::Payload`](crate::Error::Payload) |
/// | `claim_lost` | 503 | `UNAVAILABLE` | [`Error::ClaimLost`](crate::Error::ClaimLost) |
/// | `shutting_down` | 503 | `UNAVAILABLE` | [`Error::ShuttingDown`](crate::Error::ShuttingDown) |
/// | `store_unavailable` | 503 | `UNAVAILABLE` | [`Error::Store`](crate::Error::Store) |
/// | `store_capacity` | 503 | `UNAVAILABLE` | [`StoreError::Capacity`](crate::StoreError::Capacity) |
/// | `invalid_session` | 400 | `INVALID_ARGUMENT` | the layer: the session header is malformed |
/// | `conflicting_idempotency_headers` | 400 | `INVALID_ARGUMENT` | the layer: a request carries both a key and a session |
/// | `sequence_acknowledged` | 410 | `OUT_OF_RANGE` | [`Error::SequenceAcknowledged`](crate::Error::SequenceAcknowledged) |
/// | `session_expired` | 410 | `NOT_FOUND` | [`Error::SessionExpired`](crate::Error::SessionExpired) |
/// | `session_window_full` | 429 | `RESOURCE_EXHAUSTED` | [`Error::SessionWindowFull`](crate::Error::SessionWindowFull) |
/// | `operation_failed` | 500 | `INTERNAL` | a completer: it gave up finishing an abandoned operation (recorded, so retries get it) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemCode {
    /// `missing_key`: a protected request carries no idempotency key.
    MissingKey,
    /// `invalid_key`: the key is malformed.
    InvalidKey,
    /// `request_body_unreadable`: the request body could not be read.
    RequestBodyUnreadable,
    /// `missing_scope`: the request carries no principal to scope its key by.
    MissingScope,
    /// `in_flight`: a call with the same key is still running.
    InFlight,
    /// `result_not_retained`: the key was processed, but its result was not kept.
    ResultNotRetained,
    /// `request_too_large`: the request body is over the limit.
    RequestTooLarge,
    /// `fingerprint_mismatch`: the key was used for a different request.
    FingerprintMismatch,
    /// `corrupt_record`: the stored record cannot be read.
    CorruptRecord,
    /// `invalid_fingerprint`: the fingerprint value cannot be encoded canonically.
    InvalidFingerprint,
    /// `payload_error`: a result cannot be encoded, or a stored one decoded.
    PayloadError,
    /// `claim_lost`: the call's claim was lost while its work ran.
    ClaimLost,
    /// `shutting_down`: the runtime is shutting down.
    ShuttingDown,
    /// `store_unavailable`: the store failed or cannot be reached.
    StoreUnavailable,
    /// `store_capacity`: the store is full of live records.
    StoreCapacity,
    /// `invalid_session`: the session header is malformed.
    InvalidSession,
    /// `conflicting_idempotency_headers`: a request carries both a key and a session.
    ConflictingIdempotencyHeaders,
    /// `sequence_acknowledged`: the session request is at or below its acknowledged mark.
    SequenceAcknowledged,
    /// `session_expired`: the session is unknown, and the request says it held answers.
    SessionExpired,
    /// `session_window_full`: the session request is numbered past its window.
    SessionWindowFull,
    /// `operation_failed`: a completer gave up finishing an operation its client abandoned.
    OperationFailed,
}

impl ProblemCode {
    /// Every code, in the order of the table above.
    pub const ALL: [ProblemCode; 21] = [
        ProblemCode::MissingKey,
        ProblemCode::InvalidKey,
        ProblemCode::RequestBodyUnreadable,
        ProblemCode::MissingScope,
        ProblemCode::InFlight,
        ProblemCode::ResultNotRetained,
        ProblemCode::RequestTooLarge,
        ProblemCode::FingerprintMismatch,
        ProblemCode::CorruptRecord,
        ProblemCode::InvalidFingerprint,
        ProblemCode::PayloadError,
        ProblemCode::ClaimLost,
        ProblemCode::ShuttingDown,
        ProblemCode::StoreUnavailable,
        ProblemCode::StoreCapacity,
        ProblemCode::InvalidSession,
        ProblemCode::ConflictingIdempotencyHeaders,
        ProblemCode::SequenceAcknowledged,
        ProblemCode::SessionExpired,
        ProblemCode::SessionWindowFull,
        ProblemCode::OperationFailed,
    ];

    /// The code's place in [`ProblemCode::ALL`] (its declaration order, which `ALL` follows).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The code's string, its HTTP status, its gRPC status and its title: the one place they
    /// are written.
    const fn describe(self) -> (&'static str, StatusCode, GrpcCode, &'static str) {
        use GrpcCode as G;
        use StatusCode as H;
        match self {
            ProblemCode::MissingKey => (
                "missing_key",
                H::BAD_REQUEST,
                G::InvalidArgument,
                "Idempotency key required",
            ),
            ProblemCode::InvalidKey => (
                "invalid_key",
                H::BAD_REQUEST,
                G::InvalidArgument,
                "Invalid idempotency key",
            ),
            ProblemCode::RequestBodyUnreadable => (
                "request_body_unreadable",
                H::BAD_REQUEST,
                G::InvalidArgument,
                "Request body unreadable",
            ),
            ProblemCode::MissingScope => (
                "missing_scope",
                H::FORBIDDEN,
                G::PermissionDenied,
                "No principal for the idempotency key",
            ),
            ProblemCode::InFlight => (
                "in_flight",
                H::CONFLICT,
                G::Aborted,
                "Request with this idempotency key is in progress",
            ),
            ProblemCode::ResultNotRetained => (
                "result_not_retained",
                H::GONE,
                G::AlreadyExists,
                "Response not retained",
            ),
            ProblemCode::RequestTooLarge => (
                "request_too_large",
                H::PAYLOAD_TOO_LARGE,
                G::ResourceExhausted,
                "Request body too large",
            ),
            ProblemCode::FingerprintMismatch => (
                "fingerprint_mismatch",
                H::UNPROCESSABLE_ENTITY,
                G::FailedPrecondition,
                "Idempotency key reused with a different request",
            ),
            ProblemCode::CorruptRecord => (
                "corrupt_record",
                H::INTERNAL_SERVER_ERROR,
                G::Internal,
                "Idempotency record unreadable",
            ),
            ProblemCode::InvalidFingerprint => (
                "invalid_fingerprint",
                H::INTERNAL_SERVER_ERROR,
                G::Internal,
                "Request cannot be fingerprinted",
            ),
            ProblemCode::PayloadError => (
                "payload_error",
                H::INTERNAL_SERVER_ERROR,
                G::Internal,
                "Result cannot be encoded or decoded",
            ),
            ProblemCode::ClaimLost => (
                "claim_lost",
                H::SERVICE_UNAVAILABLE,
                G::Unavailable,
                "Request lost its idempotency claim",
            ),
            ProblemCode::ShuttingDown => (
                "shutting_down",
                H::SERVICE_UNAVAILABLE,
                G::Unavailable,
                "Service shutting down",
            ),
            ProblemCode::StoreUnavailable => (
                "store_unavailable",
                H::SERVICE_UNAVAILABLE,
                G::Unavailable,
                "Idempotency store unavailable",
            ),
            ProblemCode::StoreCapacity => (
                "store_capacity",
                H::SERVICE_UNAVAILABLE,
                G::Unavailable,
                "Idempotency store full",
            ),
            ProblemCode::InvalidSession => (
                "invalid_session",
                H::BAD_REQUEST,
                G::InvalidArgument,
                "Invalid idempotency session",
            ),
            ProblemCode::ConflictingIdempotencyHeaders => (
                "conflicting_idempotency_headers",
                H::BAD_REQUEST,
                G::InvalidArgument,
                "Both an idempotency key and a session",
            ),
            ProblemCode::SequenceAcknowledged => (
                "sequence_acknowledged",
                H::GONE,
                G::OutOfRange,
                "Session request already acknowledged",
            ),
            ProblemCode::SessionExpired => (
                "session_expired",
                H::GONE,
                G::NotFound,
                "Idempotency session expired",
            ),
            ProblemCode::SessionWindowFull => (
                "session_window_full",
                H::TOO_MANY_REQUESTS,
                G::ResourceExhausted,
                "Session window full",
            ),
            ProblemCode::OperationFailed => (
                "operation_failed",
                H::INTERNAL_SERVER_ERROR,
                G::Internal,
                "Operation failed",
            ),
        }
    }

    /// The code as written on the wire and in logs, such as `"in_flight"`.
    pub const fn as_str(self) -> &'static str {
        self.describe().0
    }

    /// The HTTP status the layer answers with.
    pub const fn status(self) -> StatusCode {
        self.describe().1
    }

    /// The gRPC status the layer answers with.
    pub const fn grpc_code(self) -> GrpcCode {
        self.describe().2
    }

    /// A short human-readable summary, the problem document's `title`.
    pub const fn title(self) -> &'static str {
        self.describe().3
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A gRPC status code, as carried in `grpc-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum GrpcCode {
    /// `OK` (0).
    Ok = 0,
    /// `CANCELLED` (1).
    Cancelled = 1,
    /// `UNKNOWN` (2).
    Unknown = 2,
    /// `INVALID_ARGUMENT` (3).
    InvalidArgument = 3,
    /// `DEADLINE_EXCEEDED` (4).
    DeadlineExceeded = 4,
    /// `NOT_FOUND` (5).
    NotFound = 5,
    /// `ALREADY_EXISTS` (6).
    AlreadyExists = 6,
    /// `PERMISSION_DENIED` (7).
    PermissionDenied = 7,
    /// `RESOURCE_EXHAUSTED` (8).
    ResourceExhausted = 8,
    /// `FAILED_PRECONDITION` (9).
    FailedPrecondition = 9,
    /// `ABORTED` (10).
    Aborted = 10,
    /// `OUT_OF_RANGE` (11).
    OutOfRange = 11,
    /// `UNIMPLEMENTED` (12).
    Unimplemented = 12,
    /// `INTERNAL` (13).
    Internal = 13,
    /// `UNAVAILABLE` (14).
    Unavailable = 14,
    /// `DATA_LOSS` (15).
    DataLoss = 15,
    /// `UNAUTHENTICATED` (16).
    Unauthenticated = 16,
}

impl GrpcCode {
    /// The code numbered `code`; a number gRPC does not define is [`Unknown`](Self::Unknown),
    /// as gRPC clients read it.
    pub const fn from_u8(code: u8) -> GrpcCode {
        match code {
            0 => GrpcCode::Ok,
            1 => GrpcCode::Cancelled,
            3 => GrpcCode::InvalidArgument,
            4 => GrpcCode::DeadlineExceeded,
            5 => GrpcCode::NotFound,
            6 => GrpcCode::AlreadyExists,
            7 => GrpcCode::PermissionDenied,
            8 => GrpcCode::ResourceExhausted,
            9 => GrpcCode::FailedPrecondition,
            10 => GrpcCode::Aborted,
            11 => GrpcCode::OutOfRange,
            12 => GrpcCode::Unimplemented,
            13 => GrpcCode::Internal,
            14 => GrpcCode::Unavailable,
            15 => GrpcCode::DataLoss,
            16 => GrpcCode::Unauthenticated,
            _ => GrpcCode::Unknown,
        }
    }

    /// A `grpc-status` value: a decimal number from 0 to 255, as [`u8`]'s `FromStr` reads it
    /// (an undefined one is [`Unknown`](Self::Unknown)); `None` for anything else.
    pub fn parse(value: &[u8]) -> Option<GrpcCode> {
        let number = std::str::from_utf8(value).ok()?.parse::<u8>().ok()?;
        Some(GrpcCode::from_u8(number))
    }

    /// The code's number.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_code_at_its_index() {
        for (i, code) in ProblemCode::ALL.into_iter().enumerate() {
            assert_eq!(code.index(), i, "{code}");
        }
    }

    #[test]
    fn every_code_has_its_own_string() {
        let mut seen = std::collections::HashSet::new();
        for code in ProblemCode::ALL {
            assert!(seen.insert(code.as_str()), "{code} twice");
            assert_eq!(code.to_string(), code.as_str());
        }
    }

    /// The table in [`ProblemCode`]'s docs is what the code answers: one row per code, with
    /// its status and gRPC status.
    #[test]
    fn the_documented_table_is_the_one_match() {
        let source = include_str!("problem.rs");
        let rows: Vec<Vec<&str>> = source
            .lines()
            .filter_map(|line| line.strip_prefix("/// | `"))
            .map(|row| row.split(" | ").map(str::trim).collect())
            .collect();
        assert_eq!(rows.len(), ProblemCode::ALL.len(), "{rows:?}");
        for code in ProblemCode::ALL {
            let row = rows
                .iter()
                .find(|row| row[0].trim_end_matches('`') == code.as_str())
                .unwrap_or_else(|| panic!("{code} is not in the table"));
            assert_eq!(row[1], code.status().as_str(), "{code}");
            let grpc = format!("{:?}", code.grpc_code());
            let screaming: String = grpc
                .chars()
                .enumerate()
                .flat_map(|(i, c)| {
                    let underscore = (i > 0 && c.is_uppercase()).then_some('_');
                    underscore.into_iter().chain(c.to_uppercase())
                })
                .collect();
            assert_eq!(row[2], format!("`{screaming}`"), "{code}");
        }
    }

    #[test]
    fn grpc_codes_round_trip_and_unknown_numbers_read_as_unknown() {
        for number in 0..=16u8 {
            assert_eq!(GrpcCode::from_u8(number).as_u8(), number);
            assert_eq!(
                GrpcCode::parse(number.to_string().as_bytes()),
                Some(GrpcCode::from_u8(number))
            );
        }
        assert_eq!(GrpcCode::from_u8(17), GrpcCode::Unknown);
        assert_eq!(GrpcCode::parse(b"200"), Some(GrpcCode::Unknown));
        assert_eq!(GrpcCode::parse(b"999"), None);
        assert_eq!(GrpcCode::parse(b"1000"), None);
        assert_eq!(GrpcCode::parse(b"+0"), Some(GrpcCode::Ok));
        assert_eq!(GrpcCode::parse(b"0014"), Some(GrpcCode::Unavailable));
        assert_eq!(GrpcCode::parse(b" 0"), None);
        assert_eq!(GrpcCode::parse(b""), None);
        assert_eq!(GrpcCode::parse(b"-1"), None);
        assert_eq!(GrpcCode::parse(b"OK"), None);
    }
}
