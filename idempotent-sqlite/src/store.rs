//! [`SqliteStore`], its builder, and every operation as one SQLite transaction.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::inspect::KeyLabel;
use idempotent_core::steps::Abandoned;
use idempotent_core::{
    CheckpointStore, Claim, FencingToken, Fingerprint, RequestOwner, SessionClaim, SessionGate,
    SessionKey, SessionMark, SessionRequest, SessionStore, StorageKey, Store, StoreError,
};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use tokio::sync::Notify;

use crate::error::{is_busy, store_error};
use crate::sql::{DEFAULT_TABLE_PREFIX, Param, Sql};

/// How long an operation waits for another connection's or process's write lock before it
/// fails with [`StoreError::Unavailable`], by default.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest busy timeout accepted; longer ones are clamped to it.
pub const MAX_BUSY_TIMEOUT: Duration = Duration::from_secs(60 * 60);
/// How many connections serve reads (replays, in-flight reports, checkpoints) at once, by
/// default.
pub const DEFAULT_MAX_READERS: u32 = 4;
/// The most read connections accepted; more are clamped to it.
pub const MAX_READERS: u32 = 64;
/// How often the background reaper deletes expired rows, by default.
pub const DEFAULT_REAP_EVERY: Duration = Duration::from_secs(60);
/// The most rows one reaper transaction deletes, by default.
pub const DEFAULT_REAP_BATCH: u32 = 1000;

/// How long an operation waits for one of this store's own connections (they are shared by
/// every task of the process) before it fails with [`StoreError::Unavailable`].
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// The shortest and longest period of the background reaper.
const MIN_REAP_EVERY: Duration = Duration::from_millis(10);
const MAX_REAP_EVERY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// When a commit is on disk: SQLite's `synchronous` setting for the store's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// `synchronous = FULL` (the default): every commit (a claim, a completion, a
    /// checkpoint) is flushed to the disk (`fsync`) before the operation returns, so an
    /// acknowledged record survives a crash of the process, of the operating system and a
    /// power loss. Each write waits for one flush of the write-ahead log.
    #[default]
    Full,
    /// `synchronous = NORMAL`: a commit is in the write-ahead log when the operation returns,
    /// and flushed at the next checkpoint. It survives a crash of the process (even
    /// `SIGKILL`), but a power loss or an operating-system crash may lose the last
    /// commits (never corrupt the file). A lost completion runs its work again on the next
    /// retry; a lost claim lets a duplicate run at once. Faster writes, weaker promise:
    /// choose it only where the work is safe to run twice after a power loss.
    Normal,
}

/// Which database a [`SqliteStore`] opens: a file path, or sqlx's connect options for it
/// (to set other pragmas, a VFS, or open it read-only for inspection).
///
/// The store sets the journal mode (WAL), `synchronous` ([`Durability`]), the busy timeout
/// and whether to create the file on the options it is given: its own settings win. An
/// in-memory database is refused: it is neither durable nor shared by connections.
#[derive(Debug, Clone)]
pub struct Database(SqliteConnectOptions);

impl Database {
    /// The database file at `path`.
    pub fn path(path: impl AsRef<Path>) -> Self {
        Database(SqliteConnectOptions::new().filename(path))
    }

    /// The database `options` name.
    pub fn options(options: SqliteConnectOptions) -> Self {
        Database(options)
    }
}

impl From<&Path> for Database {
    fn from(path: &Path) -> Self {
        Database::path(path)
    }
}

impl From<PathBuf> for Database {
    fn from(path: PathBuf) -> Self {
        Database::path(path)
    }
}

impl From<&PathBuf> for Database {
    fn from(path: &PathBuf) -> Self {
        Database::path(path)
    }
}

impl From<&str> for Database {
    fn from(path: &str) -> Self {
        Database::path(path)
    }
}

impl From<String> for Database {
    fn from(path: String) -> Self {
        Database::path(path)
    }
}

impl From<SqliteConnectOptions> for Database {
    fn from(options: SqliteConnectOptions) -> Self {
        Database(options)
    }
}

/// A [`Store`] in one SQLite file: one row per record, shared by every process of the host
/// that opens the same file.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_sqlite::{Durability, SqliteStore};
///
/// # async fn example() -> Result<(), idempotent_core::StoreError> {
/// let store = SqliteStore::builder("/var/lib/myapp/idempotency.db")
///     .table_prefix("myapp_") // tables myapp_records and myapp_tokens
///     .busy_timeout(Duration::from_secs(2))
///     .durability(Durability::Full) // the default
///     .build()
///     .await?; // opens (creating the file if missing) and migrates
/// let idempotency = idempotent_core::Idempotency::new(store);
/// # Ok(())
/// # }
/// ```
///
/// # The table
///
/// [`migrate`](Self::migrate) (run by [`open`](Self::open) and
/// [`build`](SqliteStoreBuilder::build)) creates, if missing:
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS "idempotent_records" (
///     storage_key BLOB NOT NULL PRIMARY KEY, -- the StorageKey's record bytes (32, or 48 in a session)
///     state TEXT NOT NULL,             -- 'in_flight', 'completed' or 'session'
///     fingerprint BLOB NOT NULL,       -- 32 bytes (empty for a session)
///     token INTEGER NOT NULL,          -- the fencing token (a session: its acknowledged mark)
///     lifetime INTEGER NOT NULL,       -- the token that began the lifetime (a session: the highest number admitted)
///     epoch INTEGER,                   -- a session's epoch
///     expires_at INTEGER NOT NULL,     -- ms since the Unix epoch: end of the lease, of the TTL, or of a session's idle time
///     kept_until INTEGER NOT NULL,     -- ms: until when the row is kept (an abandoned claim: the TTL it was claimed with)
///     payload BLOB,                    -- the completed result
///     steps BLOB,                      -- the operation's checkpoints, concatenated (in flight)
///     request BLOB,                    -- the request a completer may run again (in flight)
///     label BLOB,                      -- the KeyLabel of the claim that began the lifetime (NULL: none)
///     released INTEGER NOT NULL DEFAULT 0, -- 1 once its owner (or an operator) released it
///     attempts INTEGER NOT NULL DEFAULT 0, -- claims of the lifetime (0: written before they were counted)
///     since INTEGER                    -- ms: when it was claimed, taken over, released or completed
/// );
/// CREATE INDEX IF NOT EXISTS "idempotent_records_kept_until" ON "idempotent_records" (kept_until);
/// CREATE INDEX IF NOT EXISTS "idempotent_records_abandoned" ON "idempotent_records"
///     (substr(request, 1, 36), expires_at) WHERE state = 'in_flight' AND request IS NOT NULL;
/// CREATE INDEX IF NOT EXISTS "idempotent_records_listed" ON "idempotent_records"
///     (state, released, since, storage_key);
/// CREATE INDEX IF NOT EXISTS "idempotent_records_lapsed" ON "idempotent_records"
///     (expires_at, storage_key) WHERE state = 'in_flight' AND released = 0;
/// CREATE TABLE IF NOT EXISTS "idempotent_tokens" (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL);
/// ```
///
/// The last four columns serve [`InspectStore`](idempotent_core::inspect::InspectStore) (and
/// the two last indexes its listings). A file made by an earlier version gets them at its next
/// migration (`ALTER TABLE … ADD COLUMN` for each one missing, in the migration's
/// transaction): its records read with no label, not released, 0 attempts, and in their state
/// since the upgrade (the one migration that adds `since` sets it on every record, a pass over
/// the table). A row a process of the earlier version writes afterwards keeps whatever the
/// row held in those columns (a new row: none, and no `since`, which leaves it out of
/// listings); upgrade every process on the file together.
///
/// The `idempotent_` prefix is [`SqliteStoreBuilder::table_prefix`]'s default. A row whose
/// `expires_at` has passed is absent as far as a claim is concerned, except that an in-flight
/// row kept until `kept_until` is taken over by a claim of the same request (which keeps its
/// `lifetime`, checkpoints and request: [`Claim::TakenOver`]) and reported to a claim of
/// another request ([`Claim::InFlight`] with a zero `retry_after`); releasing a claim ends its
/// lease rather than deleting the row. A lease above [`MAX_LEASE`] or a TTL above
/// [`MAX_TTL`] is written as that ceiling.
///
/// [`MAX_LEASE`]: idempotent_core::limits::MAX_LEASE
/// [`MAX_TTL`]: idempotent_core::limits::MAX_TTL
///
/// Every value read back is checked for its type and range: a live row this store cannot
/// interpret (an unknown state, a fingerprint that is not 32 bytes, a time or token that is
/// not an integer, a completed row without a payload) is [`StoreError::Corrupt`], never
/// treated as absent and never overwritten; so is a file that is not a SQLite database, or a
/// damaged one. A row past its time is absent whatever else it holds.
///
/// # Operations
///
/// Each write is one transaction begun with `BEGIN IMMEDIATE`, which takes the database's
/// write lock before it reads: of any number of connections and processes, one at a time
/// reads the row, decides and writes, so two claims can never both win. A claim first reads
/// the row on a read connection (WAL readers never wait for the writer): a replay or an
/// in-flight report costs that one read, and only a claim that may win takes the write lock
/// and reads again under it. Reads of checkpoints, of a session's mark and the completer's
/// list are single statements on read connections. In one process, writes take turns on one
/// write connection; readers share up to [`SqliteStoreBuilder::max_readers`] connections.
///
/// An operation runs to its end on a task of its own even if its caller stops waiting (the
/// runtime bounds every store call): a claim that lands after its caller left is given back
/// at once (its lease ended, as a release does), so the caller's retry takes it over instead
/// of waiting out the lease.
///
/// [`claim_labelled`](Store::claim_labelled) keeps its label on a claim that begins a
/// lifetime; a takeover (also [`resume`](CheckpointStore::resume)) keeps the row's label,
/// counts one more attempt and clears `released`; [`release`](Store::release), and the
/// give-back of a claim whose caller left, set it.
///
/// Tokens and session epochs come from one counter in the `tokens` table, raised in the same
/// transaction that writes the row (and never to the row's own token or below): a token is
/// never issued twice in one database, for any key, even after the reaper deleted the record
/// it belonged to, so no grace period is needed before reaping.
///
/// # Client sessions
///
/// A session is rows of the same table: its own row at the session's digest followed by 16
/// zero bytes, with `state = 'session'`, `token` its acknowledged mark, `lifetime` the
/// highest number admitted and `epoch` drawn from the token counter; each request's record at
/// the session's digest, the epoch and the number (big-endian, so one epoch's requests are a
/// range of the primary key). The gate is one `BEGIN IMMEDIATE` transaction: it applies the
/// gate's rules to the session's row, writes it back, deletes the records the new mark covers
/// and keeps those above it for the idle time, both ranges at most the window long.
///
/// # Deployment
///
/// - **Durability.** With the default [`Durability::Full`] (`synchronous = FULL` in WAL
///   mode), a claim, a checkpoint or a completion is on the disk when the operation returns:
///   it survives the process being killed (`SIGKILL`), an operating-system crash and a power
///   loss, on a disk that honours `fsync`. [`Durability::Normal`] trades the last commits
///   before a power loss for faster writes.
/// - **One host, one clock.** Leases, TTLs and idle times are wall-clock times
///   ([`SystemTime`](std::time::SystemTime), milliseconds since the Unix epoch) written into
///   the rows, because several processes share them: every process opening the file must
///   read the same clock, which one host does. Do not share the file between machines over a
///   network file system (SQLite's locking is not reliable there, and their clocks differ).
///   A step of the host's clock moves every lease and TTL with it: forward, leases end early
///   (as a store stalled past the lease); backward, they last longer.
/// - **Several processes.** Every process opens the same path; writes take the file's write
///   lock in turn. An operation that cannot get the lock within the
///   [busy timeout](SqliteStoreBuilder::busy_timeout) (another process holds it that long)
///   fails with [`StoreError::Unavailable`] (fail closed: HTTP 503). A full disk, or the
///   database's `max_page_count`, fails writes with [`StoreError::Capacity`]; a read-only
///   file fails them with [`StoreError::Backend`].
/// - **Reaping.** Expired rows are deleted by a background task that
///   [`build`](SqliteStoreBuilder::build) starts (every [`DEFAULT_REAP_EVERY`]; see
///   [`SqliteStoreBuilder::reap_every`]), in batches of [`DEFAULT_REAP_BATCH`] rows, each a
///   short transaction using the `kept_until` index: completed rows past their TTL, abandoned
///   claims past the TTL they were claimed with, sessions past their idle time. A claim also
///   reuses an expired row of its key in place. Several processes may reap at once. Without a
///   reaper ([`reap_every(None)`](SqliteStoreBuilder::reap_every)), call
///   [`reap`](Self::reap) yourself, or the file grows with every key ever used. The file does
///   not shrink by itself when rows are deleted (SQLite reuses the free pages); `VACUUM` it
///   offline to give space back.
/// - **Needs a tokio runtime**, like sqlx: open and use the store inside one.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// One connection: this process's writes take turns on it.
    pub(crate) writer: SqlitePool,
    pub(crate) readers: SqlitePool,
    pub(crate) sql: Sql,
    path: PathBuf,
    pub(crate) reap_batch: u32,
    /// Completions and releases in this process, for [`Store::wait_for_change`].
    pub(crate) changed: Notify,
    reaper: OnceLock<tokio::task::AbortHandle>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.get() {
            reaper.abort();
        }
    }
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("table", &self.inner.sql.records)
            .finish_non_exhaustive()
    }
}

/// Configures a [`SqliteStore`]. Created by [`SqliteStore::builder`]; every setting has a
/// default, and a value out of its range is clamped into it (never a panic).
#[must_use]
pub struct SqliteStoreBuilder {
    database: Database,
    table_prefix: String,
    busy_timeout: Duration,
    durability: Durability,
    max_readers: u32,
    reap_every: Option<Duration>,
    reap_batch: u32,
    create_if_missing: bool,
    migrate: bool,
}

impl fmt::Debug for SqliteStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStoreBuilder")
            .field("path", &self.database.0.get_filename())
            .field("table_prefix", &self.table_prefix)
            .field("busy_timeout", &self.busy_timeout)
            .field("durability", &self.durability)
            .field("max_readers", &self.max_readers)
            .field("reap_every", &self.reap_every)
            .field("reap_batch", &self.reap_batch)
            .finish_non_exhaustive()
    }
}

impl SqliteStoreBuilder {
    /// What the tables' names begin with (default [`DEFAULT_TABLE_PREFIX`], `idempotent_`):
    /// the records live in `{prefix}records`, the token counter in `{prefix}tokens`. Empty, or
    /// a lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes); anything else makes
    /// [`build`](Self::build) fail with [`InvalidTablePrefix`](crate::InvalidTablePrefix), so a name can never inject SQL.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// How long an operation waits for the write lock that another process (or connection)
    /// holds before failing with [`StoreError::Unavailable`] (default
    /// [`DEFAULT_BUSY_TIMEOUT`]; at most [`MAX_BUSY_TIMEOUT`]). Writes hold the lock for
    /// milliseconds, so only a stuck or very busy process makes others wait long.
    ///
    /// The runtime bounds its own waits too: a claim at
    /// [`CLAIM_TIMEOUT`](idempotent_core::CLAIM_TIMEOUT) (5 s, or a sixth of a shorter lease),
    /// a renewal or a completion at a sixth of the lease. An operation it stopped waiting for
    /// still runs to its end (a claim that lands then is given back at once); a busy timeout
    /// below those bounds makes the store's own answer arrive first.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        if timeout > MAX_BUSY_TIMEOUT {
            tracing::warn!(
                ?timeout,
                max = ?MAX_BUSY_TIMEOUT,
                "SQLite busy timeout clamped to its maximum"
            );
        }
        self.busy_timeout = timeout.min(MAX_BUSY_TIMEOUT);
        self
    }

    /// When a commit is on disk (default [`Durability::Full`]: every commit is flushed before
    /// the operation returns). See [`Durability`].
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// How many connections serve reads at once (default [`DEFAULT_MAX_READERS`]; 1 to
    /// [`MAX_READERS`]). Writes always use one connection of their own.
    pub fn max_readers(mut self, readers: u32) -> Self {
        self.max_readers = readers.clamp(1, MAX_READERS);
        self
    }

    /// How often the background reaper deletes expired rows (default
    /// [`DEFAULT_REAP_EVERY`]; between 10 ms and 365 days), or `None` for no reaper (call
    /// [`SqliteStore::reap`] yourself). The reaper runs on the tokio runtime that builds the
    /// store and stops when the last clone of the store is dropped.
    pub fn reap_every(mut self, every: Option<Duration>) -> Self {
        self.reap_every = every.map(|every| every.clamp(MIN_REAP_EVERY, MAX_REAP_EVERY));
        self
    }

    /// The most rows one reaper transaction deletes (default [`DEFAULT_REAP_BATCH`]; at least
    /// 1), so that the write lock is never held long.
    pub fn reap_batch(mut self, rows: u32) -> Self {
        self.reap_batch = rows.max(1);
        self
    }

    /// Whether to create the database file if it does not exist (default `true`). Its
    /// directory must exist either way.
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// Whether [`build`](Self::build) runs [`SqliteStore::migrate`] (default `true`). Turn it
    /// off to open a database whose tables someone else made, with an account that may not
    /// create them: they must then have every column and index of "The table" in
    /// [`SqliteStore`]'s documentation.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Opens the database (creating the file if missing and allowed), sets WAL mode, creates
    /// the tables if missing (see [`SqliteStore::migrate`]) and starts the reaper. Fails with
    /// [`StoreError::Backend`] for an invalid table prefix or an in-memory database,
    /// [`StoreError::Unavailable`] if the file cannot be opened (a missing directory, no
    /// permission) or stays locked past the busy timeout, [`StoreError::Corrupt`] if it is not
    /// a SQLite database, and as [`SqliteStore::migrate`] does. Needs a tokio runtime.
    pub async fn build(self) -> Result<SqliteStore, StoreError> {
        let sql = Sql::new(&self.table_prefix).map_err(|e| StoreError::Backend(Box::new(e)))?;
        let path = self.database.0.get_filename().to_path_buf();
        let name = path.to_string_lossy();
        // sqlx names its in-memory databases (`sqlite::memory:`) `file:sqlx-in-memory-N`.
        let in_memory = name.is_empty()
            || name == ":memory:"
            || name.contains("mode=memory")
            || name.starts_with("file:sqlx-in-memory-");
        if in_memory {
            return Err(StoreError::Backend(
                format!(
                    "cannot keep idempotency records in the in-memory SQLite database {name:?}: \
                     it is neither durable nor shared by connections; give a file path"
                )
                .into(),
            ));
        }
        let options = self
            .database
            .0
            .create_if_missing(self.create_if_missing)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match self.durability {
                Durability::Full => SqliteSynchronous::Full,
                Durability::Normal => SqliteSynchronous::Normal,
            })
            .busy_timeout(self.busy_timeout);
        let pool = |connections: u32| {
            SqlitePoolOptions::new()
                .max_connections(connections)
                .min_connections(0)
                .acquire_timeout(ACQUIRE_TIMEOUT + self.busy_timeout)
                .test_before_acquire(false)
        };
        let doing = format!("opening the SQLite database {}", path.display());
        let writer = open_retrying(pool(1), &options, self.busy_timeout)
            .await
            .map_err(|e| store_error(doing, e))?;
        // The writer's connection made the file a WAL database: the readers' `journal_mode`
        // pragma finds it so and needs no lock.
        let readers = pool(self.max_readers).connect_lazy_with(options);
        let store = SqliteStore {
            inner: Arc::new(Inner {
                writer,
                readers,
                sql,
                path,
                reap_batch: self.reap_batch,
                changed: Notify::new(),
                reaper: OnceLock::new(),
            }),
        };
        if self.migrate {
            store.migrate().await?;
        }
        if let Some(every) = self.reap_every {
            let reaper = tokio::spawn(reap_forever(Arc::downgrade(&store.inner), every));
            let _ = store.inner.reaper.set(reaper.abort_handle());
        }
        Ok(store)
    }
}

/// Opens the first connection, again while the file is busy: a new file's switch to WAL
/// takes an exclusive lock that SQLite's busy handler does not wait for, so processes that
/// open a new file at once may meet it.
async fn open_retrying(
    pool: SqlitePoolOptions,
    options: &SqliteConnectOptions,
    busy_timeout: Duration,
) -> Result<SqlitePool, sqlx::Error> {
    let deadline = tokio::time::Instant::now() + busy_timeout.max(Duration::from_secs(1));
    loop {
        match pool.clone().connect_with(options.clone()).await {
            Err(error) if is_busy(&error) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            result => return result,
        }
    }
}

/// The background reaper: reaps every `every` until the store is dropped.
async fn reap_forever(store: Weak<Inner>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = store.upgrade() else {
            return;
        };
        match inner.reap().await {
            Ok(0) => {}
            Ok(rows) => {
                tracing::debug!(table = %inner.sql.records, rows, "reaped expired idempotency records")
            }
            Err(error) => tracing::warn!(
                table = %inner.sql.records,
                error = &error as &dyn std::error::Error,
                "could not reap expired idempotency records; retrying at the next tick"
            ),
        }
    }
}

impl SqliteStore {
    /// Opens (creating it if missing) the database file at `path` with every default: see
    /// [`SqliteStoreBuilder`] and [`build`](SqliteStoreBuilder::build).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        SqliteStore::builder(Database::path(path)).build().await
    }

    /// Configures a store on `database`: a path (`&str`, `String`, `&Path`, `PathBuf`) or
    /// sqlx's [`SqliteConnectOptions`].
    pub fn builder(database: impl Into<Database>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            database: database.into(),
            table_prefix: DEFAULT_TABLE_PREFIX.to_owned(),
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            durability: Durability::Full,
            max_readers: DEFAULT_MAX_READERS,
            reap_every: Some(DEFAULT_REAP_EVERY),
            reap_batch: DEFAULT_REAP_BATCH,
            create_if_missing: true,
            migrate: true,
        }
    }

    /// The database file's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The records table's name (`{prefix}records`).
    pub fn table(&self) -> &str {
        &self.inner.sql.records
    }

    /// Creates the tables and indexes if they do not exist (see "The table"), adds the columns
    /// a table made by an earlier version lacks, and makes the token counter if it is missing
    /// (above every token and epoch the records hold).
    ///
    /// Idempotent, and safe to run from every process at startup, at the same time: it is one
    /// `BEGIN IMMEDIATE` transaction, so concurrent migrations take turns. [`open`](Self::open)
    /// and [`build`](SqliteStoreBuilder::build) run it.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let doing = "creating the idempotency tables";
        let mut tx = self.inner.begin(doing).await?;
        let made = self.inner.migrate_under_lock(&mut tx).await;
        let made = made.map_err(|e| store_error(doing, e));
        tx.finish(made, doing).await
    }

    /// Deletes the rows past their time (completed past the TTL, abandoned claims past the
    /// TTL they were claimed with, sessions past their idle time), in transactions of at most
    /// [`SqliteStoreBuilder::reap_batch`] rows, until none are left. Returns how many rows
    /// were deleted. The background reaper calls it.
    pub async fn reap(&self) -> Result<u64, StoreError> {
        self.inner.reap().await
    }

    /// Runs `op` on a task of its own, so that it finishes (and leaves no transaction open)
    /// even if the caller stops waiting.
    pub(crate) async fn spawned<T, F>(
        &self,
        op: impl FnOnce(Arc<Inner>) -> F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        match tokio::spawn(op(Arc::clone(&self.inner))).await {
            Ok(result) => result,
            Err(error) => Err(StoreError::Backend(
                format!("a SQLite store operation failed: {error}").into(),
            )),
        }
    }

    /// A claim, or with `resume` a takeover only, on a task of its own; a claim that begins a
    /// lifetime keeps `label`. One whose caller left before its answer is given back: its
    /// lease ends at once (the record is then released), so the caller's retry takes it over.
    async fn claim_or_resume(
        &self,
        key: StorageKey,
        fingerprint: Fingerprint,
        terms: (Duration, Duration),
        (resume, label): (bool, Option<Bytes>),
    ) -> Result<Option<Claim>, StoreError> {
        self.claimed(
            move |inner| async move {
                inner
                    .claim_or_resume(&key, &fingerprint, terms, resume, label.as_deref())
                    .await
            },
            move |found| match found {
                Some(Claim::Claimed(token) | Claim::TakenOver { token, .. }) => Some((key, *token)),
                _ => None,
            },
        )
        .await
    }

    /// Runs a claim (`op`) on a task of its own, as [`spawned`](Self::spawned) does, and gives
    /// back what it claimed if its caller stopped waiting before the answer: `claimed` names
    /// the record and token an answer holds, if any. The claim's lease ends at once (the record
    /// is then released), so the caller's retry takes it over.
    async fn claimed<T, F>(
        &self,
        op: impl FnOnce(Arc<Inner>) -> F,
        claimed: impl FnOnce(&T) -> Option<(StorageKey, FencingToken)> + Send + 'static,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let claim = op(Arc::clone(&inner));
        let (answer, answered) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Err(Ok(unanswered)) = answer.send(claim.await) else {
                return;
            };
            let Some((key, token)) = claimed(&unanswered) else {
                return;
            };
            match inner.release(&key, token).await {
                Ok(()) => tracing::debug!(
                    key = %key,
                    "gave back a claim whose caller stopped waiting for it"
                ),
                Err(error) => tracing::warn!(
                    key = %key,
                    error = &error as &dyn std::error::Error,
                    "could not give back a claim whose caller stopped waiting; it lapses with its lease"
                ),
            }
        });
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::Backend(
                "a SQLite claim's task ended without an answer".into(),
            ))
        })
    }
}

impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(*key, *fingerprint, (lease, ttl), (false, None))
            .await?
            .ok_or_else(|| {
                StoreError::Backend("a claim answered that there was nothing to resume".into())
            })
    }

    /// As [`claim`](Store::claim), keeping `label` in the row's `label` column when the claim
    /// begins a lifetime (a takeover keeps the label the row has).
    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        label: &KeyLabel,
    ) -> Result<Claim, StoreError> {
        let label = Some(label.as_bytes().clone());
        self.claim_or_resume(*key, *fingerprint, (lease, ttl), (false, label))
            .await?
            .ok_or_else(|| {
                StoreError::Backend("a claim answered that there was nothing to resume".into())
            })
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let key = *key;
        self.spawned(move |inner| async move { inner.complete(&key, token, payload, ttl).await })
            .await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let key = *key;
        self.spawned(move |inner| async move { inner.release(&key, token).await })
            .await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let key = *key;
        self.spawned(move |inner| async move { inner.renew(&key, token, lease).await })
            .await
    }

    /// Returns when a completion or a release in this process may have changed a record, or
    /// after `max_wait`: changes made by other processes are seen at the caller's next claim,
    /// which the runtime polls with growing waits.
    async fn wait_for_change(&self, _key: &StorageKey, max_wait: Duration) {
        let changed = self.inner.changed.notified();
        let _ = tokio::time::timeout(max_wait, changed).await;
    }
}

impl SessionStore for SqliteStore {
    async fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        let session = *session;
        self.spawned(move |inner| async move { inner.open_session(&session, request).await })
            .await
    }

    /// The gate and the claim in one write transaction, on a task of its own. A claim whose
    /// caller left before its answer is given back as a claim of a key is (see
    /// [`claim`](Store::claim)).
    async fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &KeyLabel,
    ) -> Result<SessionClaim, StoreError> {
        let (session, fingerprint, label) = (*session, *fingerprint, label.as_bytes().clone());
        self.claimed(
            move |inner| async move {
                inner
                    .claim_in_session(&session, request, &fingerprint, lease, &label)
                    .await
            },
            move |answer| match answer {
                SessionClaim::Admitted {
                    epoch,
                    claim: Claim::Claimed(token) | Claim::TakenOver { token, .. },
                } => Some((session.seq_key(*epoch, request.seq), *token)),
                _ => None,
            },
        )
        .await
    }

    async fn session_mark(&self, session: &SessionKey) -> Result<Option<SessionMark>, StoreError> {
        let session = *session;
        self.spawned(move |inner| async move { inner.session_mark(&session).await })
            .await
    }
}

impl CheckpointStore for SqliteStore {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.claim_or_resume(*key, *fingerprint, (lease, ttl), (true, None))
            .await
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> Result<(), StoreError> {
        let key = *key;
        self.spawned(move |inner| async move {
            let entry = [Param::Bytes(&entry)];
            let statement = &inner.sql.save_step;
            inner
                .guarded("saving a checkpoint", statement, &key, token, &entry)
                .await
        })
        .await
    }

    async fn load_steps(&self, key: &StorageKey, token: FencingToken) -> Result<Bytes, StoreError> {
        let key = *key;
        self.spawned(move |inner| async move { inner.load_steps(&key, token).await })
            .await
    }

    async fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        let key = *key;
        self.spawned(move |inner| async move {
            let request = [Param::Bytes(&request)];
            let statement = &inner.sql.save_request;
            inner
                .guarded("saving a request", statement, &key, token, &request)
                .await
        })
        .await
    }

    /// One read on the partial index of in-flight rows holding a request, oldest lease end
    /// first. Rows whose storage key is not 32 or 48 bytes are skipped (no claim can reach
    /// them); a listed row that cannot be read is skipped with a warning.
    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&RequestOwner>,
    ) -> Result<Vec<Abandoned>, StoreError> {
        let owner = owner.copied();
        self.spawned(move |inner| async move { inner.abandoned(idle, limit, owner.as_ref()).await })
            .await
    }
}
