//! The `ledger` consumer with real Redis, PostgreSQL and processes.
//!
//! - 1,000 stream entries over 200 accounts, 20% of them duplicate ids (some adjacent, some far
//!   apart) and a few malformed, consumed by two consumers, with notifications relayed by the
//!   first consumer and two relay processes; consumers and relays are killed with SIGKILL at
//!   random moments and restarted. When the group has nothing pending and nothing unread, every
//!   balance must equal the sum over distinct ids, the dead-letter stream must hold exactly
//!   the malformed entries and the one PostgreSQL rejects, and the notifier (deduplicating by
//!   `Idempotency-Key`) must have acted once on each applied posting and on nothing else.
//! - A notifier that is down delays notifications and loses none; one it refuses is
//!   dead-lettered; three relays never deliver one notification at the same time. A relay
//!   frozen mid-batch gives the batch up to another once PostgreSQL ends its transaction.
//! - Six consumers and two relays started in the same instant on an empty database all come
//!   up (the idempotency, accounts and outbox tables each created once).
//! - Entries PostgreSQL rejects, and malformed ones, are dead-lettered (after `MAX_DELIVERIES`
//!   deliveries counted across restarts, and at once, respectively) while the entries around
//!   them are applied once.
//! - A pending list longer than one `XAUTOCLAIM` page is processed to its tail although its
//!   head keeps failing.
//! - A row locked by a hung transaction costs one entry a lock or statement timeout, not the
//!   consumer its progress; the entry is applied once the lock is released. Those failures, a
//!   lost connection, a serialization failure and a deadlock are transient: retried past
//!   `MAX_DELIVERIES`, never dead-lettered.
//! - A notification that kills every relay delivering it (SIGKILLed by the test each time the
//!   notifier receives it) is dead-lettered as `relay_crashed` after `RELAY_MAX_ATTEMPTS`
//!   crashes, and the notifications behind it on its ordering key, and the others, are
//!   delivered.
//! - An entry whose idempotency record cannot be decoded is dead-lettered once, and the
//!   entries after it are applied.
//! - Bad settings make the consumer exit with status 2.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotent_core::Key;
use idempotent_core::conformance::backend_url;
use idempotent_core::postgres::{Message, Outbox};
use redis::Value;
use redis::aio::MultiplexedConnection;
use sqlx::PgPool;
use support::ledger::{Consumer, Database, Deadline, Rng};
use tokio::process::Command;

/// The consumer group the example creates.
const GROUP: &str = "ledger";

/// The example's table, created here by tests that need a row before a consumer starts.
const ACCOUNTS_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS accounts (account text PRIMARY KEY, balance bigint NOT NULL)";

/// A PostgreSQL database and a Redis stream of one test's own.
struct Fixture {
    db: Database,
    redis_url: String,
    stream: String,
    redis: MultiplexedConnection,
}

impl Fixture {
    /// `None` when the backends are not configured (and not required).
    async fn new(name: &str) -> Option<Fixture> {
        let redis_url = backend_url("IDEMPOTENT_TEST_REDIS_URL")?;
        let db = Database::create(&format!("ledger_{name}_{}", std::process::id())).await?;
        let stream = db.name.clone();
        let client = redis::Client::open(redis_url.as_str()).unwrap();
        let mut redis = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .arg(format!("{stream}:dead"))
            .query_async(&mut redis)
            .await
            .unwrap();
        Some(Fixture {
            db,
            redis_url,
            stream,
            redis,
        })
    }

    /// The consumers' environment: this fixture's servers and stream, and `settings`.
    fn env(&self, settings: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("REDIS_URL", self.redis_url.clone()),
            ("DATABASE_URL", self.db.url.clone()),
            ("STREAM", self.stream.clone()),
        ];
        env.extend(settings.iter().map(|(k, v)| (*k, (*v).to_owned())));
        env
    }

    async fn db(&self) -> PgPool {
        self.db.pool().await
    }

    /// Adds an entry with `fields` to the stream; its id.
    async fn publish(&mut self, fields: &[(&str, &[u8])]) -> String {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream).arg("*");
        for (name, value) in fields {
            cmd.arg(*name).arg(*value);
        }
        cmd.query_async(&mut self.redis).await.unwrap()
    }

    /// Publishes a posting; its entry id.
    async fn post(&mut self, id: &str, account: &str, amount: i64) -> String {
        let amount = amount.to_string();
        self.publish(&[
            ("id", id.as_bytes()),
            ("account", account.as_bytes()),
            ("amount", amount.as_bytes()),
        ])
        .await
    }

    /// Creates the group and delivers every entry published so far to `consumer`, which never
    /// acknowledges them: they stay pending under its name, as with a consumer that died.
    async fn deliver_to_dead_consumer(&mut self, consumer: &str) {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(GROUP)
            .arg("0")
            .query_async(&mut self.redis)
            .await
            .unwrap();
        let _: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(consumer)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.redis)
            .await
            .unwrap();
    }

    async fn balances(&self, db: &PgPool) -> BTreeMap<String, i64> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT account, balance FROM accounts")
            .fetch_all(db)
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    /// How many times the group delivered `entry`, if it is pending.
    async fn deliveries(&mut self, entry: &str) -> Option<u64> {
        let reply: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(entry)
            .arg(entry)
            .arg(1)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        match reply {
            Value::Array(rows) => match rows.first() {
                Some(Value::Array(row)) => match row.get(3) {
                    Some(Value::Int(n)) => u64::try_from(*n).ok(),
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        }
    }

    /// The dead-letter stream's entries, oldest first.
    async fn dead_letters(&mut self) -> Vec<DeadLetter> {
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(format!("{}:dead", self.stream))
            .arg("-")
            .arg("+")
            .query_async(&mut self.redis)
            .await
            .unwrap();
        entries
            .into_iter()
            .map(|(_, fields)| DeadLetter { fields })
            .collect()
    }

    /// Whether the group has nothing pending and has delivered everything up to `last_id`.
    async fn drained(&mut self, last_id: &str) -> bool {
        let pending: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(GROUP)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        let pending = match pending {
            Value::Array(v) => matches!(v.first(), Some(Value::Int(0))),
            _ => false,
        };
        let groups: Vec<Value> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.stream)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        let delivered = groups.iter().any(|group| {
            let fields: Vec<(String, Value)> = match group {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|kv| match (&kv[0], kv.get(1)) {
                        (Value::BulkString(k), Some(v)) => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                Value::Map(pairs) => pairs
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Value::BulkString(k) => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        Value::SimpleString(k) => Some((k.clone(), v.clone())),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            fields.iter().any(|(k, v)| {
                k == "last-delivered-id"
                    && matches!(v, Value::BulkString(id) if id == last_id.as_bytes())
            })
        });
        pending && delivered
    }

    async fn wait_drained(&mut self, last_id: &str, within: Duration) {
        let deadline = Deadline::after(within, "the group never drained");
        while !self.drained(last_id).await {
            deadline.tick().await;
        }
    }

    async fn drop_database(self) {
        self.db.drop_database().await;
    }
}

/// A stream entry's fields, in order.
type Fields = Vec<(String, Vec<u8>)>;

/// One entry of the dead-letter stream.
struct DeadLetter {
    fields: Fields,
}

impl DeadLetter {
    /// The first field called `name`, as text.
    fn field(&self, name: &str) -> String {
        let (_, value) = self
            .fields
            .iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("dead letter without `{name}`"));
        String::from_utf8_lossy(value).into_owned()
    }

    /// The original entry's fields, after `reason`, `entry` and `deliveries`.
    fn original_fields(&self) -> &[(String, Vec<u8>)] {
        let names: Vec<&str> = self
            .fields
            .iter()
            .take(3)
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(names, ["reason", "entry", "deliveries"]);
        &self.fields[3..]
    }
}

enum Entry {
    Posting {
        id: String,
        account: String,
        amount: i64,
    },
    Malformed(Vec<(&'static str, String)>),
}

/// 800 distinct postings, 200 duplicates (half right after their original, half far later),
/// and 6 malformed entries, in publication order.
fn workload(rng: &mut Rng) -> Vec<Entry> {
    let posting = |i: u64| Entry::Posting {
        id: format!("pay-{i}"),
        account: format!("acct-{}", i % 200),
        amount: ((i * 7919) % 2001) as i64 - 1000,
    };
    let mut entries = Vec::new();
    let mut far = Vec::new();
    for i in 0..800u64 {
        entries.push(posting(i));
        if i % 8 == 0 {
            entries.push(posting(i)); // a producer retry, adjacent
        }
        if i % 8 == 4 {
            far.push(i);
        }
    }
    for i in far {
        // a redelivery far from the original
        let at = entries.len() - rng.below(entries.len() as u64 / 4) as usize;
        entries.insert(at, posting(i));
    }
    let malformed: [Vec<(&'static str, String)>; 6] = [
        vec![("id", "bad-1".into()), ("amount", "5".into())],
        vec![
            ("id", "bad-2".into()),
            ("account", "acct-1".into()),
            ("amount", "12.5".into()),
        ],
        vec![
            ("id", "bad-3".into()),
            ("account", "acct-2".into()),
            ("amount", "abc".into()),
        ],
        vec![("account", "acct-3".into()), ("amount", "7".into())],
        vec![
            ("id", "".into()),
            ("account", "acct-4".into()),
            ("amount", "7".into()),
        ],
        vec![
            ("id", "bad-6".into()),
            ("account", "acct-5".into()),
            ("amount", "99999999999999999999".into()),
        ],
    ];
    for (n, fields) in malformed.into_iter().enumerate() {
        let at = (n + 1) * entries.len() / 7;
        entries.insert(at, Entry::Malformed(fields));
    }
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_are_exact_after_duplicates_malformed_entries_and_kills() {
    let Some(mut fx) = Fixture::new("kills").await else {
        return;
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("ledger e2e seed: {seed}");
    let mut rng = Rng(seed);

    let entries = workload(&mut rng);
    assert_eq!(entries.len(), 1006);
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for entry in &entries {
        if let Entry::Posting {
            id,
            account,
            amount,
        } = entry
        {
            if seen.insert(id.clone()) {
                *expected.entry(account.clone()).or_default() += amount;
            }
        }
    }
    assert_eq!(seen.len(), 800);

    // Each applied posting notifies the notifier through the outbox: relays run inside the
    // first consumer and on their own, and are killed too.
    let notifier = Notifier::start().await;
    let notify = [
        ("NOTIFY_URL", notifier.url()),
        ("RELAY_BACKOFF", "100ms".into()),
        ("RELAY_POLL", "200ms".into()),
        ("RELAY_MAX_ATTEMPTS", "1000".into()),
    ];
    let settings: Vec<(&str, &str)> = [("CLAIM_IDLE", "1s"), ("EFFECT_DELAY_MS", "3")]
        .into_iter()
        .chain(notify.iter().map(|(k, v)| (*k, v.as_str())))
        .collect();
    let env = fx.env(&settings);
    let mut without_relay = env.clone();
    without_relay.push(("RELAY", "0".into()));
    let mut consumers = [
        Consumer::start(&env, "c0-0").await,
        Consumer::start(&without_relay, "c1-0").await,
    ];
    let mut relays = [
        Consumer::relay(&env, "r0-0").await,
        Consumer::relay(&env, "r1-0").await,
    ];

    // Publish while the consumers run.
    let publisher = tokio::spawn({
        let mut redis = fx.redis.clone();
        let stream = fx.stream.clone();
        async move {
            let (mut malformed_ids, mut last) = (BTreeSet::new(), String::new());
            for (n, entry) in entries.iter().enumerate() {
                if n == 500 {
                    // PostgreSQL rejects this one (a NUL byte in the account) after its
                    // notification was enqueued: every attempt rolls both back, and the entry
                    // is dead-lettered after MAX_DELIVERIES.
                    let rejected: String = redis::cmd("XADD")
                        .arg(&stream)
                        .arg("*")
                        .arg("id")
                        .arg("pay-rejected")
                        .arg("account")
                        .arg("acct-\0")
                        .arg("amount")
                        .arg(1)
                        .query_async(&mut redis)
                        .await
                        .unwrap();
                    malformed_ids.insert(rejected);
                }
                let mut cmd = redis::cmd("XADD");
                cmd.arg(&stream).arg("*");
                match entry {
                    Entry::Posting {
                        id,
                        account,
                        amount,
                    } => {
                        cmd.arg("id")
                            .arg(id)
                            .arg("account")
                            .arg(account)
                            .arg("amount")
                            .arg(amount);
                    }
                    Entry::Malformed(fields) => {
                        for (k, v) in fields {
                            cmd.arg(*k).arg(v);
                        }
                    }
                }
                last = cmd.query_async(&mut redis).await.unwrap();
                if matches!(entry, Entry::Malformed(_)) {
                    malformed_ids.insert(last.clone());
                }
                if n % 50 == 49 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            (malformed_ids, last)
        }
    });

    // Kill consumers and relays at random moments, and restart them.
    for round in 1..=8 {
        tokio::time::sleep(Duration::from_millis(150 + rng.below(500))).await;
        let victim = rng.below(2) as usize;
        if rng.below(2) == 0 {
            consumers[victim].kill().await;
            eprintln!("killed {} in round {round}", consumers[victim].name);
            let env = if victim == 0 { &env } else { &without_relay };
            consumers[victim] = Consumer::start(env, format!("c{victim}-{round}")).await;
        } else {
            relays[victim].kill().await;
            eprintln!("killed {} in round {round}", relays[victim].name);
            relays[victim] = Consumer::relay(&env, format!("r{victim}-{round}")).await;
        }
    }

    let (malformed_ids, last_id) = publisher.await.unwrap();
    fx.wait_drained(&last_id, Duration::from_secs(90)).await;
    notifier.wait_for(&seen, Duration::from_secs(90)).await;
    // A notification whose relay was killed after the notifier had it is delivered again, and
    // recorded, by another relay once the killed relay's hold on it is over (5 s).
    let db = fx.db().await;
    let deadline = Deadline::after(Duration::from_secs(60), "the outbox never drained");
    while outbox_states(&db).await.contains_key("pending") {
        deadline.tick().await;
    }
    for process in consumers.iter_mut().chain(&mut relays) {
        process.stop().await;
    }
    // Exactly one notification acted on per distinct applied posting (at least one delivery
    // each; duplicates deduplicated by key), none for the rejected entry whose transactions
    // rolled back, none for malformed ones.
    notifier.assert_once_each(&seen);

    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("delivered".to_owned(), 800)]),
        "one message per applied posting, all delivered"
    );
    let balances = fx.balances(&db).await;
    assert_eq!(balances.len(), 200);
    assert_eq!(
        balances, expected,
        "every balance is the sum over distinct ids"
    );

    let dead = fx.dead_letters().await;
    let dead_entries: Vec<String> = dead.iter().map(|d| d.field("entry")).collect();
    assert_eq!(
        dead_entries.len(),
        malformed_ids.len(),
        "each malformed entry dead-lettered once"
    );
    assert_eq!(
        dead_entries.into_iter().collect::<BTreeSet<_>>(),
        malformed_ids
    );
    assert!(dead.iter().all(|d| !d.field("reason").is_empty()));

    drop(db);
    fx.drop_database().await;
}

/// Regression: consumers started at the same moment on an empty database failed with
/// `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`, because
/// concurrent `CREATE TABLE IF NOT EXISTS` statements race in PostgreSQL's catalog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_started_at_once_on_an_empty_database_all_come_up() {
    // Each round on a fresh database: the race is between the first table creations, and
    // does not show every time.
    for round in 0..5 {
        let Some(mut fx) = Fixture::new(&format!("start{round}")).await else {
            return;
        };
        // With notifications on, each also creates the outbox table; two relays start with them.
        let notifier = Notifier::start().await;
        let url = notifier.url();
        let env = fx.env(&[("CLAIM_IDLE", "1s"), ("NOTIFY_URL", &url)]);
        // All processes first, then the waits: they start in the same instant.
        let mut consumers: Vec<Consumer> = (0..6)
            .map(|n| Consumer::spawn(&env, format!("s{round}-{n}")))
            .chain((0..2).map(|n| {
                Consumer::spawn_example("relay", "relaying to ", &env, format!("r{round}-{n}"))
            }))
            .collect();
        for consumer in &mut consumers {
            consumer.ready().await;
        }

        // 200 distinct ids over 20 accounts, the first 40 published twice.
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        let mut last = String::new();
        for i in 0..240i64 {
            let n = i % 200;
            let account = format!("acct-{}", n % 20);
            if i < 200 {
                *expected.entry(account.clone()).or_default() += n - 100;
            }
            last = fx.post(&format!("pay-{n}"), &account, n - 100).await;
        }
        fx.wait_drained(&last, Duration::from_secs(60)).await;
        let ids: BTreeSet<String> = (0..200).map(|n| format!("pay-{n}")).collect();
        notifier.wait_for(&ids, Duration::from_secs(60)).await;
        for consumer in &mut consumers {
            consumer.stop().await;
        }
        notifier.assert_once_each(&ids);
        let db = fx.db().await;
        assert_eq!(fx.balances(&db).await, expected);
        assert!(fx.dead_letters().await.is_empty());
        drop(db);
        fx.drop_database().await;
    }
}

/// Publishes `n` good postings numbered from `next` (every fifth twice, as a producer retry),
/// adding them to `expected`.
async fn publish_goods(
    fx: &mut Fixture,
    expected: &mut BTreeMap<String, i64>,
    next: &mut i64,
    n: i64,
) {
    for _ in 0..n {
        let account = format!("acct-{}", *next % 6);
        let amount = *next * 13 - 300;
        fx.post(&format!("good-{next}"), &account, amount).await;
        if *next % 5 == 0 {
            fx.post(&format!("good-{next}"), &account, amount).await;
        }
        *expected.entry(account).or_default() += amount;
        *next += 1;
    }
}

/// Regression: entries PostgreSQL rejects for their data were delivered again forever, and a
/// malformed entry with thousands of fields could not be dead-lettered (the dead-letter script
/// failed), so it was too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_entries_are_dead_lettered_and_the_entries_around_them_applied_once() {
    let Some(mut fx) = Fixture::new("poison").await else {
        return;
    };
    const MAX_DELIVERIES: u64 = 3;
    let env = fx.env(&[("CLAIM_IDLE", "1s"), ("MAX_DELIVERIES", "3")]);
    let mut consumer = Consumer::start(&env, "p-0").await;
    let db = fx.db().await;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();

    // An account at the top of `bigint`, first, so that adding to it overflows.
    let last = fx.post("max-1", "big", i64::MAX).await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    expected.insert("big".into(), i64::MAX);

    // A rule of the deployment's own, which PostgreSQL enforces.
    sqlx::query("ALTER TABLE accounts ADD CONSTRAINT no_overdraft CHECK (balance >= -1000000)")
        .execute(&db)
        .await
        .unwrap();

    let mut next = 0;
    // Malformed, or an id reused for another posting: dead-lettered at their first delivery.
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let mut wide_fields: Vec<(String, String)> = vec![
        ("id".into(), "wide-1".into()),
        ("account".into(), "acct-0".into()),
        ("amount".into(), "1".into()),
    ];
    wide_fields.extend((0..5000).map(|i| (format!("f{i}"), format!("v{i}"))));
    let wide_refs: Vec<(&str, &[u8])> = wide_fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_bytes()))
        .collect();
    let wide = fx.publish(&wide_refs).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let twice = fx
        .publish(&[
            ("id", b"twice-1"),
            ("account", b"acct-1"),
            ("amount", b"1"),
            ("amount", b"2"),
        ])
        .await;
    let reused = fx.post("max-1", "big", 5).await;

    // Rejected by PostgreSQL: dead-lettered at their MAX_DELIVERIES-th delivery.
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let overflow = fx.post("over-1", "big", 1).await;
    let overdraft = fx.post("overdraft-1", "acct-new", -2_000_000).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    // Random letters barely compress: too long for a B-tree index entry (SQLSTATE 54000).
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let long_account: String = (0..20_000)
        .map(|_| char::from(b'a' + rng.below(26) as u8))
        .collect();
    let long = fx.post("long-1", &long_account, 1).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let nul = fx
        .publish(&[
            ("id", b"nul-1"),
            ("account", b"acct\0nul"),
            ("amount", b"5"),
        ])
        .await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;

    // A new process for each delivery of `nul` but its last: the delivery count that bounds
    // the attempts is Redis's, and survives restarts.
    for restart in 1..MAX_DELIVERIES {
        consumer
            .wait_for_log(
                &format!("entry {nul} left pending"),
                Duration::from_secs(30),
            )
            .await;
        consumer.kill().await;
        consumer = Consumer::start(&env, format!("p-{restart}")).await;
    }
    let last = fx.post("good-last", "acct-0", 1).await;
    *expected.entry("acct-0".into()).or_default() += 1;
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    consumer.stop().await;

    assert_eq!(
        fx.balances(&db).await,
        expected,
        "every good entry applied once"
    );

    let dead = fx.dead_letters().await;
    let by_entry: BTreeMap<String, &DeadLetter> =
        dead.iter().map(|d| (d.field("entry"), d)).collect();
    assert_eq!(by_entry.len(), dead.len(), "each entry dead-lettered once");
    assert_eq!(
        by_entry.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            wide.clone(),
            twice.clone(),
            reused.clone(),
            overflow.clone(),
            overdraft.clone(),
            long.clone(),
            nul.clone()
        ])
    );
    let assert_dead_letter = |entry: &str, deliveries: u64, reason: &str| {
        let letter = by_entry[entry];
        assert_eq!(
            letter.field("deliveries"),
            deliveries.to_string(),
            "{entry}"
        );
        assert!(
            letter.field("reason").contains(reason),
            "{entry}: {:?} should contain {reason:?}",
            letter.field("reason")
        );
    };
    assert_dead_letter(&wide, 1, "the entry has 5003 fields, more than 64");
    assert_dead_letter(&twice, 1, "field `amount` is repeated");
    assert_dead_letter(
        &reused,
        1,
        "fingerprint mismatch: the key was already used for a message with other content",
    );
    assert_dead_letter(&overflow, MAX_DELIVERIES, "(SQLSTATE 22003)");
    assert_dead_letter(&overdraft, MAX_DELIVERIES, "(SQLSTATE 23514)");
    assert_dead_letter(&long, MAX_DELIVERIES, "(SQLSTATE 54000)");
    assert_dead_letter(&nul, MAX_DELIVERIES, "(SQLSTATE 22021)");

    // The dead letter carries the original fields, bytes as published; at most 64 of them.
    let copied =
        |entry: &str| -> Vec<(String, Vec<u8>)> { by_entry[entry].original_fields().to_vec() };
    let nul_fields: Vec<(String, Vec<u8>)> = vec![
        ("id".into(), b"nul-1".to_vec()),
        ("account".into(), b"acct\0nul".to_vec()),
        ("amount".into(), b"5".to_vec()),
    ];
    assert_eq!(copied(&nul), nul_fields);
    let wide_first: Vec<(String, Vec<u8>)> = wide_fields
        .iter()
        .take(64)
        .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
        .collect();
    assert_eq!(copied(&wide), wide_first);

    drop(db);
    fx.drop_database().await;
}

/// Regression: `XAUTOCLAIM` always started from `0-0`, so when the first page of the pending
/// list kept failing, the entries after it were never claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_list_longer_than_a_claim_page_is_processed_to_its_tail() {
    let Some(mut fx) = Fixture::new("tail").await else {
        return;
    };
    // The head: 70 entries (more than one 64-entry page) on an account whose row the test
    // keeps locked, so each of them fails with a lock timeout.
    let db = fx.db().await;
    sqlx::query(ACCOUNTS_TABLE).execute(&db).await.unwrap();
    sqlx::query("INSERT INTO accounts VALUES ('held', 0)")
        .execute(&db)
        .await
        .unwrap();
    let mut holder = db.begin().await.unwrap();
    sqlx::query("SELECT balance FROM accounts WHERE account = 'held' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut held_total = 0;
    for i in 0..70 {
        fx.post(&format!("held-{i}"), "held", i + 1).await;
        held_total += i + 1;
    }
    // The tail: 300 entries on other accounts.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut last = String::new();
    for i in 0..300i64 {
        let account = format!("acct-{}", i % 10);
        last = fx.post(&format!("tail-{i}"), &account, i).await;
        *expected.entry(account).or_default() += i;
    }
    fx.deliver_to_dead_consumer("gone").await;

    let env = fx.env(&[("CLAIM_IDLE", "1s"), ("LOCK_TIMEOUT", "30ms")]);
    let mut consumer = Consumer::start(&env, "t-0").await;

    // The whole tail is applied while the head still fails.
    let deadline = Deadline::after(
        Duration::from_secs(60),
        "the tail of the pending list was never processed",
    );
    loop {
        let mut balances = fx.balances(&db).await;
        assert_eq!(balances.remove("held"), Some(0));
        if balances == expected {
            break;
        }
        deadline.tick().await;
    }
    assert!(fx.dead_letters().await.is_empty());

    holder.rollback().await.unwrap();
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    consumer.stop().await;
    expected.insert("held".into(), held_total);
    assert_eq!(fx.balances(&db).await, expected);
    assert!(fx.dead_letters().await.is_empty());
    drop(db);
    fx.drop_database().await;
}

/// What ends the consumer's wait for the row the test holds, short of releasing it.
#[derive(Clone, Copy, PartialEq)]
enum Unblock {
    /// The consumer's own `LOCK_TIMEOUT` or `STATEMENT_TIMEOUT`.
    Timeout,
    /// The test terminates the waiting backend: the consumer loses its connection.
    TerminateBackend,
    /// The consumer's transactions run under `REPEATABLE READ`, and the test commits its
    /// update of the row while the consumer waits: a serialization failure.
    ConcurrentUpdate,
    /// The test waits for a lock the consumer's transaction holds: a deadlock, and
    /// PostgreSQL picks the consumer's transaction to abort.
    Deadlock,
}

/// The test's transaction on the `held` account's row. The row stays locked from `new` to
/// `release`: whatever ends the consumer's waits, no attempt of the blocked entry can succeed
/// before the release.
struct Holder {
    db: PgPool,
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
    unblock: Unblock,
}

impl Holder {
    async fn new(db: &PgPool, unblock: Unblock) -> Holder {
        let tx = Holder::lock(db.clone()).await;
        Holder {
            db: db.clone(),
            tx: Some(tx),
            unblock,
        }
    }

    /// A transaction that has locked the row (waiting for it if need be), and updated it: a
    /// transaction under `REPEATABLE READ` that then writes the row fails to serialize.
    async fn lock(db: PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = db.begin().await.unwrap();
        // Whatever the database's default: it waits for the previous holder and then
        // updates the row, where `REPEATABLE READ` would fail.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *tx)
            .await
            .unwrap();
        // So that in a deadlock, the consumer's transaction is the one PostgreSQL aborts.
        sqlx::query("SET LOCAL deadlock_timeout = '30s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("UPDATE accounts SET balance = balance WHERE account = 'held'")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    }

    /// How many sessions wait for a lock.
    async fn waiting(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&self.db)
        .await
        .unwrap()
    }

    /// Ends the consumer's current wait, if the test's part is to end it.
    async fn disturb(&mut self) {
        match self.unblock {
            Unblock::Timeout => {}
            Unblock::TerminateBackend => {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .execute(&self.db)
                .await
                .unwrap();
            }
            Unblock::ConcurrentUpdate => {
                if self.waiting().await == 0 {
                    return;
                }
                // The next holder queues for the row behind the consumer before this one
                // commits, so the row is never free; the consumer's transaction, whose
                // snapshot predates the commit, fails to serialize.
                let next = tokio::spawn(Holder::lock(self.db.clone()));
                let deadline = Deadline::after(Duration::from_secs(10), "the next holder waits");
                while self.waiting().await < 2 {
                    deadline.tick().await;
                }
                self.tx.take().unwrap().commit().await.unwrap();
                self.tx = Some(next.await.unwrap());
            }
            Unblock::Deadlock => {
                if self.waiting().await == 0 {
                    return;
                }
                // The consumer's transaction wrote the idempotency table and waits for our
                // row; this waits for the consumer's transaction. Under a savepoint, so that
                // the table lock goes and the row lock stays.
                let tx = self.tx.as_mut().unwrap();
                for statement in [
                    "SAVEPOINT deadlock",
                    "SET LOCAL lock_timeout = '20s'",
                    "LOCK TABLE idempotent_records IN SHARE MODE",
                    "ROLLBACK TO SAVEPOINT deadlock",
                ] {
                    sqlx::query(statement).execute(&mut **tx).await.unwrap();
                }
            }
        }
    }

    async fn release(mut self) {
        self.tx.take().unwrap().rollback().await.unwrap();
    }
}

/// Holds the lock on one account's row from an open transaction while the consumer runs with
/// `settings`, and ends each of the consumer's waits by `unblock`: the consumer keeps applying
/// the other entries, delivers the blocked one again and again (more often than
/// `MAX_DELIVERIES`: the failure, `sqlstate`, is not the entry's fault), and applies it once
/// the lock is released.
async fn blocked_entry(
    name: &str,
    settings: &[(&'static str, &str)],
    unblock: Unblock,
    sqlstate: &str,
) {
    let Some(mut fx) = Fixture::new(name).await else {
        return;
    };
    // For the consumer's sessions.
    let database_setting = match unblock {
        Unblock::ConcurrentUpdate => Some("default_transaction_isolation = 'repeatable read'"),
        // PostgreSQL looks for a deadlock once, this long after a session begins to wait: the
        // test must close the cycle before the consumer's session looks.
        Unblock::Deadlock => Some("deadlock_timeout = '2s'"),
        Unblock::Timeout | Unblock::TerminateBackend => None,
    };
    if let Some(setting) = database_setting {
        sqlx::query(&format!("ALTER DATABASE {} SET {setting}", fx.db.name))
            .execute(&fx.db.admin)
            .await
            .unwrap();
    }
    let mut env_settings = vec![("CLAIM_IDLE", "1s"), ("MAX_DELIVERIES", "2")];
    env_settings.extend_from_slice(settings);
    let env = fx.env(&env_settings);
    let mut consumer = Consumer::start(&env, format!("{name}-0")).await;

    // The consumer has created the table.
    let db = fx.db().await;
    sqlx::query("INSERT INTO accounts VALUES ('held', 0)")
        .execute(&db)
        .await
        .unwrap();
    let mut holder = Holder::new(&db, unblock).await;

    let blocked = fx.post("held-1", "held", 7).await;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut last = String::new();
    for i in 0..20i64 {
        let account = format!("acct-{}", i % 4);
        last = fx.post(&format!("other-{i}"), &account, i + 1).await;
        *expected.entry(account).or_default() += i + 1;
    }

    let deadline = Deadline::after(
        Duration::from_secs(30),
        "the entries after the blocked one were not applied",
    );
    loop {
        holder.disturb().await;
        let mut balances = fx.balances(&db).await;
        assert_eq!(balances.remove("held"), Some(0));
        if balances == expected {
            break;
        }
        deadline.tick().await;
    }
    let deadline = Deadline::after(
        Duration::from_secs(30),
        "the blocked entry was not delivered again",
    );
    while fx.deliveries(&blocked).await.unwrap_or(0) < 3 {
        holder.disturb().await;
        deadline.tick().await;
    }
    let log = consumer.log();
    assert!(
        log.contains(&format!("entry {blocked} left pending"))
            && log.contains(&format!("(SQLSTATE {sqlstate})")),
        "{log}"
    );
    assert!(fx.dead_letters().await.is_empty());

    holder.release().await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    consumer.stop().await;
    expected.insert("held".into(), 7);
    assert_eq!(fx.balances(&db).await, expected);
    assert!(fx.dead_letters().await.is_empty());
    drop(db);
    fx.drop_database().await;
}

/// Regression: a transaction blocked on a row lock held by a hung transaction stalled the
/// consumer for as long as the lock was held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_timeout_keeps_a_hung_transaction_from_stalling_the_consumer() {
    let settings = [("LOCK_TIMEOUT", "200ms")];
    blocked_entry("lock", &settings, Unblock::Timeout, "55P03").await;
}

/// The same with only `STATEMENT_TIMEOUT` short enough to end the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_keeps_a_hung_transaction_from_stalling_the_consumer() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "300ms")];
    blocked_entry("statement", &settings, Unblock::Timeout, "57014").await;
}

/// A connection lost mid-transaction is transient: retried without bound, then applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("lost", &settings, Unblock::TerminateBackend, "57P01").await;
}

/// A serialization failure is transient: retried without bound, then applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("serial", &settings, Unblock::ConcurrentUpdate, "40001").await;
}

/// A deadlock is transient: retried without bound, then applied. Each attempt waits two
/// seconds for the deadlock to be found, longer than `CLAIM_IDLE / 2`: entries published after
/// the blocked one are still read between the sweeps that deliver it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("deadlock", &settings, Unblock::Deadlock, "40P01").await;
}

/// Bad settings are refused before anything is touched: exit status 2, the variable named.
#[tokio::test]
async fn bad_settings_exit_with_status_2_naming_the_variable() {
    for (name, value) in [
        ("MAX_DELIVERIES", "0"),
        ("MAX_DELIVERIES", "three"),
        ("LOCK_TIMEOUT", "25d"),
        ("STATEMENT_TIMEOUT", "0s"),
        ("CLAIM_IDLE", "soon"),
        ("RELAY", "yes"),
        ("NOTIFY_URL", "https://notifier.example/notify"),
        ("NOTIFY_URL", "not a url"),
        ("RELAY_MAX_ATTEMPTS", "0"),
        ("RELAY_BACKOFF", "fast"),
        ("RELAY_POLL", "0ms"),
    ] {
        for example in ["ledger", "relay"] {
            if example == "relay"
                && matches!(
                    name,
                    "MAX_DELIVERIES"
                        | "LOCK_TIMEOUT"
                        | "STATEMENT_TIMEOUT"
                        | "CLAIM_IDLE"
                        | "RELAY"
                )
            {
                continue;
            }
            let mut command = Command::new(support::example_binary(example));
            if name.starts_with("RELAY_") {
                command.env("NOTIFY_URL", "http://127.0.0.1:9/notify");
            }
            let output = command.env(name, value).output().await.unwrap();
            assert_eq!(output.status.code(), Some(2), "{example}: {name}={value}");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                stderr.contains(&format!("{name}=")),
                "{example}: {name}={value}: {stderr}"
            );
        }
    }
    // The relay has nothing to do without NOTIFY_URL.
    let output = Command::new(support::example_binary("relay"))
        .env_remove("NOTIFY_URL")
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("NOTIFY_URL"));
}

/// What the notifier saw.
#[derive(Default)]
struct Notified {
    /// Each notification its handler acted on, after deduplication: `(key, body)`.
    acted: Vec<(String, serde_json::Value)>,
    /// Requests received per key, duplicates and refusals included.
    attempts: HashMap<String, u32>,
    /// Keys of the requests being handled now.
    in_flight: HashSet<String>,
    /// Whether two requests with one key were ever handled at once.
    overlapped: bool,
}

/// The receiver of the ledger's notifications: an HTTP server in the test process that
/// deduplicates by `Idempotency-Key` with this library's layer (its records survive a
/// restart), counts what it receives, refuses (400) the notifications of one account, and
/// never answers those with a [hanging key](HANGING_KEY_PREFIX). It can be stopped, refusing
/// connections, and started again on the same port.
struct Notifier {
    port: u16,
    /// How long the handler takes.
    hold: Duration,
    seen: Arc<Mutex<Notified>>,
    idempotency: idempotent_core::Idempotency,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// The account whose notifications the notifier refuses.
const REFUSED_ACCOUNT: &str = "acct-refused";

/// The notifier never answers a request whose `Idempotency-Key` starts with this: it counts
/// it, then holds it until its connection goes (the test kills the relay that sent it).
const HANGING_KEY_PREFIX: &str = "hang-";

impl Notifier {
    async fn start() -> Notifier {
        Notifier::start_holding(Duration::from_millis(5)).await
    }

    async fn start_holding(hold: Duration) -> Notifier {
        let mut notifier = Notifier {
            port: 0,
            hold,
            seen: Arc::default(),
            idempotency: idempotent_core::Idempotency::new(
                idempotent_core::memory::MemoryStore::new(),
            ),
            server: None,
        };
        notifier.up().await;
        notifier
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/notify", self.port)
    }

    /// Listens (on the same port as before, once there was one).
    async fn up(&mut self) {
        use axum::extract::State;
        use axum::routing::post;

        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.port = listener.local_addr().unwrap().port();
        let hold = self.hold;
        let act = move |State(seen): State<Arc<Mutex<Notified>>>,
                        headers: http::HeaderMap,
                        body: axum::Json<serde_json::Value>| async move {
            if body["account"] == REFUSED_ACCOUNT {
                return http::StatusCode::BAD_REQUEST;
            }
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            lock(&seen).acted.push((key, body.0));
            // A hold, so that a second delivery of one message at the same time would be seen.
            tokio::time::sleep(hold).await;
            http::StatusCode::CREATED
        };
        let count = |State(seen): State<Arc<Mutex<Notified>>>,
                     request: axum::extract::Request,
                     next: axum::middleware::Next| async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .map(|k| k.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let hang = {
                let mut seen = lock(&seen);
                *seen.attempts.entry(key.clone()).or_default() += 1;
                // The key as sent: an RFC 8941 string, quoted or bare.
                let hang = key.trim_matches('"').starts_with(HANGING_KEY_PREFIX);
                if !hang && !seen.in_flight.insert(key.clone()) {
                    seen.overlapped = true;
                }
                hang
            };
            if hang {
                return std::future::pending().await;
            }
            let response = next.run(request).await;
            lock(&seen).in_flight.remove(&key);
            response
        };
        let app = axum::Router::new()
            .route("/notify", post(act))
            .layer(
                idempotent_tower::IdempotencyLayer::new_for_http(self.idempotency.clone())
                    .allow_anonymous(true),
            )
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&self.seen),
                count,
            ))
            .with_state(Arc::clone(&self.seen));
        self.server = Some(tokio::spawn(async move {
            // Every connection is a task of this set: stopping the server drops them all.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                connections.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        }));
    }

    /// Stops listening and drops every connection: deliveries fail until [`up`](Self::up).
    async fn down(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Notified> {
        lock(&self.seen)
    }

    /// Requests received with the message key `key` (sent quoted or bare).
    fn attempts(&self, key: &str) -> u32 {
        self.seen()
            .attempts
            .iter()
            .filter(|(sent, _)| sent.trim_matches('"') == key)
            .map(|(_, n)| n)
            .sum()
    }

    /// Waits until notifications for `ids` were acted on.
    async fn wait_for(&self, ids: &BTreeSet<String>, within: Duration) {
        let deadline = Deadline::after(within, "not every notification arrived");
        loop {
            let acted: BTreeSet<String> = self
                .seen()
                .acted
                .iter()
                .map(|(_, body)| body["id"].as_str().unwrap().to_owned())
                .collect();
            if ids.is_subset(&acted) {
                return;
            }
            deadline.tick().await;
        }
    }

    /// Checks that each of `ids` was acted on exactly once, with its own key, and nothing
    /// else was.
    fn assert_once_each(&self, ids: &BTreeSet<String>) {
        let seen = self.seen();
        let mut by_id: BTreeMap<String, Vec<&String>> = BTreeMap::new();
        for (key, body) in &seen.acted {
            by_id
                .entry(body["id"].as_str().unwrap().to_owned())
                .or_default()
                .push(key);
        }
        let acted: BTreeSet<String> = by_id.keys().cloned().collect();
        assert_eq!(
            &acted, ids,
            "one notification per applied posting, no other"
        );
        for (id, keys) in &by_id {
            assert_eq!(keys.len(), 1, "{id} acted on {} times", keys.len());
            assert!(seen.attempts[keys[0]] >= 1);
        }
        let keys: HashSet<&String> = by_id.values().map(|k| k[0]).collect();
        assert_eq!(keys.len(), ids.len(), "each notification has its own key");
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

fn lock(seen: &Mutex<Notified>) -> std::sync::MutexGuard<'_, Notified> {
    seen.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The outbox rows by state.
async fn outbox_states(db: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM idempotent_outbox GROUP BY state")
            .fetch_all(db)
            .await
            .unwrap();
    rows.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notifier_that_is_down_delays_notifications_and_loses_none() {
    let Some(mut fx) = Fixture::new("notify_down").await else {
        return;
    };
    let mut notifier = Notifier::start().await;
    notifier.down().await;
    let env = fx.env(&[
        ("NOTIFY_URL", &notifier.url()),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
        ("RELAY_MAX_ATTEMPTS", "1000"),
    ]);
    // Three relays: the consumer's and two on their own.
    let mut processes = vec![
        Consumer::start(&env, "c0").await,
        Consumer::relay(&env, "relay-0").await,
        Consumer::relay(&env, "relay-1").await,
    ];
    let mut ids = BTreeSet::new();
    let mut last = String::new();
    for n in 0..60 {
        let id = format!("pay-{n}");
        last = fx.post(&id, &format!("acct-{}", n % 7), 10 + n).await;
        ids.insert(id);
    }
    fx.post("pay-refused", REFUSED_ACCOUNT, 5).await;
    let last_id = fx.post("pay-last", "acct-0", 1).await;
    ids.insert("pay-last".to_owned());
    fx.wait_drained(&last_id, Duration::from_secs(60)).await;
    let _ = last;
    let db = fx.db().await;
    // Applied, and their notifications waiting: attempts failed while the notifier is down.
    let deadline = Deadline::after(Duration::from_secs(30), "no delivery attempt failed");
    loop {
        let failed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotent_outbox WHERE state = 'pending' AND attempts > 0 \
             AND last_error IS NOT NULL",
        )
        .fetch_one(&db)
        .await
        .unwrap();
        if failed > 0 {
            break;
        }
        deadline.tick().await;
    }
    assert!(notifier.seen().acted.is_empty());
    assert_eq!(outbox_states(&db).await.get("pending"), Some(&62));

    notifier.up().await;
    notifier.wait_for(&ids, Duration::from_secs(60)).await;
    // The refused one is dead-lettered at once, with the answer kept.
    let deadline = Deadline::after(Duration::from_secs(30), "the refusal was not dead-lettered");
    while outbox_states(&db).await.get("dead") != Some(&1) {
        deadline.tick().await;
    }
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM idempotent_outbox WHERE state = 'dead'")
            .fetch_one(&db)
            .await
            .unwrap();
    assert!(error.contains("400"), "{error}");
    for process in &mut processes {
        process.stop().await;
    }
    notifier.assert_once_each(&ids);
    assert_eq!(outbox_states(&db).await.get("pending"), None);
    assert!(
        !notifier.seen().overlapped,
        "two relays delivered one notification at the same time"
    );
    drop(db);
    fx.drop_database().await;
}

/// A relay frozen (SIGSTOP) in the middle of a batch keeps its notifications locked only until
/// PostgreSQL ends its idle transaction (twice the delivery timeout plus 5 s); another relay
/// then delivers them, and the receiver acts on each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_gives_its_batch_up_to_another() {
    let Some(mut fx) = Fixture::new("relay_frozen").await else {
        return;
    };
    let notifier = Notifier::start_holding(Duration::from_millis(200)).await;
    let url = notifier.url();
    let relay_env = fx.env(&[
        ("NOTIFY_URL", &url),
        ("RELAY_DELIVERY_TIMEOUT", "1s"),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
    ]);
    let mut consumer_env = relay_env.clone();
    consumer_env.push(("RELAY", "0".into()));
    let mut consumer = Consumer::start(&consumer_env, "c0").await;
    let mut ids = BTreeSet::new();
    let mut last = String::new();
    for n in 0..20 {
        let id = format!("pay-{n}");
        last = fx.post(&id, "acct-0", n).await;
        ids.insert(id);
    }
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    // One relay takes all 20 in its first batch; freeze it while it delivers them.
    let mut frozen = Consumer::relay(&relay_env, "relay-frozen").await;
    let deadline = Deadline::after(Duration::from_secs(30), "the relay never delivered");
    while notifier.seen().attempts.is_empty() {
        deadline.tick().await;
    }
    frozen.signal("STOP");
    let mut other = Consumer::relay(&relay_env, "relay-other").await;
    // While the first relay stays frozen, the other one gets the batch once PostgreSQL has
    // ended the frozen relay's transaction, and records every notification delivered.
    let db = fx.db().await;
    let deadline = Deadline::after(
        Duration::from_secs(60),
        "the frozen relay's batch was never delivered by the other",
    );
    while outbox_states(&db).await != BTreeMap::from([("delivered".to_owned(), 20)]) {
        deadline.tick().await;
    }
    let redelivered = notifier
        .seen()
        .attempts
        .values()
        .filter(|n| **n >= 2)
        .count();
    assert!(redelivered > 0, "the other relay delivered the batch again");
    frozen.signal("CONT");
    for process in [&mut consumer, &mut frozen, &mut other] {
        process.stop().await;
    }
    notifier.assert_once_each(&ids);
    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("delivered".to_owned(), 20)])
    );
    drop(db);
    fx.drop_database().await;
}

// Regression: a notification whose delivery killed its relay was delivered again forever: the
// relay counted the attempt in its batch's transaction, which died with it, so the next relay
// took the same notification first, died too, and the later notifications of its ordering key
// waited behind it. Here the test SIGKILLs the relay process each time the notifier receives
// that notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_relay_is_dead_lettered_and_the_rest_flows() {
    let Some(fx) = Fixture::new("relay_crash").await else {
        return;
    };
    const MAX_ATTEMPTS: u32 = 3;
    let poison_key = format!("{HANGING_KEY_PREFIX}pay-poison");
    let notifier = Notifier::start().await;
    let db = fx.db().await;
    let outbox = Outbox::new();
    outbox.migrate(&db).await.unwrap();
    // Notifications as the ledger enqueues them, six in order on one account (the poison one
    // second), four without an ordering key.
    let mut ids = BTreeSet::new();
    let mut in_order = Vec::new();
    let mut tx = db.begin().await.unwrap();
    for n in 0..10 {
        let id = if n == 1 {
            "pay-poison".to_owned()
        } else {
            format!("pay-{n}")
        };
        let body = serde_json::json!({"id": id, "account": "acct-0", "amount": n});
        let key = if n == 1 {
            poison_key.clone()
        } else {
            format!("note-{n}")
        };
        let mut message = Message::new("notifications", body.to_string())
            .key(Key::new(key).unwrap())
            .header("content-type", "application/json");
        if n < 6 {
            message = message.ordering_key("acct-0");
            if n != 1 {
                in_order.push(id.clone());
            }
        }
        outbox.enqueue(&mut tx, &message).await.unwrap();
        if n != 1 {
            ids.insert(id);
        }
    }
    tx.commit().await.unwrap();

    let env = fx.env(&[
        ("NOTIFY_URL", &notifier.url()),
        ("RELAY_MAX_ATTEMPTS", &MAX_ATTEMPTS.to_string()),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
    ]);
    // Each time the notifier receives it, the relay delivering it is killed, and another
    // started. Its relays crash MAX_ATTEMPTS times; then it is dead-lettered, not delivered
    // again.
    let mut relay = Consumer::relay(&env, "relay-0").await;
    let mut crashes = 0;
    let deadline = Deadline::after(
        Duration::from_secs(90),
        "the poison notification was never dead-lettered",
    );
    let dead = loop {
        if notifier.attempts(&poison_key) > crashes {
            crashes += 1;
            assert!(
                crashes <= MAX_ATTEMPTS,
                "delivered again after {MAX_ATTEMPTS} relays died delivering it: their \
                 attempts were not counted"
            );
            relay.kill().await;
            relay = Consumer::relay(&env, format!("relay-{crashes}")).await;
            continue;
        }
        let dead = outbox.dead_letters(&db, 10).await.unwrap();
        if !dead.is_empty() {
            break dead;
        }
        deadline.tick().await;
    };
    assert_eq!(crashes, MAX_ATTEMPTS);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].key, poison_key);
    assert_eq!(dead[0].attempts, MAX_ATTEMPTS as i32);
    let error = dead[0].last_error.clone().unwrap_or_default();
    assert!(
        error.starts_with("relay_crashed: a relay died while delivering it (attempt 3)"),
        "{error}"
    );
    // The rest flows, its ordering key in order.
    notifier.wait_for(&ids, Duration::from_secs(60)).await;
    relay.stop().await;
    notifier.assert_once_each(&ids);
    let acted: Vec<String> = notifier
        .seen()
        .acted
        .iter()
        .map(|(_, body)| body["id"].as_str().unwrap().to_owned())
        .filter(|id| in_order.contains(id))
        .collect();
    assert_eq!(acted, in_order, "acct-0's notifications out of order");
    assert_eq!(
        notifier.attempts(&poison_key),
        MAX_ATTEMPTS,
        "one delivery per attempt, none after the last"
    );
    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("dead".to_owned(), 1), ("delivered".to_owned(), 9)])
    );
    drop(db);
    fx.drop_database().await;
}

// Regression: an entry whose idempotency record could not be decoded (`Error::CorruptRecord`)
// counted as a transient failure: it was left pending and delivered again forever, every
// delivery meeting the same record. Now it is dead-lettered at once with that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_whose_record_cannot_be_decoded_is_dead_lettered_once() {
    let Some(mut fx) = Fixture::new("corrupt").await else {
        return;
    };
    let env = fx.env(&[("CLAIM_IDLE", "1s")]);
    let mut consumer = Consumer::start(&env, "corrupt-0").await;
    let db = fx.db().await;
    let first = fx.post("pay-1", "acct-1", 100).await;
    fx.wait_drained(&first, Duration::from_secs(30)).await;
    // Its record, the only one so far, damaged in the table.
    let damaged = sqlx::query("UPDATE idempotent_records SET payload = '\\xdeadbeef'::bytea")
        .execute(&db)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(damaged, 1);
    // The same posting again (a producer retry), then others.
    let replay = fx.post("pay-1", "acct-1", 100).await;
    fx.post("pay-2", "acct-2", 7).await;
    fx.post("pay-3", "acct-1", 5).await;
    let last = fx.post("pay-4", "acct-2", -2).await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    consumer.stop().await;

    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1, "dead-lettered once");
    assert_eq!(dead[0].field("entry"), replay);
    assert_eq!(dead[0].field("deliveries"), "1");
    let reason = dead[0].field("reason");
    assert!(
        reason.contains("cannot be decoded") && reason.contains("corrupt_record"),
        "{reason}"
    );
    assert_eq!(
        fx.balances(&db).await,
        BTreeMap::from([("acct-1".to_owned(), 105), ("acct-2".to_owned(), 5)]),
        "pay-1 applied once, the others after it applied"
    );
    drop(db);
    fx.drop_database().await;
}
