//! The three kinds of [`Failure`] a message can end in: malformed, rejected, transient.

use std::fmt;

/// Why a message was not applied, and so what becomes of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The message is at fault whatever the moment (it cannot be decoded, its key is reused
    /// for other content): dead-lettered at once.
    Malformed(String),
    /// The data was refused (a constraint, an overflow), which can depend on the moment:
    /// retried, and dead-lettered from its
    /// [`max_deliveries`](crate::Consumer::max_deliveries)-th delivery on.
    Rejected(String),
    /// The system failed, not the message: retried with backoff until it succeeds.
    Transient(String),
}

impl Failure {
    /// The reason kept with the dead letter and logged.
    pub fn reason(&self) -> &str {
        match self {
            Failure::Malformed(reason) | Failure::Rejected(reason) | Failure::Transient(reason) => {
                reason
            }
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Failure::Malformed(_) => "malformed",
            Failure::Rejected(_) => "rejected",
            Failure::Transient(_) => "transient",
        };
        write!(f, "{kind}: {}", self.reason())
    }
}

impl std::error::Error for Failure {}

/// An invalid key is the message's fault: [`Failure::Malformed`].
impl From<idempotent_core::KeyError> for Failure {
    fn from(error: idempotent_core::KeyError) -> Self {
        Failure::Malformed(format!("the key is not valid: {error}"))
    }
}

/// A fingerprint that cannot be computed is the message's fault: [`Failure::Malformed`].
impl From<idempotent_core::CanonicalError> for Failure {
    fn from(error: idempotent_core::CanonicalError) -> Self {
        Failure::Malformed(format!("cannot fingerprint the message: {error}"))
    }
}
