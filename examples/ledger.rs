//! An idempotent message consumer on the library's consumer runtime: postings from Redis
//! Streams, NATS JetStream, RabbitMQ or Kafka, applied to PostgreSQL balances exactly once.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --release --example ledger
//! redis-cli XADD payments '*' id pay-1 account alice amount 250
//! ```
//!
//! Each message carries `id` (the idempotency key, stable across producer retries), `account`
//! and `amount` (a decimal 64-bit integer): a Redis Streams entry as three fields; a NATS,
//! RabbitMQ or Kafka message as a JSON object body with those three string fields
//! (`{"id":"pay-1","account":"alice","amount":"250"}`). Applying it adds `amount` to the
//! account's balance in table `accounts(account, balance)`, in one PostgreSQL transaction with
//! the idempotency record ([`Consumer::run_transactional`]); the message is acknowledged after
//! the commit, so a crash anywhere applies it once. Publishers need not set `Nats-Msg-Id` or a
//! message id: deduplication is the consumer's job.
//!
//! What becomes of a message that is not applied (see README, "Consuming messages"):
//!
//! - **malformed** — not a JSON object, a field missing, empty or repeated, an `amount` that
//!   is not a decimal `i64` (`"12x"`, `"1.5"`, `""`, one that overflows), more than 64 fields
//!   in a Redis entry, an `id` reused for another account or amount, or an idempotency record
//!   that cannot be decoded: dead-lettered at once, never applied;
//! - **rejected by PostgreSQL for its data** (SQLSTATE classes `22`, `23`, `54`): delivered
//!   again, and dead-lettered from its `MAX_DELIVERIES`-th delivery, as the broker counts them
//!   (Kafka counts none: the ledger counts them in PostgreSQL, and an entry whose handling
//!   killed its consumer `MAX_DELIVERIES` times is dead-lettered unhandled);
//! - **transient** (a lost connection, a lock or statement timeout, a serialization failure,
//!   a deadlock): delivered again until it succeeds, however many deliveries that takes.
//!
//! Dead letters carry the original message unchanged and its `reason`: on Redis the stream
//! `STREAM:dead` (fields `reason`, `entry`, `deliveries`, then the entry's), exactly once; on
//! NATS the subject `STREAM.dead` of the stream, with a `reason` header and a `Nats-Msg-Id`
//! from the entry's stream sequence, so a repeat after a crash is dropped; on RabbitMQ the
//! quorum queue `STREAM.dead` with a `reason` header, at least once; on Kafka the topic
//! `STREAM.dead` with the entry's key, the `reason` header and `source-partition` and
//! `source-offset` headers, at least once. On NATS the stream
//! `STREAM` (subjects `STREAM.entries`, `STREAM.dead`, file storage) is created when missing
//! and used as it is otherwise; the durable pull consumer `GROUP` too. On RabbitMQ the
//! quorum queues `STREAM` and `STREAM.dead` are declared with `{"x-queue-type": "quorum"}`;
//! publish entries to the default exchange with routing key `STREAM`. On Kafka the topics
//! `STREAM` and `STREAM.dead` are created with three partitions when missing and used as they
//! are otherwise; `GROUP` is the consumer group; entries with the same Kafka key are applied
//! in order, others concurrently.
//!
//! A broker that goes away, at startup or later, is waited for. Any number of consumers may
//! start at once. On SIGTERM the consumer finishes the messages in hand and exits 0.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `LEDGER_SOURCE` | `REDIS_URL` | the broker: `redis://…`, `nats://HOST:PORT`, `amqp://USER:PASS@HOST:PORT/%2f` or `kafka://HOST:PORT[,HOST:PORT]` |
//! | `REDIS_URL` | `redis://127.0.0.1:6379` | the Redis broker, when `LEDGER_SOURCE` is unset |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | balances and idempotency records |
//! | `IDEMPOTENCY_CACHE` | unset: no cache | finished records cached in front of PostgreSQL, so a duplicate is acknowledged without a transaction: `memory:N` (in this process, `N` records) or `redis://HOST:PORT[/DB]` (a Redis the consumers share); see `idempotent-cache` |
//! | `STREAM` | `payments` | the stream (Redis, NATS), queue (RabbitMQ) or topic (Kafka) to consume |
//! | `GROUP` | `ledger` | the consumer group (Redis, Kafka) or durable consumer (NATS) |
//! | `CONSUMER` | `HOST-PID` | this consumer's name in the group (Redis), its consumer tag (RabbitMQ), its `client.id` (Kafka) |
//! | `CLAIM_IDLE` | `5s` | deliver again messages left unacknowledged this long (Redis: pending idle time; NATS: ack wait; Kafka: the session timeout, after which a dead consumer's partitions go to the others) |
//! | `MAX_DELIVERIES` | `3` | dead-letter a message PostgreSQL rejects from this delivery on |
//! | `LOCK_TIMEOUT`, `STATEMENT_TIMEOUT` | `1s`, `2s` | the longest a transaction waits for a lock, a statement runs |
//! | `EFFECT_DELAY_MS` | `0` | a pause inside the transaction, between the effect and the commit |
//! | `NOTIFY_URL` | unset | notify each applied posting, through the outbox, to this `http://` URL or Kafka topic (`kafka://HOST:PORT[,HOST:PORT]/TOPIC`; see the `relay` example) |
//! | `RELAY` | `1` | `0`: enqueue notifications but leave their delivery to other processes |
//! | `RELAY_MAX_ATTEMPTS`, `RELAY_BACKOFF`, `RELAY_POLL`, `RELAY_DELIVERY_TIMEOUT` | `10`, `1s`, `1s`, `30s` | the relay's settings (see the `relay` example) |
//!
//! Durations are read by `idempotent_core::limits::parse_duration` (`500ms`, `30s`, `1h 30m`),
//! greater than zero; the two timeouts at most 2,147,483,647 ms, `CLAIM_IDLE` and the relay's
//! at most `365d` (on NATS the server's ack wait is further bounded to a day). A bad value
//! exits with status 2 naming the variable.
//!
//! With `NOTIFY_URL`, each applied posting also enqueues, in its transaction, a notification
//! `{"id", "account", "amount"}` keyed by the posting's operation key
//! ([`KeyClaim::operation_key`](idempotent_core::KeyClaim::operation_key)), which a relay POSTs with that key as `Idempotency-Key`:
//! one message per committed posting, delivered at least once, dead-lettered in the outbox
//! after `RELAY_MAX_ATTEMPTS` attempts or a refusal.

mod common;

use std::process::ExitCode;
use std::time::Duration;

use common::relay::{NOTIFICATIONS, RelaySettings};
use idempotent_consumer::{
    AnySource, Consumer, Decode, Endpoint, Failure, Fields, Message, Outcome, TxHandler,
    sql_failure,
};
use idempotent_core::{ClaimHandle, Fingerprint, Key};
use idempotent_postgres::outbox::{Outbox, Outgoing};
use idempotent_postgres::{PostgresStore, Transactional};
use sqlx::PgConnection;
use tokio::signal::unix::{SignalKind, signal};

/// A well-formed posting.
struct Posting {
    id: String,
    account: String,
    amount: i64,
}

struct Ledger {
    timeouts: (String, String),
    effect_delay: Duration,
    /// With `NOTIFY_URL`: where each applied posting's notification is enqueued.
    outbox: Option<Outbox>,
}

impl Decode for Ledger {
    type Input = Posting;

    fn decode(&self, message: &Message) -> Result<Posting, Failure> {
        posting(message)
    }

    fn key(&self, _: &Message, posting: &Posting) -> Result<Key, Failure> {
        Ok(Key::new(posting.id.as_str())?)
    }

    fn fingerprint(&self, _: &Message, posting: &Posting) -> Result<Fingerprint, Failure> {
        Ok(Fingerprint::of(&(&posting.account, posting.amount))?)
    }
}

impl TxHandler for Ledger {
    type Output = i64;

    async fn begin(&self, tx: &mut PgConnection) -> Result<(), Failure> {
        sqlx::query("SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)")
            .bind(&self.timeouts.0)
            .bind(&self.timeouts.1)
            .execute(tx)
            .await
            .map(drop)
            .map_err(|e| sql_failure("set timeouts", &e))
    }

    async fn handle(
        &self,
        tx: &mut PgConnection,
        p: &Posting,
        _: &ClaimHandle,
    ) -> Result<i64, Failure> {
        if let Some(outbox) = &self.outbox {
            // Keyed by the claim's operation key: the same for every attempt of this posting.
            let body = serde_json::json!({"id": p.id, "account": p.account, "amount": p.amount});
            let message = Outgoing::new(NOTIFICATIONS, body.to_string())
                .header("content-type", "application/json");
            outbox
                .enqueue(&mut *tx, &message)
                .await
                .map_err(|e| Failure::Transient(format!("outbox: {e}")))?;
        }
        let balance = sqlx::query_scalar(
            "INSERT INTO accounts (account, balance) VALUES ($1, $2) \
             ON CONFLICT (account) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance \
             RETURNING balance",
        )
        .bind(&p.account)
        .bind(p.amount)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| sql_failure("database", &e))?;
        tokio::time::sleep(self.effect_delay).await;
        Ok(balance)
    }
}

/// The posting a message carries: a Redis entry's fields, or a JSON object body.
fn posting(message: &Message) -> Result<Posting, Failure> {
    let fields = Fields::of(message)?;
    let (id, account) = (
        fields.text("id")?.to_owned(),
        fields.text("account")?.to_owned(),
    );
    Ok(Posting {
        id,
        account,
        amount: fields.parse("amount")?,
    })
}

struct Config {
    endpoint: Endpoint,
    database_url: String,
    max_deliveries: u64,
    ledger: Ledger,
    /// With `NOTIFY_URL`: the relay's settings, and whether it runs in this process.
    relay: Option<(RelaySettings, bool)>,
}

fn config() -> Result<Config, String> {
    let var =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let duration = |name: &str, default: &str| common::parse_duration(name, &var(name, default));
    let url = var("LEDGER_SOURCE", &var("REDIS_URL", "redis://127.0.0.1:6379"));
    if !AnySource::supports(&url) {
        return Err(format!(
            "LEDGER_SOURCE={url:?} is not a redis://, nats://, amqp:// or kafka:// URL"
        ));
    }
    // PostgreSQL takes both timeouts in milliseconds, as a 32-bit integer.
    let timeout = |name: &str, default: &str| match duration(name, default)?.as_millis() {
        ms if ms > i32::MAX as u128 => Err(format!(
            "{name}={:?} is longer than PostgreSQL accepts",
            var(name, default)
        )),
        ms => Ok(format!("{ms}ms")),
    };
    let delay = var("EFFECT_DELAY_MS", "0");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let run_relay = match var("RELAY", "1").as_str() {
        "1" => true,
        "0" => false,
        other => return Err(format!("RELAY={other:?} is neither 0 nor 1")),
    };
    let relay = common::relay::relay_settings()?.map(|settings| (settings, run_relay));
    Ok(Config {
        endpoint: Endpoint {
            url,
            stream: var("STREAM", "payments"),
            group: var("GROUP", "ledger"),
            consumer: var(
                "CONSUMER",
                &format!("{}-{}", host.trim(), std::process::id()),
            ),
            redelivery: common::bounded_duration("CLAIM_IDLE", &var("CLAIM_IDLE", "5s"))?,
        },
        database_url: var(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        max_deliveries: common::positive("MAX_DELIVERIES", &var("MAX_DELIVERIES", "3"))?,
        ledger: Ledger {
            timeouts: (
                timeout("LOCK_TIMEOUT", "1s")?,
                timeout("STATEMENT_TIMEOUT", "2s")?,
            ),
            effect_delay: Duration::from_millis(delay.parse().map_err(|_| {
                format!("EFFECT_DELAY_MS={delay:?} is not a number of milliseconds")
            })?),
            outbox: relay.as_ref().map(|_| Outbox::new()),
        },
        relay,
    })
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
    let (Ok(mut stop), Ok(store)) = (
        signal(SignalKind::terminate()),
        setup(&config).await.map_err(|e| eprintln!("ledger: {e}")),
    ) else {
        return ExitCode::FAILURE;
    };
    let tier = match idempotent_any::tier::from_env(&config.database_url).await {
        Ok(tier) => tier,
        Err(error) => {
            eprintln!("ledger: {}", common::error_chain(&error));
            return ExitCode::from(2);
        }
    };
    // The in-process relay, stopped after the consumer.
    let relay = match (&config.relay, &config.ledger.outbox) {
        (Some((settings, true)), Some(outbox)) => {
            Some(common::relay::relay(store.pool().clone(), outbox.clone(), settings).spawn())
        }
        _ => None,
    };
    // A broker that is away, now or later, is waited for, as long as it takes.
    let source = loop {
        match AnySource::connect(&config.endpoint).await {
            Ok(source) => break Some(source),
            Err(error) => eprintln!("ledger: {error}; waiting for the broker"),
        }
        tokio::select! {
            _ = stop.recv() => break None,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    };
    if let Some(source) = source {
        println!(
            "consuming {} as {}",
            config.endpoint.stream, config.endpoint.consumer
        );
        let max = config.max_deliveries;
        Consumer::new(source)
            .max_deliveries(max)
            .backoff(Duration::from_millis(100), config.endpoint.redelivery)
            .on_outcome(move |message, outcome| match outcome {
                Outcome::DeadLettered { failure } => eprintln!(
                    "ledger: entry {} dead-lettered: {}",
                    message.position(),
                    failure.reason()
                ),
                Outcome::Retried { failure, .. } => eprintln!(
                    "ledger: entry {} left pending: {failure} (delivery {} of {max})",
                    message.position(),
                    message.deliveries()
                ),
                _ => {}
            })
            .run_transactional(
                store.pool().clone(),
                match tier {
                    Some(tier) => Transactional::new(&store).tier(tier),
                    None => Transactional::new(&store),
                }
                .namespace("ledger"),
                config.ledger,
                async move {
                    stop.recv().await;
                },
            )
            .await;
    }
    if let Some(relay) = relay {
        // What is left is delivered by other relays, or by this one's successor.
        let _ = tokio::time::timeout(Duration::from_secs(30), relay.stop()).await;
    }
    eprintln!("ledger: stopped on SIGTERM");
    ExitCode::SUCCESS
}

/// The idempotency table, `accounts` and (with `NOTIFY_URL`) the outbox table, each created
/// once however many consumers start at the same moment (under advisory locks: `CREATE TABLE
/// IF NOT EXISTS` run concurrently can fail on PostgreSQL's catalog).
async fn setup(config: &Config) -> Result<PostgresStore, String> {
    let url = &config.database_url;
    let store = PostgresStore::connect(url)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e:?}"))?;
    store
        .migrate()
        .await
        .map_err(|e| format!("cannot create the idempotency table: {e:?}"))?;
    let accounts = async {
        let mut tx = store.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('ledger: accounts table', 0))")
            .execute(&mut *tx)
            .await?;
        let create = "CREATE TABLE IF NOT EXISTS accounts (account text PRIMARY KEY, balance bigint NOT NULL)";
        sqlx::query(create).execute(&mut *tx).await?;
        tx.commit().await
    };
    accounts
        .await
        .map_err(|e| format!("cannot create the accounts table: {e}"))?;
    if let Some(outbox) = &config.ledger.outbox {
        outbox
            .migrate(store.pool())
            .await
            .map_err(|e| format!("cannot create the outbox table: {e:?}"))?;
    }
    Ok(store)
}
