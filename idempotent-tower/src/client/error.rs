//! [`ClientError`]: why a call through the client failed without an answer, and [`GiveUp`]:
//! what ended its retries.

use std::fmt;

use idempotent_core::{BoxError, KeyError};

/// Why a call through the client layer failed without an answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request body is larger than the policy's
    /// [`max_request_body`](super::RetryPolicy::max_request_body): it could not be kept for a
    /// retry, and nothing was sent.
    #[error(
        "the request body is over the client's limit of {limit} bytes; nothing was sent (raise RetryPolicy::max_request_body)"
    )]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The request body could not be read; nothing was sent.
    #[error("the request body could not be read; nothing was sent")]
    Body(#[source] BoxError),
    /// The key given in [`IdempotencyKey::new`](super::IdempotencyKey::new) is not a valid key.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// No attempt got an answer before the attempts, the deadline or the budget ran out. The
    /// call may or may not have run: send the same request with `key` to find out (it will
    /// not run twice).
    #[error(
        "no answer after {attempts} attempts ({reason}); the call may have run: send the same request with the key {key:?} to learn its outcome"
    )]
    GaveUp {
        /// The call's key.
        key: String,
        /// Requests sent.
        attempts: u32,
        /// What ran out.
        reason: GiveUp,
        /// The last attempt's error.
        #[source]
        last: BoxError,
    },
    /// A request the layer does not protect (another method) failed.
    #[error("the request failed")]
    Unprotected(#[source] BoxError),
}

/// What ended the retries of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUp {
    /// [`RetryPolicy::max_attempts`](super::RetryPolicy::max_attempts) were sent.
    Attempts,
    /// The next attempt would start after [`RetryPolicy::deadline`](super::RetryPolicy::deadline).
    Deadline,
    /// The retry budget was spent.
    Budget,
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GiveUp::Attempts => "attempts exhausted",
            GiveUp::Deadline => "deadline reached",
            GiveUp::Budget => "retry budget spent",
        })
    }
}
