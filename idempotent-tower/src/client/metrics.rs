//! The client's metrics, through the [`metrics`](https://docs.rs/metrics) facade, registered
//! when a [`ClientLayer`](super::ClientLayer) (or the reqwest middleware) is created.

use ::metrics::{Counter, Unit};

use super::error::{ClientError, GiveUp};
use super::verdict::{Ended, Refusal, RetryReason};

/// `idempotency.client.calls` (counter; labels `protocol`, `outcome`): logical calls, once
/// each, by how they ended.
pub const CLIENT_CALLS: &str = "idempotency.client.calls";
/// `idempotency.client.attempts` (counter; label `protocol`): requests sent, retries
/// included.
pub const CLIENT_ATTEMPTS: &str = "idempotency.client.attempts";
/// `idempotency.client.retries` (counter; labels `protocol`, `reason`): attempts that were
/// retried, by why.
pub const CLIENT_RETRIES: &str = "idempotency.client.retries";

/// How a logical call ended: the `outcome` label of [`CLIENT_CALLS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Answered,
    Replayed,
    KeyReused,
    AttemptsExhausted,
    DeadlineReached,
    BudgetSpent,
    NotSent,
    SequenceAcknowledged,
    SessionExpired,
}

impl Outcome {
    const ALL: [Outcome; 9] = [
        Outcome::Answered,
        Outcome::Replayed,
        Outcome::KeyReused,
        Outcome::AttemptsExhausted,
        Outcome::DeadlineReached,
        Outcome::BudgetSpent,
        Outcome::NotSent,
        Outcome::SequenceAcknowledged,
        Outcome::SessionExpired,
    ];

    const fn as_str(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Replayed => "replayed",
            Outcome::KeyReused => "key_reused",
            Outcome::AttemptsExhausted => "attempts_exhausted",
            Outcome::DeadlineReached => "deadline_reached",
            Outcome::BudgetSpent => "budget_spent",
            Outcome::NotSent => "not_sent",
            Outcome::SequenceAcknowledged => "sequence_acknowledged",
            Outcome::SessionExpired => "session_expired",
        }
    }

    fn gave_up(reason: GiveUp) -> Self {
        match reason {
            GiveUp::Attempts => Outcome::AttemptsExhausted,
            GiveUp::Deadline => Outcome::DeadlineReached,
            GiveUp::Budget => Outcome::BudgetSpent,
        }
    }

    fn refused(refusal: Refusal) -> Self {
        match refusal {
            Refusal::SequenceAcknowledged => Outcome::SequenceAcknowledged,
            Refusal::SessionExpired => Outcome::SessionExpired,
        }
    }
}

/// The handles of one client's metrics, registered once.
#[derive(Debug, Clone)]
pub(crate) struct ClientMetrics {
    attempts: Counter,
    retries: [Counter; RetryReason::ALL.len()],
    calls: [Counter; Outcome::ALL.len()],
}

impl ClientMetrics {
    /// Registers the metrics of a client speaking `protocol` (`http` or `grpc`) with the
    /// recorder installed now.
    pub(crate) fn register(protocol: &'static str) -> Self {
        ::metrics::describe_counter!(
            CLIENT_CALLS,
            Unit::Count,
            "Logical calls sent with an idempotency key or in a client session, by how they ended"
        );
        ::metrics::describe_counter!(
            CLIENT_ATTEMPTS,
            Unit::Count,
            "Requests sent for logical calls, retries included"
        );
        ::metrics::describe_counter!(
            CLIENT_RETRIES,
            Unit::Count,
            "Attempts retried with the same key, by why"
        );
        ClientMetrics {
            attempts: ::metrics::counter!(CLIENT_ATTEMPTS, "protocol" => protocol),
            retries: RetryReason::ALL.map(|reason| {
                ::metrics::counter!(CLIENT_RETRIES, "protocol" => protocol, "reason" => reason.as_str())
            }),
            calls: Outcome::ALL.map(|outcome| {
                ::metrics::counter!(CLIENT_CALLS, "protocol" => protocol, "outcome" => outcome.as_str())
            }),
        }
    }

    /// A request is being sent.
    pub(crate) fn attempt(&self) {
        self.attempts.increment(1);
    }

    /// An attempt is retried.
    pub(crate) fn retry(&self, why: RetryReason) {
        self.retries[why as usize].increment(1);
    }

    /// A call ended with an answer: `replayed` if it was a replay.
    pub(crate) fn answered(&self, ended: Ended, replayed: bool) {
        let outcome = match ended {
            Ended::Answered if replayed => Outcome::Replayed,
            Ended::Answered => Outcome::Answered,
            Ended::KeyReused => Outcome::KeyReused,
            Ended::GaveUp(reason) => Outcome::gave_up(reason),
            Ended::Refused(refusal) => Outcome::refused(refusal),
        };
        self.count(outcome);
    }

    /// A call ended without an answer.
    pub(crate) fn failed(&self, error: &ClientError) {
        let outcome = match error {
            ClientError::GaveUp { reason, .. } => Outcome::gave_up(*reason),
            ClientError::SequenceAcknowledged { .. } => Outcome::SequenceAcknowledged,
            ClientError::SessionExpired { .. } => Outcome::SessionExpired,
            _ => Outcome::NotSent,
        };
        self.count(outcome);
    }

    fn count(&self, outcome: Outcome) {
        self.calls[outcome as usize].increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_tables_follow_declaration_order() {
        for (i, reason) in RetryReason::ALL.into_iter().enumerate() {
            assert_eq!(reason as usize, i, "{reason:?}");
        }
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, i, "{outcome:?}");
        }
    }
}
