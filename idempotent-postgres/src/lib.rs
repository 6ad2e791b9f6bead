//! A PostgreSQL store for the `idempotent` family: one row per record in a table shared by
//! every app instance; the transactional mode ([`Transactional`]) that commits the record in
//! your own transaction, with your writes; the [`Fence`] for fencing tokens; and the
//! transactional [`outbox`] with its relay.
//!
//! ```no_run
//! use idempotent_core::Idempotency;
//! use idempotent_postgres::{PostgresStore, Transactional};
//!
//! # async fn example() -> Result<(), idempotent_core::StoreError> {
//! let store = PostgresStore::connect("postgres://app@db:5432/app").await?;
//! store.migrate().await?; // creates the table if it is not there
//! let idempotency = Idempotency::builder(store.clone()).namespace("billing").build();
//! // The same records, claimed and completed inside your transactions.
//! let transactional = Transactional::of(&idempotency, &store);
//! # let _ = transactional;
//! # Ok(())
//! # }
//! ```
//!
//! Where to read on: [`PostgresStore`] (the table, the reaper, fencing, what a database that
//! is down or full does), [`Transactional`] (and `#[idempotent(tx = ...)]`),
//! [`PostgresStore::step_in_transaction`] (a step whose effect and checkpoint commit
//! together), [`Fence`], [`outbox`]. The store passes the whole conformance suite of
//! `idempotent_core::conformance` and is built on `idempotent_core::store`, the contract any
//! store uses, and nothing else of core (the attribute's expansion aside).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod connections;
mod error;
mod expansion;
mod fence;
mod inspect;
pub mod outbox;
mod sql;
mod steps;
mod table;
mod transactional;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgPool, PgPoolOptions};
// Statements run through the executor's own methods, which return boxed `Send` futures: the
// `Query` methods are generic `async fn`s whose futures rustc cannot prove `Send` for every
// lifetime of a `&mut PgConnection` parameter ("implementation of `Executor` is not general
// enough"), which would make every caller's future non-`Send`.
use sqlx::Executor as _;

use self::connections::Connections;
use idempotent_core::steps::Abandoned;
use idempotent_core::store::Unanswered;
use idempotent_core::{
    CheckpointStore, Claim, FencingToken, Fingerprint, SessionGate, SessionKey, SessionRequest,
    SessionStore, StorageKey, Store, StoreError, limits,
};

pub(crate) use self::error::store_error;
pub use self::fence::{DEFAULT_FENCE_TABLE, Fence, FenceError};
use self::sql::{SessionParams, token_param};
pub(crate) use self::sql::{Sql, micros, migrate};
pub use self::table::InvalidTableName;
pub(crate) use self::table::TableName;
pub use self::transactional::{
    Completed, PendingRecord, RawClaim, Transactional, TransactionalClaim,
};

/// What `#[idempotent(tx = ...)]` expands into: not a public API (no semver guarantees); only
/// the `idempotent-macros` release of this family calls it.
#[doc(hidden)]
pub mod __private {
    #[doc(hidden)]
    pub use crate::expansion::*;
}

/// The table [`PostgresStore::new`] and [`Transactional::default`] use.
pub const DEFAULT_TABLE: &str = "idempotent_records";
/// The most rows one [`reap`](PostgresStore::reap) statement deletes.
pub const DEFAULT_REAP_BATCH: u32 = 1000;
/// How long after expiring a row is left for the reaper: see [`PostgresStore`]'s "Fencing
/// tokens".
pub const DEFAULT_REAP_GRACE: Duration = Duration::from_secs(60);

/// A [`Store`] on PostgreSQL: one row per record in one table, shared by every app instance
/// that points at the same database.
///
/// ```no_run
/// use idempotent_core::Idempotency;
/// use idempotent_postgres::PostgresStore;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://app@db/app").await?;
/// store.migrate().await?; // creates the table, its index and its sequence if missing
/// store.spawn_reaper(std::time::Duration::from_secs(60)); // deletes expired rows
/// let idempotency = Idempotency::new(store);
/// # Ok(())
/// # }
/// ```
///
/// Every operation of a key is one SQL statement and one round trip: a replay costs one
/// `claim`; a fresh call a `claim` and a `complete`, plus a `renew` every
/// third of the lease while the work runs. Every time comparison uses the database's clock
/// (`clock_timestamp()`), so app servers with skewed clocks agree on when a lease ends.
///
/// # The table
///
/// [`migrate`](Self::migrate) creates it (idempotently, serialized by an advisory lock, so
/// every instance may run it at startup):
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS "idempotent_records" (
///     storage_key bytea PRIMARY KEY,   -- the StorageKey's record bytes (32, or 48 in a session)
///     state text NOT NULL,             -- 'in_flight', 'completed' or 'session'
///     fingerprint bytea NOT NULL,      -- 32 bytes (empty for a session)
///     token bigint NOT NULL,           -- the fencing token
///     payload bytea,                   -- the completed result
///     expires_at timestamptz NOT NULL, -- end of the lease (in flight) or of the TTL (completed)
///     lifetime bigint,                 -- the token that began the record's lifetime (NULL: token)
///     kept_until timestamptz,          -- until when the row is kept (an abandoned claim: its TTL)
///     claimant bigint,                 -- names the claim attempt, to give back one whose caller left
///     steps bytea,                     -- the operation's checkpoints, concatenated (in flight)
///     request bytea,                   -- the request a completer may run again (in flight)
///     label bytea,                     -- what an operator sees of the key (KeyLabel)
///     released boolean,                -- released by its owner or an operator (in flight)
///     attempts integer,                -- the operation's claims: 1, one more per takeover
///     since timestamptz                -- when it was claimed, taken over or completed
/// );
/// CREATE INDEX IF NOT EXISTS "idempotent_records_expires_at_idx"
///     ON "idempotent_records" (expires_at);
/// CREATE INDEX IF NOT EXISTS "idempotent_records_kept_until_idx"
///     ON "idempotent_records" ((greatest(kept_until, expires_at)));
/// CREATE INDEX IF NOT EXISTS "idempotent_records_abandoned_idx"
///     ON "idempotent_records" (expires_at) WHERE state = 'in_flight' AND request IS NOT NULL;
/// CREATE INDEX IF NOT EXISTS "idempotent_records_owner_idx" ON "idempotent_records"
///     ((substring(request from 1 for 36)), expires_at)
///     WHERE state = 'in_flight' AND request IS NOT NULL;
/// CREATE INDEX IF NOT EXISTS "idempotent_records_listing_idx"
///     ON "idempotent_records" ((state COLLATE "C"), since, storage_key);
/// CREATE SEQUENCE IF NOT EXISTS "idempotent_records_token_seq";
/// ```
///
/// The last four columns and the listing index are what an operator reads
/// ([`InspectStore`](idempotent_core::inspect::InspectStore)): a record by key is one primary
/// key lookup; a listing of one state is a range of `listing_idx` (in flight, released,
/// completed) or of `expires_at_idx` (abandoned: by the lease's end), read a page at a time
/// after a keyset cursor; a repair locks the row (`SELECT … FOR UPDATE`), checks its token and
/// lease, and changes it in the same transaction. Rows written before 0.4 have no `since`: they
/// are found by key, and listed once they are claimed again. The listing index keys the state
/// in the "C" collation, which only the listings compare it in: every statement of one key
/// reaches its row through the primary key, never through a range of states (the planner would
/// take the `in_flight` range for nearly empty, while it holds an entry of every claim since the
/// last vacuum).
///
/// (A table made by an earlier release gets the columns it lacks and the indexes on them from
/// `migrate`, which checks the catalog first and locks the
/// table only when they are missing. Building an index locks a table that has it missing for
/// as long as the build takes: on a large table, create it first with `CREATE INDEX
/// CONCURRENTLY` and the definition above, after adding the columns, and `migrate` finds it
/// there.)
///
/// A row whose `expires_at` has passed is absent as far as `claim` is concerned, except that an
/// in-flight row kept until `kept_until` is *taken over* by a claim of the same request,
/// which keeps its `lifetime` (see [`Claim::TakenOver`]); releasing a claim ends its lease
/// rather than deleting the row. A lease above [`limits::MAX_LEASE`] or a
/// TTL above [`limits::MAX_TTL`] is written as that ceiling, so `expires_at` is always a valid
/// timestamp at most a year away. A row this store cannot interpret (an
/// unknown state, a fingerprint that is not 32 bytes, a completed row without a payload) is
/// reported as [`StoreError::Corrupt`], never treated as absent and never overwritten while it
/// is live.
///
/// The table name is configurable with [`PostgresStoreBuilder::table`], optionally
/// schema-qualified (`billing.idempotency`). It is validated as a plain lowercase identifier,
/// so it can never inject SQL.
///
/// # The claim
///
/// One statement: report the live record if the snapshot has one, otherwise insert a new
/// in-flight row, or take over an expired one, under the row's lock.
///
/// ```sql
/// WITH live AS (
///     SELECT state, fingerprint, payload, <microseconds until expires_at> AS remaining_us
///     FROM t WHERE storage_key = $1 AND expires_at > clock_timestamp()
/// ), claimed AS (
///     INSERT INTO t AS r (storage_key, state, fingerprint, token, lifetime, payload,
///                         expires_at, kept_until, claimant)
///     SELECT $1, 'in_flight', $2, nextval('t_token_seq'), NULL, NULL,
///            clock_timestamp() + $3, clock_timestamp() + greatest($3, $4), $5
///     WHERE NOT EXISTS (SELECT FROM live)
///     ON CONFLICT (storage_key) DO UPDATE
///     SET state = 'in_flight', fingerprint = excluded.fingerprint,
///         token = greatest(nextval('t_token_seq'), r.token + 1),
///         -- kept by a takeover, NULL (a new lifetime) otherwise
///         (lifetime, steps, request) = (SELECT coalesce(r.lifetime, r.token), r.steps, r.request
///                                       WHERE <r is an abandoned claim of the same fingerprint, kept>),
///         payload = NULL, expires_at = clock_timestamp() + $3,
///         kept_until = clock_timestamp() + greatest($3, $4), claimant = excluded.claimant
///     WHERE r.expires_at <= clock_timestamp()
///     RETURNING r.token, coalesce(r.lifetime, r.token) AS lifetime
/// )
/// SELECT 'claimed', token, lifetime, NULL, NULL, NULL FROM claimed
/// UNION ALL
/// SELECT state, NULL, NULL, fingerprint, payload, remaining_us FROM live
/// ```
///
/// Of concurrent claims on an absent key, the unique index lets one insert; the others wait
/// for it and then find a live row. A claim whose snapshot predates a concurrent winner's
/// commit finds that row neither in `live` nor expired, so the statement returns nothing; the
/// store then runs it again with a fresh snapshot (this is the only case with a second round
/// trip).
///
/// # Checkpoints and saved requests
///
/// A [step](idempotent_core::ClaimHandle::step)'s checkpoint is appended to the in-flight row's `steps`
/// (`steps = coalesce(steps, '') || $3`), and a saved request replaces its `request`, each by
/// one statement guarded like a renewal (`storage_key`, `token`, in flight, lease not ended).
/// Both belong to the operation: a takeover keeps them with the `lifetime`, a claim that
/// begins a new lifetime and both completions set them to `NULL`. The completer's list
/// ([`abandoned`](CheckpointStore::abandoned)) is one statement over the partial index of in-flight
/// rows that hold a request, oldest lease end first. For a step whose database effect must
/// commit with its checkpoint, see [`step_in_transaction`](Self::step_in_transaction).
///
/// # Client sessions
///
/// A [client session](idempotent_core::session) is rows of the same table. Its own row is at the
/// session's digest followed by 16 zero bytes, with `state = 'session'`, `token` its
/// acknowledged mark, `lifetime` the highest sequence number it admitted, `claimant` its
/// epoch (drawn from the token sequence, so never reused), `expires_at` the end of its idle
/// time, an empty `fingerprint` and no `payload` or `kept_until`. Each request's record is an
/// ordinary record at the session's digest followed by the epoch and the sequence number
/// (big-endian, [`StorageKey::record_bytes`]), so one epoch's requests sort together, in
/// order. [`open_session`](SessionStore::open_session) is one statement: it locks the session's row
/// (`FOR UPDATE`), applies the gate's rules to it, writes it back, deletes the request rows
/// the new mark covers and extends the life of those above it to the idle time, both by a
/// range of the primary key at most the window long; under the lock, so one session's gates
/// run one at a time. (A first request that meets a session row committed after its
/// statement began runs the statement once more.) So a session holds its row and at most its
/// window of answers, and the reaper deletes a session nobody sent to for its idle time like
/// any expired row, with its answers. A session row that is not one (a negative mark, a
/// missing epoch) is [`StoreError::Corrupt`] while it is live, and never overwritten. The
/// [`Transactional`] mode does not serve sessions.
///
/// # Fencing tokens
///
/// Tokens come from one sequence per table, so no token is ever issued twice, for any key. A
/// takeover draws its token while holding the row's lock and never below the row's token plus
/// one, so it is greater than every token issued before for that key. A new row draws its token
/// just before inserting; the [reaper](Self::reap) leaves expired rows in place for a grace
/// period (default [`DEFAULT_REAP_GRACE`]) so that the row a slower claim could race with is
/// still there to be taken over under its lock. Do not give the sequence a `CACHE` above 1:
/// cached values are handed out out of order across connections.
///
/// # Deployment
///
/// - **Reaping.** Nothing deletes rows by itself: run [`spawn_reaper`](Self::spawn_reaper) in
///   one or more instances (concurrent reapers skip each other's rows), or call
///   [`reap`](Self::reap) from a scheduled job. It deletes rows past their `kept_until`
///   (completed rows past their TTL, abandoned claims past the TTL they were claimed with,
///   client sessions past their idle time) in
///   batches of [`DEFAULT_REAP_BATCH`], one short statement each, using the `kept_until` index.
/// - **Durability.** A record is as durable as any committed row: with `synchronous_commit =
///   on` (the default) an acknowledged claim or completion survives a crash, and with
///   synchronous replication a failover. With asynchronous replication, a claim committed on a
///   primary that fails over before shipping it is lost, like any other write.
/// - **Outages.** Operations fail with [`StoreError::Unavailable`] (fail closed: HTTP 503)
///   while the database is unreachable, after the pool's acquire timeout (2 s with
///   [`connect`](Self::connect)) for a free connection and as long again to open one. A
///   connection that fails that way is closed, so a connection broken by a database restart
///   fails at most the one operation that used it; new ones are opened as needed, and service
///   resumes when the database is back, without restarting the application. A database that
///   is up but does not answer (frozen, its connections hung) keeps a statement waiting: the
///   runtime abandons a claim after [`CLAIM_TIMEOUT`](idempotent_core::CLAIM_TIMEOUT) and renewals,
///   completions and releases after a sixth of the lease. A claim abandoned that way may still
///   be made when the database answers again; each claim writes a random claimant number into
///   its row, and the store gives back (ends the lease of) the row holding its number as soon
///   as the database answers, retrying for a few seconds in case the claim is still queued
///   behind it.
/// - **Connections.** The claim, completion, release and renewal statements run on
///   connections the store opens itself, with the [`PgPool`]'s connect options (URL,
///   credentials, TLS, statement cache), at most the pool's `max_connections` of them (or
///   [`PostgresStoreBuilder::max_connections`]), opened on first use. They go back to the
///   store without the round trip sqlx's pool makes to check every connection it takes back,
///   which doubled the round trips of every operation (BENCHMARKS.md). The pool itself serves
///   [`migrate`](Self::migrate), [`reap`](Self::reap), the completer's
///   [`abandoned`](CheckpointStore::abandoned), the transactions of
///   [`step_in_transaction`](Self::step_in_transaction) and your own transactions, so the store
///   and the pool together can hold up to twice the pool's `max_connections`: size the
///   database's `max_connections` for both. `after_connect` hooks of the pool do not run on
///   the store's connections: schema-qualify the [table](PostgresStoreBuilder::table) rather
///   than setting `search_path` in a hook. [`connect`](Self::connect) opens a pool of at most
///   16 connections; pass your own [`PgPool`] to [`new`](Self::new) or
///   [`builder`](Self::builder) to size it or add TLS (enable one of sqlx's TLS features in
///   your `Cargo.toml`).
/// - **Transactions.** For database work, [`Transactional`] writes the claim and the completed
///   record in your own transaction; see its docs.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    connections: Connections,
    sql: Arc<Sql>,
    reap_batch: u32,
    reap_grace: Duration,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .field("reap_batch", &self.reap_batch)
            .field("reap_grace", &self.reap_grace)
            .field("max_connections", &self.connections.max())
            .finish_non_exhaustive()
    }
}

/// Configures a [`PostgresStore`]. Created by [`PostgresStore::builder`].
#[must_use]
pub struct PostgresStoreBuilder {
    pool: PgPool,
    max_connections: usize,
    table: String,
    reap_batch: u32,
    reap_grace: Duration,
}

impl fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    /// The table records live in (default [`DEFAULT_TABLE`]): a lowercase identifier
    /// (`[a-z_][a-z0-9_]*`, at most 48 bytes), optionally qualified by a schema
    /// (`billing.idempotency`). Its index and sequence are named after it.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The most rows one reaper statement deletes (default [`DEFAULT_REAP_BATCH`]).
    pub fn reap_batch(mut self, rows: u32) -> Self {
        self.reap_batch = rows.max(1);
        self
    }

    /// How long after expiring a row is left for the reaper (default [`DEFAULT_REAP_GRACE`]).
    pub fn reap_grace(mut self, grace: Duration) -> Self {
        self.reap_grace = grace;
        self
    }

    /// The most connections the store's own statements use at once (default: the pool's
    /// `max_connections`; at least 1). See [`PostgresStore`]'s "Connections".
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// Builds the store; fails if the table name is not a valid identifier.
    pub fn build(self) -> Result<PostgresStore, InvalidTableName> {
        let connections = Connections::new(
            self.pool.connect_options(),
            self.max_connections,
            self.pool.options().get_acquire_timeout(),
        );
        Ok(PostgresStore {
            pool: self.pool,
            connections,
            sql: Arc::new(Sql::new(&self.table)?),
            reap_batch: self.reap_batch,
            reap_grace: self.reap_grace,
        })
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE`) with a pool of at
    /// most 16 connections and a 2-second acquire timeout, using [`DEFAULT_TABLE`]; fails if
    /// the database cannot be reached. The store's own statements run on up to 16 connections
    /// of its own (see "Connections" above). Call [`migrate`](Self::migrate) before the first
    /// operation.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(2))
            .connect(url)
            .await
            .map_err(store_error)?;
        Ok(PostgresStore::new(pool))
    }

    /// A store on `pool` using [`DEFAULT_TABLE`].
    pub fn new(pool: PgPool) -> Self {
        PostgresStore::builder(pool)
            .build()
            .expect("the default table name is valid")
    }

    /// Configures a store on `pool`.
    pub fn builder(pool: PgPool) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            max_connections: pool.options().get_max_connections() as usize,
            pool,
            table: DEFAULT_TABLE.to_owned(),
            reap_batch: DEFAULT_REAP_BATCH,
            reap_grace: DEFAULT_REAP_GRACE,
        }
    }

    /// The pool this store runs on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table name, as configured.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// The claim and the completion statements, exactly as the store sends them: the claim
    /// binds `$1` storage key, `$2` fingerprint, `$3` lease and `$4` TTL in microseconds and
    /// `$5` a claimant number; the completion
    /// `$1` storage key, `$2` token, `$3` payload, `$4` TTL in microseconds. For measuring
    /// what the database itself does with them (the benchmark's `pgbench` rows); not a stable
    /// API.
    #[doc(hidden)]
    pub fn claim_and_complete_sql(&self) -> [&str; 2] {
        [&self.sql.claim, &self.sql.complete]
    }

    /// Creates the table, its indexes and its token sequence if they do not exist, and adds
    /// the columns and indexes a table made by an earlier release lacks (see "The table").
    ///
    /// Idempotent, and safe to run from every instance at startup: concurrent migrations of one
    /// table are serialized by a transaction-scoped advisory lock. Needs the privilege to
    /// create tables in the schema; if the application's role lacks it, run it once from a
    /// deployment step instead.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool, &self.sql.table, &self.sql.migrate)
            .await
            .map_err(store_error)
    }

    /// Deletes rows that expired at least the grace period ago (see
    /// [`PostgresStoreBuilder::reap_grace`]), in batches of at most
    /// [`PostgresStoreBuilder::reap_batch`] rows, one statement each, until none are left.
    /// Returns how many rows were deleted. Rows another reaper is deleting are skipped.
    pub async fn reap(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let reap = sqlx::query(&self.sql.reap)
                .bind(micros(self.reap_grace))
                .bind(i64::from(self.reap_batch));
            let deleted = self
                .pool
                .execute(reap)
                .await
                .map_err(store_error)?
                .rows_affected();
            total += deleted;
            if deleted < u64::from(self.reap_batch) {
                return Ok(total);
            }
        }
    }

    /// Spawns a task that calls [`reap`](Self::reap) every `every` until the returned handle is
    /// aborted (or the runtime shuts down). Failures are logged and retried at the next tick.
    /// Requires a tokio runtime.
    pub fn spawn_reaper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        let every = every.max(Duration::from_millis(1));
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match store.reap().await {
                    Ok(0) => {}
                    Ok(rows) => {
                        tracing::debug!(table = %store.sql.table, rows, "reaped expired idempotency records")
                    }
                    Err(error) => tracing::warn!(
                        table = %store.sql.table,
                        error = &error as &dyn std::error::Error,
                        "could not reap expired idempotency records; retrying at the next tick"
                    ),
                }
            }
        })
    }
}

impl PostgresStore {
    /// Runs a give-back statement (`give_back` or `give_back_in_session`) on a connection of its
    /// own: `true` when it gave back the claim (one row).
    async fn give_back_with(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<bool, StoreError> {
        let mut connection = self.connections.get().await?;
        let given = connection
            .execute(query)
            .await
            .map(|done| done.rows_affected() == 1)
            .map_err(store_error);
        Connections::settle(connection, given)
    }

    /// A claim, or with `resume` a takeover only ([`CheckpointStore::resume`]: `None` when there was
    /// nothing of the request to take over). One that does not come back (the connection
    /// broke, the database froze) may still land: it is given back as soon as the database
    /// answers.
    async fn claim_or_resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        resume: bool,
        label: Option<&idempotent_core::inspect::KeyLabel>,
    ) -> Result<Option<Claim>, StoreError> {
        let mut connection = self.connections.get().await?;
        // Non-negative, so it fits a bigint.
        let claimant = i64::try_from(idempotent_core::store::claimant()).unwrap_or(i64::MAX);
        let mut unanswered = Unanswered::new({
            let (store, key) = (self.clone(), *key);
            Box::new(move || {
                let store = store.clone();
                Box::pin(async move {
                    let record = key.record_bytes();
                    let query = sqlx::query(&store.sql.give_back)
                        .bind(record.as_ref())
                        .bind(claimant);
                    store.give_back_with(query).await
                })
            })
        });
        let claimant = Some(claimant);
        let result = if resume {
            let sql = &self.sql;
            sql.resume_on(&mut connection, key, fingerprint, terms, claimant)
                .await
        } else {
            let sql = &self.sql;
            let label = label.map(|label| label.as_bytes().as_ref());
            sql.claim_on(&mut connection, key, fingerprint, terms, claimant, label)
                .await
                .map(Some)
        };
        // An error from the database itself is an answer; one from the connection may
        // not be: the claim may be made when the database runs again.
        if !matches!(result, Err(StoreError::Unavailable(_))) {
            unanswered.answered();
        }
        Connections::settle(connection, result)
    }
}

impl PostgresStore {
    /// `postgres://HOST:PORT/DATABASE?table=TABLE`, or `postgres:///DATABASE?host=SOCKET&port=PORT&table=TABLE`
    /// on a Unix socket (the port names the cluster's socket file there too), without user or
    /// password: see [`Store::location`].
    fn location_url(&self) -> String {
        let options = self.pool.connect_options();
        let database = options.get_database().unwrap_or("");
        // A host that is a directory is a socket's, as libpq and sqlx read it.
        let socket = options
            .get_socket()
            .map(|socket| socket.display().to_string())
            .or_else(|| {
                let host = options.get_host();
                host.starts_with('/').then(|| host.to_owned())
            });
        match socket {
            Some(socket) => format!(
                "postgres:///{database}?host={socket}&port={}&table={}",
                options.get_port(),
                self.sql.table
            ),
            None => format!(
                "postgres://{}:{}/{database}?table={}",
                options.get_host(),
                options.get_port(),
                self.sql.table
            ),
        }
    }
}

impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn location(&self) -> Option<String> {
        Some(self.location_url())
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), false, None)
            .await?
            .ok_or_else(|| {
                StoreError::Corrupt("a claim answered that there was nothing to resume".into())
            })
    }

    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(key, fingerprint, terms, false, Some(label))
            .await?
            .ok_or_else(|| {
                StoreError::Corrupt("a claim answered that there was nothing to resume".into())
            })
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let mut connection = self.connections.get().await?;
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.complete)
            .bind(record.as_ref())
            .bind(token)
            .bind(payload.as_ref())
            .bind(micros(limits::clamp_ttl(ttl)));
        let result = self.sql.guarded(query, &mut connection).await;
        Connections::settle(connection, result)
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let mut connection = self.connections.get().await?;
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.release)
            .bind(record.as_ref())
            .bind(token);
        let result = self.sql.guarded(query, &mut connection).await;
        Connections::settle(connection, result)
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let mut connection = self.connections.get().await?;
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.renew)
            .bind(record.as_ref())
            .bind(token)
            .bind(micros(limits::clamp_lease(lease)));
        let result = self.sql.guarded(query, &mut connection).await;
        Connections::settle(connection, result)
    }
}

impl SessionStore for PostgresStore {
    async fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        let params = SessionParams::new(session, request)?;
        let mut connection = self.connections.get().await?;
        let result = self.sql.open_session_on(&mut connection, &params).await;
        Connections::settle(connection, result)
    }

    /// The gate and, admitted, the claim, in one transaction that holds the session's row from
    /// the gate to the claim, so no check of the mark follows: one plain statement in the
    /// common case (a live session, the request admitted, nothing left unacknowledged above the
    /// new mark), and when that statement answers nothing, one call of the session claim
    /// function (see `migrate`), which decides every case.
    async fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<idempotent_core::SessionClaim, StoreError> {
        let params = SessionParams::new(session, request)?;
        let mut connection = self.connections.get().await?;
        // Non-negative, so it fits a bigint.
        let claimant = i64::try_from(idempotent_core::store::claimant()).unwrap_or(i64::MAX);
        let mut unanswered = Unanswered::new({
            let (store, session, seq) = (self.clone(), *session, params.seq());
            Box::new(move || {
                let store = store.clone();
                Box::pin(async move {
                    let query = sqlx::query(&store.sql.give_back_in_session)
                        .bind(session.record_key().record_bytes().as_ref().to_vec())
                        .bind(claimant)
                        .bind(seq);
                    store.give_back_with(query).await
                })
            })
        });
        let result = self
            .sql
            .claim_in_session_on(
                &mut connection,
                &params,
                fingerprint,
                lease,
                claimant,
                label.as_bytes(),
            )
            .await;
        // An error from the database itself is an answer; one from the connection may
        // not be: the claim may be made when the database runs again.
        if !matches!(result, Err(StoreError::Unavailable(_))) {
            unanswered.answered();
        }
        Connections::settle(connection, result)
    }

    /// One read of the session's row: live, and a valid session, or nothing.
    async fn session_mark(
        &self,
        session: &idempotent_core::SessionKey,
    ) -> Result<Option<idempotent_core::SessionMark>, StoreError> {
        let mut connection = self.connections.get().await?;
        let query = sqlx::query(&self.sql.session_mark)
            .bind(session.record_key().record_bytes().as_ref().to_vec());
        let result = connection
            .fetch_optional(query)
            .await
            .map_err(store_error)
            .and_then(|row| row.map(|row| session_mark(&row)).transpose());
        Connections::settle(connection, result)
    }
}

impl CheckpointStore for PostgresStore {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), true, None)
            .await
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> Result<(), StoreError> {
        self.guarded_bytes(&self.sql.save_step, key, token, &entry)
            .await
    }

    async fn load_steps(&self, key: &StorageKey, token: FencingToken) -> Result<Bytes, StoreError> {
        use sqlx::Row as _;
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let mut connection = self.connections.get().await?;
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.load_steps)
            .bind(record.as_ref())
            .bind(token);
        let result = match connection.fetch_optional(query).await {
            Ok(Some(row)) => row
                .try_get::<Vec<u8>, _>("steps")
                .map(Bytes::from)
                .map_err(store_error),
            Ok(None) => Err(StoreError::TokenRejected),
            Err(error) => Err(store_error(error)),
        };
        Connections::settle(connection, result)
    }

    async fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        self.guarded_bytes(&self.sql.save_request, key, token, &request)
            .await
    }

    /// One statement on the pool, using the partial index of in-flight rows that hold a
    /// request. Rows whose storage key is not 32 or 48 bytes (no storage key's record bytes)
    /// are skipped: no claim can reach them. Any other garbage in a listed row (a fingerprint
    /// that is not 32 bytes) is [`StoreError::Corrupt`].
    ///
    /// One owner's requests come from an index of their own (by the request's first bytes),
    /// so other owners' rows are never read.
    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&idempotent_core::RequestOwner>,
    ) -> Result<Vec<Abandoned>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let statement = match owner {
            Some(_) => &self.sql.abandoned_of,
            None => &self.sql.abandoned,
        };
        let mut query = sqlx::query(statement)
            .bind(micros(idle))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX));
        if let Some(owner) = owner {
            query = query.bind(owner.as_bytes().as_slice());
        }
        let rows = self.pool.fetch_all(query).await.map_err(store_error)?;
        // A row that cannot be read is skipped (and left as it is), not the call: the others
        // are still listed.
        Ok(rows
            .iter()
            .filter_map(|row| match steps::decode_abandoned(row) {
                Ok(abandoned) => Some(abandoned),
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "a row with a saved request cannot be read; skipped"
                    );
                    None
                }
            })
            .collect())
    }
}

impl PostgresStore {
    /// Runs a token-guarded update binding `$1` storage key, `$2` token, `$3` `bytes`.
    async fn guarded_bytes(
        &self,
        statement: &str,
        key: &StorageKey,
        token: FencingToken,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let mut connection = self.connections.get().await?;
        let record = key.record_bytes();
        let query = sqlx::query(statement)
            .bind(record.as_ref())
            .bind(token)
            .bind(bytes);
        let result = self.sql.guarded(query, &mut connection).await;
        Connections::settle(connection, result)
    }
}

/// A live session row as the session's state; anything else at its key is corrupt.
fn session_mark(row: &sqlx::postgres::PgRow) -> Result<idempotent_core::SessionMark, StoreError> {
    use sqlx::Row as _;
    let state: Option<String> = row.try_get("state").ok();
    let ack: Option<i64> = row.try_get("token").ok();
    let epoch: Option<i64> = row.try_get("claimant").ok().flatten();
    match (state.as_deref(), ack, epoch) {
        (Some("session"), Some(ack), Some(epoch))
            if epoch > 0 && (0..=idempotent_core::session::MAX_SEQ as i64).contains(&ack) =>
        {
            Ok(idempotent_core::SessionMark {
                epoch: epoch as u64,
                ack: ack as u64,
            })
        }
        _ => Err(StoreError::Corrupt(
            "the row at a session's key is not a valid session".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::sql::MAX_MICROS;
    use super::table::MAX_TABLE_NAME;
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in [
            "idempotent_records",
            "_t",
            "t1",
            "billing.idempotency",
            "select",
            &"a".repeat(MAX_TABLE_NAME),
        ] {
            assert!(Sql::new(good).is_ok(), "{good:?} rejected");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a.b.c",
            "1t",
            "Records",
            "records\"; DROP TABLE users; --",
            "records'",
            "re cords",
            "réservé",
            "a-b",
            "a\0",
            &"a".repeat(MAX_TABLE_NAME + 1),
        ] {
            assert!(Sql::new(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn derived_names_are_quoted_and_qualified() {
        let sql = Sql::new("billing.records").unwrap();
        assert!(sql.migrate[0].contains("\"billing\".\"records\""));
        assert!(sql.migrate[1].contains("\"records_expires_at_idx\" ON \"billing\".\"records\""));
        assert!(sql.migrate[2].contains("\"billing\".\"records_token_seq\""));
        assert!(sql.migrate[4].contains("to_regclass('\"billing\".\"records_abandoned_idx\"')"));
        assert!(sql.migrate[4].contains("\"records_abandoned_idx\" ON \"billing\".\"records\""));
        assert!(sql.migrate[5].contains("to_regclass('\"billing\".\"records_owner_idx\"')"));
        assert!(sql.migrate[5].contains("\"records_owner_idx\" ON \"billing\".\"records\""));
        assert!(
            sql.claim
                .contains("nextval('\"billing\".\"records_token_seq\"')")
        );
    }

    #[test]
    fn session_numbers_beyond_the_largest_are_refused_before_any_statement() {
        use idempotent_core::session::MAX_SEQ;
        let session = SessionKey::from_bytes([7; 32]);
        let idle = Duration::from_secs(1);
        for (seq, ack) in [(MAX_SEQ + 1, 0), (1, MAX_SEQ + 1), (u64::MAX, u64::MAX)] {
            assert!(matches!(
                SessionParams::new(&session, SessionRequest::new(seq, ack, 64, idle)),
                Err(StoreError::Backend(_))
            ));
        }
        for window in [0, 64, MAX_SEQ, u64::MAX] {
            assert!(
                SessionParams::new(
                    &session,
                    SessionRequest::new(MAX_SEQ, MAX_SEQ, window, idle)
                )
                .is_ok()
            );
        }
        let sql = Sql::new("billing.records").unwrap();
        assert!(
            sql.open_session
                .contains("nextval('\"billing\".\"records_token_seq\"')")
        );
    }

    #[test]
    fn durations_are_capped_microseconds() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::ZERO), 0);
        assert_eq!(micros(Duration::MAX), MAX_MICROS);
        assert_eq!(
            micros(limits::MAX_TTL + Duration::from_micros(1)),
            i64::try_from(limits::MAX_TTL.as_micros()).unwrap()
        );
    }
}
