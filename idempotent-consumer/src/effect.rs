//! The two ways a message's effect is made once: under a claim in any store, or inside the
//! PostgreSQL transaction that records it.

use std::future::Future;

use bytes::Bytes;

use super::{Decode, Failure, Handler, Message};
use idempotent_core::metrics::{ProtocolLabel, RequestOutcome};
use idempotent_core::{Call, ClaimHandle, Error, Execution, Idempotency, Retain, StoreError};

/// How one message's handling ended, before the broker is answered.
#[derive(Debug)]
pub(crate) enum Processed {
    /// The handler ran and its record is durable.
    Applied,
    /// The key was recorded already: nothing ran.
    Duplicate,
    /// Not applied.
    Failed(Failure),
}

/// A decoded message, ready to be applied.
pub(crate) struct Prepared<I> {
    pub(crate) input: I,
    pub(crate) call: Call,
    pub(crate) ordering: Option<String>,
}

/// What the runner needs of a mode.
pub(crate) trait Effect: Send + Sync + 'static {
    type Input: Send + Sync + 'static;

    fn prepare(&self, message: &Message) -> Result<Prepared<Self::Input>, Failure>;

    fn apply(&self, prepared: &Prepared<Self::Input>) -> impl Future<Output = Processed> + Send;
}

fn prepare<D: Decode + ?Sized>(
    decoder: &D,
    message: &Message,
) -> Result<Prepared<D::Input>, Failure> {
    let input = decoder.decode(message)?;
    let key = decoder.key(message, &input)?;
    let fingerprint = decoder.fingerprint(message, &input)?;
    let ordering = decoder.ordering_key(message, &input);
    let mut call = Call::new(key).fingerprint(fingerprint);
    if let Some(scope) = decoder.scope(message, &input) {
        call = call.scope(scope);
    }
    Ok(Prepared {
        input,
        call,
        ordering,
    })
}

/// The runtime's error, as a failure of the message or of the system.
fn sort(error: Error) -> Processed {
    match error {
        Error::FingerprintMismatch => Processed::Failed(Failure::Malformed(
            "fingerprint mismatch: the key was already used for a message with other content"
                .into(),
        )),
        // The work ran once; its result was not kept. Running it again is what the record
        // forbids: the message is done.
        Error::ResultNotRetained => Processed::Duplicate,
        // The record is there and cannot be read: the runtime never takes it for absent, so
        // every delivery would meet it again. An operator can repair it; a retry cannot. The
        // same whether the runtime found it undecodable or the store did (PostgreSQL's
        // fingerprint of the wrong length, a completed row without payload, an unknown state;
        // Redis's unknown state): `Error::code` treats both alike.
        error @ (Error::CorruptRecord(_)
        | Error::Store(StoreError::Corrupt(_))
        | Error::Payload(_)) => {
            let code = error.code();
            Processed::Failed(Failure::Malformed(format!(
                "the stored record cannot be decoded: {} ({code})",
                chain(&error)
            )))
        }
        error @ (Error::InvalidKey(_) | Error::Fingerprint(_)) => {
            Processed::Failed(Failure::Malformed(chain(&error)))
        }
        // In flight elsewhere, a lost claim, a shutdown, the store: not the message's fault.
        error => {
            let code = error.code();
            Processed::Failed(Failure::Transient(format!("{} ({code})", chain(&error))))
        }
    }
}

/// Applied, once the record of the work that ran under `claim` is written. When the first
/// write failed or timed out, the runtime answered at once and goes on writing in the
/// background, holding the claim (a duplicate meets it in flight): the message is not
/// acknowledged before that write lands. If the runtime gives up (its
/// [`record_retry`](idempotent_core::IdempotencyBuilder::record_retry) bound) or the claim is lost, the
/// message is retried as [`Failure::Transient`]: its redelivery meets the record if a write
/// landed after all, or, as for a call, runs again once the claim has lapsed.
async fn durable(claim: &ClaimHandle) -> Processed {
    if !claim.is_completed() {
        tracing::warn!(
            storage_key = %claim.storage_key(),
            "message applied but its record is not written yet; acknowledged once it is"
        );
        claim.settled().await;
    }
    if claim.is_completed() {
        Processed::Applied
    } else {
        Processed::Failed(Failure::Transient(
            "the handler ran but its record could not be written: delivered again".into(),
        ))
    }
}

/// `error` and its sources, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// [`Consumer::run`](super::Consumer::run)'s mode.
pub(crate) struct Claimed<H> {
    pub(crate) idempotency: Idempotency,
    pub(crate) handler: H,
}

impl<H: Handler> Effect for Claimed<H> {
    type Input = H::Input;

    fn prepare(&self, message: &Message) -> Result<Prepared<H::Input>, Failure> {
        prepare(&self.handler, message)
    }

    async fn apply(&self, prepared: &Prepared<H::Input>) -> Processed {
        // The claim the work ran under: after the work, whether its record is written.
        let ran_under: std::sync::Mutex<Option<ClaimHandle>> = std::sync::Mutex::new(None);
        let work = async {
            match ClaimHandle::current() {
                Some(claim) => {
                    *ran_under
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(claim.clone());
                    self.handler.handle(&prepared.input, &claim).await
                }
                // The runtime runs the work inside its claim's scope: never here.
                None => Err(Failure::Transient("the work ran without its claim".into())),
            }
        };
        let execution = self
            .idempotency
            .execute(
                &prepared.call,
                work,
                |result| match result {
                    Ok(_) => Retain::Keep,
                    Err(_) => Retain::Release,
                },
                |result| {
                    // An output that cannot be encoded is recorded as done without a result:
                    // it ran, and must not run again.
                    let output = result.as_ref().ok()?;
                    serde_json::to_vec(output).ok().map(Bytes::from)
                },
            )
            .await;
        self.idempotency.count(
            ProtocolLabel::Message,
            match &execution {
                Ok(Execution::Fresh(_)) => RequestOutcome::Fresh,
                Ok(Execution::Replayed(_)) => RequestOutcome::Replayed,
                Err(error) => RequestOutcome::of_error(error),
            },
        );
        let claim = ran_under
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match execution {
            Ok(Execution::Fresh(Ok(_))) => match claim {
                Some(claim) => durable(&claim).await,
                None => Processed::Applied,
            },
            Ok(Execution::Fresh(Err(failure))) => Processed::Failed(failure),
            Ok(Execution::Replayed(_)) => Processed::Duplicate,
            Err(error) => sort(error),
        }
    }
}

#[cfg(feature = "postgres")]
pub(crate) use self::transactional::InTransaction;
#[cfg(feature = "postgres")]
pub use self::transactional::sql_failure;

#[cfg(feature = "postgres")]
pub(crate) mod transactional {
    use super::{Effect, Prepared, Processed, prepare, sort};
    use crate::{Failure, Message, TxHandler};
    use idempotent_core::metrics::ProtocolLabel;
    use idempotent_postgres::RawClaim;
    use idempotent_postgres::Transactional;

    /// Sorts a failed statement: SQLSTATE classes `22` (data exception), `23` (integrity
    /// constraint violation) and `54` (program limit exceeded) blame the message's data
    /// ([`Failure::Rejected`]); anything else (a lost connection, a timeout, a serialization
    /// failure, a deadlock, a shutdown) is [`Failure::Transient`].
    pub fn sql_failure(context: &str, error: &sqlx::Error) -> Failure {
        if let sqlx::Error::Database(db) = error
            && let Some(code) = db.code()
        {
            let reason = format!("{context}: {} (SQLSTATE {code})", db.message());
            return match code.get(..2) {
                Some("22" | "23" | "54") => Failure::Rejected(reason),
                _ => Failure::Transient(reason),
            };
        }
        Failure::Transient(format!("{context}: {error}"))
    }

    /// [`Consumer::run_transactional`](crate::Consumer::run_transactional)'s mode.
    pub(crate) struct InTransaction<H> {
        pub(crate) pool: sqlx::PgPool,
        pub(crate) transactional: Transactional,
        pub(crate) handler: H,
    }

    impl<H: TxHandler> Effect for InTransaction<H> {
        type Input = H::Input;

        fn prepare(&self, message: &Message) -> Result<Prepared<H::Input>, Failure> {
            prepare(&self.handler, message)
        }

        async fn apply(&self, prepared: &Prepared<H::Input>) -> Processed {
            match self.attempt(prepared).await {
                Ok(processed) => processed,
                Err(failure) => Processed::Failed(failure),
            }
        }
    }

    impl<H: TxHandler> InTransaction<H> {
        /// One transaction: claim, handle, complete, commit. Any early return drops the
        /// transaction, which rolls it back, claim and all.
        async fn attempt(&self, prepared: &Prepared<H::Input>) -> Result<Processed, Failure> {
            // A duplicate the cache tier knows is acknowledged without a transaction.
            #[cfg(feature = "cache")]
            if let Some(cached) = self
                .transactional
                .cached(&prepared.call, ProtocolLabel::Message)
                .await
            {
                return Ok(match cached {
                    Ok(_) => Processed::Duplicate,
                    Err(error) => sort(error),
                });
            }
            let mut tx = self
                .pool
                .begin()
                .await
                .map_err(|e| sql_failure("begin", &e))?;
            self.handler.begin(&mut tx).await?;
            #[cfg(feature = "cache")]
            let claim = self
                .transactional
                .claim_counted_uncached(&prepared.call, &mut tx, ProtocolLabel::Message)
                .await;
            #[cfg(not(feature = "cache"))]
            let claim = self
                .transactional
                .claim_counted(&prepared.call, &mut tx, ProtocolLabel::Message)
                .await;
            let pending = match claim {
                Ok(RawClaim::Run(pending)) => pending,
                Ok(RawClaim::Replay(_)) => return Ok(Processed::Duplicate),
                Err(error) => return Ok(sort(error)),
            };
            let claim = pending.claim();
            // In the claim's scope, as a call's work: `ClaimHandle::current()` answers, and
            // outbox messages take their default key from it.
            let output = claim
                .clone()
                .scope(self.handler.handle(&mut tx, &prepared.input, &claim))
                .await?;
            let completed = match pending.complete_recorded(&mut tx, &output).await {
                Ok(completed) => completed,
                Err(error) => return Ok(sort(error)),
            };
            tx.commit().await.map_err(|e| sql_failure("commit", &e))?;
            // Committed: the record is durable, and the tier may keep it.
            #[cfg(feature = "cache")]
            if let Some(completed) = completed {
                self.transactional.committed(completed);
            }
            #[cfg(not(feature = "cache"))]
            let _ = completed;
            Ok(Processed::Applied)
        }
    }
}
