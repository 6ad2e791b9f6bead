//! The transactional mode: the claim, the caller's work and the completed record in one
//! PostgreSQL transaction.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Executor as _;
use sqlx::postgres::PgConnection;

use super::{DEFAULT_TABLE, PostgresStore, Sql, micros, store_error, token_param};
use idempotent_core::metrics::{ProtocolLabel, RequestOutcome};
use idempotent_core::store::Payload;
use idempotent_core::store::Settings;
use idempotent_core::store::envelope::Integrity;
use idempotent_core::store::{ClaimAnswer, Step};
use idempotent_core::store::{Operation, StoreMetrics};
use idempotent_core::{
    Call, ClaimHandle, Defaults, Error, FencingToken, Idempotency, Retain, StorageKey, StoreError,
};

/// The savepoint the work runs under, so that a failed call can undo its own writes. Sent
/// without parameters, so in one round trip each.
const SAVEPOINT: &str = "SAVEPOINT idempotent_work";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT idempotent_work";
const ROLLBACK_TO_SAVEPOINT: &str =
    "ROLLBACK TO SAVEPOINT idempotent_work; RELEASE SAVEPOINT idempotent_work";
/// What releases a claim taken without a savepoint ([`Transactional::without_savepoint`]):
/// an error raised in the caller's transaction, after which PostgreSQL refuses every
/// statement of it and turns its `COMMIT` into a rollback, so that neither the work nor the
/// claim can be committed.
const ABORT_TRANSACTION: &str = "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'P0001', \
     MESSAGE = 'idempotent: a claim taken without a savepoint was released, or its result could \
     not be recorded: this transaction can only be rolled back'; END $$";

/// Exactly-once database work: the claim, your writes and the completed record commit together
/// in **your** transaction, or not at all.
///
/// With a standalone store, a crash between the effect and the completion record either
/// repeats the effect (the claim's lease ends, a retry runs it again) or loses it. Here the
/// record is a row written in the same transaction as the effect, so there is nothing in
/// between: after a commit both exist, after a rollback or a crash neither does, and a retry
/// runs the work again as if it had never started.
///
/// ```no_run
/// use idempotent_postgres::{PostgresStore, Transactional, TransactionalClaim};
/// use idempotent_core::{Call, Fingerprint, Idempotency};
/// use sqlx::PgPool;
///
/// # async fn example(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::new(pool.clone());
/// store.migrate().await?;
/// let runtime = Idempotency::builder(store.clone()).namespace("billing").build();
/// // The runtime's namespace and defaults, over the store's table: each replays the other.
/// let transactional = Transactional::of(&runtime, &store);
///
/// let mut tx = pool.begin().await?;
/// let call = Call::new("deposit-7f3a".parse()?).fingerprint(Fingerprint::of(&("acct-1", 100))?);
/// let balance: i64 = match transactional.claim(&call, &mut tx).await? {
///     TransactionalClaim::Replay(balance) => balance, // done before: nothing was written
///     TransactionalClaim::Run(pending) => {
///         let balance = sqlx::query_scalar(
///             "UPDATE accounts SET balance = balance + 100 WHERE id = 'acct-1' RETURNING balance",
///         )
///         .fetch_one(&mut *tx)
///         .await?; // on error, `tx` is dropped: rolled back, claim and all
///         pending.complete(&mut tx, &balance).await?;
///         balance
///     }
/// };
/// tx.commit().await?; // the deposit and its record, together
/// # Ok(())
/// # }
/// ```
///
/// The `#[idempotent]` attribute does the same for a function with a transaction parameter:
/// `#[idempotent(key = ..., tx = tx)]`.
///
/// # What the transaction covers
///
/// 1. **Claim**: one statement in your transaction, the same as
///    [`PostgresStore`](crate::PostgresStore)'s claim. A new or taken-over row is locked by your
///    transaction until it ends and is invisible to everyone else until it commits. A completed record is replayed; a live in-flight record
///    committed by a standalone caller is answered by the in-flight policy.
/// 2. **Work**: you run it with the same transaction (the claim took a savepoint after the
///    row).
/// 3. **Complete**: [`PendingRecord::complete`] (or an `Ok` from an `#[idempotent]` function)
///    turns the row into a completed record in your transaction and releases the savepoint.
///    Commit, and both the work and the record are durable; roll back (or crash, or drop the
///    transaction), and neither is.
/// 4. **Fail**: [`PendingRecord::release`] (or an `Err` from an `#[idempotent]` function) rolls
///    back to the savepoint, undoing the work's writes, and releases the claim in your
///    transaction. The transaction stays usable, even if the work left it aborted; whether you
///    commit or roll back, the next retry runs the work again.
///
/// A concurrent duplicate in another transaction **waits on the row** until your transaction
/// ends, then replays the committed result (or, after a rollback, claims the key and runs).
/// Bound that wait with `SET LOCAL lock_timeout` in the duplicate's transaction if needed; a
/// lock timeout fails the claim with [`StoreError::Unavailable`].
///
/// # Requirements
///
/// - The connection must be inside a transaction (`pool.begin()`, or `conn.begin()`): a claim
///   made in autocommit mode is released and fails with [`Error::Store`].
/// - Isolation `READ COMMITTED` (PostgreSQL's default). Under `REPEATABLE READ` or
///   `SERIALIZABLE`, a duplicate that started before the first transaction committed fails
///   with a serialization error ([`StoreError::Unavailable`]); retry the whole transaction,
///   which then replays.
/// - Roll back, or drop the transaction, after an error from the claim or the completion, and
///   whenever a [`PendingRecord`] was neither completed nor released (an early return, a
///   cancelled call): committing it would publish an in-flight claim that holds the key until
///   its lease ends.
///
/// Records are the same rows as [`PostgresStore`](crate::PostgresStore)'s, with results encoded
/// as JSON like [`Idempotency::run`](idempotent_core::Idempotency::run): with the same table and
/// namespace, a standalone runtime replays what a transactional call recorded, and the other
/// way round.
#[derive(Clone)]
pub struct Transactional {
    sql: Arc<Sql>,
    namespace: Arc<[u8]>,
    defaults: Defaults,
    /// Whether claims keep their key in clear (a runtime's `keys_in_clear`).
    keys_in_clear: bool,
    /// Whether a claim takes a savepoint for its work (see [`Transactional::without_savepoint`]).
    savepoint: bool,
    metrics: Arc<StoreMetrics>,
    /// The runtime's cache tier: duplicates are answered from it without a query.
    #[cfg(feature = "cache")]
    tier: Option<idempotent_cache::CacheTier>,
}

impl fmt::Debug for Transactional {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transactional")
            .field("table", &self.sql.table)
            .field("namespace", &String::from_utf8_lossy(&self.namespace))
            .field("defaults", &self.defaults)
            .field("savepoint", &self.savepoint)
            .finish()
    }
}

impl Default for Transactional {
    /// Over [`DEFAULT_TABLE`], with the empty namespace and the runtime's defaults.
    fn default() -> Self {
        Transactional::with_sql(Arc::new(
            Sql::new(DEFAULT_TABLE).expect("the default table name is valid"),
        ))
    }
}

impl Transactional {
    /// The transactional mode over `store`'s table, with the empty namespace and the
    /// runtime's default [`Defaults`]: set them with [`namespace`](Self::namespace) and
    /// [`defaults`](Self::defaults), or take both from a runtime with [`of`](Self::of).
    pub fn new(store: &PostgresStore) -> Self {
        Transactional::with_sql(Arc::clone(&store.sql))
    }

    /// The transactional mode of `runtime` over `store`: `store`'s table, with the runtime's
    /// namespace and [defaults](idempotent_core::IdempotencyBuilder::defaults), so that a
    /// transactional call and the runtime replay each other's records. `store` must be the
    /// store the runtime was built on (or the one behind its cache tier, which
    /// [`tier`](Self::tier) then names): the records are found by table, so a runtime over
    /// another store would not see this mode's records, nor this mode the runtime's.
    ///
    /// The defaults' lease is only written with a claim here: an uncommitted claim needs none
    /// (nobody else can see it), so it matters only if a transaction commits a claim it
    /// neither completed nor released. The in-flight policy answers a live in-flight record
    /// committed by a standalone caller; duplicates in other transactions are not affected:
    /// they wait on the row.
    pub fn of(runtime: &Idempotency, store: &PostgresStore) -> Self {
        Transactional::new(store)
            .namespace(runtime.namespace())
            .defaults(*runtime.defaults())
            .keys_in_clear(runtime.keys_in_clear())
    }

    /// Whether each record keeps its key in clear for an operator, as a runtime's
    /// ([`IdempotencyBuilder::keys_in_clear`](idempotent_core::IdempotencyBuilder::keys_in_clear));
    /// default `true`.
    pub fn keys_in_clear(mut self, keep: bool) -> Self {
        self.keys_in_clear = keep;
        self
    }

    /// The namespace of the storage keys, as a runtime's
    /// ([`IdempotencyBuilder::namespace`](idempotent_core::IdempotencyBuilder::namespace)).
    pub fn namespace(mut self, namespace: impl AsRef<[u8]>) -> Self {
        self.namespace = Arc::from(namespace.as_ref());
        self
    }

    /// The defaults of every call (a call's own options override them).
    pub fn defaults(mut self, defaults: Defaults) -> Self {
        self.defaults = defaults;
        self
    }

    /// Takes no savepoint after a claim, for callers that roll back the whole transaction
    /// whenever the work, its completion or a release fails (as the consumer runtime's
    /// `run_transactional` does): each claim then costs
    /// two round trips fewer (the `SAVEPOINT` and its `RELEASE`) and no subtransaction.
    ///
    /// Without a savepoint, the work cannot be undone alone, so
    /// [`release`](PendingRecord::release), and a [`complete`](PendingRecord::complete) that
    /// fails, **abort the caller's transaction** instead: PostgreSQL then refuses its further
    /// statements and turns its `COMMIT` into a rollback, so neither the work nor the claim can
    /// be committed, and a retry runs the work again. A connection that sqlx does not know to be
    /// inside a transaction (one begun with a plain `BEGIN` statement, or none) still gets the
    /// savepoint, which is also how a claim made outside a transaction is refused.
    ///
    /// **Check what `release` and `complete` return, not the `COMMIT`:** PostgreSQL answers
    /// the `COMMIT` of an aborted transaction with a rollback, which sqlx reports as success,
    /// and everything the transaction wrote is gone, including what it wrote before the claim.
    /// So this is not for a transaction that goes on after a release (as
    /// `#[idempotent(tx = …, on_error = "release")]` expects), nor for one that sends its own
    /// `COMMIT` or `ROLLBACK` statements through a sqlx transaction (sqlx's count of the
    /// transactions is then wrong). A release through a nested transaction of the one the
    /// claim was made in aborts the nested one and fails: roll back the outer one.
    pub fn without_savepoint(mut self) -> Self {
        self.savepoint = false;
        self
    }

    /// Answers duplicates from `tier` without a query: the records the tier holds, which it
    /// takes only from what is known committed, never from a row seen inside a caller's
    /// transaction. Give it the tier of the runtime's [`Cached`](idempotent_cache::Cached)
    /// store.
    #[cfg(feature = "cache")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
    pub fn tier(mut self, tier: idempotent_cache::CacheTier) -> Self {
        self.tier = Some(tier);
        self
    }
}

impl Transactional {
    fn with_sql(sql: Arc<Sql>) -> Self {
        Transactional {
            sql,
            namespace: Arc::from(&[][..]),
            defaults: Defaults::new(),
            keys_in_clear: true,
            savepoint: true,
            metrics: Arc::new(StoreMetrics::register("postgres")),
            #[cfg(feature = "cache")]
            tier: None,
        }
    }

    /// The table this mode writes to.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// The storage key (the row's primary key) `call` maps to.
    pub fn storage_key(&self, call: &Call) -> StorageKey {
        StorageKey::derive(&self.namespace, call.scope_ref(), call.key())
    }

    /// Claims `call`'s key in `connection`'s transaction, or replays the completed result.
    ///
    /// On [`TransactionalClaim::Run`], do the work with the same connection, then complete the
    /// [`PendingRecord`] (or release it) before committing.
    pub async fn claim<T: DeserializeOwned>(
        &self,
        call: &Call,
        connection: &mut PgConnection,
    ) -> Result<TransactionalClaim<T>, Error> {
        match self.claim_raw(call, connection).await? {
            RawClaim::Run(pending) => Ok(TransactionalClaim::Run(pending)),
            RawClaim::Replay(bytes) => serde_json::from_slice(&bytes)
                .map(TransactionalClaim::Replay)
                .map_err(|e| Error::Payload(e.into())),
        }
    }

    /// Claims, and counts the call by how the claim ended (`fresh` when the work is to run)
    /// in [`idempotency.requests`](idempotent_core::metrics) with protocol `call`.
    pub(crate) async fn claim_raw(
        &self,
        call: &Call,
        connection: &mut PgConnection,
    ) -> Result<RawClaim, Error> {
        self.claim_counted(call, connection, ProtocolLabel::Call)
            .await
    }

    /// [`claim`](Self::claim) without decoding a replay, counted by how the claim ended under
    /// `protocol` in `idempotency.requests`: for a runtime built on this mode (the consumer
    /// runtime's transactional mode counts its messages under `message`).
    pub async fn claim_counted(
        &self,
        call: &Call,
        connection: &mut PgConnection,
        protocol: ProtocolLabel,
    ) -> Result<RawClaim, Error> {
        let claim = self.claim_uncounted(call, connection, true).await;
        self.count(protocol, &claim);
        claim
    }

    /// Claims after [`cached`](Self::cached) missed (the tier is not asked again), and counts
    /// the call by how the claim ended under `protocol`.
    #[cfg(feature = "cache")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
    pub async fn claim_counted_uncached(
        &self,
        call: &Call,
        connection: &mut PgConnection,
        protocol: ProtocolLabel,
    ) -> Result<RawClaim, Error> {
        let claim = self.claim_uncounted(call, connection, false).await;
        self.count(protocol, &claim);
        claim
    }

    /// The answer of the cache tier to `call`, counted under `protocol` when there is one: the
    /// recorded result, or the error a replay of it meets (another request's record, a
    /// result not kept). `None` when there is no tier or it does not hold the key: claim.
    #[cfg(feature = "cache")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
    pub async fn cached(
        &self,
        call: &Call,
        protocol: ProtocolLabel,
    ) -> Option<Result<Bytes, Error>> {
        let key = self.storage_key(call);
        let claim = self.tier.as_ref()?.lookup(&key).await?;
        let in_flight = call.settings(&self.defaults).in_flight;
        // A tier answers finished records only (`CacheTier::lookup` keeps nothing else); were
        // it to answer anything but a replay, the claim goes to the database.
        let replay = match ClaimAnswer::new(in_flight, Integrity::Checksummed).step(
            &key,
            call.fingerprint_ref(),
            claim,
        ) {
            Ok(Step::Replay(bytes)) => Ok(bytes),
            Ok(_) => return None,
            Err(error) => Err(error),
        };
        self.metrics.request(
            protocol,
            match &replay {
                Ok(_) => RequestOutcome::Replayed,
                Err(error) => RequestOutcome::of_error(error),
            },
        );
        Some(replay)
    }

    /// Keeps the record `completed` in the cache tier: called once its transaction committed.
    #[cfg(feature = "cache")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
    pub fn committed(&self, completed: Completed) {
        if let Some(tier) = &self.tier {
            tier.put_committed(
                completed.key,
                completed.fingerprint,
                completed.payload,
                completed.ttl,
                completed.from,
            );
        }
    }

    fn count(&self, protocol: ProtocolLabel, claim: &Result<RawClaim, Error>) {
        self.metrics.request(
            protocol,
            match claim {
                Ok(RawClaim::Run(_)) => RequestOutcome::Fresh,
                Ok(RawClaim::Replay(_)) => RequestOutcome::Replayed,
                Err(error) => RequestOutcome::of_error(error),
            },
        );
    }

    /// Counts a call refused before its claim (a malformed key or fingerprint).
    pub(crate) fn count_refused(&self, error: &Error) {
        self.metrics
            .request(ProtocolLabel::Call, RequestOutcome::of_error(error));
    }

    /// Claims; with `ask_tier`, the cache tier answers first when it holds the key.
    async fn claim_uncounted(
        &self,
        call: &Call,
        connection: &mut PgConnection,
        ask_tier: bool,
    ) -> Result<RawClaim, Error> {
        // A `Call` is a plain key's: a session's call and a completer's resume call are of
        // other types, which this mode does not take (they go through the runtime).
        let key = self.storage_key(call);
        let fingerprint = call.fingerprint_ref();
        let label = idempotent_core::inspect::KeyLabel::new(
            call.key(),
            call.scope_ref(),
            self.keys_in_clear,
        );
        let Settings {
            ttl,
            lease,
            in_flight,
            max_result_bytes,
            ..
        } = call.settings(&self.defaults);
        let mut answer = ClaimAnswer::new(in_flight, Integrity::Checksummed);
        #[cfg(feature = "cache")]
        if ask_tier
            && let Some(tier) = &self.tier
            && let Some(claim) = tier.lookup(&key).await
            && let Step::Replay(bytes) = answer.step(&key, fingerprint, claim)?
        {
            return Ok(RawClaim::Replay(bytes));
        }
        #[cfg(not(feature = "cache"))]
        let _ = ask_tier;
        loop {
            let started = Instant::now();
            let claim = self
                .sql
                .claim_on(
                    connection,
                    &key,
                    fingerprint,
                    (lease, ttl),
                    None,
                    Some(label.as_bytes()),
                )
                .await;
            self.metrics
                .store_operation(Operation::Claim, claim.as_ref().err(), started.elapsed());
            let claim = claim?;
            // The tier is not filled from here: a completed row seen inside the caller's
            // transaction may be the caller's own, not committed yet (a key claimed twice in
            // one transaction), and a rollback would leave the tier answering for nothing.
            match answer.step(&key, fingerprint, claim)? {
                Step::Owner(token, lifetime) => {
                    // sqlx's own count of the connection's transactions: a connection it
                    // does not know to be in one gets the savepoint, which checks.
                    let depth = transaction_depth(connection);
                    let savepoint = self.savepoint || depth == 0;
                    let pending = PendingRecord {
                        sql: Arc::clone(&self.sql),
                        key,
                        fingerprint: *fingerprint,
                        token,
                        lifetime,
                        ttl,
                        lease,
                        max_result_bytes,
                        savepoint,
                        depth,
                    };
                    if savepoint {
                        pending.savepoint(connection).await?;
                    }
                    tracing::debug!(storage_key = %key, token = token.get(), "transactional call claimed");
                    return Ok(RawClaim::Run(pending));
                }
                Step::Replay(bytes) => {
                    tracing::debug!(storage_key = %key, "transactional call replayed");
                    return Ok(RawClaim::Replay(bytes));
                }
                // The connection is inside the caller's transaction: nothing to be notified
                // on, so poll.
                Step::Wait(wait) => tokio::time::sleep(wait).await,
            }
        }
    }
}

/// What [`Transactional::claim`] found.
#[derive(Debug)]
#[must_use]
pub enum TransactionalClaim<T> {
    /// The caller owns the key in its transaction: run the work with the transaction, then
    /// [`complete`](PendingRecord::complete) or [`release`](PendingRecord::release).
    Run(PendingRecord),
    /// An earlier call completed; this is its result. Nothing was written.
    Replay(T),
}

/// A claim written in the caller's transaction and not yet completed.
///
/// Complete it with the result, or release it, with the same transaction, before committing.
/// Dropped without either, the transaction holds an in-flight claim: roll it back.
#[must_use = "complete or release the claim with the same transaction before committing"]
pub struct PendingRecord {
    sql: Arc<Sql>,
    key: StorageKey,
    fingerprint: idempotent_core::Fingerprint,
    token: FencingToken,
    /// The token that began the record's lifetime.
    lifetime: FencingToken,
    ttl: Duration,
    lease: Duration,
    max_result_bytes: usize,
    /// Whether the work runs under a savepoint taken after the claim; without one, a release
    /// aborts the transaction (see [`Transactional::without_savepoint`]).
    savepoint: bool,
    /// sqlx's count of the connection's transactions when the claim was made.
    depth: usize,
}

/// sqlx's count of `connection`'s open transactions (1: a transaction, more: savepoints of
/// nested ones), kept by sqlx as it begins and ends them.
fn transaction_depth(connection: &PgConnection) -> usize {
    <<sqlx::Postgres as sqlx::Database>::TransactionManager as sqlx::TransactionManager>::get_transaction_depth(connection)
}

/// SQLSTATEs: an error raised by `RAISE EXCEPTION` (our abort), a statement in a transaction
/// already aborted, and a savepoint outside a transaction.
const RAISED: &str = "P0001";
const IN_FAILED_TRANSACTION: &str = "25P02";
const NO_ACTIVE_TRANSACTION: &str = "25P01";

impl fmt::Debug for PendingRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingRecord")
            .field("table", &self.sql.table)
            .field("storage_key", &self.key)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

/// A record a transactional completion wrote, for [`Transactional::committed`] once its
/// transaction committed ([`PendingRecord::complete_recorded`]).
#[derive(Debug)]
#[cfg_attr(not(feature = "cache"), allow(dead_code))]
pub struct Completed {
    key: StorageKey,
    fingerprint: idempotent_core::Fingerprint,
    payload: Bytes,
    ttl: Duration,
    /// Before the completion was sent: the record expires `ttl` after a later moment.
    from: Instant,
}

/// What [`Transactional::claim_counted`] found (the byte-level face of [`TransactionalClaim`]): the claim to run under, or the recorded result's
/// bytes (JSON, as [`Idempotency::run`](idempotent_core::Idempotency::run) records them).
#[derive(Debug)]
#[must_use]
pub enum RawClaim {
    /// The call owns the key: run its work, then complete or release the record.
    Run(PendingRecord),
    /// An earlier call completed: its recorded result.
    Replay(Bytes),
}

impl PendingRecord {
    /// The storage key claimed.
    pub fn storage_key(&self) -> StorageKey {
        self.key
    }

    /// The claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The claim as the work sees it: its fencing token, its downstream operation key, and
    /// whether it is held (see [`ClaimHandle`]).
    ///
    /// Here the claim is a row of the caller's open transaction: other callers wait on the row
    /// until the transaction ends, so the claim cannot be lost while the work runs, and
    /// [`KeyClaim::check`](idempotent_core::KeyClaim::check) answers `Ok` without a round trip.
    ///
    /// The [operation key](idempotent_core::KeyClaim::operation_key) names the record's lifetime, which
    /// begins with the claim that finds no live record. A rolled-back transaction leaves no
    /// record, so its retry begins a new lifetime with a new operation key: what the work
    /// writes in the transaction is undone with it (messages of the
    /// [`Outbox`](crate::outbox::Outbox) included), but a call already made to another
    /// system is not, and the retry's key does not deduplicate it. Make such calls through
    /// the outbox, which sends them only once the transaction commits, or with the leased
    /// runtime, whose released and lapsed claims keep their lifetime.
    pub fn claim(&self) -> ClaimHandle {
        ClaimHandle::in_transaction(self.key, self.token, self.lifetime, self.lease)
    }

    /// Records `value` (as JSON) as the call's result in `connection`'s transaction. Commit the
    /// transaction to make the work and the record durable together.
    ///
    /// If the value cannot be encoded or the record cannot be written, the work's writes are
    /// undone and the claim released (as by [`release`](Self::release)) and the error is
    /// returned: roll back.
    pub async fn complete<T: Serialize + ?Sized>(
        self,
        connection: &mut PgConnection,
        value: &T,
    ) -> Result<(), Error> {
        match serde_json::to_vec(value) {
            Ok(bytes) => {
                self.finish(connection, Retain::Keep, Some(bytes.into()))
                    .await
            }
            Err(error) => {
                self.release_logged(connection).await;
                Err(Error::Payload(error.into()))
            }
        }
    }

    /// Undoes the work's writes (back to the savepoint taken after the claim) and releases the
    /// claim in `connection`'s transaction, so the next retry runs the work again.
    ///
    /// A claim taken [without a savepoint](Transactional::without_savepoint) cannot undo the
    /// work alone: its release aborts the transaction instead, which can then only be rolled
    /// back (its `COMMIT` rolls back), with the same outcome: nothing of the work or the
    /// claim is committed.
    pub async fn release(self, connection: &mut PgConnection) -> Result<(), Error> {
        if !self.savepoint {
            let aborted = match (&mut *connection).execute(ABORT_TRANSACTION).await {
                // Aborted now, or already (a statement of it failed).
                Err(sqlx::Error::Database(error))
                    if matches!(
                        error.code().as_deref(),
                        Some(RAISED | IN_FAILED_TRANSACTION)
                    ) =>
                {
                    Ok(())
                }
                Err(error) => Err(Error::Store(store_error(error))),
                Ok(_) => Err(Error::Store(StoreError::Backend(
                    "the transaction of a claim taken without a savepoint could not be aborted"
                        .into(),
                ))),
            };
            aborted?;
            if transaction_depth(connection) != self.depth {
                // Aborting a nested transaction leaves the one the claim was made in able to
                // commit the claim and the work.
                return Err(Error::Store(StoreError::Backend(
                    "a claim taken without a savepoint was released in another (nested) \
                     transaction than it was made in: roll back the one it was made in"
                        .into(),
                )));
            }
            tracing::debug!(storage_key = %self.key, "transactional call released: its transaction was aborted");
            return Ok(());
        }
        (&mut *connection)
            .execute(ROLLBACK_TO_SAVEPOINT)
            .await
            .map_err(store_error)?;
        let record = self.key.record_bytes();
        let query = sqlx::query(&self.sql.release_in_transaction)
            .bind(record.as_ref())
            .bind(token_param(self.token));
        self.sql.guarded(query, connection).await?;
        tracing::debug!(storage_key = %self.key, "transactional call released");
        Ok(())
    }

    /// Completes with `result`, the encoded result (`None`: recorded without one, as
    /// [`Idempotency::execute`](idempotent_core::Idempotency::execute) does), or releases: the
    /// byte-level face of [`complete`](Self::complete) and [`release`](Self::release).
    pub(crate) async fn finish(
        self,
        connection: &mut PgConnection,
        retain: Retain,
        result: Option<Bytes>,
    ) -> Result<(), Error> {
        self.finish_recorded(connection, retain, result)
            .await
            .map(drop)
    }

    /// [`complete`](Self::complete), handing back what was written for
    /// [`Transactional::committed`] to keep in the cache tier after the commit.
    pub async fn complete_recorded<T: Serialize + ?Sized>(
        self,
        connection: &mut PgConnection,
        value: &T,
    ) -> Result<Option<Completed>, Error> {
        match serde_json::to_vec(value) {
            Ok(bytes) => {
                self.finish_recorded(connection, Retain::Keep, Some(bytes.into()))
                    .await
            }
            Err(error) => {
                self.release_logged(connection).await;
                Err(Error::Payload(error.into()))
            }
        }
    }

    async fn finish_recorded(
        self,
        connection: &mut PgConnection,
        retain: Retain,
        result: Option<Bytes>,
    ) -> Result<Option<Completed>, Error> {
        let started = Instant::now();
        let payload = match retain {
            Retain::Release => return self.release(connection).await.map(|()| None),
            Retain::Keep => Payload::new(&self.key, result, self.max_result_bytes)
                .envelope(Integrity::Checksummed),
        };
        let record = self.key.record_bytes();
        let query = sqlx::query(&self.sql.complete_in_transaction)
            .bind(record.as_ref())
            .bind(token_param(self.token))
            .bind(payload.as_ref())
            .bind(micros(self.ttl));
        let completed = match self.sql.guarded(query, connection).await {
            Ok(()) if self.savepoint => (&mut *connection)
                .execute(RELEASE_SAVEPOINT)
                .await
                .map(drop)
                .map_err(store_error),
            result => result,
        };
        match completed {
            Ok(()) => {
                tracing::debug!(storage_key = %self.key, "transactional call completed");
                Ok(Some(Completed {
                    key: self.key,
                    fingerprint: self.fingerprint,
                    payload,
                    ttl: self.ttl,
                    from: started,
                }))
            }
            Err(error) => {
                tracing::warn!(
                    storage_key = %self.key,
                    error = &error as &dyn std::error::Error,
                    "transactional call could not record its result; undoing its work"
                );
                self.release_logged(connection).await;
                Err(Error::Store(error))
            }
        }
    }

    /// Releases, logging a failure instead of returning it: used where another error is
    /// already on its way to the caller, who must roll back anyway.
    pub(crate) async fn release_logged(self, connection: &mut PgConnection) {
        let key = self.key;
        if let Err(error) = self.release(connection).await {
            tracing::warn!(
                storage_key = %key,
                error = &error as &dyn std::error::Error,
                "transactional call could not release its claim; roll the transaction back"
            );
        }
    }

    /// Takes the savepoint the work runs under. Outside a transaction, the claim has already
    /// committed on its own: it is released, and the call fails.
    async fn savepoint(&self, connection: &mut PgConnection) -> Result<(), Error> {
        let Err(error) = (&mut *connection).execute(SAVEPOINT).await else {
            return Ok(());
        };
        let outside_transaction = matches!(
            &error,
            sqlx::Error::Database(db) if db.code().as_deref() == Some(NO_ACTIVE_TRANSACTION)
        );
        if !outside_transaction {
            return Err(Error::Store(store_error(error)));
        }
        let record = self.key.record_bytes();
        let query = sqlx::query(&self.sql.release)
            .bind(record.as_ref())
            .bind(token_param(self.token));
        if let Err(error) = self.sql.guarded(query, connection).await {
            tracing::warn!(
                storage_key = %self.key,
                error = &error as &dyn std::error::Error,
                "could not release a claim made outside a transaction; it ends with its lease"
            );
        }
        Err(Error::Store(StoreError::Backend(
            "transactional mode needs a connection inside a transaction (begin one with \
             `pool.begin()`); the claim was released"
                .into(),
        )))
    }
}
