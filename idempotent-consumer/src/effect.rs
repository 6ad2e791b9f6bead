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
    /// Not applied, and delivered as often as the consumer allows, as counted on the
    /// message's record ([`Count`]): dead-lettered now.
    Exhausted(Failure),
}

/// The runtime counts this message's deliveries on its record: its source does not
/// ([`Source::counts_deliveries`](crate::Source::counts_deliveries)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Count {
    /// [`Consumer::max_deliveries`](crate::Consumer::max_deliveries).
    pub(crate) max: u64,
    /// The deliveries the source made itself ([`Message::deliveries`]).
    pub(crate) seen: u64,
}

impl Count {
    /// How a message's handling that ended in `processed` stands, `deliveries` counted on
    /// its record (`None`: not counted, the handling ended before): a rejection at the bound
    /// is dead-lettered.
    fn judge(self, deliveries: Option<u64>, processed: Processed) -> Processed {
        match (processed, deliveries) {
            (Processed::Failed(failure @ Failure::Rejected(_)), Some(deliveries))
                if deliveries >= self.max =>
            {
                Processed::Exhausted(failure)
            }
            (processed, _) => processed,
        }
    }

    /// The deliveries of a message whose record counts `before` earlier ones, `answered` of
    /// which ended with an answer (its handler returned): every one counts toward the
    /// rejected bound (as a broker counts them), at least those this source made itself;
    /// `Err` when `max_deliveries` earlier ones ended without an answer (their consumers died
    /// while handling it): its handler must not run again.
    fn deliveries(self, before: u64, answered: u64) -> Result<u64, Failure> {
        let deliveries = before.saturating_add(1).max(self.seen);
        let crashes = before.saturating_sub(answered);
        if crashes >= self.max {
            return Err(Failure::Rejected(format!(
                "delivered {deliveries} times; {crashes} of its deliveries ended without an \
                 answer (their consumers stopped while handling it), max_deliveries is {}",
                self.max
            )));
        }
        Ok(deliveries)
    }
}

/// The step that marks a claim mode delivery answered (its handler returned): delivery `n`
/// (from 1) on the record.
fn answered_step(n: u64) -> String {
    format!("idempotent-consumer.answered.{n}")
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

    /// Applies the message; with `count`, counting its delivery on its record first.
    fn apply(
        &self,
        prepared: &Prepared<Self::Input>,
        count: Option<Count>,
    ) -> impl Future<Output = Processed> + Send;
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

    async fn apply(&self, prepared: &Prepared<H::Input>, count: Option<Count>) -> Processed {
        // The claim the work ran under: after the work, whether its record is written.
        let ran_under: std::sync::Mutex<Option<ClaimHandle>> = std::sync::Mutex::new(None);
        // The deliveries counted on the record, when counted.
        let counted: std::sync::Mutex<Option<u64>> = std::sync::Mutex::new(None);
        let work = async {
            match ClaimHandle::current() {
                Some(claim) => {
                    *ran_under
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(claim.clone());
                    let Some(count) = count else {
                        return self.handler.handle(&prepared.input, &claim).await;
                    };
                    // A checkpoint of the runtime's own, written with the claim's token: it
                    // survives this process, and a crash leaves the record in flight with it,
                    // for the next delivery's claim to take over. Deliveries whose handler
                    // returned are marked with a step of their own.
                    let counting = |error: Error| {
                        Failure::Transient(format!(
                            "cannot count the delivery on its record: {}",
                            chain(&error)
                        ))
                    };
                    let before = u64::from(claim.count_attempt().await.map_err(counting)?);
                    let mut answered = 0;
                    for n in 1..=before {
                        if claim
                            .saved_step::<()>(&answered_step(n))
                            .await
                            .map_err(counting)?
                            .is_some()
                        {
                            answered += 1;
                        }
                    }
                    let deliveries = count.deliveries(before, answered);
                    *counted
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) =
                        Some(deliveries.as_ref().map_or(u64::MAX, |d| *d));
                    deliveries?;
                    let result = self.handler.handle(&prepared.input, &claim).await;
                    if result.is_err() {
                        // Best effort: unmarked, it counts as a crash.
                        let _ = claim.step(&answered_step(before + 1), async {}).await;
                    }
                    result
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
        let processed = match execution {
            Ok(Execution::Fresh(Ok(_))) => match claim {
                Some(claim) => durable(&claim).await,
                None => Processed::Applied,
            },
            Ok(Execution::Fresh(Err(failure))) => Processed::Failed(failure),
            Ok(Execution::Replayed(_)) => Processed::Duplicate,
            Err(error) => sort(error),
        };
        match count {
            Some(count) => count.judge(
                counted
                    .into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                processed,
            ),
            None => processed,
        }
    }
}

#[cfg(feature = "postgres")]
pub(crate) use self::transactional::InTransaction;
#[cfg(feature = "postgres")]
pub use self::transactional::sql_failure;

#[cfg(feature = "postgres")]
pub(crate) mod transactional {
    use super::{Count, Effect, Prepared, Processed, chain, prepare, sort};
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
        pub(crate) deliveries: Deliveries,
    }

    /// Deliveries counted durably, for a source that does not count them (Kafka): one row per
    /// message in hand in `<records table>_deliveries`, counted in a statement of its own before
    /// each delivery's transaction (so a crash inside it still counts), its `answered` column
    /// counted after each delivery that ended otherwise (a failure, a duplicate), and deleted
    /// by the transaction that applies the message.
    pub(crate) struct Deliveries {
        /// The statements, built once: create, sweep, count, answered, forget.
        create: String,
        sweep: String,
        count: String,
        answered: String,
        forget: String,
        created: tokio::sync::OnceCell<()>,
        counted: std::sync::atomic::AtomicU64,
    }

    /// Rows untouched this long are deleted (messages dead-lettered or handled elsewhere).
    const DELIVERIES_KEPT: &str = "7 days";

    impl Deliveries {
        /// The table beside `transactional`'s records table (validated there as a plain,
        /// optionally schema-qualified, lowercase identifier).
        pub(crate) fn beside(transactional: &Transactional) -> Self {
            let table = match transactional.table().split_once('.') {
                Some((schema, name)) => format!("\"{schema}\".\"{name}_deliveries\""),
                None => format!("\"{}_deliveries\"", transactional.table()),
            };
            Deliveries {
                create: format!(
                    "CREATE TABLE IF NOT EXISTS {table} (storage_key bytea PRIMARY KEY, \
                     deliveries bigint NOT NULL, answered bigint NOT NULL DEFAULT 0, \
                     updated_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ),
                sweep: format!(
                    "DELETE FROM {table} \
                     WHERE updated_at < clock_timestamp() - interval '{DELIVERIES_KEPT}'"
                ),
                count: format!(
                    "INSERT INTO {table} AS d (storage_key, deliveries) VALUES ($1, 1) \
                     ON CONFLICT (storage_key) DO UPDATE \
                     SET deliveries = d.deliveries + 1, updated_at = clock_timestamp() \
                     RETURNING deliveries, answered"
                ),
                answered: format!(
                    "UPDATE {table} SET answered = answered + 1 WHERE storage_key = $1"
                ),
                forget: format!("DELETE FROM {table} WHERE storage_key = $1"),
                created: tokio::sync::OnceCell::new(),
                counted: std::sync::atomic::AtomicU64::new(0),
            }
        }

        /// Counts one more delivery of the message stored at `key`: how many were counted
        /// before this one, and how many of those were answered.
        async fn count(&self, pool: &sqlx::PgPool, key: &[u8]) -> Result<(u64, u64), sqlx::Error> {
            self.created
                .get_or_try_init(|| async {
                    let create = &self.create;
                    // Two consumers creating it at once: one of them may fail on the catalog's
                    // unique index; the table is there then.
                    match sqlx::query(create).execute(pool).await {
                        Ok(_) => Ok(()),
                        Err(_) => sqlx::query(create).execute(pool).await.map(|_| ()),
                    }
                })
                .await?;
            let n = self
                .counted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n % 1024 == 1023 {
                sqlx::query(&self.sweep).execute(pool).await?;
            }
            let (deliveries, answered): (i64, i64) = sqlx::query_as(&self.count)
                .bind(key)
                .fetch_one(pool)
                .await?;
            let count = |n: i64| u64::try_from(n).unwrap_or(0);
            Ok((count(deliveries).saturating_sub(1), count(answered)))
        }

        /// The delivery of the message stored at `key` ended with an answer.
        async fn answered(&self, pool: &sqlx::PgPool, key: &[u8]) -> Result<(), sqlx::Error> {
            sqlx::query(&self.answered)
                .bind(key)
                .execute(pool)
                .await
                .map(|_| ())
        }

        /// Forgets the message's count, in the transaction that applies it.
        async fn forget(&self, tx: &mut sqlx::PgConnection, key: &[u8]) -> Result<(), sqlx::Error> {
            sqlx::query(&self.forget)
                .bind(key)
                .execute(tx)
                .await
                .map(|_| ())
        }
    }

    impl<H: TxHandler> Effect for InTransaction<H> {
        type Input = H::Input;

        fn prepare(&self, message: &Message) -> Result<Prepared<H::Input>, Failure> {
            prepare(&self.handler, message)
        }

        async fn apply(&self, prepared: &Prepared<H::Input>, count: Option<Count>) -> Processed {
            let Some(count) = count else {
                return match self.attempt(prepared, None).await {
                    Ok(processed) => processed,
                    Err(failure) => Processed::Failed(failure),
                };
            };
            let key = self.transactional.storage_key(&prepared.call);
            let deliveries = match self.deliveries.count(&self.pool, key.as_bytes()).await {
                Ok((before, answered)) => count.deliveries(before, answered),
                Err(error) => {
                    return Processed::Failed(Failure::Transient(format!(
                        "cannot count the delivery: {}",
                        chain(&error)
                    )));
                }
            };
            let deliveries = match deliveries {
                Ok(deliveries) => deliveries,
                Err(failure) => return Processed::Exhausted(failure),
            };
            let processed = match self.attempt(prepared, Some(key.as_bytes())).await {
                Ok(processed) => processed,
                Err(failure) => Processed::Failed(failure),
            };
            if !matches!(processed, Processed::Applied)
                && let Err(error) = self.deliveries.answered(&self.pool, key.as_bytes()).await
            {
                // Unmarked, this delivery counts as one that crashed.
                tracing::warn!(%error, "cannot mark a delivery answered");
            }
            count.judge(Some(deliveries), processed)
        }
    }

    impl<H: TxHandler> InTransaction<H> {
        /// One transaction: claim, handle, complete, commit. Any early return drops the
        /// transaction, which rolls it back, claim and all.
        async fn attempt(
            &self,
            prepared: &Prepared<H::Input>,
            counted: Option<&[u8]>,
        ) -> Result<Processed, Failure> {
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
            if let Some(key) = counted {
                self.deliveries
                    .forget(&mut tx, key)
                    .await
                    .map_err(|e| sql_failure("forgetting the delivery count", &e))?;
            }
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
