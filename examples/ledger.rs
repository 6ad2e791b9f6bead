//! An idempotent message consumer: Redis Streams delivery, PostgreSQL exactly-once effects.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1/postgres \
//!     cargo run --release --example ledger
//! redis-cli XADD payments '*' id pay-1 account alice amount 250
//! ```
//!
//! Each stream entry carries `id` (the message's idempotency key, stable across producer
//! retries), `account` and `amount` (a signed integer). Applying it adds `amount` to the
//! account's balance — an effect that is *not* idempotent by itself — in one PostgreSQL
//! transaction together with the idempotency record (`#[idempotent(tx = ..)]`), and the entry is
//! acknowledged (`XACK`) only after that transaction commits:
//!
//! - a crash before the commit leaves neither the balance change nor the record: the entry is
//!   still pending and is delivered again (to this consumer, or to another one through
//!   `XAUTOCLAIM` once it has been idle for `CLAIM_IDLE`);
//! - a crash after the commit and before the `XACK` redelivers an entry whose record exists:
//!   the retry replays it and changes nothing;
//! - the same `id` published again as another entry (a producer retry) also changes nothing.
//!
//! # Failures
//!
//! An entry that is not applied is either at fault itself or met a fault of the system:
//!
//! - **Malformed** — a field missing, empty or repeated, an `amount` that is not a 64-bit
//!   integer, more than 64 fields — or an `id` reused for a different account or amount:
//!   retrying cannot help, so it is dead-lettered at once.
//! - **Its record cannot be decoded** — the idempotency record of its `id` is there but
//!   corrupt (`corrupt_record`: its bytes were damaged or written by something else; or
//!   `payload_error`: the result it holds is not a balance). The runtime never treats such a
//!   record as absent, so every delivery would meet it again: dead-lettered at once, with
//!   that reason, for an operator to repair.
//! - **Rejected by PostgreSQL for its data** — SQLSTATE class `22` (data exception: a NUL byte
//!   in `account`, a balance overflowing `bigint`), `23` (integrity constraint violation: a
//!   `CHECK` constraint a deployment adds to `accounts`) or `54` (program limit exceeded: an
//!   `account` too long for the primary key's index): left pending and delivered again, because
//!   a rejection can depend on the moment (a balance overflows until a debit arrives), and
//!   dead-lettered at the first rejection from its `MAX_DELIVERIES`-th delivery on.
//! - **Transient** — any other failure: the connection to PostgreSQL lost (`57P01` when the
//!   server ends it), a serialization failure (`40001`), a deadlock (`40P01`), a lock or
//!   statement timeout (`55P03`, `57014`): left pending and delivered again until it succeeds,
//!   however many deliveries that takes, because the entry is not at fault and waiting is what
//!   repairs it.
//!
//! The bound counts the deliveries Redis records for the entry (its `XPENDING` delivery count),
//! so it holds across restarts and across consumers.
//!
//! Dead letters go to the stream `STREAM:dead`. Each is a new entry with the fields `reason`,
//! `entry` (the original entry's id) and `deliveries`, followed by the original entry's fields
//! (its first 64). It is added and the original acknowledged in one Redis script, only while the
//! original is still pending, so an entry is dead-lettered exactly once even when two consumers
//! give up on it at the same moment. The original stays in `STREAM` under its id until the
//! stream is trimmed.
//!
//! # Retries and hung transactions
//!
//! An entry left pending is delivered again once it has been idle for `CLAIM_IDLE`. The
//! consumer sweeps the group's pending list with `XAUTOCLAIM`, 64 entries a page, following the
//! cursor each page returns until it wraps, so the tail of a long pending list is reached even
//! when the entries at its head keep failing. Between the end of one sweep and the start of the
//! next, `CLAIM_IDLE / 2` later, it reads new entries, so a slow sweep cannot starve them.
//!
//! Each transaction runs with `SET LOCAL lock_timeout = LOCK_TIMEOUT` and `statement_timeout =
//! STATEMENT_TIMEOUT`: an account whose row is held by another transaction that hangs, or a
//! statement that never returns, fails that entry as transient instead of stalling the
//! consumer, which goes on with the next entries. Keep both below `CLAIM_IDLE`, so that an
//! entry is not taken over while its transaction still waits.
//!
//! # Starting
//!
//! Any number of consumers may start at the same moment: the idempotency table's migration and
//! the creation of the `accounts` table each run under a transaction-scoped advisory lock,
//! because `CREATE TABLE IF NOT EXISTS` run concurrently can fail on PostgreSQL's catalog. The
//! consumer group is created if missing. The consumer never crashes on input. On SIGTERM it
//! finishes the entry in hand and exits 0.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | `redis://127.0.0.1:6379` | the broker |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | balances and idempotency records |
//! | `STREAM` | `payments` | the stream to consume; dead letters go to `STREAM:dead` |
//! | `GROUP` | `ledger` | the consumer group (created if missing) |
//! | `CONSUMER` | `HOST-PID` | this consumer's name in the group |
//! | `CLAIM_IDLE` | `5s` | deliver again entries left pending this long, by any consumer |
//! | `MAX_DELIVERIES` | `3` | dead-letter an entry PostgreSQL rejects from this delivery on |
//! | `LOCK_TIMEOUT` | `1s` | the longest a transaction waits for a lock |
//! | `STATEMENT_TIMEOUT` | `2s` | the longest one statement runs |
//! | `EFFECT_DELAY_MS` | `0` | a pause inside the transaction, between the effect and the commit |
//! | `NOTIFY_URL` | unset | notify each applied posting to this `http://` URL, through the outbox |
//! | `RELAY` | `1` | `0`: enqueue notifications but leave their delivery to other processes |
//! | `RELAY_MAX_ATTEMPTS`, `RELAY_BACKOFF`, `RELAY_POLL`, `RELAY_DELIVERY_TIMEOUT` | `10`, `1s`, `1s`, `30s` | the relay's attempts, first backoff, poll interval and delivery timeout (see the `relay` example) |
//!
//! Durations are a number followed by `ms`, `s`, `m`, `h` or `d`, greater than zero; the two
//! timeouts at most 2,147,483,647 ms, about 24.8 days (PostgreSQL's limit). A bad value makes
//! the consumer exit with status 2 and a message naming the variable.
//!
//! # Notifications: an effect outside the database
//!
//! With `NOTIFY_URL` set, each applied posting also notifies another service: in the same
//! transaction as the balance change and the record, it enqueues a message in the transactional
//! outbox (`idempotent_core::postgres::Outbox`), and a relay POSTs it to `NOTIFY_URL` as
//! `{"id": <posting id>, "account": …, "amount": …}` with the message key as `Idempotency-Key`.
//! The key is the posting's operation key (`ClaimHandle::operation_key`), the same for every
//! attempt of the posting. So:
//!
//! - a posting whose transaction rolls back (a crash, a rejection by PostgreSQL) enqueued
//!   nothing; its redelivery enqueues again, with the same key;
//! - a committed posting has exactly one message, delivered at least once (a relay that dies
//!   mid-delivery leaves it to be delivered again), always with the same key, so a receiver that
//!   deduplicates on `Idempotency-Key` (this library's layer) acts on it once;
//! - a receiver that is down delays notifications, and loses none: each is retried with
//!   backoff, and dead-lettered (kept in the outbox table with its last error) after
//!   `RELAY_MAX_ATTEMPTS` attempts or a refusal (4xx). Attempts during which the relay died
//!   count: a notification whose delivery kills its relay every time is dead-lettered as
//!   `relay_crashed` instead of taking every relay down.
//!
//! Every consumer runs a relay in-process unless `RELAY=0`; `cargo run --release --example
//! relay` runs one on its own. Any number of relays share the outbox; two never deliver one
//! message at the same time. Without `NOTIFY_URL`, nothing is enqueued.

mod common;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::relay::{NOTIFICATIONS, RelaySettings};
use idempotent_core::postgres::{Message, Outbox, OutboxError, PostgresStore, Transactional};
use idempotent_core::{Error, ProblemCode, idempotent};
use redis::Value;
use redis::aio::MultiplexedConnection;
use sqlx::{PgPool, Postgres, Transaction};

/// The most fields an entry may carry; a dead letter copies at most this many.
const MAX_FIELDS: usize = 64;

/// Entries per `XAUTOCLAIM` page.
const CLAIM_PAGE: usize = 64;

/// The cursor that starts a sweep of the pending list, and that `XAUTOCLAIM` returns when the
/// sweep has reached its end.
const SWEEP_START: &str = "0-0";

struct Config {
    redis_url: String,
    database_url: String,
    stream: String,
    dead: String,
    group: String,
    consumer: String,
    claim_idle: Duration,
    max_deliveries: u64,
    lock_timeout: Duration,
    statement_timeout: Duration,
    effect_delay: Duration,
    notify: Option<RelaySettings>,
    run_relay: bool,
}

fn config() -> Result<Config, String> {
    let var =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let stream = var("STREAM", "payments");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    let claim_idle = common::parse_duration("CLAIM_IDLE", &var("CLAIM_IDLE", "5s"))?;
    let max_deliveries = var("MAX_DELIVERIES", "3");
    let max_deliveries = match max_deliveries.parse() {
        Ok(n) if n > 0 => n,
        _ => {
            return Err(format!(
                "MAX_DELIVERIES={max_deliveries:?} is not a whole number greater than zero"
            ));
        }
    };
    let timeout = |name: &str, default: &str| -> Result<Duration, String> {
        let value = var(name, default);
        let timeout = common::parse_duration(name, &value)?;
        // PostgreSQL takes both settings in milliseconds, as a 32-bit integer.
        if timeout.as_millis() > i32::MAX as u128 {
            return Err(format!(
                "{name}={value:?} is longer than PostgreSQL accepts"
            ));
        }
        Ok(timeout)
    };
    let lock_timeout = timeout("LOCK_TIMEOUT", "1s")?;
    let statement_timeout = timeout("STATEMENT_TIMEOUT", "2s")?;
    let delay = var("EFFECT_DELAY_MS", "0");
    let effect_delay = delay
        .parse()
        .map(Duration::from_millis)
        .map_err(|_| format!("EFFECT_DELAY_MS={delay:?} is not a number of milliseconds"))?;
    let run_relay = match var("RELAY", "1").as_str() {
        "1" => true,
        "0" => false,
        other => return Err(format!("RELAY={other:?} is neither 0 nor 1")),
    };
    Ok(Config {
        notify: common::relay::relay_settings()?,
        run_relay,
        redis_url: var("REDIS_URL", "redis://127.0.0.1:6379"),
        database_url: var(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        dead: format!("{stream}:dead"),
        stream,
        group: var("GROUP", "ledger"),
        consumer: var("CONSUMER", &format!("{host}-{}", std::process::id())),
        claim_idle,
        max_deliveries,
        lock_timeout,
        statement_timeout,
        effect_delay,
    })
}

/// One stream entry, as delivered.
struct Delivery {
    entry_id: String,
    fields: Vec<(String, Vec<u8>)>,
    /// How many times the group has delivered it, this delivery included.
    deliveries: u64,
}

/// A well-formed payment message.
struct Posting {
    id: String,
    account: String,
    amount: i64,
}

impl Delivery {
    /// The posting it carries, or why it is malformed.
    fn posting(&self) -> Result<Posting, String> {
        if self.fields.len() > MAX_FIELDS {
            return Err(format!(
                "the entry has {} fields, more than {MAX_FIELDS}",
                self.fields.len()
            ));
        }
        let text = |name: &str| -> Result<String, String> {
            let mut values = self.fields.iter().filter(|(k, _)| k == name);
            let (_, value) = values
                .next()
                .ok_or_else(|| format!("missing field `{name}`"))?;
            if values.next().is_some() {
                return Err(format!("field `{name}` is repeated"));
            }
            let value =
                std::str::from_utf8(value).map_err(|_| format!("field `{name}` is not UTF-8"))?;
            if value.is_empty() {
                return Err(format!("field `{name}` is empty"));
            }
            Ok(value.to_owned())
        };
        let id = text("id")?;
        idempotent_core::Key::new(id.as_str())
            .map_err(|e| format!("field `id` is not a valid key: {e}"))?;
        let account = text("account")?;
        let amount = text("amount")?;
        let amount = amount
            .parse()
            .map_err(|_| format!("field `amount` is not a 64-bit integer: {amount:?}"))?;
        Ok(Posting {
            id,
            account,
            amount,
        })
    }
}

#[derive(Debug)]
enum ApplyError {
    Idempotency(Error),
    Database(sqlx::Error),
    Outbox(OutboxError),
}

impl From<Error> for ApplyError {
    fn from(error: Error) -> Self {
        ApplyError::Idempotency(error)
    }
}

struct Ledger {
    transactional: Transactional,
    effect_delay: Duration,
    /// With `NOTIFY_URL`: where each applied posting's notification is enqueued.
    outbox: Option<Outbox>,
}

/// Adds the posting's amount to its account, exactly once per message id: the balance update,
/// the idempotency record and (with `NOTIFY_URL`) the notification's outbox message are
/// written in `tx`, and commit or roll back together.
#[idempotent(
    key = posting.id.as_str(),
    tx = tx,
    runtime = &ledger.transactional,
    fingerprint = (&posting.account, posting.amount),
    name = "ledger.apply",
)]
async fn apply(
    ledger: &Ledger,
    tx: &mut Transaction<'_, Postgres>,
    posting: &Posting,
) -> Result<i64, ApplyError> {
    if let Some(outbox) = &ledger.outbox {
        // Keyed by the running claim's operation key: the same for every attempt of this
        // posting. Enqueued first, so that a posting PostgreSQL then rejects leaves nothing.
        let notification = serde_json::json!({
            "id": posting.id,
            "account": posting.account,
            "amount": posting.amount,
        });
        let message = Message::new(NOTIFICATIONS, notification.to_string())
            .header("content-type", "application/json");
        outbox
            .enqueue(tx, &message)
            .await
            .map_err(ApplyError::Outbox)?;
    }
    let balance: i64 = sqlx::query_scalar(
        "INSERT INTO accounts (account, balance) VALUES ($1, $2) \
         ON CONFLICT (account) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance \
         RETURNING balance",
    )
    .bind(&posting.account)
    .bind(posting.amount)
    .fetch_one(&mut **tx)
    .await
    .map_err(ApplyError::Database)?;
    if !ledger.effect_delay.is_zero() {
        tokio::time::sleep(ledger.effect_delay).await;
    }
    Ok(balance)
}

/// Why an entry was not applied.
enum Failure {
    /// The entry is at fault whatever the moment: dead-letter it now.
    Invalid(String),
    /// PostgreSQL rejected the entry's data: deliver it again, up to `MAX_DELIVERIES`.
    Rejected(String),
    /// The system failed, not the entry: deliver it again until it succeeds.
    Transient(String),
}

impl Failure {
    /// A failure of one of the posting's own statements: SQLSTATE classes `22` (data
    /// exception), `23` (integrity constraint violation) and `54` (program limit exceeded)
    /// blame its data; anything else (connection, timeout, conflict with another
    /// transaction, shutdown) is transient.
    fn of_statement(context: &str, error: &sqlx::Error) -> Failure {
        if let sqlx::Error::Database(db) = error {
            if let Some(code) = db.code() {
                let reason = format!("{context}: {} (SQLSTATE {code})", db.message());
                return match code.get(..2) {
                    Some("22" | "23" | "54") => Failure::Rejected(reason),
                    _ => Failure::Transient(reason),
                };
            }
        }
        Failure::Transient(format!("{context}: {error}"))
    }

    fn of_idempotency(error: Error) -> Failure {
        match error {
            Error::FingerprintMismatch => {
                Failure::Invalid("id already used for a different account or amount".into())
            }
            // The entry's record is there and cannot be decoded (its bytes were damaged, or
            // written by something else): the runtime never treats it as absent, so every
            // delivery would meet it again. Retrying cannot help; an operator can.
            error
                if matches!(
                    error.code(),
                    ProblemCode::CorruptRecord | ProblemCode::PayloadError
                ) =>
            {
                Failure::Invalid(format!(
                    "idempotency: the stored record cannot be decoded: {} ({})",
                    common::error_chain(&error),
                    error.code()
                ))
            }
            // The store's failures, not the entry's: its key was validated when it was read.
            error => Failure::Transient(format!("idempotency: {error} ({})", error.code())),
        }
    }
}

/// Copies an entry to the dead-letter stream and acknowledges it, atomically: only an entry
/// still pending is copied, so an entry is never dead-lettered twice.
const DEAD_LETTER: &str = r"
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'reason', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
             unpack(ARGV, 5))
  return 1
end
return 0
";

struct Consumer {
    config: Config,
    redis: MultiplexedConnection,
    pool: PgPool,
    ledger: Ledger,
    dead_letter: redis::Script,
    /// Where the sweep of the pending list goes on from.
    claim_cursor: String,
}

enum Outcome {
    /// Applied now, or found already applied (replayed): either way acknowledged.
    Applied,
    DeadLettered(String),
    /// Not applied, still pending: delivered again after `CLAIM_IDLE`.
    LeftPending(String),
    /// Acknowledged by another consumer meanwhile (applied or dead-lettered there): nothing
    /// left to do here.
    Gone,
}

impl Consumer {
    async fn setup(config: Config) -> Result<Consumer, String> {
        let client = redis::Client::open(config.redis_url.as_str())
            .map_err(|e| format!("REDIS_URL={:?}: {e}", config.redis_url))?;
        // Blocking reads wait up to a second on the server: the response timeout must be longer,
        // or entries the server delivered would be lost to this consumer until reclaimed.
        let connection = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(10)));
        let mut redis = client
            .get_multiplexed_async_connection_with_config(&connection)
            .await
            .map_err(|e| format!("cannot connect to Redis at {}: {e}", config.redis_url))?;
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&config.stream)
            .arg(&config.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut redis)
            .await;
        if let Err(e) = created {
            if e.code() != Some("BUSYGROUP") {
                return Err(format!(
                    "cannot create consumer group {}: {e}",
                    config.group
                ));
            }
        }
        let store = PostgresStore::connect(&config.database_url)
            .await
            .map_err(|e| {
                format!(
                    "cannot connect to PostgreSQL at {}: {e:?}",
                    config.database_url
                )
            })?;
        store
            .migrate()
            .await
            .map_err(|e| format!("cannot create the idempotency table: {e:?}"))?;
        let pool = store.pool().clone();
        create_accounts_table(&pool)
            .await
            .map_err(|e| format!("cannot create the accounts table: {e}"))?;
        let outbox = match &config.notify {
            Some(_) => {
                let outbox = Outbox::new();
                outbox
                    .migrate(&pool)
                    .await
                    .map_err(|e| format!("cannot create the outbox table: {e:?}"))?;
                Some(outbox)
            }
            None => None,
        };
        let ledger = Ledger {
            transactional: store.transactional().namespace("ledger"),
            effect_delay: config.effect_delay,
            outbox,
        };
        Ok(Consumer {
            config,
            redis,
            pool,
            ledger,
            dead_letter: redis::Script::new(DEAD_LETTER),
            claim_cursor: SWEEP_START.to_owned(),
        })
    }

    /// Whether a sweep of the pending list has pages left.
    fn sweeping(&self) -> bool {
        self.claim_cursor != SWEEP_START
    }

    /// New entries for this consumer, waiting up to a second for some.
    async fn read_new(&mut self) -> redis::RedisResult<Vec<Delivery>> {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg("COUNT")
            .arg(16)
            .arg("BLOCK")
            .arg(1000)
            .arg("STREAMS")
            .arg(&self.config.stream)
            .arg(">")
            .query_async(&mut self.redis)
            .await?;
        // [[stream, [entries...]]] or nil on timeout.
        Ok(match reply {
            Value::Array(streams) => streams
                .into_iter()
                .filter_map(|s| match s {
                    Value::Array(mut pair) if pair.len() == 2 => Some(entries(pair.remove(1))),
                    _ => None,
                })
                .flatten()
                .collect(),
            Value::Map(streams) => streams.into_iter().flat_map(|(_, e)| entries(e)).collect(),
            _ => Vec::new(),
        })
    }

    /// The next page of the sweep: entries left pending for longer than `CLAIM_IDLE` (by any
    /// consumer, this one included), now ours, with their delivery counts.
    async fn claim_abandoned(&mut self) -> redis::RedisResult<Vec<Delivery>> {
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg(u64::try_from(self.config.claim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(&self.claim_cursor)
            .arg("COUNT")
            .arg(CLAIM_PAGE)
            .query_async(&mut self.redis)
            .await?;
        // [next-cursor, [entries...], [deleted ids...]]
        let Value::Array(mut parts) = reply else {
            self.claim_cursor = SWEEP_START.to_owned();
            return Ok(Vec::new());
        };
        let mut claimed = if parts.len() >= 2 {
            entries(parts.remove(1))
        } else {
            Vec::new()
        };
        self.claim_cursor = parts
            .first()
            .and_then(text)
            .unwrap_or_else(|| SWEEP_START.to_owned());
        if claimed.is_empty() {
            return Ok(claimed);
        }
        // XAUTOCLAIM does not report delivery counts: the pending list holds them.
        let mut lookups = redis::pipe();
        for delivery in &claimed {
            lookups
                .cmd("XPENDING")
                .arg(&self.config.stream)
                .arg(&self.config.group)
                .arg(&delivery.entry_id)
                .arg(&delivery.entry_id)
                .arg(1);
        }
        let counts: Vec<Value> = lookups.query_async(&mut self.redis).await?;
        for (delivery, count) in claimed.iter_mut().zip(&counts) {
            // An entry acknowledged meanwhile has no count; it is applied or dead-lettered
            // already, and handling it again changes nothing.
            delivery.deliveries = delivery_count(count).unwrap_or(1);
        }
        Ok(claimed)
    }

    async fn handle(&mut self, delivery: &Delivery) -> Result<Outcome, String> {
        let failure = match delivery.posting() {
            Ok(posting) => match self.post(&posting).await {
                Ok(()) => {
                    let _: i64 = redis::cmd("XACK")
                        .arg(&self.config.stream)
                        .arg(&self.config.group)
                        .arg(&delivery.entry_id)
                        .query_async(&mut self.redis)
                        .await
                        .map_err(|e| format!("XACK: {e}"))?;
                    return Ok(Outcome::Applied);
                }
                Err(failure) => failure,
            },
            Err(reason) => Failure::Invalid(reason),
        };
        match failure {
            Failure::Invalid(reason) => self.dead_letter(delivery, reason).await,
            Failure::Rejected(reason) if delivery.deliveries >= self.config.max_deliveries => {
                self.dead_letter(delivery, reason).await
            }
            Failure::Rejected(reason) => Ok(Outcome::LeftPending(format!(
                "{reason} (delivery {} of {})",
                delivery.deliveries, self.config.max_deliveries
            ))),
            Failure::Transient(reason) => Ok(Outcome::LeftPending(reason)),
        }
    }

    /// Applies the posting in a transaction of its own, bounded by the lock and statement
    /// timeouts, and commits it.
    async fn post(&self, posting: &Posting) -> Result<(), Failure> {
        let transient =
            |context: &str, e: sqlx::Error| Failure::Transient(format!("{context}: {e}"));
        let mut tx = self.pool.begin().await.map_err(|e| transient("begin", e))?;
        sqlx::query(
            "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)",
        )
        .bind(format!("{}ms", self.config.lock_timeout.as_millis()))
        .bind(format!("{}ms", self.config.statement_timeout.as_millis()))
        .execute(&mut *tx)
        .await
        .map_err(|e| transient("set timeouts", e))?;
        // On an error, `tx` is dropped: rolled back, claim and all.
        match apply(&self.ledger, &mut tx, posting).await {
            Ok(_) => tx
                .commit()
                .await
                .map_err(|e| Failure::of_statement("commit", &e)),
            Err(ApplyError::Database(e)) => Err(Failure::of_statement("database", &e)),
            Err(ApplyError::Idempotency(e)) => Err(Failure::of_idempotency(e)),
            // The outbox's statement failed (its other errors cannot happen here: the key is
            // the claim's, the message well-formed).
            Err(ApplyError::Outbox(e)) => Err(Failure::Transient(format!("outbox: {e}"))),
        }
    }

    async fn dead_letter(
        &mut self,
        delivery: &Delivery,
        reason: String,
    ) -> Result<Outcome, String> {
        let mut invocation = self.dead_letter.key(&self.config.stream);
        invocation
            .key(&self.config.dead)
            .arg(&self.config.group)
            .arg(&delivery.entry_id)
            .arg(&reason)
            .arg(delivery.deliveries);
        // Bounded: a script cannot pass thousands of arguments to a command.
        for (name, value) in delivery.fields.iter().take(MAX_FIELDS) {
            invocation.arg(name).arg(value.as_slice());
        }
        let copied: i64 = invocation
            .invoke_async(&mut self.redis)
            .await
            .map_err(|e| format!("dead-letter: {e}"))?;
        Ok(if copied == 1 {
            Outcome::DeadLettered(reason)
        } else {
            Outcome::Gone
        })
    }
}

/// Creates the `accounts` table if it is missing. `CREATE TABLE IF NOT EXISTS` is not atomic:
/// two sessions can both find the table missing, and the second then fails on a unique index
/// of PostgreSQL's catalog. A transaction-scoped advisory lock makes instances starting at
/// once take turns.
async fn create_accounts_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('ledger: accounts table', 0))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (account text PRIMARY KEY, balance bigint NOT NULL)",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Entries as `XREADGROUP` and `XAUTOCLAIM` return them, counted as first deliveries.
fn entries(value: Value) -> Vec<Delivery> {
    let Value::Array(items) = value else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|item| {
            let Value::Array(mut pair) = item else {
                return None;
            };
            if pair.len() != 2 {
                return None;
            }
            let fields = pair.pop()?;
            let entry_id = text(&pair.pop()?)?;
            let fields = match fields {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|kv| Some((text(kv.first()?)?, bytes(kv.get(1)?)?)))
                    .collect(),
                Value::Map(pairs) => pairs
                    .iter()
                    .filter_map(|(k, v)| Some((text(k)?, bytes(v)?)))
                    .collect(),
                _ => Vec::new(),
            };
            Some(Delivery {
                entry_id,
                fields,
                deliveries: 1,
            })
        })
        .collect()
}

/// The delivery count in an `XPENDING stream group id id 1` reply:
/// `[[id, consumer, idle-ms, deliveries]]`.
fn delivery_count(reply: &Value) -> Option<u64> {
    let Value::Array(rows) = reply else {
        return None;
    };
    let Some(Value::Array(row)) = rows.first() else {
        return None;
    };
    match row.get(3)? {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    String::from_utf8(bytes(value)?).ok()
}

#[tokio::main]
async fn main() -> ExitCode {
    let config = match config() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("ledger: {message}");
            return ExitCode::from(2);
        }
    };
    let stopping = Arc::new(AtomicBool::new(false));
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut sigterm) => {
            let stopping = Arc::clone(&stopping);
            tokio::spawn(async move {
                sigterm.recv().await;
                stopping.store(true, Ordering::SeqCst);
            });
        }
        Err(error) => {
            eprintln!("ledger: cannot listen for SIGTERM: {error}");
            return ExitCode::FAILURE;
        }
    }
    let mut consumer = match Consumer::setup(config).await {
        Ok(consumer) => consumer,
        Err(message) => {
            eprintln!("ledger: {message}");
            return ExitCode::FAILURE;
        }
    };
    // The in-process relay, stopped after the consumer loop.
    let relay = match (&consumer.config.notify, &consumer.ledger.outbox) {
        (Some(settings), Some(outbox)) if consumer.config.run_relay => {
            Some(common::relay::relay(consumer.pool.clone(), outbox.clone(), settings).spawn())
        }
        _ => None,
    };
    println!(
        "consuming {} as {}",
        consumer.config.stream, consumer.config.consumer
    );

    let mut next_sweep = tokio::time::Instant::now() + consumer.config.claim_idle / 2;
    while !stopping.load(Ordering::SeqCst) {
        // A sweep, once begun, runs page after page until its cursor wraps.
        let sweep = consumer.sweeping() || tokio::time::Instant::now() >= next_sweep;
        let batch = if sweep {
            consumer.claim_abandoned().await
        } else {
            consumer.read_new().await
        };
        let batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                eprintln!(
                    "ledger: reading {}: {error}; retrying",
                    consumer.config.stream
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        for delivery in &batch {
            let entry = &delivery.entry_id;
            match consumer.handle(delivery).await {
                Ok(Outcome::Applied | Outcome::Gone) => {}
                Ok(Outcome::DeadLettered(reason)) => {
                    eprintln!("ledger: entry {entry} dead-lettered: {reason}");
                }
                Ok(Outcome::LeftPending(reason)) => {
                    eprintln!("ledger: entry {entry} left pending: {reason}");
                }
                // Redis failed after the transaction: still pending, delivered again later.
                Err(error) => eprintln!("ledger: entry {entry} left pending: {error}"),
            }
            if stopping.load(Ordering::SeqCst) {
                break;
            }
        }
        if sweep && !consumer.sweeping() {
            // Timed from the end of the sweep, however long it took: new entries get their
            // turn before the next one.
            next_sweep = tokio::time::Instant::now() + consumer.config.claim_idle / 2;
        }
    }
    if let Some(relay) = relay {
        // The batch in hand is finished; what is left is delivered by other relays, or by
        // this one's successor.
        let _ = tokio::time::timeout(Duration::from_secs(30), relay.stop()).await;
    }
    eprintln!("ledger: stopped on SIGTERM");
    ExitCode::SUCCESS
}
