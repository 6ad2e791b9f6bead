//! Errors of the runtime and of stores.

use std::time::Duration;

use crate::{CanonicalError, KeyError, ProblemCode};

/// A boxed error source, as kept by [`StoreError`] and [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a call through the runtime did not run the work or replay a result.
///
/// Every variant tells the client what to do next; see each variant. None of these outcomes is
/// ever stored: a retry after fixing the cause is handled afresh.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is malformed. Client: send a valid key.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),

    /// The key was already used for a request with a different fingerprint. Client: use a new
    /// key for a new request; never reuse a key with a different payload.
    #[error("idempotency key was already used for a different request")]
    FingerprintMismatch,

    /// Another call with the same key is still running. Client: retry after `retry_after`
    /// (the time left on the owner's lease, capped at
    /// [`MAX_IN_FLIGHT_RETRY_HINT`](crate::MAX_IN_FLIGHT_RETRY_HINT)).
    #[error("a request with this idempotency key is still in flight; retry after {retry_after:?}")]
    InFlight {
        /// When to try again.
        retry_after: Duration,
    },

    /// The first call completed but its result was too large to retain, so there is nothing to
    /// replay and the work is not run again. Client: treat the original call as done and look
    /// its result up by other means.
    #[error("the request completed but its result was too large to retain for replay")]
    ResultNotRetained,

    /// The store holds a record for this key that cannot be decoded. It is treated as a conflict,
    /// never as absent, so the work is not run again. Operator: inspect the store.
    #[error("the stored record for this key is corrupt")]
    CorruptRecord(#[source] BoxError),

    /// The fingerprint value could not be encoded canonically.
    #[error("cannot fingerprint the request")]
    Fingerprint(#[from] CanonicalError),

    /// The result could not be encoded for storage, or a stored result could not be decoded into
    /// the expected type.
    #[error("cannot encode or decode the result")]
    Payload(#[source] BoxError),

    /// The call's claim was lost while its work ran: its lease ended before a renewal got
    /// through (the store stalled or was unreachable), or another owner took the key over.
    /// Returned by [`KeyClaim::check`](crate::KeyClaim::check) and answered to a client
    /// whose request was stopped because of it. Client: retry with the same key after
    /// `retry_after`: the retry is answered by whichever owner holds the key now.
    #[error("the request lost its claim on the idempotency key while running")]
    ClaimLost,

    /// The runtime is shutting down ([`Idempotency::shutdown`](crate::Idempotency::shutdown)):
    /// the call arrived after shutdown began and was not run, or its work was still running at
    /// the shutdown's deadline and was stopped (its claim released). Client: retry with the
    /// same key after `retry_after`, on another instance.
    #[error("the service is shutting down; the request was not processed")]
    ShuttingDown,

    /// The store failed; see the source. The work was not run (fail closed).
    #[error("idempotency store failed")]
    Store(#[from] StoreError),

    /// A call in a [client session](crate::session) is numbered at or below the session's
    /// acknowledged mark: the client said it holds that answer, and it was dropped. Nothing
    /// ran. Client: this is a bug in the client (it reused a number it had acknowledged); never
    /// retry it as new work.
    #[error(
        "session request {seq} is at or below the acknowledged mark {ack}; its answer was dropped"
    )]
    SequenceAcknowledged {
        /// The call's sequence number.
        seq: u64,
        /// The session's acknowledged mark.
        ack: u64,
    },

    /// A call in a [client session](crate::session) is numbered more than the window past
    /// the acknowledged mark. Nothing ran. Client: wait for earlier answers, acknowledge them,
    /// and send this one again.
    #[error(
        "session request {seq} is more than the window {window} past the acknowledged mark {ack}"
    )]
    SessionWindowFull {
        /// The call's sequence number.
        seq: u64,
        /// The session's acknowledged mark.
        ack: u64,
        /// The session window.
        window: u64,
    },

    /// A call says its [client session](crate::session) holds answers (`ack > 0`), but the
    /// server knows no such session: it was forgotten after its idle time, and what ran in it
    /// cannot be told. Nothing ran. Client: find out what the session's unanswered requests
    /// did by other means, then start a new session.
    #[error("the idempotency session is unknown or expired")]
    SessionExpired,

    /// A [step](crate::steps) could not run or keep its checkpoint: its name is invalid, its
    /// result is too large to keep, or its saved checkpoint does not decode. A programming
    /// error, answered like [`Payload`](Self::Payload).
    #[error(transparent)]
    Checkpoint(#[from] crate::steps::CheckpointError),

    /// A call marked [`Call::resume_only`](crate::Call::resume_only) found no abandoned
    /// operation to take over (it finished, someone else took it over, or it expired), so
    /// nothing ran. Only a completer makes such calls; answered like
    /// [`ClaimLost`](Self::ClaimLost).
    #[error("there is no abandoned operation under this key to resume")]
    NothingToResume,
}

impl Error {
    /// How long a client should wait before retrying, where a retry can succeed.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::InFlight { retry_after } => Some(*retry_after),
            Error::ClaimLost | Error::ShuttingDown | Error::SessionWindowFull { .. } => {
                Some(crate::MAX_IN_FLIGHT_RETRY_HINT)
            }
            Error::Store(e) => e.retry_after(),
            _ => None,
        }
    }

    /// The stable code of this error: the problem document's `code` behind the HTTP layer,
    /// the `idempotent-error` metadata entry behind the gRPC layer, and the `outcome` of log
    /// events. See [`ProblemCode`] for its HTTP and gRPC statuses.
    pub fn code(&self) -> ProblemCode {
        match self {
            Error::InvalidKey(_) => ProblemCode::InvalidKey,
            Error::FingerprintMismatch => ProblemCode::FingerprintMismatch,
            Error::InFlight { .. } => ProblemCode::InFlight,
            Error::ResultNotRetained => ProblemCode::ResultNotRetained,
            Error::ClaimLost | Error::NothingToResume => ProblemCode::ClaimLost,
            Error::Checkpoint(_) => ProblemCode::PayloadError,
            Error::ShuttingDown => ProblemCode::ShuttingDown,
            Error::CorruptRecord(_) | Error::Store(StoreError::Corrupt(_)) => {
                ProblemCode::CorruptRecord
            }
            Error::Fingerprint(_) => ProblemCode::InvalidFingerprint,
            Error::Payload(_) => ProblemCode::PayloadError,
            Error::Store(StoreError::Capacity { .. }) => ProblemCode::StoreCapacity,
            Error::Store(_) => ProblemCode::StoreUnavailable,
            Error::SequenceAcknowledged { .. } => ProblemCode::SequenceAcknowledged,
            Error::SessionWindowFull { .. } => ProblemCode::SessionWindowFull,
            Error::SessionExpired => ProblemCode::SessionExpired,
        }
    }
}

/// What a store reports when an operation fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// `complete`, `release` or `renew` was called with a token that is not the record's current
    /// one: the caller's lease ended and another caller took over (or the record is gone). The
    /// record was left as it was.
    #[error("fencing token rejected: the claim is no longer held by this caller")]
    TokenRejected,

    /// The store is full of live records and refuses new ones rather than evicting them.
    #[error(
        "idempotency store is full ({what}); it refuses writes rather than evicting live records"
    )]
    Capacity {
        /// Which bound was hit.
        what: &'static str,
    },

    /// The backend could not be reached or did not answer.
    #[error("idempotency store is unavailable")]
    Unavailable(#[source] BoxError),

    /// The backend answered with something this store cannot interpret.
    #[error("idempotency store returned data it cannot decode")]
    Corrupt(#[source] BoxError),

    /// Any other backend failure.
    #[error("idempotency store failed")]
    Backend(#[source] BoxError),
}

impl StoreError {
    /// How long to wait before retrying an operation that failed with this error.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            StoreError::Unavailable(_) | StoreError::Capacity { .. } | StoreError::Backend(_) => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        }
    }
}
