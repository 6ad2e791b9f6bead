//! The `ledger` consumer under chaos, on each broker it runs on: Redis Streams, NATS JetStream,
//! RabbitMQ and Kafka (nisshi), each a private broker the test kills, with PostgreSQL from
//! `IDEMPOTENT_TEST_POSTGRES_URL` (a fresh database per test).
//!
//! (Longer than most files here, on purpose: the chaos driver — publishing, killing,
//! restarting and auditing — is one procedure run on three brokers.)
//!
//! Each test publishes about 1,000 entries — 760 distinct postings over 200 accounts, 190
//! duplicates of them (95 right after their original, 95 at least 100 entries later) and 50
//! malformed entries of every kind the ledger refuses, each carrying a unique marker — while
//! two ledger processes consume them. Meanwhile the consumers are `SIGKILL`ed at random moments
//! eight times and started again, and once, halfway through the publishing, the broker itself
//! is `SIGKILL`ed (a consumer with it, started again while the broker is away) and restarted.
//! The publisher retries each entry until the broker confirms it (Redis: the `XADD` reply;
//! NATS: the JetStream publish ack; RabbitMQ: the publisher confirm; Kafka: the idempotent
//! producer's delivery report with `acks=all`), so an entry may be stored twice: a posting's
//! copy is a duplicate, and malformed entries are compared by marker. On Kafka postings carry
//! their account as the record key, over three partitions: each consumer kill and restart is
//! a rebalance while the other consumer has records in hand.
//!
//! Once the broker has nothing left to deliver (Redis: nothing pending and the group's
//! last-delivered id at the stream's last entry; NATS: the durable consumer's `num_pending`
//! and `num_ack_pending` both 0; RabbitMQ: the queue's ready and checked-out messages, asked
//! of its Raft state machine, both 0; Kafka: the group's committed offset of each partition at
//! its high watermark):
//!
//! - every balance is the sum of its account's postings over distinct ids;
//! - every malformed entry is dead-lettered with a reason, and no posting is: on Redis and
//!   NATS exactly once per stored copy (Redis: one dead letter per entry id; NATS: one per
//!   stream sequence, by its `Nats-Msg-Id`), on RabbitMQ and Kafka at least once (Kafka: by
//!   its `source-partition` and `source-offset` headers);
//! - no consumer exited by itself (checked before each kill, while waiting, and at the end),
//!   and each exits 0 on `SIGTERM`.
//!
//! The seed is printed (`IDEMPOTENT_CHAOS_SEED=N` repeats a run's workload and kill
//! schedule), with each test's timings. Without a broker installed a test says loudly that it
//! did not run, or fails where backends are required (`IDEMPOTENT_REQUIRE_BACKENDS=1`, CI).
//!
//! Longer than most test files: one scenario, and for each of the three brokers the adapter
//! that publishes, kills, restarts and drains it; apart they would say less.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, stream::StorageType};
use idempotent_test_kit::brokers::{PrivateKafka, PrivateNats, PrivateRabbit};
use idempotent_test_kit::postgres::Database;
use idempotent_test_kit::redis::PrivateRedis;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use redis::Value;
use redis::aio::MultiplexedConnection;
use support::ledger::{Consumer, Deadline, Posting, Rng, expected_balances, postings};
use tokio::time::{Instant, sleep, timeout};

/// The consumer group (Redis), durable consumer (NATS).
const GROUP: &str = "ledger";
/// Distinct postings; each eighth is published again right after, another eighth far later.
const DISTINCT: u64 = 760;
const ACCOUNTS: u64 = 200;
const MALFORMED: usize = 50;
/// Consumer kills; the broker is killed in round [`BROKER_ROUND`].
const KILLS: u32 = 8;
const BROKER_ROUND: u32 = 4;
/// The publisher pauses this long after every ten entries, so that publishing spans the kills.
const PACE: Duration = Duration::from_millis(80);
/// The longest one entry's publish may keep failing (the broker is away meanwhile).
const PUBLISH_PATIENCE: Duration = Duration::from_secs(120);
/// The longest the consumers may take to consume what is left once publishing is over.
const DRAIN_PATIENCE: Duration = Duration::from_secs(120);

// ----- the workload -----

#[derive(Clone, Debug)]
enum Entry {
    Posting(Posting),
    /// The `n`-th malformed entry, of kind `n % kinds`, carrying `MARKER-nnn`.
    Malformed {
        n: usize,
    },
}

fn marker(n: usize) -> String {
    format!("MARKER-{n:03}")
}

/// The marker in `bytes`, if any.
fn marker_in(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    let at = text.find("MARKER-")?;
    let marker = text.get(at..at + 10)?;
    marker[7..]
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| marker.to_owned())
}

struct Workload {
    entries: Vec<Entry>,
    /// Each account's balance: the sum of its postings over distinct ids.
    expected: BTreeMap<String, i64>,
    distinct: usize,
    markers: BTreeSet<String>,
}

/// [`DISTINCT`] postings with their duplicates, and [`MALFORMED`] malformed entries at random
/// places, in publication order.
fn workload(rng: &mut Rng) -> Workload {
    let postings = postings(DISTINCT, ACCOUNTS, rng);
    let (expected, distinct) = expected_balances(&postings);
    let distinct = distinct.len();
    let mut entries: Vec<Entry> = postings.into_iter().map(Entry::Posting).collect();
    for n in 0..MALFORMED {
        let at = rng.below(entries.len() as u64 + 1) as usize;
        entries.insert(at, Entry::Malformed { n });
    }
    Workload {
        entries,
        expected,
        distinct,
        markers: (0..MALFORMED).map(marker).collect(),
    }
}

/// A Redis Streams entry's fields. Malformed: a field missing, empty or repeated, an amount
/// that is not a decimal `i64`; each with its marker in a field of its own (which the ledger
/// ignores, and the dead letter keeps).
fn redis_fields(entry: &Entry) -> Vec<(&'static str, String)> {
    let (n, kind) = match entry {
        Entry::Posting(Posting {
            id,
            account,
            amount,
        }) => {
            return vec![
                ("id", id.clone()),
                ("account", account.clone()),
                ("amount", amount.to_string()),
            ];
        }
        Entry::Malformed { n } => (*n, n % 10),
    };
    let (id, account) = (format!("bad-{n}"), format!("acct-{}", n as u64 % ACCOUNTS));
    let mut fields = match kind {
        0 => vec![("account", account), ("amount", "5".into())],
        1 => vec![("id", id), ("amount", "5".into())],
        2 => vec![("id", id), ("account", account)],
        3 => vec![
            ("id", "".into()),
            ("account", account),
            ("amount", "5".into()),
        ],
        4 => vec![("id", id), ("account", "".into()), ("amount", "5".into())],
        5 => vec![("id", id), ("account", account), ("amount", "".into())],
        6 => vec![("id", id), ("account", account), ("amount", "12x".into())],
        7 => vec![("id", id), ("account", account), ("amount", "1.5".into())],
        8 => vec![
            ("id", id),
            ("account", account),
            ("amount", "99999999999999999999".into()),
        ],
        _ => vec![
            ("id", id),
            ("account", account),
            ("amount", "5".into()),
            ("amount", "6".into()),
        ],
    };
    fields.push(("marker", marker(n)));
    fields
}

/// A NATS or RabbitMQ message's body: a JSON object of three strings. Malformed: not JSON, a
/// JSON array, a field missing or empty, an amount `"12x"`, `"1.5"`, `""`, one that overflows,
/// a number; each with its marker in the body.
fn json_body(entry: &Entry) -> Vec<u8> {
    let n = match entry {
        Entry::Posting(Posting {
            id,
            account,
            amount,
        }) => {
            let body =
                serde_json::json!({"id": id, "account": account, "amount": amount.to_string()});
            return body.to_string().into_bytes();
        }
        Entry::Malformed { n } => *n,
    };
    let (id, account, marker) = (
        format!("bad-{n}"),
        format!("acct-{}", n as u64 % ACCOUNTS),
        marker(n),
    );
    let object = |amount: serde_json::Value| {
        serde_json::json!({"id": id, "account": account, "amount": amount, "marker": marker})
            .to_string()
    };
    let body = match n % 9 {
        0 => format!("not json {marker}"),
        1 => serde_json::json!([marker, id, account, "5"]).to_string(),
        2 => serde_json::json!({"id": id, "account": account, "marker": marker}).to_string(),
        3 => serde_json::json!({"id": "", "account": account, "amount": "5", "marker": marker})
            .to_string(),
        4 => object("12x".into()),
        5 => object("1.5".into()),
        6 => object("".into()),
        7 => object("99999999999999999999".into()),
        _ => object(12.into()),
    };
    body.into_bytes()
}

// ----- the brokers -----

/// A private broker the test kills, as the chaos needs it.
trait Broker {
    const NAME: &'static str;
    type Publisher: Publisher;

    /// The ledger's `LEDGER_SOURCE`, `STREAM` (and what else the broker needs).
    fn env(&self) -> Vec<(&'static str, String)>;

    /// Sets up what publishers set up (the NATS stream, the RabbitMQ queues); a publisher
    /// connected to the broker.
    async fn publisher(&mut self) -> Self::Publisher;

    async fn kill(&mut self);

    async fn restart(&mut self);

    /// Whether everything published was consumed; `Err` says why that cannot be told now.
    async fn drained(&mut self) -> Result<bool, String>;

    /// Checks the dead letters against the malformed entries; a one-line summary.
    async fn check_dead_letters(&mut self, workload: &Workload) -> String;
}

trait Publisher: Send + 'static {
    /// One attempt at publishing `entry`: `Ok` once the broker has confirmed it. After an
    /// error the next attempt connects again.
    fn attempt(&mut self, entry: &Entry) -> impl Future<Output = Result<(), String>> + Send;
}

/// Publishes `entry` again and again until the broker confirms it; the attempts it took.
/// Fails the test after [`PUBLISH_PATIENCE`] of failures.
async fn publish<P: Publisher>(publisher: &mut P, entry: &Entry) -> u32 {
    let started = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match publisher.attempt(entry).await {
            Ok(()) => return attempts,
            Err(error) => assert!(
                started.elapsed() < PUBLISH_PATIENCE,
                "{entry:?}: not confirmed within {PUBLISH_PATIENCE:?}: {error}"
            ),
        }
        sleep(Duration::from_millis(50)).await;
    }
}

// ----- Redis Streams -----

struct Redis {
    server: PrivateRedis,
    stream: String,
}

struct RedisPublisher {
    client: redis::Client,
    connection: Option<MultiplexedConnection>,
    stream: String,
}

async fn redis_connect(client: &redis::Client) -> Result<MultiplexedConnection, String> {
    match timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no connection within 5 s".into()),
    }
}

/// `command` on `connection`, bounded: a server killed mid-command fails it.
async fn redis_query<T: redis::FromRedisValue>(
    connection: &mut MultiplexedConnection,
    command: &redis::Cmd,
) -> Result<T, String> {
    match timeout(Duration::from_secs(10), command.query_async(connection)).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err("no reply within 10 s".into()),
    }
}

impl Publisher for RedisPublisher {
    fn attempt(&mut self, entry: &Entry) -> impl Future<Output = Result<(), String>> + Send {
        let mut command = redis::cmd("XADD");
        command.arg(&self.stream).arg("*");
        for (name, value) in redis_fields(entry) {
            command.arg(name).arg(value);
        }
        async move {
            if self.connection.is_none() {
                self.connection = Some(redis_connect(&self.client).await?);
            }
            let connection = self.connection.as_mut().unwrap();
            let added = redis_query::<String>(connection, &command).await;
            if added.is_err() {
                self.connection = None;
            }
            added.map(drop)
        }
    }
}

/// A reply's `key value ...` pairs (a flat array in RESP2, a map in RESP3).
fn pairs(value: &Value) -> Vec<(String, Value)> {
    let name = |k: &Value| match k {
        Value::BulkString(k) => Some(String::from_utf8_lossy(k).into_owned()),
        Value::SimpleString(k) => Some(k.clone()),
        _ => None,
    };
    match value {
        Value::Array(flat) => flat
            .chunks(2)
            .filter_map(|kv| Some((name(&kv[0])?, kv.get(1)?.clone())))
            .collect(),
        Value::Map(map) => map
            .iter()
            .filter_map(|(k, v)| Some((name(k)?, v.clone())))
            .collect(),
        _ => Vec::new(),
    }
}

/// A stream entry id as `(milliseconds, sequence)`, to compare.
fn entry_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap(), seq.parse().unwrap())
}

/// A stream's entries: id and fields, in order.
type Entries = Vec<(String, Vec<(String, Vec<u8>)>)>;

/// Fields as `name=value ...`, for messages.
fn show(fields: &[(String, Vec<u8>)]) -> String {
    let shown: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}={:?}", String::from_utf8_lossy(v)))
        .collect();
    shown.join(" ")
}

fn field(fields: &[(String, Vec<u8>)], name: &str) -> Option<String> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

impl Redis {
    async fn connection(&self) -> Result<MultiplexedConnection, String> {
        redis_connect(&redis::Client::open(self.server.url()).unwrap()).await
    }

    async fn entries(&self, stream: &str) -> Entries {
        let mut connection = self.connection().await.unwrap();
        let mut command = redis::cmd("XRANGE");
        command.arg(stream).arg("-").arg("+");
        redis_query(&mut connection, &command).await.unwrap()
    }
}

impl Broker for Redis {
    const NAME: &'static str = "redis";
    type Publisher = RedisPublisher;

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LEDGER_SOURCE", self.server.url()),
            ("STREAM", self.stream.clone()),
        ]
    }

    async fn publisher(&mut self) -> RedisPublisher {
        RedisPublisher {
            client: redis::Client::open(self.server.url()).unwrap(),
            connection: None,
            stream: self.stream.clone(),
        }
    }

    async fn kill(&mut self) {
        self.server.kill().await;
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }

    async fn drained(&mut self) -> Result<bool, String> {
        let mut connection = self.connection().await?;
        let mut last = redis::cmd("XREVRANGE");
        last.arg(&self.stream).arg("+").arg("-").arg("COUNT").arg(1);
        let last: Entries = redis_query(&mut connection, &last).await?;
        let last = entry_id(&last.first().ok_or("the stream is empty")?.0);
        let mut groups = redis::cmd("XINFO");
        groups.arg("GROUPS").arg(&self.stream);
        let groups: Vec<Value> = redis_query(&mut connection, &groups).await?;
        let delivered = groups
            .iter()
            .map(pairs)
            .find(|group| {
                group
                    .iter()
                    .any(|(k, v)| k == "name" && *v == Value::BulkString(GROUP.into()))
            })
            .and_then(|group| {
                group.into_iter().find_map(|(k, v)| match v {
                    Value::BulkString(id) if k == "last-delivered-id" => {
                        Some(entry_id(&String::from_utf8_lossy(&id)))
                    }
                    _ => None,
                })
            })
            .ok_or("no group, or no last-delivered-id")?;
        // Pending entries are read after the group's last delivered one: read before it, an
        // entry delivered between the two reads would count as delivered and, not yet
        // pending at the first read, as acknowledged while still being handled.
        let mut pending = redis::cmd("XPENDING");
        pending.arg(&self.stream).arg(GROUP);
        let pending: Value = redis_query(&mut connection, &pending).await?;
        let pending = match &pending {
            Value::Array(summary) => match summary.first() {
                Some(Value::Int(n)) => *n,
                _ => return Err(format!("XPENDING: {pending:?}")),
            },
            _ => return Err(format!("XPENDING: {pending:?}")),
        };
        Ok(pending == 0 && delivered >= last)
    }

    async fn check_dead_letters(&mut self, workload: &Workload) -> String {
        // The stream keeps every entry: which ones are malformed copies, by marker.
        let entries = self.entries(&self.stream).await;
        let stored: BTreeMap<String, String> = entries
            .iter()
            .filter_map(|(id, fields)| Some((id.clone(), field(fields, "marker")?)))
            .collect();
        let dead = self.entries(&format!("{}:dead", self.stream)).await;
        let mut dead_lettered: BTreeMap<String, String> = BTreeMap::new();
        for (_, fields) in &dead {
            let names: Vec<&str> = fields.iter().take(3).map(|(k, _)| k.as_str()).collect();
            assert_eq!(names, ["reason", "entry", "deliveries"], "{}", show(fields));
            let reason = field(fields, "reason").unwrap();
            let entry = field(fields, "entry").unwrap();
            let original = &fields[3..];
            let Some(marker) = field(original, "marker") else {
                let original = show(original);
                panic!("a posting was dead-lettered: entry {entry} ({reason}): {original}");
            };
            assert!(
                !reason.is_empty(),
                "dead letter of {entry} without a reason"
            );
            assert_eq!(
                stored.get(&entry),
                Some(&marker),
                "dead letter of {entry} carries {marker}, the entry another"
            );
            if let Some(earlier) = dead_lettered.insert(entry.clone(), marker) {
                panic!("entry {entry} ({earlier}) dead-lettered more than once");
            }
        }
        let missing: Vec<_> = stored
            .iter()
            .filter(|(id, _)| !dead_lettered.contains_key(*id))
            .collect();
        assert!(
            missing.is_empty(),
            "malformed entries never dead-lettered: {missing:?}"
        );
        let markers: BTreeSet<String> = stored.values().cloned().collect();
        assert_eq!(markers, workload.markers, "the markers stored");
        format!(
            "{} dead letters, one per malformed entry stored ({} of them copies stored by \
             retried publishes)",
            dead.len(),
            stored.len() - markers.len()
        )
    }
}

// ----- NATS JetStream -----

struct Nats {
    server: PrivateNats,
    /// The test's own client (it reconnects by itself after a restart).
    context: jetstream::Context,
}

/// The stream: as the ledger's module docs ask of a publisher that creates it.
const NATS_STREAM: &str = "CHAOS";

struct NatsPublisher {
    context: jetstream::Context,
}

impl Publisher for NatsPublisher {
    fn attempt(&mut self, entry: &Entry) -> impl Future<Output = Result<(), String>> + Send {
        let body = bytes::Bytes::from(json_body(entry));
        async move {
            let ack = async {
                self.context
                    .publish(format!("{NATS_STREAM}.entries"), body)
                    .await?
                    .await
            };
            match timeout(Duration::from_secs(10), ack).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no ack within 10 s".into()),
            }
        }
    }
}

/// The header `name` of a stored message (compared without case: the client spells its
/// standard names its own way).
fn nats_header(headers: &async_nats::HeaderMap, name: &str) -> Option<String> {
    headers.iter().find_map(|(k, values)| {
        let k: &str = k.as_ref();
        k.eq_ignore_ascii_case(name)
            .then(|| values.first().map(|v| v.as_str().to_owned()))
            .flatten()
    })
}

impl Broker for Nats {
    const NAME: &'static str = "nats";
    type Publisher = NatsPublisher;

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LEDGER_SOURCE", self.server.url()),
            ("STREAM", NATS_STREAM.into()),
        ]
    }

    async fn publisher(&mut self) -> NatsPublisher {
        self.context
            .get_or_create_stream(jetstream::stream::Config {
                name: NATS_STREAM.into(),
                subjects: vec![
                    format!("{NATS_STREAM}.entries"),
                    format!("{NATS_STREAM}.dead"),
                ],
                storage: StorageType::File,
                ..Default::default()
            })
            .await
            .unwrap();
        let client = async_nats::connect(self.server.url()).await.unwrap();
        // The client keeps what it publishes while the server is away and sends it once it
        // is back: with a short wait for the ack, such a publish is also retried (and may be
        // stored twice), as a publisher with a deadline would.
        let mut context = jetstream::new(client);
        context.set_timeout(Duration::from_millis(300));
        NatsPublisher { context }
    }

    async fn kill(&mut self) {
        self.server.kill().await;
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }

    async fn drained(&mut self) -> Result<bool, String> {
        let info = async {
            let stream = self
                .context
                .get_stream(NATS_STREAM)
                .await
                .map_err(|e| e.to_string())?;
            stream.consumer_info(GROUP).await.map_err(|e| e.to_string())
        };
        let info = timeout(Duration::from_secs(10), info)
            .await
            .map_err(|_| "no consumer info within 10 s".to_owned())??;
        Ok(info.num_pending == 0 && info.num_ack_pending == 0)
    }

    async fn check_dead_letters(&mut self, workload: &Workload) -> String {
        // The stream keeps every message, entries and dead letters alike.
        let mut stream = self.context.get_stream(NATS_STREAM).await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut stored: BTreeMap<u64, String> = BTreeMap::new();
        let mut dead_lettered: BTreeMap<u64, String> = BTreeMap::new();
        let mut dead = 0;
        for sequence in 1..=last {
            let message = stream.get_raw_message(sequence).await.unwrap();
            let marker = marker_in(&message.payload);
            let body = String::from_utf8_lossy(&message.payload);
            if message.subject.as_str() == format!("{NATS_STREAM}.entries") {
                if let Some(marker) = marker {
                    stored.insert(sequence, marker);
                }
                continue;
            }
            assert_eq!(message.subject.as_str(), format!("{NATS_STREAM}.dead"));
            dead += 1;
            let reason = nats_header(&message.headers, "reason").unwrap_or_default();
            let id = nats_header(&message.headers, "Nats-Msg-Id").unwrap_or_default();
            let Some(marker) = marker else {
                panic!("a posting was dead-lettered ({id}, {reason:?}): {body}");
            };
            assert!(
                !reason.is_empty(),
                "dead letter {id} without a reason: {body}"
            );
            let entry: u64 = id
                .strip_prefix(&format!("dead-{NATS_STREAM}-"))
                .and_then(|seq| seq.parse().ok())
                .unwrap_or_else(|| panic!("dead letter {sequence}'s Nats-Msg-Id {id:?}"));
            if let Some(earlier) = dead_lettered.insert(entry, marker.clone()) {
                panic!("entry {entry} ({earlier}) dead-lettered more than once");
            }
        }
        for (entry, marker) in &dead_lettered {
            assert_eq!(
                stored.get(entry),
                Some(marker),
                "the dead letter of sequence {entry} carries {marker}, the entry another"
            );
        }
        let missing: Vec<_> = stored
            .iter()
            .filter(|(seq, _)| !dead_lettered.contains_key(*seq))
            .collect();
        assert!(
            missing.is_empty(),
            "malformed entries never dead-lettered: {missing:?}"
        );
        let markers: BTreeSet<String> = stored.values().cloned().collect();
        assert_eq!(markers, workload.markers, "the markers stored");
        format!(
            "{dead} dead letters, one per malformed entry stored ({} of them copies stored by \
             retried publishes)",
            stored.len() - markers.len()
        )
    }
}

// ----- RabbitMQ -----

struct Rabbit {
    server: PrivateRabbit,
}

/// The queue; its dead letters on `chaos.dead`.
const RABBIT_QUEUE: &str = "chaos";

struct RabbitPublisher {
    url: String,
    /// The connection (kept open) and its channel in confirm mode.
    link: Option<(Connection, Channel)>,
}

/// A connection and a channel in confirm mode, with both queues declared as the ledger
/// declares them.
async fn rabbit_connect(url: &str) -> Result<(Connection, Channel), String> {
    let connect = async {
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let connection = Connection::connect(url, properties).await?;
        let channel = connection.create_channel().await?;
        for queue in [RABBIT_QUEUE.to_owned(), format!("{RABBIT_QUEUE}.dead")] {
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            channel.queue_declare(&queue, durable, arguments).await?;
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok::<_, lapin::Error>((connection, channel))
    };
    match timeout(Duration::from_secs(10), connect).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err("no connection within 10 s".into()),
    }
}

impl Publisher for RabbitPublisher {
    fn attempt(&mut self, entry: &Entry) -> impl Future<Output = Result<(), String>> + Send {
        let body = json_body(entry);
        async move {
            if self.link.is_none() {
                self.link = Some(rabbit_connect(&self.url).await?);
            }
            let (_, channel) = self.link.as_ref().unwrap();
            let confirmed = async {
                let options = BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                };
                let properties = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_content_type("application/json".into());
                channel
                    .basic_publish("", RABBIT_QUEUE, options, &body, properties)
                    .await?
                    .await
            };
            let confirmed = match timeout(Duration::from_secs(10), confirmed).await {
                Ok(Ok(Confirmation::Ack(None))) => Ok(()),
                Ok(Ok(other)) => Err(format!("not confirmed: {other:?}")),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no confirm within 10 s".into()),
            };
            if confirmed.is_err() {
                self.link = None;
            }
            confirmed
        }
    }
}

impl Rabbit {
    /// The queue's (ready, checked out) messages, from its Raft state machine on the node:
    /// exact, where `list_queues` reports figures up to a few seconds old.
    async fn counts(&self, queue: &str) -> Result<(u64, u64), String> {
        let expression = format!(
            "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{queue}\">>)), \
             L = amqqueue:get_pid(Q), \
             {{ok, {{_, R}}, _}} = ra:local_query(L, fun rabbit_fifo:query_messages_ready/1), \
             {{ok, {{_, C}}, _}} = ra:local_query(L, fun rabbit_fifo:query_messages_checked_out/1), \
             io:format(\"~b ~b~n\", [R, C])."
        );
        let output = self.server.rabbitmqctl(&["eval", &expression]).await;
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "rabbitmqctl eval: {text}{}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let numbers: Vec<u64> = text
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        match numbers[..] {
            [ready, out] => Ok((ready, out)),
            _ => Err(format!("rabbitmqctl eval: {text}")),
        }
    }
}

impl Broker for Rabbit {
    const NAME: &'static str = "rabbitmq";
    type Publisher = RabbitPublisher;

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LEDGER_SOURCE", self.server.url()),
            ("STREAM", RABBIT_QUEUE.into()),
        ]
    }

    async fn publisher(&mut self) -> RabbitPublisher {
        let link = rabbit_connect(&self.server.url()).await.unwrap();
        RabbitPublisher {
            url: self.server.url(),
            link: Some(link),
        }
    }

    async fn kill(&mut self) {
        self.server.kill().await;
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }

    async fn drained(&mut self) -> Result<bool, String> {
        let (ready, out) = self.counts(RABBIT_QUEUE).await?;
        Ok(ready == 0 && out == 0)
    }

    async fn check_dead_letters(&mut self, workload: &Workload) -> String {
        let (_connection, channel) = rabbit_connect(&self.server.url()).await.unwrap();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut dead = 0;
        while let Some(message) = channel
            .basic_get(
                &format!("{RABBIT_QUEUE}.dead"),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            dead += 1;
            let body = String::from_utf8_lossy(&message.data).into_owned();
            let reason = message
                .properties
                .headers()
                .as_ref()
                .and_then(|h| match h.inner().get("reason") {
                    Some(AMQPValue::LongString(reason)) => {
                        Some(String::from_utf8_lossy(reason.as_bytes()).into_owned())
                    }
                    _ => None,
                })
                .unwrap_or_default();
            let Some(marker) = marker_in(&message.data) else {
                panic!("a posting was dead-lettered ({reason:?}): {body}");
            };
            assert!(!reason.is_empty(), "dead letter without a reason: {body}");
            *seen.entry(marker).or_default() += 1;
        }
        let markers: BTreeSet<String> = seen.keys().cloned().collect();
        assert_eq!(
            markers, workload.markers,
            "every malformed entry dead-lettered at least once"
        );
        format!(
            "{dead} dead letters for {} markers (at least once: {} twice or more)",
            markers.len(),
            seen.values().filter(|n| **n > 1).count()
        )
    }
}

// ----- the chaos -----

/// Fails the test if a consumer has exited by itself.
fn assert_running(consumers: &mut [Consumer]) {
    for consumer in consumers {
        if let Some(status) = consumer.exited() {
            panic!("{} exited by itself: {status}", consumer.name);
        }
    }
}

// ----- Kafka -----

struct Kafka {
    server: PrivateKafka,
}

/// The topic; its dead letters on `chaos.dead`.
const KAFKA_TOPIC: &str = "chaos";

struct KafkaPublisher {
    producer: rdkafka::producer::FutureProducer,
}

impl Publisher for KafkaPublisher {
    fn attempt(&mut self, entry: &Entry) -> impl Future<Output = Result<(), String>> + Send {
        let body = json_body(entry);
        let key = match entry {
            Entry::Posting(posting) => posting.account.clone(),
            Entry::Malformed { n } => format!("bad-{n}"),
        };
        async move {
            let record = rdkafka::producer::FutureRecord::to(KAFKA_TOPIC)
                .key(&key)
                .payload(&body);
            self.producer
                .send(record, Duration::from_secs(10))
                .await
                .map(drop)
                .map_err(|(e, _)| e.to_string())
        }
    }
}

impl Kafka {
    fn config(&self) -> rdkafka::ClientConfig {
        let mut config = rdkafka::ClientConfig::new();
        config.set("bootstrap.servers", self.server.brokers());
        config
    }

    /// Every record of `topic`: (partition, offset, value, headers), read from the start by a
    /// consumer of its own until ten seconds pass without one.
    async fn records(&self, topic: &str) -> Vec<(i32, i64, String, BTreeMap<String, String>)> {
        use rdkafka::Message as _;
        use rdkafka::consumer::Consumer as _;
        use rdkafka::message::Headers as _;
        let mut config = self.config();
        config
            .set("group.id", format!("reader-{}", std::process::id()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false");
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let consumer: rdkafka::consumer::BaseConsumer = config.create().unwrap();
            consumer.subscribe(&[&topic]).unwrap();
            let mut out = Vec::new();
            let mut quiet = Instant::now();
            while quiet.elapsed() < Duration::from_secs(10) {
                if let Some(record) = consumer.poll(Duration::from_millis(200)) {
                    let record = record.unwrap();
                    let headers = record
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    let value = h.value.unwrap_or_default();
                                    (
                                        h.key.to_owned(),
                                        String::from_utf8_lossy(value).into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let value = String::from_utf8_lossy(record.payload().unwrap_or_default());
                    out.push((
                        record.partition(),
                        record.offset(),
                        value.into_owned(),
                        headers,
                    ));
                    quiet = Instant::now();
                }
            }
            out
        })
        .await
        .unwrap()
    }
}

impl Broker for Kafka {
    const NAME: &'static str = "kafka";
    type Publisher = KafkaPublisher;

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LEDGER_SOURCE", self.server.url()),
            ("STREAM", KAFKA_TOPIC.into()),
        ]
    }

    async fn publisher(&mut self) -> KafkaPublisher {
        // As the ledger's docs ask of a publisher that creates the topics: three partitions.
        let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
            self.config().create().unwrap();
        let topics = [KAFKA_TOPIC.to_owned(), format!("{KAFKA_TOPIC}.dead")];
        let new: Vec<_> = topics
            .iter()
            .map(|t| {
                rdkafka::admin::NewTopic::new(t, 3, rdkafka::admin::TopicReplication::Fixed(1))
            })
            .collect();
        for result in admin
            .create_topics(&new, &rdkafka::admin::AdminOptions::new())
            .await
            .unwrap()
        {
            result.unwrap();
        }
        let producer = self
            .config()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", "10000")
            .create()
            .unwrap();
        KafkaPublisher { producer }
    }

    async fn kill(&mut self) {
        self.server.kill().await;
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }

    async fn drained(&mut self) -> Result<bool, String> {
        use rdkafka::consumer::Consumer as _;
        let mut config = self.config();
        config.set("group.id", GROUP);
        tokio::task::spawn_blocking(move || {
            let consumer: rdkafka::consumer::BaseConsumer =
                config.create().map_err(|e| e.to_string())?;
            let mut list = rdkafka::TopicPartitionList::new();
            for partition in 0..3 {
                list.add_partition(KAFKA_TOPIC, partition);
            }
            let committed = consumer
                .committed_offsets(list, Duration::from_secs(5))
                .map_err(|e| format!("committed offsets: {e}"))?;
            for partition in 0..3 {
                let (_, high) = consumer
                    .fetch_watermarks(KAFKA_TOPIC, partition, Duration::from_secs(5))
                    .map_err(|e| format!("watermarks: {e}"))?;
                let at = committed
                    .find_partition(KAFKA_TOPIC, partition)
                    .map(|e| e.offset());
                if at != Some(rdkafka::Offset::Offset(high)) && high > 0 {
                    return Ok(false);
                }
            }
            Ok(true)
        })
        .await
        .unwrap()
    }

    async fn check_dead_letters(&mut self, workload: &Workload) -> String {
        let stored: BTreeMap<(i32, i64), String> = self
            .records(KAFKA_TOPIC)
            .await
            .into_iter()
            .filter_map(|(p, o, value, _)| Some(((p, o), marker_in(value.as_bytes())?)))
            .collect();
        let dead = self.records(&format!("{KAFKA_TOPIC}.dead")).await;
        let mut dead_lettered: BTreeMap<(i32, i64), String> = BTreeMap::new();
        let mut repeats = 0;
        for (_, _, value, headers) in &dead {
            let reason = headers.get("reason").cloned().unwrap_or_default();
            let Some(marker) = marker_in(value.as_bytes()) else {
                panic!("a posting was dead-lettered ({reason:?}): {value}");
            };
            assert!(!reason.is_empty(), "dead letter without a reason: {value}");
            let at = |name: &str| headers.get(name).and_then(|v| v.parse::<i64>().ok());
            let (Some(partition), Some(offset)) = (at("source-partition"), at("source-offset"))
            else {
                panic!("dead letter without its source: {headers:?}");
            };
            let entry = (partition as i32, offset);
            assert_eq!(
                stored.get(&entry),
                Some(&marker),
                "the dead letter of {entry:?} carries {marker}, the entry another"
            );
            if dead_lettered.insert(entry, marker).is_some() {
                repeats += 1;
            }
        }
        let missing: Vec<_> = stored
            .iter()
            .filter(|(entry, _)| !dead_lettered.contains_key(*entry))
            .collect();
        assert!(
            missing.is_empty(),
            "malformed entries never dead-lettered: {missing:?}"
        );
        let markers: BTreeSet<String> = stored.values().cloned().collect();
        assert_eq!(markers, workload.markers, "the markers stored");
        format!(
            "{} dead letters for {} malformed entries stored ({} of them copies stored by \
             retried publishes; {repeats} dead-lettered again after a crash)",
            dead.len(),
            stored.len(),
            stored.len() - markers.len()
        )
    }
}

fn seconds(since: Instant) -> String {
    format!("{:.1} s", since.elapsed().as_secs_f64())
}

/// The seed: `IDEMPOTENT_CHAOS_SEED`, or the clock's.
fn seeded() -> Rng {
    match std::env::var("IDEMPOTENT_CHAOS_SEED") {
        Ok(seed) => Rng(seed.parse().expect("IDEMPOTENT_CHAOS_SEED is a number")),
        Err(_) => Rng::from_clock(),
    }
}

async fn chaos<B: Broker>(mut broker: B, db: Database, started: Instant) {
    let name = B::NAME;
    let mut rng = seeded();
    eprintln!("{name} chaos seed: {} (IDEMPOTENT_CHAOS_SEED)", rng.0);
    let work = workload(&mut rng);
    let total = work.entries.len();

    let mut env = broker.env();
    env.extend([
        ("DATABASE_URL", db.url.clone()),
        ("GROUP", GROUP.to_owned()),
        ("CLAIM_IDLE", "1s".to_owned()),
        ("EFFECT_DELAY_MS", "3".to_owned()),
    ]);
    let mut connection = broker.publisher().await;
    let mut consumers = [
        Consumer::start(&env, "c0-0").await,
        Consumer::start(&env, "c1-0").await,
    ];
    // Killed consumers are kept: their stderr is printed too if the test fails.
    let mut killed: Vec<Consumer> = Vec::new();

    let progress = Arc::new(AtomicUsize::new(0));
    let publishing = Instant::now();
    let publisher = tokio::spawn({
        let entries = work.entries.clone();
        let progress = Arc::clone(&progress);
        async move {
            let mut retried = 0;
            for (n, entry) in entries.iter().enumerate() {
                retried += publish(&mut connection, entry).await - 1;
                progress.store(n + 1, Ordering::Relaxed);
                if n % 10 == 9 {
                    sleep(PACE).await;
                }
            }
            (retried, publishing.elapsed())
        }
    });

    let mut broker_down = Duration::ZERO;
    for round in 1..=KILLS {
        sleep(Duration::from_millis(250 + rng.below(750))).await;
        let victim = rng.below(2) as usize;
        assert_running(&mut consumers);
        if round == BROKER_ROUND {
            // Halfway through the publishing: the broker goes, a consumer with it; that
            // consumer starts again while the broker is away, and waits for it.
            let deadline = Deadline::after(Duration::from_secs(60), "publishing never got going");
            while progress.load(Ordering::Relaxed) < total * 3 / 10 {
                deadline.tick().await;
            }
            let published = progress.load(Ordering::Relaxed);
            assert!(
                published < total,
                "publishing ended before the broker was killed"
            );
            let down = Instant::now();
            broker.kill().await;
            consumers[victim].kill().await;
            let mut next = Consumer::spawn(&env, format!("c{victim}-{round}"));
            eprintln!(
                "{name}: killed the broker and {} in round {round}, {published} of {total} \
                 entries published",
                consumers[victim].name
            );
            sleep(Duration::from_millis(300 + rng.below(700))).await;
            broker.restart().await;
            broker_down = down.elapsed();
            eprintln!("{name}: broker back after {broker_down:?}");
            next.ready().await;
            killed.push(std::mem::replace(&mut consumers[victim], next));
            continue;
        }
        consumers[victim].kill().await;
        eprintln!(
            "{name}: killed {} in round {round}, {} of {total} entries published",
            consumers[victim].name,
            progress.load(Ordering::Relaxed)
        );
        let next = Consumer::start(&env, format!("c{victim}-{round}")).await;
        killed.push(std::mem::replace(&mut consumers[victim], next));
    }

    let (retried, published_in) = publisher.await.unwrap();
    let draining = Instant::now();
    let mut last_error = String::new();
    loop {
        assert_running(&mut consumers);
        match broker.drained().await {
            Ok(true) => break,
            Ok(false) => {}
            Err(error) => last_error = error,
        }
        assert!(
            draining.elapsed() < DRAIN_PATIENCE,
            "{name}: not everything consumed within {DRAIN_PATIENCE:?} after the publishing \
             (last error asking: {last_error:?})"
        );
        sleep(Duration::from_millis(200)).await;
    }
    let drained_in = draining.elapsed();
    assert_running(&mut consumers);
    for consumer in &mut consumers {
        consumer.stop().await;
    }

    let pool = db.pool().await;
    let balances: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance FROM accounts")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let records: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM idempotent_records GROUP BY state")
            .fetch_all(&pool)
            .await
            .unwrap();
    let wrong: Vec<String> = work
        .expected
        .iter()
        .filter(|(account, balance)| balances.get(*account) != Some(balance))
        .map(|(account, balance)| {
            format!("{account}: {:?}, expected {balance}", balances.get(account))
        })
        .chain(
            balances
                .keys()
                .filter(|account| !work.expected.contains_key(*account))
                .map(|account| format!("{account}: not expected")),
        )
        .collect();
    assert!(
        wrong.is_empty(),
        "{name}: {} balances off (records by state: {records:?}): {wrong:?}",
        wrong.len()
    );
    let dead = broker.check_dead_letters(&work).await;
    let logged: usize = killed
        .iter()
        .chain(&consumers)
        .map(|c| c.log().matches("dead-lettered").count())
        .sum();
    // Retries are rare here (a broker operation failed while the broker was away): shown.
    let retries: Vec<String> = killed
        .iter()
        .chain(&consumers)
        .flat_map(|c| {
            c.log()
                .lines()
                .filter(|line| line.contains("left pending"))
                .map(|line| format!("{}: {line}", c.name))
                .collect::<Vec<_>>()
        })
        .collect();
    for line in &retries {
        eprintln!("{name}: {line}");
    }
    let left_pending = retries.len();
    let _ = writeln!(
        std::io::stderr(),
        "{name} chaos: {total} entries ({} distinct postings, {MALFORMED} malformed), {retried} \
         publishes retried; {} consumer kills, broker down {broker_down:?}; published in \
         {published_in:?}, drained {drained_in:?} later; {} accounts exact, records {records:?}; \
         {dead}; {logged} dead letters and {left_pending} retries logged; {} in all",
        work.distinct,
        killed.len(),
        balances.len(),
        seconds(started)
    );
    drop(pool);
    db.drop_database().await;
}

async fn database(broker: &str) -> Option<Database> {
    Database::create(&format!("chaos_{broker}_{}", std::process::id())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_ledger_survives_consumer_and_broker_kills() {
    let started = Instant::now();
    let Some(db) = database("redis").await else {
        return;
    };
    let Some(server) = PrivateRedis::start_durable("chaos").await else {
        return;
    };
    // Nothing acknowledged may be lost to the SIGKILL.
    let mut connection = redis_connect(&redis::Client::open(server.url()).unwrap())
        .await
        .unwrap();
    let mut config = redis::cmd("CONFIG");
    config.arg("GET").arg("append*");
    let config: Vec<String> = redis_query(&mut connection, &config).await.unwrap();
    assert!(
        config.windows(2).any(|kv| kv == ["appendonly", "yes"])
            && config.windows(2).any(|kv| kv == ["appendfsync", "always"]),
        "{config:?}"
    );
    let broker = Redis {
        server,
        stream: "chaos".into(),
    };
    chaos(broker, db, started).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_ledger_survives_consumer_and_broker_kills() {
    let started = Instant::now();
    let Some(db) = database("nats").await else {
        return;
    };
    let Some(server) = PrivateNats::start().await else {
        return;
    };
    let client = async_nats::connect(server.url()).await.unwrap();
    let broker = Nats {
        server,
        context: jetstream::new(client),
    };
    chaos(broker, db, started).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_ledger_survives_consumer_and_broker_kills() {
    let started = Instant::now();
    let Some(db) = database("rabbitmq").await else {
        return;
    };
    let Some(server) = PrivateRabbit::start().await else {
        return;
    };
    eprintln!("rabbitmq: node up in {}", seconds(started));
    chaos(Rabbit { server }, db, started).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_ledger_survives_consumer_and_broker_kills() {
    let started = Instant::now();
    let Some(db) = database("kafka").await else {
        return;
    };
    let Some(server) = PrivateKafka::start().await else {
        return;
    };
    chaos(Kafka { server }, db, started).await;
}
