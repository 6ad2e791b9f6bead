//! Recording a call's outcome once its work has run: the first write, the fallback to "ran, not
//! retained", and the bounded retries that keep the claim alive until the record lands.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::claim::KeyClaim;
use crate::envelope;
use crate::lease::{Renewal, attempt_limit, bounded, later};
use crate::run_to_end::RunToEnd;
use crate::runtime::ClaimedAt;
use crate::shutdown::ActiveOwned;
use crate::store::BoxFuture;
use crate::{Idempotency, StorageKey, StoreError};

impl<C: crate::capability::Capabilities> Idempotency<C> {
    /// Finishes recording the outcome after a first write that did not succeed at once: waits
    /// for it (bounded), falls back to the small "not retained" record if the result does not
    /// fit, and if the store still fails, retries on a task of its own (the caller gets its
    /// value now) while the lease is kept alive, so duplicates are answered "in flight" and
    /// then replayed, never run again. It gives up when the store rejects the token (the claim
    /// is provably lost) or after the runtime's record retry bound. Runs inside
    /// [`RunToEnd`](crate::RunToEnd): once the work has run, abandoning the write would leave the claim to
    /// lapse and a retry to run the work again.
    pub(crate) async fn record(&self, recording: Recording, first: First) {
        let Recording {
            claim,
            claimed_at,
            renewal,
            payload,
            ttl,
            active,
        } = recording;
        let key = claim.storage_key();
        let limit = first_record_limit(claim.lease());
        let outcome = match first {
            First::InFlight(write) => match bounded(write, limit).await {
                Some(outcome) => RecordError::from_store(outcome),
                None => Err(RecordError::TimedOut(limit)),
            },
            First::Failed(error) => RecordError::from_store(Err(error)),
        };
        let outcome = self
            .or_not_retained(outcome, &claim, &payload, ttl, limit)
            .await;
        let error = match outcome {
            Ok(()) => {
                claim.mark_completed();
                return;
            }
            Err(RecordError::Lost) => {
                claim.mark_lost("the store rejected its token when the result was recorded");
                tracing::warn!(
                    storage_key = %key,
                    token = claim.token().get(),
                    "idempotent call ran but the store refused its record (the claim was lost): the record of the owner that holds the key now stands"
                );
                return;
            }
            Err(error) => error,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing to retry on: the claim ends with its lease.
            claim.mark_released();
            return;
        };
        tracing::warn!(
            storage_key = %key,
            error = %error,
            "idempotent call ran but its result could not be recorded yet; retrying while its claim is kept alive"
        );
        // Without a renewal yet, the work finished without waiting and the claim came at most
        // one attempt (two bounded writes: the result, then the small record) ago.
        let renewal =
            renewal.or_else(|| Renewal::start(&claim, claimed_at.instant_within(limit * 2)));
        let this = self.clone();
        runtime.spawn(async move {
            this.record_with_retries(claim, payload, ttl, renewal).await;
            drop(active);
        });
    }

    async fn record_with_retries(
        &self,
        claim: KeyClaim,
        payload: Payload,
        ttl: Duration,
        renewal: Option<Renewal>,
    ) {
        let key = claim.storage_key();
        // A write that takes longer than its limit is abandoned and tried again with twice the
        // limit, so a hung connection is given up while a store that is merely slow still
        // gets the time it needs.
        let mut limit = first_record_limit(claim.lease());
        let deadline = later(tokio::time::Instant::now(), self.inner.record_retry);
        let mut backoff = FIRST_RECORD_BACKOFF;
        let mut attempts = 1u32;
        loop {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(LAST_RECORD_BACKOFF);
            limit = (limit * 2).min(self.inner.record_retry.max(limit));
            attempts += 1;
            self.inner.metrics().completion_retries.increment(1);
            let error = match self.complete_once(&claim, &payload, ttl, limit).await {
                Ok(()) => {
                    tracing::info!(storage_key = %key, attempts, "idempotent result recorded after retries");
                    return;
                }
                // An earlier attempt may have landed with its reply lost, or another owner
                // took over after the lease lapsed: either way nothing is left to write.
                Err(RecordError::Lost) => {
                    tracing::warn!(storage_key = %key, attempts, "the store rejected the claim's token while the result was being recorded again: an earlier attempt landed, or the claim was lost");
                    claim.mark_lost(
                        "the store rejected its token when the result was recorded again",
                    );
                    return;
                }
                Err(error) => error,
            };
            if tokio::time::Instant::now() >= deadline {
                drop(renewal);
                // Given up: the claim ends with its lease. Whoever waits for the record (the
                // consumer runtime, before it acknowledges) learns it now.
                claim.mark_released();
                tracing::error!(
                    storage_key = %key,
                    attempts,
                    error = %error,
                    "idempotent call ran but its result could not be recorded; gave up, the claim ends with its lease and a later retry may run the work again"
                );
                return;
            }
        }
    }

    /// One attempt at completing the record.
    async fn complete_once(
        &self,
        claim: &KeyClaim,
        payload: &Payload,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        let outcome = self
            .complete_bounded(claim, payload.envelope(self.inner.integrity), ttl, limit)
            .await;
        self.or_not_retained(outcome, claim, payload, ttl, limit)
            .await
    }

    /// A result the store has no room for is replaced by the small "ran, result not retained"
    /// record, so that a retry is refused rather than run again (a store full of live records
    /// may stay full). Any other outcome stands.
    async fn or_not_retained(
        &self,
        outcome: Result<(), RecordError>,
        claim: &KeyClaim,
        payload: &Payload,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        match outcome {
            Err(RecordError::Store(StoreError::Capacity { what }))
                if matches!(payload, Payload::Value(_)) =>
            {
                tracing::warn!(storage_key = %claim.storage_key(), what, "idempotency store full; recording the call without its result");
                self.complete_bounded(claim, envelope::encode_not_retained(), ttl, limit)
                    .await
            }
            other => other,
        }
    }

    /// One `complete`, abandoned after `limit`.
    async fn complete_bounded(
        &self,
        claim: &KeyClaim,
        bytes: Bytes,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        let key = claim.storage_key();
        let outcome = bounded(
            Arc::clone(&self.inner.store).complete(key, claim.token(), bytes, ttl),
            limit,
        )
        .await;
        match outcome {
            Some(outcome) => {
                let outcome = RecordError::from_store(outcome);
                if outcome.is_ok() {
                    claim.mark_completed();
                    tracing::debug!(storage_key = %key, "idempotent call completed");
                }
                outcome
            }
            None => Err(RecordError::TimedOut(limit)),
        }
    }
}

/// Everything needed to record a call's outcome once its work has run.
pub(crate) struct Recording {
    pub(crate) claim: KeyClaim,
    pub(crate) claimed_at: ClaimedAt,
    pub(crate) renewal: Option<Renewal>,
    pub(crate) payload: Payload,
    pub(crate) ttl: Duration,
    /// Counts the call in flight until its outcome is recorded (see graceful shutdown).
    pub(crate) active: ActiveOwned,
}

/// The first write of a record that did not succeed at once.
pub(crate) enum First {
    /// The store has not answered yet.
    InFlight(BoxFuture<'static, Result<(), StoreError>>),
    /// The store answered with this error.
    Failed(StoreError),
}

/// What a completion writes: the result, or the mark that the call ran and its result is not
/// kept. [`envelope`](Payload::envelope) turns it into the bytes a store keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// The result, to be written in an envelope.
    Value(Bytes),
    /// The call ran; its result is not kept.
    NotRetained,
}

impl Payload {
    /// What to write for a result: itself, or "ran, not retained" when there is none or it
    /// is larger than the runtime keeps.
    pub fn new(key: &StorageKey, result: Option<Bytes>, max: usize) -> Payload {
        match result {
            Some(result) if result.len() <= max => Payload::Value(result),
            Some(result) => {
                tracing::warn!(
                    storage_key = %key,
                    bytes = result.len(),
                    max,
                    "idempotent result too large to retain; retries will get result_not_retained"
                );
                Payload::NotRetained
            }
            None => Payload::NotRetained,
        }
    }

    /// The bytes to store: encoded per attempt, so that a call does not copy the envelope
    /// in case a retry needs it again.
    pub fn envelope(&self, integrity: envelope::Integrity) -> Bytes {
        match self {
            Payload::Value(result) => envelope::encode_value(result, integrity),
            Payload::NotRetained => envelope::encode_not_retained(),
        }
    }
}

enum RecordError {
    Lost,
    Store(StoreError),
    TimedOut(Duration),
}

impl RecordError {
    fn from_store(outcome: Result<(), StoreError>) -> Result<(), RecordError> {
        match outcome {
            Ok(()) => Ok(()),
            Err(StoreError::TokenRejected) => Err(RecordError::Lost),
            Err(error) => Err(RecordError::Store(error)),
        }
    }
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Lost => f.write_str("the claim was lost"),
            RecordError::Store(error) => match std::error::Error::source(error) {
                Some(source) => write!(f, "{error}: {source}"),
                None => write!(f, "{error}"),
            },
            RecordError::TimedOut(limit) => write!(f, "the store did not answer within {limit:?}"),
        }
    }
}

/// How long the first attempt at writing a record may take: a third of the lease (the renewal
/// period; the lease is renewed meanwhile), at least 10 ms.
fn first_record_limit(lease: Duration) -> Duration {
    (lease / 3).max(attempt_limit(lease))
}

const FIRST_RECORD_BACKOFF: Duration = Duration::from_millis(20);
const LAST_RECORD_BACKOFF: Duration = Duration::from_secs(2);

/// `write`, with the call counted in flight until it is done, run to its end even if the caller
/// stops waiting for it.
pub(crate) fn finish(
    write: impl Future<Output = ()> + Send + 'static,
    active: ActiveOwned,
) -> RunToEnd<()> {
    RunToEnd::new(async move {
        write.await;
        drop(active);
    })
}
