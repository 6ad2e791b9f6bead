//! How a call answers what its claim finds: run, replay, wait, or fail.

use std::time::Duration;

use crate::envelope::{self, Integrity, Stored};
use crate::{Claim, Error, FencingToken, Fingerprint, InFlightPolicy, StorageKey};

/// The longest retry hint given for a call in flight. The owner's lease bounds how long the
/// key can stay locked, but work usually finishes long before its lease ends, so clients are
/// told to come back soon rather than when the lease would end.
pub const MAX_IN_FLIGHT_RETRY_HINT: Duration = Duration::from_secs(1);

const FIRST_WAIT_POLL: Duration = Duration::from_millis(5);
const LAST_WAIT_POLL: Duration = Duration::from_millis(200);

/// What a call does next with a store's answer to its claim.
pub enum Step {
    /// The call owns the key with this token, in the record lifetime the second token began:
    /// run the work.
    Owner(FencingToken, FencingToken),
    /// An earlier call completed: replay these result bytes.
    Replay(bytes::Bytes),
    /// The key is in flight and the call waits: claim again after at most this long.
    Wait(Duration),
}

/// How a call answers what its claims find, under its in-flight policy. Every claim loop (the
/// runtime's, and the PostgreSQL transactional mode's) decides through this one, so they agree
/// on fingerprint checks, corrupt records, retry hints and how long to wait.
pub struct ClaimAnswer {
    integrity: Integrity,
    deadline: Deadline,
    poll: Duration,
}

/// Until when a call waits for a key in flight.
#[derive(Clone, Copy)]
enum Deadline {
    /// It does not wait ([`InFlightPolicy::Reject`]).
    Now,
    /// Until this instant.
    At(tokio::time::Instant),
    /// With no deadline: the policy's `max` is past what the clock can represent.
    Never,
}

impl ClaimAnswer {
    /// A claim loop under `policy`, reading envelopes with `integrity`: the deadline of a
    /// waiting policy starts now.
    pub fn new(policy: InFlightPolicy, integrity: Integrity) -> Self {
        ClaimAnswer {
            integrity,
            deadline: match policy {
                InFlightPolicy::Reject => Deadline::Now,
                InFlightPolicy::Wait { max } => tokio::time::Instant::now()
                    .checked_add(max)
                    .map_or(Deadline::Never, Deadline::At),
            },
            poll: FIRST_WAIT_POLL,
        }
    }

    /// The next step for a call with `fingerprint` whose claim on `key` found `claim`.
    pub fn step(
        &mut self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        claim: Claim,
    ) -> Result<Step, Error> {
        let (recorded, found) = match claim {
            Claim::Claimed(token) => return Ok(Step::Owner(token, token)),
            Claim::TakenOver { token, lifetime } => return Ok(Step::Owner(token, lifetime)),
            Claim::Completed {
                fingerprint,
                payload,
                ..
            } => (fingerprint, Ok(payload)),
            Claim::InFlight {
                fingerprint,
                retry_after,
            } => (fingerprint, Err(retry_after)),
        };
        if recorded != *fingerprint {
            tracing::info!(storage_key = %key, "idempotency key reused with a different fingerprint");
            return Err(Error::FingerprintMismatch);
        }
        match found {
            Ok(payload) => match envelope::decode(&payload, self.integrity) {
                Ok(Stored::Value(bytes)) => Ok(Step::Replay(bytes)),
                Ok(Stored::NotRetained) => Err(Error::ResultNotRetained),
                Err(e) => {
                    tracing::error!(storage_key = %key, error = %e, "corrupt idempotency record");
                    Err(Error::CorruptRecord(e.into()))
                }
            },
            Err(retry_after) => {
                let hint = retry_after.min(MAX_IN_FLIGHT_RETRY_HINT);
                let now = tokio::time::Instant::now();
                let left = match self.deadline {
                    Deadline::Now => None,
                    Deadline::At(deadline) => deadline
                        .checked_duration_since(now)
                        .filter(|left| !left.is_zero()),
                    Deadline::Never => Some(Duration::MAX),
                };
                let Some(left) = left else {
                    tracing::debug!(storage_key = %key, "idempotent call in flight");
                    return Err(Error::InFlight { retry_after: hint });
                };
                let wait = self.poll.min(left).min(retry_after.max(FIRST_WAIT_POLL));
                self.poll = (self.poll * 2).min(LAST_WAIT_POLL);
                Ok(Step::Wait(wait))
            }
        }
    }
}
