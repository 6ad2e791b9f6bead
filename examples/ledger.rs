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
//! A malformed entry (a field missing, an amount that is not an integer, an `id` reused for a
//! different account or amount) is copied to `STREAM:dead` with a `reason` and the original
//! entry id, and acknowledged, in one Redis script, so it is dead-lettered exactly once. The
//! consumer never crashes on input. On SIGTERM it finishes the entry in hand and exits 0.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | `redis://127.0.0.1:6379` | the broker |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | balances and idempotency records |
//! | `STREAM` | `payments` | the stream to consume |
//! | `GROUP` | `ledger` | the consumer group (created if missing) |
//! | `CONSUMER` | `HOST-PID` | this consumer's name in the group |
//! | `CLAIM_IDLE` | `5s` | take over entries left pending this long by another consumer |
//! | `EFFECT_DELAY_MS` | `0` | a pause inside the transaction, between the effect and the commit |
//!
//! What the transaction cannot cover: an effect outside this database (an e-mail, an HTTP call
//! to a provider without idempotency keys). Write such an effect as a row of an outbox table in
//! the same transaction, and deliver it from there.

mod common;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent_core::{Error, PostgresStore, Transactional, idempotent};
use redis::Value;
use redis::aio::MultiplexedConnection;
use sqlx::{PgPool, Postgres, Transaction};

struct Config {
    redis_url: String,
    database_url: String,
    stream: String,
    dead: String,
    group: String,
    consumer: String,
    claim_idle: Duration,
    effect_delay: Duration,
}

fn config() -> Result<Config, String> {
    let var =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let stream = var("STREAM", "payments");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    let claim_idle = common::parse_duration("CLAIM_IDLE", &var("CLAIM_IDLE", "5s"))?;
    let delay = var("EFFECT_DELAY_MS", "0");
    let effect_delay = delay
        .parse()
        .map(Duration::from_millis)
        .map_err(|_| format!("EFFECT_DELAY_MS={delay:?} is not a number of milliseconds"))?;
    Ok(Config {
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
        effect_delay,
    })
}

/// One stream entry, as delivered.
struct Delivery {
    entry_id: String,
    fields: Vec<(String, Vec<u8>)>,
}

/// A well-formed payment message.
struct Posting {
    id: String,
    account: String,
    amount: i64,
}

impl Delivery {
    fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The posting it carries, or why it is malformed.
    fn posting(&self) -> Result<Posting, String> {
        let text = |name: &str| -> Result<String, String> {
            let value = self
                .field(name)
                .ok_or_else(|| format!("missing field `{name}`"))?;
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
            .map_err(|_| format!("field `amount` is not an integer: {amount:?}"))?;
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
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApplyError::Idempotency(e) => write!(f, "{e} ({})", e.code()),
            ApplyError::Database(e) => write!(f, "database: {e}"),
        }
    }
}

impl From<Error> for ApplyError {
    fn from(error: Error) -> Self {
        ApplyError::Idempotency(error)
    }
}

struct Ledger {
    transactional: Transactional,
    effect_delay: Duration,
}

/// Adds the posting's amount to its account, exactly once per message id: the balance update
/// and the idempotency record are written in `tx`, and commit or roll back together.
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

/// Copies an entry to the dead-letter stream and acknowledges it, atomically: only an entry
/// still pending is copied, so a redelivered malformed entry is never dead-lettered twice.
const DEAD_LETTER: &str = r"
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'reason', ARGV[3], 'entry', ARGV[2], unpack(ARGV, 4))
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
}

enum Outcome {
    /// Applied now, or found already applied (replayed): either way acknowledged.
    Applied,
    DeadLettered,
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
        sqlx::query("CREATE TABLE IF NOT EXISTS accounts (account text PRIMARY KEY, balance bigint NOT NULL)")
            .execute(&pool)
            .await
            .map_err(|e| format!("cannot create the accounts table: {e}"))?;
        let ledger = Ledger {
            transactional: store.transactional().namespace("ledger"),
            effect_delay: config.effect_delay,
        };
        Ok(Consumer {
            config,
            redis,
            pool,
            ledger,
            dead_letter: redis::Script::new(DEAD_LETTER),
        })
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

    /// Entries other consumers left pending for longer than `CLAIM_IDLE`, now ours.
    async fn claim_abandoned(&mut self) -> redis::RedisResult<Vec<Delivery>> {
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg(u64::try_from(self.config.claim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg("0-0")
            .arg("COUNT")
            .arg(64)
            .query_async(&mut self.redis)
            .await?;
        // [next-cursor, [entries...], [deleted ids...]]
        Ok(match reply {
            Value::Array(mut parts) if parts.len() >= 2 => entries(parts.remove(1)),
            _ => Vec::new(),
        })
    }

    async fn handle(&mut self, delivery: &Delivery) -> Result<Outcome, String> {
        let posting = match delivery.posting() {
            Ok(posting) => posting,
            Err(reason) => return self.dead_letter(delivery, &reason).await,
        };
        let mut tx = self.pool.begin().await.map_err(|e| format!("begin: {e}"))?;
        match apply(&self.ledger, &mut tx, &posting).await {
            Ok(_) => {
                tx.commit().await.map_err(|e| format!("commit: {e}"))?;
            }
            Err(ApplyError::Idempotency(Error::FingerprintMismatch)) => {
                drop(tx);
                let reason = "id already used for a different account or amount";
                return self.dead_letter(delivery, reason).await;
            }
            Err(error) => return Err(format!("apply {}: {error}", posting.id)),
        }
        let _: i64 = redis::cmd("XACK")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&delivery.entry_id)
            .query_async(&mut self.redis)
            .await
            .map_err(|e| format!("XACK: {e}"))?;
        Ok(Outcome::Applied)
    }

    async fn dead_letter(&mut self, delivery: &Delivery, reason: &str) -> Result<Outcome, String> {
        let mut invocation = self.dead_letter.key(&self.config.stream);
        invocation
            .key(&self.config.dead)
            .arg(&self.config.group)
            .arg(&delivery.entry_id)
            .arg(reason);
        for (name, value) in &delivery.fields {
            invocation.arg(name).arg(value.as_slice());
        }
        let _: i64 = invocation
            .invoke_async(&mut self.redis)
            .await
            .map_err(|e| format!("dead-letter: {e}"))?;
        Ok(Outcome::DeadLettered)
    }
}

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
            Some(Delivery { entry_id, fields })
        })
        .collect()
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
    println!(
        "consuming {} as {}",
        consumer.config.stream, consumer.config.consumer
    );

    let mut last_claim = tokio::time::Instant::now();
    while !stopping.load(Ordering::SeqCst) {
        let batch = if last_claim.elapsed() >= consumer.config.claim_idle / 2 {
            last_claim = tokio::time::Instant::now();
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
            // A transient failure leaves the entry pending: it is retried after CLAIM_IDLE.
            match consumer.handle(delivery).await {
                Ok(Outcome::Applied) => {}
                Ok(Outcome::DeadLettered) => {
                    eprintln!("ledger: entry {} dead-lettered", delivery.entry_id);
                }
                Err(error) => {
                    eprintln!("ledger: entry {} left pending: {error}", delivery.entry_id)
                }
            }
            if stopping.load(Ordering::SeqCst) {
                break;
            }
        }
    }
    eprintln!("ledger: stopped on SIGTERM");
    ExitCode::SUCCESS
}
