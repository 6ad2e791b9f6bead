//! The outbox table: enqueue in the caller's transaction, dead letters, the backlog, requeue,
//! and the SQL the relay runs on it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgPool};
// The executor's own methods, for `Send` futures: see the note in the parent module.
use sqlx::{Executor as _, Row as _};

use super::message::{MAX_OUTBOX_PAYLOAD, OutboxError, Outgoing};
use crate::{InvalidTableName, TableName, micros, migrate, store_error};
use idempotent_core::StoreError;

/// The table [`Outbox::new`] uses.
pub const DEFAULT_OUTBOX_TABLE: &str = "idempotent_outbox";

/// The longest wait the outbox writes into its table: 365 days. A [`Outgoing::delay`], a
/// relay's [backoff](super::RelayBuilder::backoff) and its
/// [`retain_delivered`](super::RelayBuilder::retain_delivered) longer than this (up to
/// [`Duration::MAX`]) are this, so that `now ± wait` is always a valid timestamp. (The same
/// ceiling as the parent module's `micros`, which binds every duration.)
pub(crate) const MAX_OUTBOX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// What [`Outbox::backlog`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// Messages not delivered yet (due, or waiting for a retry or their delay).
    pub pending: u64,
    /// Dead letters.
    pub dead: u64,
    /// How long ago the oldest pending message was enqueued; `None` with none pending.
    pub oldest_pending: Option<Duration>,
}

/// A message the relay could not deliver, kept with its last error.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The message's row id.
    pub id: i64,
    /// Its destination.
    pub destination: String,
    /// Its key.
    pub key: String,
    /// Delivery attempts made.
    pub attempts: i32,
    /// The last attempt's error.
    pub last_error: Option<String>,
}

/// The transactional outbox on PostgreSQL: [`enqueue`](Self::enqueue) writes a message in
/// **your** transaction, so it commits with the effect and the idempotency record, or not at
/// all; a [`Relay`](super::Relay) delivers it afterwards, at least once, with its key.
///
/// ```no_run
/// use idempotent_postgres::outbox::{Outbox, Outgoing};
/// use sqlx::PgPool;
///
/// # async fn example(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new();
/// outbox.migrate(&pool).await?; // at startup, like `PostgresStore::migrate`
///
/// let mut tx = pool.begin().await?;
/// // ... the business change, in `tx` ...
/// let message = Outgoing::new("notifications", r#"{"order":7}"#)
///     .key("order-7-confirmation".parse()?);
/// outbox.enqueue(&mut tx, &message).await?;
/// tx.commit().await?; // the change and the message, together
/// # Ok(())
/// # }
/// ```
///
/// Inside the work of an idempotent call (`#[idempotent(tx = ..)]`, or the runtime's `run`), a
/// message without a key gets the running claim's [operation
/// key](idempotent_core::KeyClaim::operation_key); with the transactional mode's API, give it the claim:
/// `Outgoing::new(..).claim(&pending.claim())`. That key is the same for every attempt of the
/// operation, so however often the operation is retried, the receiver sees one key.
/// With the transactional mode, a retried operation either replays (its transaction, message
/// included, committed) or runs again from nothing (it rolled back, message included).
///
/// # The table
///
/// [`migrate`](Self::migrate) creates it (idempotently, serialized by an advisory lock, so
/// every instance may run it at startup):
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS "idempotent_outbox" (
///     id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- enqueue order
///     destination text NOT NULL,      -- routed by the relay to a sink
///     message_key text NOT NULL,      -- what the receiver deduplicates on
///     payload bytea NOT NULL,
///     header_names text[] NOT NULL,
///     header_values text[] NOT NULL,
///     ordering_key text,              -- one at a time, in order, per ordering key
///     state text NOT NULL DEFAULT 'pending',  -- 'pending', 'delivered' or 'dead'
///     attempts integer NOT NULL DEFAULT 0,
///     available_at timestamptz NOT NULL,      -- not delivered before (backoff, delay)
///     created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
///     delivered_at timestamptz,
///     last_error text,
///     delivering_since timestamptz,   -- set while an attempt runs (or its relay died)
///     delivering_alone boolean        -- whether that attempt's batch had it alone
/// );
/// ```
///
/// with partial indexes on the pending messages (by `available_at`; by `available_at` for
/// those without an ordering key; by `ordering_key, id` for the others), on the delivered ones
/// (by `delivered_at`, for reaping) and on the dead letters. A table created by an earlier
/// version gets `delivering_since`, `delivering_alone` and the new index from `migrate`.
/// Enqueuing also sends
/// `NOTIFY` on the outbox's [`channel`](Self::channel), which PostgreSQL delivers at the
/// commit: a listening relay wakes up at once.
///
/// `attempts` counts every attempt, committed before the message is handed to a sink, so an
/// attempt during which the relay died (SIGKILL, out of memory, an abort) counts too; a message
/// found so is taken again alone, and its relays' deaths dead-letter it only once it was alone
/// (`delivering_alone`): see "How it delivers" on [`Relay`](super::Relay).
///
/// A relay's batch costs at most one index probe per ordering key with pending messages (it
/// stops as soon as it has a batch of them), plus the batch itself: the messages waiting
/// behind a key's oldest one are never read, so one key with a backlog of thousands does not
/// slow the batches down.
#[derive(Clone)]
pub struct Outbox {
    sql: Arc<OutboxSql>,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.sql.table)
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

impl Outbox {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`].
    pub fn new() -> Self {
        Self::with_table(DEFAULT_OUTBOX_TABLE).expect("the default table name is valid")
    }

    /// The outbox in `table`: a lowercase identifier, optionally qualified by a schema.
    pub fn with_table(table: impl AsRef<str>) -> Result<Self, InvalidTableName> {
        Ok(Outbox {
            sql: Arc::new(OutboxSql::new(table.as_ref())?),
        })
    }

    /// The table's name, as given.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// The `LISTEN`/`NOTIFY` channel enqueues notify: the table's name, or for a name longer
    /// than PostgreSQL's 63-byte channel names, `idempotent_outbox_` and a hash of it.
    pub fn channel(&self) -> &str {
        &self.sql.channel
    }

    pub(crate) fn sql(&self) -> &OutboxSql {
        &self.sql
    }

    /// Creates the table and its indexes if missing. Safe to run from every instance at once.
    pub async fn migrate(&self, pool: &PgPool) -> Result<(), StoreError> {
        migrate(pool, &self.sql.table, &self.sql.migrate)
            .await
            .map_err(store_error)
    }

    /// Writes `message` in `connection`'s transaction and returns its id. It is delivered once
    /// the transaction commits; a rollback discards it. The key is the message's own, else the
    /// running claim's operation key (see [`Outgoing::key`]).
    ///
    /// In autocommit mode (a connection not in a transaction) the message is committed at
    /// once, which is only right for a message that does not depend on other writes; a
    /// message with an [ordering key](Outgoing::ordering_key) is refused there with
    /// [`OutboxError::NotInTransaction`] before anything is written (one extra round trip,
    /// only for messages with an ordering key, asks the server).
    pub async fn enqueue(
        &self,
        connection: &mut PgConnection,
        message: &Outgoing,
    ) -> Result<i64, OutboxError> {
        let key = message.resolved_key()?;
        if message.destination.is_empty() || message.destination.len() > 255 {
            return Err(OutboxError::InvalidDestination);
        }
        if message.payload.len() > MAX_OUTBOX_PAYLOAD {
            return Err(OutboxError::PayloadTooLarge {
                size: message.payload.len(),
            });
        }
        let valid_header = |(name, value): &(String, String)| {
            http::HeaderName::from_bytes(name.as_bytes()).is_ok()
                && http::HeaderValue::from_str(value).is_ok()
                && !name.eq_ignore_ascii_case("idempotency-key")
        };
        let nul = message.destination.contains('\0')
            || message
                .ordering_key
                .as_ref()
                .is_some_and(|k| k.contains('\0'));
        if nul || !message.headers.iter().all(valid_header) {
            return Err(OutboxError::InvalidHeader);
        }
        if let Some(ordering_key) = &message.ordering_key {
            // The turn below is a transaction-scoped advisory lock: in autocommit mode it would
            // end with its own statement, and a later transaction could commit its message
            // first. Whether the connection is in a transaction block is asked of the server
            // itself: `SAVEPOINT` is refused (SQLSTATE 25P01) outside one, autocommit and the
            // implicit block of a multi-statement query alike, and a savepoint released at once
            // changes nothing inside one. The cheaper hints are not reliable:
            // `txid_current_if_assigned()` is NULL in a transaction that has not written yet,
            // `now() = statement_timestamp()` also holds for the first statement after a
            // `BEGIN` sent in the same microsecond, and sqlx's own transaction depth does not
            // see a `BEGIN` run as a query.
            match connection.execute(IN_TRANSACTION_PROBE).await {
                Ok(_) => {}
                Err(sqlx::Error::Database(error))
                    if error.code().as_deref() == Some(NO_ACTIVE_SQL_TRANSACTION) =>
                {
                    return Err(OutboxError::NotInTransaction);
                }
                Err(error) => return Err(OutboxError::Store(store_error(error))),
            }
            let turn = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))").bind(
                format!("idempotent-core outbox {} {ordering_key}", self.sql.table),
            );
            connection
                .execute(turn)
                .await
                .map_err(|e| OutboxError::Store(store_error(e)))?;
        }
        let (names, values): (Vec<&str>, Vec<&str>) = message
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .unzip();
        let insert = sqlx::query(&self.sql.enqueue)
            .bind(&message.destination)
            .bind(key.as_str())
            .bind(message.payload.as_ref())
            .bind(names)
            .bind(values)
            .bind(message.ordering_key.as_deref())
            .bind(micros(message.delay))
            .bind(&self.sql.channel);
        let row = connection
            .fetch_one(insert)
            .await
            .map_err(|e| OutboxError::Store(store_error(e)))?;
        row.try_get::<i64, _>(0)
            .map_err(|e| OutboxError::Store(store_error(e)))
    }

    /// Messages the relay gave up on, oldest first, at most `limit`.
    pub async fn dead_letters(
        &self,
        pool: &PgPool,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = pool
            .fetch_all(sqlx::query(&self.sql.dead_letters).bind(i64::from(limit)))
            .await
            .map_err(store_error)?;
        rows.iter()
            .map(|row| {
                Ok(DeadLetter {
                    id: row.try_get(0)?,
                    destination: row.try_get(1)?,
                    key: row.try_get(2)?,
                    attempts: row.try_get(3)?,
                    last_error: row.try_get(4)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(store_error)
    }

    /// How much is waiting: pending messages, dead letters, and how long the oldest pending
    /// message has waited. The relays report the same as gauges.
    pub async fn backlog(&self, pool: &PgPool) -> Result<Backlog, StoreError> {
        let row = pool
            .fetch_one(sqlx::query(&self.sql.backlog))
            .await
            .map_err(store_error)?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(Backlog {
            pending: count(row.try_get(0).map_err(store_error)?),
            dead: count(row.try_get(1).map_err(store_error)?),
            oldest_pending: row
                .try_get::<Option<f64>, _>(2)
                .map_err(store_error)?
                .filter(|secs| secs.is_finite())
                .map(|secs| Duration::from_secs_f64(secs.max(0.0))),
        })
    }

    /// Puts a dead letter back to be delivered again (its attempts counted from zero), for
    /// example once the receiver is fixed. Returns whether `id` was a dead letter.
    pub async fn requeue(&self, pool: &PgPool, id: i64) -> Result<bool, StoreError> {
        let done = pool
            .execute(sqlx::query(&self.sql.requeue).bind(id))
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// Deletes delivered messages delivered more than `older_than` ago, in batches of 1,000;
    /// returns how many. Pending messages and dead letters are kept. An `older_than` above 365
    /// days, [`Duration::MAX`] included, is 365 days. The relay runs it: see
    /// [`Relay::reap`](super::Relay::reap).
    pub(super) async fn reap(
        &self,
        pool: &PgPool,
        older_than: Duration,
    ) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = pool
                .execute(sqlx::query(&self.sql.reap).bind(micros(older_than)))
                .await
                .map_err(store_error)?
                .rows_affected();
            total += deleted;
            if deleted < REAP_BATCH {
                return Ok(total);
            }
        }
    }
}

/// Succeeds in a transaction block, changing nothing; fails with
/// [`NO_ACTIVE_SQL_TRANSACTION`] outside one. One simple-query round trip.
const IN_TRANSACTION_PROBE: &str =
    "SAVEPOINT idempotent_outbox_probe; RELEASE SAVEPOINT idempotent_outbox_probe";

/// SQLSTATE `25P01`: `SAVEPOINT can only be used in transaction blocks`.
const NO_ACTIVE_SQL_TRANSACTION: &str = "25P01";

/// Rows one reap statement deletes at most.
const REAP_BATCH: u64 = 1000;

/// How long a message a relay took stays out of other relays' batches before the relay holds
/// it under a row lock: the moment between the commit that counts the attempt and the lock.
/// Once the lock is held, the lock keeps the others away; if the relay dies before it records
/// the outcome, the message is due again this long after it was taken, at the soonest.
pub(crate) const TAKEN_HOLD: Duration = Duration::from_secs(5);

/// The prefix of the last error of an attempt whose relay died, or lost its database
/// connection, before recording how it ended.
pub(crate) const RELAY_CRASHED: &str = "relay_crashed";

/// The outbox's statements, for one table.
pub(crate) struct OutboxSql {
    pub(crate) table: String,
    channel: String,
    migrate: [String; 8],
    backlog: String,
    enqueue: String,
    dead_letters: String,
    requeue: String,
    reap: String,
    /// The batch statement, with `{batch}` for the batch size. See [`take`](Self::take).
    take: String,
    /// Locks, in the batch's transaction, the messages just taken that are still as the take
    /// left them: `$1` their ids, `$2` their attempt counts. Returns the ids locked.
    ///
    /// It waits for locks rather than skipping them: another relay's batch statement, running
    /// while this one's committed, can hold some of them for a moment (`FOR UPDATE` locks a row
    /// before it sees the row is no longer due, and keeps the lock to the end of its
    /// statement); skipping them would strand them until [`TAKEN_HOLD`] is over. A message
    /// another relay took over meanwhile has another attempt count by then, and is not locked.
    /// The wait is bounded by the batch's `lock_timeout` ([`TAKEN_HOLD`]).
    pub(crate) lock: String,
    /// `$1` the ids delivered.
    pub(crate) delivered: String,
    /// `$1` id, `$2` error, `$3` backoff (µs). Whether the attempt was the last is the
    /// relay's decision: then it runs [`dead`](Self::dead) instead.
    pub(crate) failed: String,
    /// `$1` id, `$2` error.
    pub(crate) dead: String,
}

impl OutboxSql {
    /// The batch statement for batches of `batch` messages whose payloads add up to at most
    /// `bytes`. Both are written into the text, not bound: with `LIMIT $1`, PostgreSQL's
    /// generic plan for the prepared statement (used after its fifth execution) takes about a
    /// hundred times longer than the plan for a known limit.
    ///
    /// Binds `$1` the destinations the relay has sinks for, `$2` its `max_attempts`, `$3` the
    /// ordering key after which the look for heads starts, `$4` whether the batch runs beside
    /// others of its relay (see below). One statement,
    /// committed on its own (autocommit), so what it counts survives the relay:
    ///
    /// - **Candidates.** Messages without an ordering key, due, oldest first, through the
    ///   partial index on `(available_at, id)` of the pending ones without an ordering key;
    ///   and the *head* of each ordering key (its oldest pending message) if it is due, found
    ///   by a skip scan of the index on `(ordering_key, id)`: one index probe per key, however
    ///   many messages wait behind its head, visiting keys from `$3` on and wrapping around,
    ///   and stopping once a batch of heads is locked. A message that is not its key's head is
    ///   never looked at. Each part locks at most `batch` rows (`FOR UPDATE SKIP LOCKED`: rows
    ///   another relay holds are passed over, and a head another relay holds blocks its key);
    ///   the oldest `batch` of both are candidates, and of those the oldest whose payloads
    ///   add up to at most `bytes` (the first to deliver always, however large: a batch
    ///   takes at least one message to deliver when one is due; a message dead-lettered here
    ///   counts nothing and is always taken, its payload not being read). The length of a
    ///   payload is read from its row without reading the payload. Up to `batch` rows of
    ///   each part are locked for the statement's length even when the byte budget takes
    ///   fewer.
    /// - **Taking.** Each taken message's `attempts` is counted and committed *before* it is
    ///   delivered, `delivering_since` is set, and it is not due for [`TAKEN_HOLD`]: by then
    ///   the relay holds it under a row lock in the batch's transaction (`lock`).
    /// - **Crashes.** A candidate whose `delivering_since` was already set was left by a
    ///   relay that died while delivering it: its `last_error` says so ([`RELAY_CRASHED`]).
    ///   If its attempts already reached `$2` and that attempt was made alone
    ///   (`delivering_alone`), it is dead-lettered here instead of being delivered again (its
    ///   payload is not returned). Otherwise it is a *suspect*: it, the oldest suspect among
    ///   the candidates, is taken **alone** (with only the messages dead-lettered here beside
    ///   it), so that if it kills this relay too, no other message is charged. Each taken
    ///   message's `delivering_alone` records whether it was the only one to deliver.
    /// - **Beside other batches** (`$4` true: the relay may have another batch under way, see
    ///   [`RelayBuilder::concurrent_batches`](super::RelayBuilder::concurrent_batches)): no
    ///   suspect is taken (they are left for a batch that has the relay to itself), and no
    ///   message counts as delivered alone, whatever the batch's size, since a crash of the
    ///   relay would be a crash of every batch it has under way.
    ///
    /// Returns `id, destination, message_key, payload, header_names, header_values, attempts,
    /// exhausted (dead-lettered here), crashed, ordering_key, last_error, cut, suspects`, a
    /// row for each message taken, or one row of NULLs but the last two when none was
    /// (`cut` and `suspects` the same in every row: the byte budget left candidates out, so
    /// more are due at once; a suspect was among the candidates, taken alone, or left
    /// because `$4`).
    pub(crate) fn take(&self, batch: u32, bytes: u64) -> String {
        self.take
            .replace("{batch}", &batch.to_string())
            .replace("{bytes}", &bytes.min(i64::MAX as u64).to_string())
    }

    fn new(table: &str) -> Result<Self, InvalidTableName> {
        let name = TableName::parse(table)?;
        let t = name.quoted();
        let short = table.rsplit('.').next().unwrap_or(table);
        let index = |suffix: &str| format!("\"{short}_{suffix}\"");
        let channel = if table.len() <= 63 {
            table.to_owned()
        } else {
            let digest = blake3::hash(table.as_bytes()).to_hex();
            format!("idempotent_outbox_{}", &digest.as_str()[..32])
        };
        let hold_ms = TAKEN_HOLD.as_millis();
        let heads = |name: &str, bound: &str| {
            let next = |after: &str| {
                format!(
                    "SELECT ordering_key, id FROM {t} WHERE state = 'pending' \
                     AND ordering_key IS NOT NULL AND {after} {bound} \
                     ORDER BY ordering_key, id LIMIT 1"
                )
            };
            format!(
                "{name}(k, id) AS (({first}) UNION ALL \
                 SELECT n.ordering_key, n.id FROM {name} c, LATERAL ({then}) n)",
                first = next("TRUE"),
                then = next("ordering_key > c.k"),
            )
        };
        let crashed_error = format!(
            "'{RELAY_CRASHED}: a relay died while delivering it (attempt ' || o.attempts || \
             '), or lost its database connection before recording how the attempt ended'"
        );
        Ok(OutboxSql {
            table: table.to_owned(),
            channel,
            migrate: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                     id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                     destination text NOT NULL, \
                     message_key text NOT NULL, \
                     payload bytea NOT NULL, \
                     header_names text[] NOT NULL, \
                     header_values text[] NOT NULL, \
                     ordering_key text, \
                     state text NOT NULL DEFAULT 'pending', \
                     attempts integer NOT NULL DEFAULT 0, \
                     available_at timestamptz NOT NULL, \
                     created_at timestamptz NOT NULL DEFAULT clock_timestamp(), \
                     delivered_at timestamptz, \
                     last_error text, \
                     delivering_since timestamptz, \
                     delivering_alone boolean)"
                ),
                // Tables created before the columns existed.
                format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS delivering_since timestamptz"),
                format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS delivering_alone boolean"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (available_at, id) \
                     WHERE state = 'pending'",
                    index("pending_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (available_at, id) \
                     WHERE state = 'pending' AND ordering_key IS NULL",
                    index("unordered_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (ordering_key, id) \
                     WHERE state = 'pending' AND ordering_key IS NOT NULL",
                    index("ordering_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (delivered_at) \
                     WHERE state = 'delivered'",
                    index("delivered_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (id) WHERE state = 'dead'",
                    index("dead_idx")
                ),
            ],
            backlog: format!(
                "SELECT (SELECT count(*) FROM {t} WHERE state = 'pending'), \
                 (SELECT count(*) FROM {t} WHERE state = 'dead'), \
                 (SELECT EXTRACT(EPOCH FROM clock_timestamp() - min(created_at))::float8 \
                  FROM {t} WHERE state = 'pending')"
            ),
            enqueue: format!(
                "WITH m AS (INSERT INTO {t} (destination, message_key, payload, header_names, \
                 header_values, ordering_key, available_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7 * interval '1 microsecond') \
                 RETURNING id) \
                 SELECT id, pg_notify($8, '') FROM m"
            ),
            dead_letters: format!(
                "SELECT id, destination, message_key, attempts, last_error FROM {t} \
                 WHERE state = 'dead' ORDER BY id LIMIT $1"
            ),
            requeue: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, delivering_since = NULL, \
                 delivering_alone = NULL, available_at = clock_timestamp() \
                 WHERE id = $1 AND state = 'dead'"
            ),
            reap: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE state = 'delivered' \
                 AND delivered_at < clock_timestamp() - $1 * interval '1 microsecond' \
                 LIMIT {REAP_BATCH} FOR UPDATE SKIP LOCKED)"
            ),
            take: format!(
                "WITH RECURSIVE {after_cursor}, {up_to_cursor}, \
                 heads AS (SELECT o.id, o.available_at, o.attempts, o.delivering_since, \
                   o.delivering_alone, octet_length(o.payload) AS bytes \
                   FROM (SELECT id FROM after_cursor UNION ALL SELECT id FROM up_to_cursor) h \
                   JOIN {t} o ON o.id = h.id \
                   WHERE o.state = 'pending' AND o.available_at <= clock_timestamp() \
                   AND o.destination = ANY($1) \
                   LIMIT {{batch}} FOR UPDATE OF o SKIP LOCKED), \
                 unordered AS (SELECT id, available_at, attempts, delivering_since, \
                   delivering_alone, octet_length(payload) AS bytes FROM {t} \
                   WHERE state = 'pending' AND ordering_key IS NULL \
                   AND available_at <= clock_timestamp() AND destination = ANY($1) \
                   ORDER BY available_at, id LIMIT {{batch}} FOR UPDATE SKIP LOCKED), \
                 oldest AS (SELECT id, available_at, \
                   delivering_since IS NOT NULL AS crashed, \
                   delivering_since IS NOT NULL AND attempts >= $2 \
                     AND delivering_alone IS TRUE AS exhausted, bytes \
                   FROM (SELECT * FROM heads UNION ALL SELECT * FROM unordered) c \
                   ORDER BY available_at, id LIMIT {{batch}}), \
                 candidates AS (SELECT id, available_at, crashed, exhausted FROM (\
                   SELECT *, count(*) FILTER (WHERE NOT exhausted) OVER w AS n, \
                   sum(CASE WHEN exhausted THEN 0 ELSE bytes END) OVER w AS upto \
                   FROM oldest WINDOW w AS (ORDER BY available_at, id)) s \
                   WHERE exhausted OR n = 1 OR upto <= {{bytes}}), \
                 suspect AS (SELECT id FROM candidates WHERE crashed AND NOT exhausted \
                   ORDER BY available_at, id LIMIT 1), \
                 chosen AS (SELECT c.id, c.crashed, c.exhausted FROM candidates c \
                   WHERE c.exhausted \
                   OR (NOT c.crashed AND ($4 OR NOT EXISTS (SELECT 1 FROM suspect))) \
                   OR (NOT $4 AND c.id = (SELECT id FROM suspect))), \
                 size AS (SELECT count(*) FILTER (WHERE NOT exhausted) = 1 AND NOT $4 AS alone \
                   FROM chosen), \
                 taken AS (UPDATE {t} o SET \
                   state = CASE WHEN c.exhausted THEN 'dead' ELSE o.state END, \
                   attempts = CASE WHEN c.exhausted THEN o.attempts \
                     ELSE LEAST(o.attempts, 2147483646) + 1 END, \
                   last_error = CASE WHEN c.crashed THEN {crashed_error} ELSE o.last_error END, \
                   available_at = CASE WHEN c.exhausted THEN o.available_at \
                     ELSE clock_timestamp() + interval '{hold_ms} milliseconds' END, \
                   delivering_since = CASE WHEN c.exhausted THEN NULL \
                     ELSE clock_timestamp() END, \
                   delivering_alone = CASE WHEN c.exhausted THEN NULL ELSE s.alone END \
                 FROM chosen c, size s WHERE o.id = c.id \
                 RETURNING o.id, o.destination, o.message_key, \
                   CASE WHEN c.exhausted THEN NULL ELSE o.payload END AS payload, \
                   o.header_names, o.header_values, o.attempts, c.exhausted AS exhausted, \
                   c.crashed AS crashed, o.ordering_key, o.last_error) \
                 SELECT t.*, f.cut, f.suspects FROM (SELECT \
                   (SELECT count(*) FROM oldest) > (SELECT count(*) FROM candidates) AS cut, \
                   EXISTS (SELECT 1 FROM suspect) AS suspects) f \
                 LEFT JOIN taken t ON true",
                after_cursor = heads("after_cursor", "AND ordering_key > $3"),
                up_to_cursor = heads("up_to_cursor", "AND ordering_key <= $3"),
            ),
            lock: format!(
                "SELECT o.id FROM {t} o \
                 JOIN unnest($1::int8[], $2::int4[]) AS taken(id, attempts) \
                 ON o.id = taken.id AND o.attempts = taken.attempts \
                 WHERE o.state = 'pending' FOR UPDATE OF o"
            ),
            delivered: format!(
                "UPDATE {t} SET state = 'delivered', delivered_at = clock_timestamp(), \
                 last_error = NULL, delivering_since = NULL, delivering_alone = NULL \
                 WHERE id = ANY($1)"
            ),
            failed: format!(
                "UPDATE {t} SET last_error = $2, delivering_since = NULL, \
                 delivering_alone = NULL, available_at = clock_timestamp() + $3 * interval '1 microsecond' \
                 WHERE id = $1"
            ),
            dead: format!(
                "UPDATE {t} SET state = 'dead', last_error = $2, delivering_since = NULL, \
                 delivering_alone = NULL WHERE id = $1"
            ),
        })
    }
}
