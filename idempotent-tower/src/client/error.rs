//! [`ClientError`]: why a call through the client failed without an answer, and [`GiveUp`]:
//! what ended its retries.

use std::fmt;

use bytes::Bytes;
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
    /// call may or may not have run: send the same request with `key` (in a session: with
    /// [`SessionSeq`](super::SessionSeq)`(seq)`) to find out (it will not run twice).
    #[error(
        "no answer after {attempts} attempts ({reason}); the call may have run: {}",
        resend_hint(key, *seq)
    )]
    GaveUp {
        /// The call's key; in a session, the session's id.
        key: String,
        /// The call's number in its session, if it was sent in one. It stays unacknowledged
        /// until the call is sent again and answered, or
        /// [`abandoned`](super::ClientSession::abandon).
        seq: Option<u64>,
        /// Requests sent: `0` for a call in a session that waited for the session's window
        /// until its deadline and was never sent.
        attempts: u32,
        /// What ran out.
        reason: GiveUp,
        /// The last attempt's error.
        #[source]
        last: BoxError,
    },
    /// The server refused call `seq` of the session as acknowledged (`410
    /// sequence_acknowledged`; gRPC `OUT_OF_RANGE`): the session's acknowledged mark is at or
    /// above it, so its answer, if it had one, was dropped. Nothing ran. A [`SessionSeq`]
    /// resent after its answer was acknowledged, or another client using the same session
    /// id; never retried, and not new work to send again with a new number.
    ///
    /// [`SessionSeq`]: super::SessionSeq
    #[error(
        "call {seq} of the idempotency session is at or below the acknowledged mark: the server dropped its answer and did not run it"
    )]
    SequenceAcknowledged {
        /// The call's number in the session.
        seq: u64,
    },
    /// The server knows the session no more (`410 session_expired`; gRPC `NOT_FOUND`): it
    /// was idle past its time and forgotten, and what ran in it cannot be told. Nothing ran.
    /// The [`ClientSession`](super::ClientSession) is expired from then on: every later call
    /// through it fails at once with this error, unsent. Find out what its unanswered calls
    /// did by other means, and open a new session.
    #[error(
        "the idempotency session is unknown or expired (call {seq}); nothing ran; open a new session"
    )]
    SessionExpired {
        /// The call's number in the session.
        seq: u64,
    },
    /// A request's [`SessionSeq`](super::SessionSeq) names a number its session never gave
    /// (0, or above [`ClientSession::last_seq`](super::ClientSession::last_seq)), or the
    /// session has given every number there is. Nothing was sent.
    #[error("the idempotency session never gave the number {seq}; nothing was sent")]
    UnknownSessionSeq {
        /// The number asked for.
        seq: u64,
    },
    /// In a session, a `410` problem document whose `code` is not a session refusal: the
    /// client read its body to learn the code, and the inner client's response body type
    /// cannot be rebuilt from bytes to return the answer as a response (hyper's `Incoming`,
    /// say). The answer is here: it is the call's, and counts as answered.
    #[error("the server answered 410 Gone (call {seq} of the session)")]
    Gone {
        /// The call's number in the session.
        seq: u64,
        /// The answer, its body read.
        answer: Box<http::Response<Bytes>>,
    },
    /// A request the layer does not protect (another method) failed.
    #[error("the request failed")]
    Unprotected(#[source] BoxError),
}

/// How to learn the outcome of a call given up on.
fn resend_hint(key: &str, seq: Option<u64>) -> String {
    match seq {
        Some(seq) => format!(
            "send the same request with SessionSeq({seq}) in the session {key:?} to learn its outcome"
        ),
        None => format!("send the same request with the key {key:?} to learn its outcome"),
    }
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
