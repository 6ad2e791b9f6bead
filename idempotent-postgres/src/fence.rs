//! Resource-side fencing: a PostgreSQL resource refuses writes from an owner whose claim was
//! taken over.

use std::fmt;
use std::sync::Arc;

use sqlx::postgres::{PgConnection, PgPool};
// The executor's own methods, for `Send` futures: see the note in the parent module.
use sqlx::{Connection as _, Executor as _, Row as _};

use super::{InvalidTableName, TableName, token_param};
use idempotent_core::{FencingToken, StoreError};

/// The table [`Fence::new`] uses.
pub const DEFAULT_FENCE_TABLE: &str = "idempotent_fences";

/// Fencing tokens checked by the resource (Kleppmann's fencing), for writes to PostgreSQL:
/// a write is applied only if its claim's [`FencingToken`] is not below the highest token the
/// resource has already seen, so an owner whose lease lapsed while it was stalled cannot
/// overwrite what its successor wrote.
///
/// A claim alone cannot stop a stalled owner: when the store (or the owner's process) pauses
/// past the lease, a second owner takes the key over and runs, and the first one, once it
/// resumes, still believes it owns the key. Every claim carries a token that is strictly
/// greater than the tokens of all earlier claims of the same key; the running work reads it
/// with [`KeyClaim::token`](idempotent_core::KeyClaim::token). [`advance`](Self::advance) records
/// it next to the resource, in the transaction that writes the resource, and refuses it with
/// [`FenceError::Stale`] once a newer owner has written.
///
/// ```no_run
/// use idempotent_core::ClaimHandle;
/// use idempotent_postgres::{Fence, FenceError};
/// use sqlx::PgPool;
///
/// /// Runs as the work of the idempotency key `report-2024-06`, whose owners are the only
/// /// writers of that report. `claim` comes from `ClaimHandle::current()` (or the layer's
/// /// request extension, or `claim = ..` in `#[idempotent]`). Returns whether it published.
/// async fn publish(
///     pool: &PgPool,
///     fence: &Fence,
///     claim: &ClaimHandle,
///     body: &str,
/// ) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
///     let mut tx = pool.begin().await?;
///     // First, in the same transaction as the write: from here on, another owner's
///     // `advance` on this resource waits until this transaction ends.
///     match fence.advance(&mut tx, "report:2024-06", claim.token()).await {
///         Ok(()) => {}
///         // A newer owner of the key has written the report: this owner was taken over
///         // while it stalled. Write nothing; dropping `tx` rolls it back.
///         Err(FenceError::Stale { .. }) => return Ok(false),
///         Err(other) => return Err(other.into()),
///     }
///     sqlx::query("UPDATE reports SET body = $1 WHERE month = '2024-06'")
///         .bind(body)
///         .execute(&mut *tx)
///         .await?;
///     tx.commit().await?; // the write and the token, together
///     Ok(true)
/// }
///
/// # async fn setup(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let fence = Fence::new();
/// fence.migrate(&pool).await?; // at startup, like `PostgresStore::migrate`
/// # Ok(())
/// # }
/// ```
///
/// # The SQL
///
/// [`migrate`](Self::migrate) creates the table (idempotently, serialized by an advisory lock,
/// so every instance may run it at startup):
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS "idempotent_fences" (
///     resource text PRIMARY KEY,   -- the name given to `advance`
///     token bigint NOT NULL,       -- the highest token that has written the resource
///     fenced_at timestamptz NOT NULL DEFAULT clock_timestamp()  -- when (informational)
/// );
/// ```
///
/// [`advance`](Self::advance) is one statement (`$1` the resource, `$2` the token):
///
/// ```sql
/// INSERT INTO "idempotent_fences" AS f (resource, token) VALUES ($1, $2)
/// ON CONFLICT (resource) DO UPDATE
/// SET token = excluded.token, fenced_at = clock_timestamp()
/// WHERE f.token <= excluded.token
/// RETURNING f.token
/// ```
///
/// A row back means the token was accepted. No row means it was stale; only then a second
/// statement, `SELECT token FROM "idempotent_fences" WHERE resource = $1`, reads the highest
/// token for the error. It reads the row the first statement refused: that statement locked it
/// (PostgreSQL locks the conflicting row even when the `WHERE` is false), so nobody can have
/// changed it since. (Folding that read into the first statement as a CTE would read the
/// statement's snapshot, which misses a row committed by a concurrent owner the statement had
/// to wait for.)
///
/// # Rules
///
/// - **Same transaction as the write.** The statement locks the resource's row until your
///   transaction ends, so a concurrent owner's `advance` waits for your commit or rollback, and
///   the writes of all owners are applied in token order. Call it before or after the write it
///   protects, but before the commit; *before* is better, because it waits on the row before
///   touching anything else, while taking the locks in the other order can deadlock with a
///   concurrent owner (one of the two then fails with a database error). A connection that is
///   not in a transaction begun with sqlx (`pool.begin()`, `conn.begin()`) is refused with
///   [`FenceError::NotInTransaction`]: in autocommit mode the lock would end with the statement,
///   before your write. The check is sqlx's own view of the connection: a transaction ended by
///   a raw `COMMIT`, or an `advance` inside a savepoint that is later rolled back to (which
///   releases the row lock and the new highest token with it), is not detected; keep the guard
///   and the write in the outermost transaction.
/// - **Roll back on [`FenceError::Stale`]**, and on any other error. In particular, when the
///   guard runs after the write, the rollback is what undoes the stale write: never commit a
///   transaction whose `advance` failed.
/// - **Equal tokens are accepted.** A token identifies one claim, so an equal token is the same
///   owner writing again: one claim may write a resource in several transactions (a long job
///   committing in batches) and retry a transaction that failed. Only a token *below* the
///   highest is refused.
/// - **One key's tokens per resource.** Tokens are ordered per idempotency key (per storage
///   key) only. Name the resource after what the owners of *one* key write, such as the job's
///   output row, or include the key in the name (`format!("{}/report",
///   claim.storage_key().to_hex())`). Fencing one resource with the claims of several keys
///   would refuse an operation because an unrelated operation holds a newer token.
/// - **Isolation `READ COMMITTED`** (PostgreSQL's default). Under `REPEATABLE READ` or
///   `SERIALIZABLE`, an `advance` whose transaction's snapshot predates a concurrent owner's
///   commit on the resource fails with a serialization error (SQLSTATE `40001`), whichever
///   token is higher: retry the whole transaction, which then compares with the committed
///   token.
/// - **Waiting.** A concurrent owner waits until your transaction ends. Bound the wait with
///   `SET LOCAL lock_timeout` if needed; a timeout is a [`FenceError::Database`] error
///   (SQLSTATE `55P03`).
///
/// # Fencing, downstream keys, or the transactional mode
///
/// The three defend against different things (design §7):
///
/// - **Fencing** stops a stale owner from writing *after* a newer owner has written. It cannot
///   stop a stale owner that writes *before* the newer one: both writes are then accepted, in
///   token order. It fits writes that overwrite state (a report, a status, a file, a job's
///   output written in batches), where the last writer must be the current owner.
/// - **The downstream operation key** ([`KeyClaim::operation_key`](idempotent_core::KeyClaim::operation_key))
///   makes both owners cause one effect, whatever the order: use it for effects that add up (a
///   charge, a deposit, a message) on a system that deduplicates by key.
/// - **The [transactional mode](crate::Transactional)** commits the record with the
///   write, so there is never a second owner: use it when the effect is a write to the same
///   database as the records.
#[derive(Clone)]
pub struct Fence {
    sql: Arc<FenceSql>,
}

/// The SQL of one fence table, built once from its validated name.
struct FenceSql {
    /// As configured (for the advisory lock and `Debug`).
    table: String,
    migrate: String,
    advance: String,
    highest: String,
}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("table", &self.sql.table)
            .finish()
    }
}

impl Default for Fence {
    /// A fence on [`DEFAULT_FENCE_TABLE`].
    fn default() -> Self {
        Fence::new()
    }
}

impl Fence {
    /// A fence on [`DEFAULT_FENCE_TABLE`]. Call [`migrate`](Self::migrate) before the first
    /// [`advance`](Self::advance).
    pub fn new() -> Self {
        Fence::with_table(DEFAULT_FENCE_TABLE).expect("the default fence table name is valid")
    }

    /// A fence on `table`: a lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes),
    /// optionally qualified by a schema (`billing.fences`), validated exactly like
    /// [`PostgresStoreBuilder::table`](crate::PostgresStoreBuilder::table), so it can
    /// never inject SQL. Use a table of its own, not the store's.
    pub fn with_table(table: impl AsRef<str>) -> Result<Self, InvalidTableName> {
        let table = table.as_ref();
        // The store's validation and quoting, so both accept exactly the same names.
        let t = TableName::parse(table)?.quoted();
        Ok(Fence {
            sql: Arc::new(FenceSql {
                table: table.to_owned(),
                migrate: format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                     resource text PRIMARY KEY, \
                     token bigint NOT NULL, \
                     fenced_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ),
                advance: format!(
                    "INSERT INTO {t} AS f (resource, token) VALUES ($1, $2) \
                     ON CONFLICT (resource) DO UPDATE \
                     SET token = excluded.token, fenced_at = clock_timestamp() \
                     WHERE f.token <= excluded.token \
                     RETURNING f.token"
                ),
                highest: format!("SELECT token FROM {t} WHERE resource = $1"),
            }),
        })
    }

    /// The table name, as configured.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// Creates the table if it does not exist.
    ///
    /// Idempotent, and safe to run from every instance at startup: concurrent migrations of
    /// one table are serialized by a transaction-scoped advisory lock (the same lock
    /// [`PostgresStore::migrate`](crate::PostgresStore::migrate) takes for a table of that
    /// name). Needs the privilege to create tables in the schema.
    pub async fn migrate(&self, pool: &PgPool) -> Result<(), StoreError> {
        super::migrate(
            pool,
            &self.sql.table,
            std::slice::from_ref(&self.sql.migrate),
        )
        .await
        .map_err(super::store_error)
    }

    /// Records that the owner of `token` writes `resource`, or refuses it: succeeds if `token`
    /// is not below the highest token recorded for `resource` (equal is accepted), and fails
    /// with [`FenceError::Stale`] otherwise, leaving the recorded token unchanged.
    ///
    /// Run it in the transaction that writes the resource, before the commit, and roll back
    /// if it fails: see [`Fence`]'s rules. It waits while another transaction holds the
    /// resource's row (a concurrent owner between its own `advance` and its commit), then
    /// compares with what that transaction left.
    ///
    /// Errors: [`FenceError::Stale`]; [`FenceError::NotInTransaction`] if `connection` is not
    /// in a transaction begun with sqlx; [`FenceError::TokenOutOfRange`] for a token above
    /// `i64::MAX`, which the `bigint` column cannot hold (no store issues one); and
    /// [`FenceError::Database`] for anything the database reports (including a table that was
    /// not migrated, a lock timeout, a deadlock or a serialization failure).
    pub async fn advance(
        &self,
        connection: &mut PgConnection,
        resource: &str,
        token: FencingToken,
    ) -> Result<(), FenceError> {
        let value = token_param(token).ok_or(FenceError::TokenOutOfRange { token })?;
        if !connection.is_in_transaction() {
            return Err(FenceError::NotInTransaction);
        }
        let advance = sqlx::query(&self.sql.advance).bind(resource).bind(value);
        let accepted = (&mut *connection)
            .fetch_optional(advance)
            .await
            .map_err(FenceError::Database)?;
        if accepted.is_some() {
            return Ok(());
        }
        // Refused: the row exists and this transaction now holds its lock, so this reads the
        // token that refused us.
        let highest = sqlx::query(&self.sql.highest).bind(resource);
        let highest: i64 = (&mut *connection)
            .fetch_one(highest)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(FenceError::Database)?;
        let highest = u64::try_from(highest).map_err(|_| {
            FenceError::Database(sqlx::Error::Decode(
                format!("negative fencing token {highest} in the fence table").into(),
            ))
        })?;
        Err(FenceError::Stale {
            token,
            highest: FencingToken::new(highest),
        })
    }
}

/// Why [`Fence::advance`] refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A newer owner has already written the resource: `token` is below `highest`, the highest
    /// token recorded for it. Write nothing and roll the transaction back; this owner's claim
    /// has been taken over.
    #[error(
        "stale fencing token {}: the resource was already written with token {}",
        token.get(),
        highest.get()
    )]
    Stale {
        /// The token that was refused.
        token: FencingToken,
        /// The highest token recorded for the resource.
        highest: FencingToken,
    },
    /// The connection is not in a transaction begun with sqlx, so the resource's row lock would
    /// end before the write it is meant to protect.
    #[error(
        "a fence must be advanced inside the transaction that writes the resource \
         (begin it with sqlx: pool.begin() or conn.begin())"
    )]
    NotInTransaction,
    /// The token is above `i64::MAX`, the largest value the `bigint` column holds.
    #[error("fencing token {} does not fit the fence table's bigint column", token.get())]
    TokenOutOfRange {
        /// The token that was given.
        token: FencingToken,
    },
    /// The database failed the statement (unreachable, table not migrated, lock timeout,
    /// deadlock, serialization failure, ...). Roll the transaction back.
    #[error("fence statement failed")]
    Database(#[source] sqlx::Error),
}
