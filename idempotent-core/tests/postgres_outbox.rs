//! The transactional outbox and its relay against a real PostgreSQL server (started by
//! `scripts/test.sh`): messages commit or roll back with the caller's transaction, take the
//! running claim's operation key, are delivered at least once by relays sharing the work
//! without ever delivering one message twice at the same time, retried with backoff,
//! dead-lettered (also when their relays die delivering them), kept in order per ordering key
//! (which must be enqueued in a transaction) without a hot key slowing the batches, woken by
//! NOTIFY, and reaped; and every duration setting saturates.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).
#![cfg(all(feature = "postgres", feature = "test-util"))]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::conformance::{backend_url, fresh_key};
use idempotent_core::metrics::Recorded;
use idempotent_core::postgres::{
    BoxFuture, Message, OUTBOX_DEAD, OUTBOX_DELIVERIES, OUTBOX_OLDEST_PENDING_AGE, OUTBOX_PENDING,
    Outbox, OutboxError, OutboxMessage, PostgresStore, Relay, Sink, SinkError, TransactionalClaim,
};
use idempotent_core::{Call, ClaimHandle, Fingerprint, Idempotency, Key};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::time::{Instant, timeout};

const URL_VAR: &str = "IDEMPOTENT_TEST_POSTGRES_URL";
/// The bound on every wait in these tests; a test that reaches it has failed.
const BOUND: Duration = Duration::from_secs(60);

async fn pool(url: &str, connections: u32) -> PgPool {
    let options = PgConnectOptions::from_str(url)
        .unwrap()
        .options([("lock_timeout", "30s")]);
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(BOUND)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}; is PostgreSQL running?"))
}

/// A pool of `connections` and a migrated outbox of the test's own, or `None` when
/// PostgreSQL is not configured (and not required).
async fn setup(connections: u32) -> Option<(PgPool, Outbox)> {
    let pool = pool(&backend_url(URL_VAR)?, connections).await;
    let outbox = outbox(&pool).await;
    Some((pool, outbox))
}

/// A migrated outbox on a table of its own.
async fn outbox(pool: &PgPool) -> Outbox {
    let outbox = Outbox::with_table(&format!("outbox_{}", &fresh_key().to_hex()[..16])).unwrap();
    outbox.migrate(pool).await.unwrap();
    outbox
}

/// One delivery a sink saw.
#[derive(Debug, Clone)]
struct Seen {
    id: i64,
    key: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    attempt: u32,
}

/// A sink that records what it is given, fails each message's first `fail_first` attempts
/// (or forever for payloads starting with `poison`, permanently for `refuse`; never answers
/// for `hang`), and notices two deliveries of one message at the same time.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    delivered: Arc<Mutex<Vec<i64>>>,
    in_flight: Arc<Mutex<HashSet<i64>>>,
    overlapped: Arc<AtomicBool>,
    fail_first: u32,
    hold: Duration,
}

impl Recorder {
    fn delivered(&self) -> Vec<i64> {
        self.delivered.lock().unwrap().clone()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Sink for Recorder {
    fn deliver<'a>(&'a self, message: &'a OutboxMessage) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            if !self.in_flight.lock().unwrap().insert(message.id) {
                self.overlapped.store(true, Ordering::SeqCst);
            }
            self.seen.lock().unwrap().push(Seen {
                id: message.id,
                key: message.key.clone(),
                payload: message.payload.to_vec(),
                headers: message.headers.clone(),
                attempt: message.attempt,
            });
            if message.payload.starts_with(b"hang") {
                // Never answers: the relay is stopped (its batch dropped) in the middle of it.
                self.in_flight.lock().unwrap().remove(&message.id);
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(self.hold).await;
            self.in_flight.lock().unwrap().remove(&message.id);
            if message.payload.starts_with(b"panic") {
                panic!("a sink bug");
            }
            if message.payload.starts_with(b"refuse") {
                return Err(SinkError::permanent("refused: malformed"));
            }
            if message.payload.starts_with(b"poison") {
                return Err(SinkError::retry(format!(
                    "receiver down (attempt {})",
                    message.attempt
                )));
            }
            if message.attempt <= self.fail_first {
                return Err(SinkError::retry("receiver busy"));
            }
            self.delivered.lock().unwrap().push(message.id);
            Ok(())
        })
    }
}

/// Waits until `check` holds, looking every 20 ms; fails the test with `what` after
/// [`BOUND`].
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < BOUND, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `relay` batch after batch until a batch takes nothing and `done` holds.
async fn drain(relay: &Relay, done: impl Fn() -> bool) {
    let start = Instant::now();
    loop {
        let batch = relay.run_once().await.unwrap();
        if batch.taken == 0 && done() {
            return;
        }
        assert!(start.elapsed() < BOUND, "the outbox did not drain");
        if batch.taken == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_commits_or_rolls_back_with_the_transaction() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let key = Key::new("order-7-confirmation").unwrap();

    let mut tx = pool.begin().await.unwrap();
    let rolled_back = Message::new("mail", "rolled back").key(key.clone());
    outbox.enqueue(&mut tx, &rolled_back).await.unwrap();
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let message = Message::new("mail", r#"{"order":7}"#)
        .key(key.clone())
        .header("content-type", "application/json")
        .header("x-tenant", "acme");
    let id = outbox.enqueue(&mut tx, &message).await.unwrap();
    // Not visible to a relay before the commit.
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("mail", sink.clone())
        .build();
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    tx.commit().await.unwrap();

    let batch = relay.run_once().await.unwrap();
    assert_eq!((batch.taken, batch.delivered), (1, 1));
    let seen = sink.seen();
    assert_eq!(seen.len(), 1, "only the committed message");
    assert_eq!(seen[0].id, id);
    assert_eq!(seen[0].key, "order-7-confirmation");
    assert_eq!(seen[0].payload, br#"{"order":7}"#);
    assert_eq!(
        seen[0].headers,
        [
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-tenant".to_owned(), "acme".to_owned())
        ]
    );
    assert_eq!(seen[0].attempt, 1);
    // Delivered once: nothing left.
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    assert_eq!(sink.seen().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_takes_the_running_claims_operation_key() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    let transactional = store.transactional().namespace("outbox-test");

    // Outside a claim there is no key to default to.
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        outbox.enqueue(&mut tx, &Message::new("mail", "x")).await,
        Err(OutboxError::NoKey)
    ));
    drop(tx);

    let client_key = format!("deposit-{}", &fresh_key().to_hex()[..12]);
    let call = || {
        Call::new(client_key.parse().unwrap())
            .fingerprint(Fingerprint::of(&("acct-1", 100)).unwrap())
    };
    // The first attempt enqueues and rolls back (a crash before the commit); the second
    // commits. Each enqueues with its claim's operation key.
    let mut keys = Vec::new();
    for commit in [false, true] {
        let mut tx = pool.begin().await.unwrap();
        let TransactionalClaim::Run(pending) =
            transactional.claim::<i64>(&call(), &mut tx).await.unwrap()
        else {
            panic!("nothing was committed yet: the work must run");
        };
        let claim = pending.claim();
        let receipt = Message::new("mail", "receipt").claim(&claim);
        outbox.enqueue(&mut tx, &receipt).await.unwrap();
        let ledger = Message::new("mail", "ledger").claim(&claim).part("ledger");
        outbox.enqueue(&mut tx, &ledger).await.unwrap();
        keys.push(claim.operation_key());
        pending.complete(&mut tx, &100i64).await.unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    }
    // The rolled-back attempt left no record, so no lifetime: the committed attempt began a
    // new one. Its messages went with the rollback, so no receiver ever sees the first key.
    assert_ne!(
        keys[0], keys[1],
        "a rolled-back attempt leaves no lifetime behind"
    );
    // A third attempt replays: nothing more is enqueued.
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        transactional.claim::<i64>(&call(), &mut tx).await.unwrap(),
        TransactionalClaim::Replay(100)
    ));
    tx.commit().await.unwrap();

    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("mail", sink.clone())
        .build();
    relay.run_once().await.unwrap();
    let seen: BTreeMap<Vec<u8>, String> = sink
        .seen()
        .into_iter()
        .map(|s| (s.payload, s.key))
        .collect();
    let operation = keys[1].as_str().to_owned();
    assert_eq!(
        seen,
        BTreeMap::from([
            (b"receipt".to_vec(), operation.clone()),
            (b"ledger".to_vec(), format!("{operation}.ledger")),
        ]),
        "one message of each, from the committed attempt, with the operation's key"
    );

    // Inside the runtime's work, the running claim gives the key (ClaimHandle::current).
    let idempotency = Idempotency::new(store.clone());
    let call = Call::new(
        format!("notify-{}", &fresh_key().to_hex()[..12])
            .parse()
            .unwrap(),
    );
    let (pool2, outbox2) = (pool.clone(), outbox.clone());
    let outcome = idempotency
        .run(&call, async move {
            let claim = ClaimHandle::current().expect("inside run");
            let mut tx = pool2.begin().await.unwrap();
            outbox2
                .enqueue(&mut tx, &Message::new("mail", "from run"))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            claim.operation_key().as_str().to_owned()
        })
        .await
        .unwrap();
    let expected = outcome.into_inner();
    relay.run_once().await.unwrap();
    let from_run: Vec<String> = sink
        .seen()
        .into_iter()
        .filter(|s| s.payload == b"from run")
        .map(|s| s.key)
        .collect();
    assert_eq!(from_run, [expected]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_with_backoff_then_dead_lettered_with_the_last_error() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["flaky", "poison", "refuse"] {
        let message = Message::new("hook", payload).key(Key::new(payload).unwrap());
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    let sink = Recorder {
        fail_first: 2,
        ..Recorder::default()
    };
    let (relay, recorded) = Recorded::capture(|| {
        Relay::builder(pool.clone(), outbox.clone())
            .sink("hook", sink.clone())
            .max_attempts(4)
            .backoff(Duration::from_millis(200), Duration::from_millis(400))
            .build()
    });

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.taken, first.retried, first.dead), (3, 2, 1));
    // The backoff holds them back: nothing is due at once.
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    let delivered = sink.clone();
    drain(&relay, || {
        !delivered.delivered().is_empty() && {
            let attempts = delivered
                .seen()
                .iter()
                .filter(|s| s.key == "poison")
                .count();
            attempts == 4
        }
    })
    .await;
    assert_eq!(
        sink.delivered(),
        [ids["flaky"]],
        "delivered on its third attempt"
    );
    let by_key = |key: &str| -> Vec<u32> {
        sink.seen()
            .iter()
            .filter(|s| s.key == key)
            .map(|s| s.attempt)
            .collect()
    };
    assert_eq!(by_key("flaky"), [1, 2, 3]);
    assert_eq!(by_key("poison"), [1, 2, 3, 4], "max_attempts, then no more");
    assert_eq!(by_key("refuse"), [1], "a permanent failure is not retried");

    let dead = outbox.dead_letters(&pool, 10).await.unwrap();
    let dead: Vec<_> = dead
        .iter()
        .map(|d| (d.id, d.attempts, d.last_error.clone().unwrap()))
        .collect();
    assert_eq!(
        dead,
        [
            (ids["poison"], 4, "receiver down (attempt 4)".to_owned()),
            (ids["refuse"], 1, "refused: malformed".to_owned()),
        ]
    );
    // Every attempt counted by how it ended: flaky 2 retried + 1 delivered, poison 3 retried
    // + 1 dead, refuse 1 dead.
    let deliveries = |result| recorded.counter(OUTBOX_DELIVERIES, &[("result", result)]);
    assert_eq!(
        (
            deliveries("delivered"),
            deliveries("retried"),
            deliveries("dead")
        ),
        (1, 5, 2)
    );
    // Dead letters are not delivered again unless requeued.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    assert!(outbox.requeue(&pool, ids["poison"]).await.unwrap());
    assert!(
        !outbox.requeue(&pool, ids["flaky"]).await.unwrap(),
        "not dead"
    );
    assert_eq!(relay.run_once().await.unwrap().taken, 1);
    assert_eq!(by_key("poison"), [1, 2, 3, 4, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_with_one_ordering_key_are_delivered_in_order() {
    let Some((pool, outbox)) = setup(8).await else {
        return;
    };
    // Three accounts, ten messages each, interleaved; every message fails once first.
    let mut tx = pool.begin().await.unwrap();
    for n in 0..30 {
        let account = format!("acct-{}", n % 3);
        let message = Message::new("hook", format!("{account}:{n}"))
            .key(Key::new(format!("m-{n}")).unwrap())
            .ordering_key(account);
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let sink = Recorder {
        fail_first: 1,
        hold: Duration::from_millis(2),
        ..Recorder::default()
    };
    // Two relays at once.
    let relays: Vec<Relay> = (0..2)
        .map(|_| {
            Relay::builder(pool.clone(), outbox.clone())
                .sink("hook", sink.clone())
                .backoff(Duration::from_millis(5), Duration::from_millis(10))
                .build()
        })
        .collect();
    let done = {
        let sink = sink.clone();
        move || sink.delivered().len() == 30
    };
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            let done = done.clone();
            tokio::spawn(async move { drain(&relay, done).await })
        })
        .collect();
    for task in tasks {
        timeout(BOUND, task).await.unwrap().unwrap();
    }
    let delivered = sink.delivered();
    for account in 0..3 {
        let ids: Vec<i64> = delivered
            .iter()
            .copied()
            .filter(|id| {
                sink.seen().iter().any(|s| {
                    s.id == *id && s.payload.starts_with(format!("acct-{account}:").as_bytes())
                })
            })
            .collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids.len(), 10);
        assert_eq!(ids, sorted, "acct-{account} out of order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_relays_share_the_work_and_never_deliver_one_message_at_once() {
    let Some((pool, outbox)) = setup(16).await else {
        return;
    };
    const MESSAGES: usize = 600;
    // Enqueued from 20 transactions at once.
    let writers: Vec<_> = (0..20)
        .map(|w| {
            let (pool, outbox) = (pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                for n in 0..MESSAGES / 20 {
                    let key = Key::new(format!("w{w}-{n}")).unwrap();
                    let message = Message::new("hook", format!("{w}-{n}")).key(key);
                    outbox.enqueue(&mut tx, &message).await.unwrap();
                }
                tx.commit().await.unwrap();
            })
        })
        .collect();
    let sink = Recorder {
        hold: Duration::from_millis(3),
        ..Recorder::default()
    };
    let relays: Vec<_> = (0..4)
        .map(|_| {
            Relay::builder(pool.clone(), outbox.clone())
                .sink("hook", sink.clone())
                .batch_size(16)
                .poll_interval(Duration::from_millis(50))
                .build()
                .spawn()
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    eventually("every message delivered", async || {
        sink.delivered().len() >= MESSAGES
    })
    .await;
    for relay in relays {
        timeout(BOUND, relay.stop()).await.unwrap();
    }
    assert!(
        !sink.overlapped.load(Ordering::SeqCst),
        "two relays delivered one message at the same time"
    );
    let delivered = sink.delivered();
    let distinct: HashSet<i64> = delivered.iter().copied().collect();
    assert_eq!(distinct.len(), MESSAGES);
    assert_eq!(delivered.len(), MESSAGES, "no crash, so no message twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_wakes_the_relay_before_its_poll_interval() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    woken_by_notify(&pool, &outbox).await;
}

/// A relay that polls once an hour delivers a message enqueued while it waits: the `NOTIFY`
/// woke it.
async fn woken_by_notify(pool: &PgPool, outbox: &Outbox) {
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .poll_interval(Duration::from_secs(3600))
        .build()
        .spawn();
    // Let it run its first batch and start waiting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tx = pool.begin().await.unwrap();
    let message = Message::new("hook", "wake").key(Key::new("wake").unwrap());
    outbox.enqueue(&mut tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    eventually("the NOTIFY woke the relay", async || {
        !sink.delivered().is_empty()
    })
    .await;
    timeout(BOUND, relay.stop()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_messages_are_reaped_and_the_others_kept() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    for payload in ["ok-1", "ok-2", "refuse", "poison"] {
        let message = Message::new("hook", payload).key(Key::new(payload).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", Recorder::default())
        .build();
    relay.run_once().await.unwrap();
    let count = |state: &'static str| {
        let (pool, table) = (pool.clone(), outbox.table().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT count(*) FROM \"{table}\" WHERE state = $1"
            ))
            .bind(state)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(count("delivered").await, 2);
    assert_eq!(
        outbox.reap(&pool, Duration::from_secs(3600)).await.unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        outbox.reap(&pool, Duration::from_millis(10)).await.unwrap(),
        2
    );
    assert_eq!(count("delivered").await, 0);
    assert_eq!(count("dead").await, 1, "a dead letter is kept");
    assert_eq!(count("pending").await, 1, "a message to retry is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_refused_before_anything_is_written() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let key = Key::new("k").unwrap();
    let mut tx = pool.begin().await.unwrap();
    let cases = [
        (Message::new("", "x").key(key.clone()), "destination"),
        (
            Message::new("d".repeat(256), "x").key(key.clone()),
            "destination",
        ),
        (
            Message::new("hook", "x")
                .key(key.clone())
                .header("bad name", "v"),
            "header",
        ),
        (
            Message::new("hook", "x")
                .key(key.clone())
                .header("x-a", "line\nbreak"),
            "header",
        ),
        (
            Message::new("hook", "x")
                .key(key.clone())
                .ordering_key("a\0b"),
            "header",
        ),
        (
            Message::new("hook", "x")
                .key(key.clone())
                .header("Idempotency-Key", "other"),
            "header",
        ),
        (
            Message::new("hook", vec![0u8; (16 << 20) + 1]).key(key.clone()),
            "payload",
        ),
    ];
    for (message, what) in cases {
        let error = outbox.enqueue(&mut tx, &message).await.unwrap_err();
        let matched = match what {
            "destination" => matches!(error, OutboxError::InvalidDestination),
            "header" => matches!(error, OutboxError::InvalidHeader),
            _ => matches!(error, OutboxError::PayloadTooLarge { .. }),
        };
        assert!(matched, "{what}: {error:?}");
    }
    // The transaction is still usable, and nothing was written.
    tx.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\"", outbox.table()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    assert!(Outbox::with_table("Outbox; DROP TABLE x").is_err());
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_streams_sink_adds_each_message_with_its_key() {
    use idempotent_core::postgres::RedisStreamSink;

    let Some(url) = backend_url(URL_VAR) else {
        return;
    };
    let Some(redis_url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
        return;
    };
    let pool = pool(&url, 4).await;
    let outbox = outbox(&pool).await;
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let connection = redis::aio::ConnectionManager::new(client).await.unwrap();
    let stream = format!("outbox-test-{}", &fresh_key().to_hex()[..12]);
    let mut tx = pool.begin().await.unwrap();
    for n in 0..3 {
        let message = Message::new("events", format!("event {n}"))
            .key(Key::new(format!("event-{n}")).unwrap())
            .header("type", "posting.applied");
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink(
            "events",
            RedisStreamSink::new(connection.clone(), stream.clone()).max_len(1000),
        )
        .build();
    assert_eq!(relay.run_once().await.unwrap().delivered, 3);
    let mut connection = connection;
    type Fields = Vec<(String, Vec<u8>)>;
    let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut connection)
        .await
        .unwrap();
    // One batch delivers its messages concurrently: in any order.
    let mut fields: Vec<Fields> = entries.into_iter().map(|(_, f)| f).collect();
    fields.sort();
    let expected: Vec<Fields> = (0..3)
        .map(|n| {
            vec![
                ("key".to_owned(), format!("event-{n}").into_bytes()),
                ("payload".to_owned(), format!("event {n}").into_bytes()),
                ("type".to_owned(), b"posting.applied".to_vec()),
            ]
        })
        .collect();
    assert_eq!(fields, expected, "each message once, with its key");
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut connection)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_panics_and_a_row_that_cannot_be_read_fail_only_their_message() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["panic", "edited", "fine"] {
        let message = Message::new("hook", payload)
            .key(Key::new(payload).unwrap())
            .header("x-a", "1");
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    // A row edited by hand so that it cannot be read.
    sqlx::query(&format!(
        "UPDATE \"{}\" SET header_values = '{{}}' WHERE id = $1",
        outbox.table()
    ))
    .bind(ids["edited"])
    .execute(&pool)
    .await
    .unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_attempts(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .build();
    let first = relay.run_once().await.unwrap();
    assert_eq!(
        (first.taken, first.delivered, first.retried, first.dead),
        (3, 1, 1, 1)
    );
    assert_eq!(sink.delivered(), [ids["fine"]]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = relay.run_once().await.unwrap();
    assert_eq!(
        (second.taken, second.dead),
        (1, 1),
        "the panic's last attempt"
    );
    let dead: BTreeMap<i64, String> = outbox
        .dead_letters(&pool, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.last_error.unwrap()))
        .collect();
    assert_eq!(dead[&ids["panic"]], "the sink panicked");
    assert!(
        dead[&ids["edited"]].starts_with("the stored message cannot be read"),
        "{dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_ordering_key_is_delivered_in_commit_order() {
    let Some((pool, outbox)) = setup(8).await else {
        return;
    };
    let message = |n: u32| {
        Message::new("hook", format!("m{n}"))
            .key(Key::new(format!("m{n}")).unwrap())
            .ordering_key("account-1")
    };
    // The first transaction enqueues and stays open; the second enqueues after it with the
    // same ordering key, and commits as soon as it can.
    let mut first = pool.begin().await.unwrap();
    outbox.enqueue(&mut first, &message(1)).await.unwrap();
    let second = {
        let (pool, outbox, m2) = (pool.clone(), outbox.clone(), message(2));
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            outbox.enqueue(&mut tx, &m2).await.unwrap();
            tx.commit().await.unwrap();
        })
    };
    // It waits for the first transaction's turn on the ordering key.
    eventually("the second enqueue waits", async || {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        waiting > 0
    })
    .await;
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .build();
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "nothing committed yet"
    );
    first.commit().await.unwrap();
    timeout(BOUND, second).await.unwrap().unwrap();
    let done = sink.clone();
    drain(&relay, move || done.delivered().len() == 2).await;
    let order: Vec<Vec<u8>> = sink.seen().into_iter().map(|s| s.payload).collect();
    assert_eq!(order, [b"m1".to_vec(), b"m2".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_table_name_gets_a_channel_postgresql_accepts() {
    let Some(url) = backend_url(URL_VAR) else {
        return;
    };
    let pool = pool(&url, 4).await;
    let schema = format!("s{}", &fresh_key().to_hex()[..40]);
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
        .execute(&pool)
        .await
        .unwrap();
    let table = format!("{schema}.{}", "o".repeat(48));
    let outbox = Outbox::with_table(&table).unwrap();
    assert!(
        table.len() > 63 && outbox.channel().len() <= 63,
        "{}",
        outbox.channel()
    );
    outbox.migrate(&pool).await.unwrap();
    woken_by_notify(&pool, &outbox).await;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stops_when_its_handle_is_stopped_or_dropped() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    // A running relay listens on the outbox's channel; a stopped one no longer does.
    let listening = || {
        let (pool, channel) = (pool.clone(), outbox.channel().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN \"' || $1 || '\"'",
            )
            .bind(channel)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    for drop_it in [false, true] {
        let relay = Relay::builder(pool.clone(), outbox.clone())
            .sink("hook", Recorder::default())
            .build()
            .spawn();
        eventually("the relay listens", async || listening().await > 0).await;
        if drop_it {
            drop(relay);
        } else {
            timeout(BOUND, relay.stop()).await.unwrap();
        }
        eventually(
            &format!("the relay stops (dropped: {drop_it})"),
            async || listening().await == 0,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_is_read_and_reported_as_gauges() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let empty = outbox.backlog(&pool).await.unwrap();
    assert_eq!(
        (empty.pending, empty.dead, empty.oldest_pending),
        (0, 0, None)
    );
    let mut tx = pool.begin().await.unwrap();
    for payload in ["ok", "refuse", "poison"] {
        let message = Message::new("hook", payload).key(Key::new(payload).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    // Not due for an hour: pending all along.
    let later = Message::new("hook", "later")
        .key(Key::new("later").unwrap())
        .delay(Duration::from_secs(3600));
    outbox.enqueue(&mut tx, &later).await.unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (relay, recorded) = Recorded::capture(|| {
        Relay::builder(pool.clone(), outbox.clone())
            .sink("hook", Recorder::default())
            .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
            .reap_every(Duration::from_millis(10))
            .poll_interval(Duration::from_millis(20))
            .build()
    });
    let running = relay.spawn();
    // ok delivered, refuse dead, poison waiting for its retry, later not due.
    eventually("the gauges show the backlog", async || {
        let gauge = |name| recorded.gauge(name, &[]);
        (gauge(OUTBOX_PENDING), gauge(OUTBOX_DEAD)) == (2.0, 1.0)
    })
    .await;
    assert!(recorded.gauge(OUTBOX_OLDEST_PENDING_AGE, &[]) >= 0.05);
    timeout(BOUND, running.stop()).await.unwrap();
    let backlog = outbox.backlog(&pool).await.unwrap();
    assert_eq!((backlog.pending, backlog.dead), (2, 1));
    assert!(backlog.oldest_pending.unwrap() >= Duration::from_millis(50));
}

/// The row of message `id`: `(state, attempts, last_error)`.
async fn row(pool: &PgPool, outbox: &Outbox, id: i64) -> (String, i32, Option<String>) {
    sqlx::query_as(&format!(
        "SELECT state, attempts, last_error FROM \"{}\" WHERE id = $1",
        outbox.table()
    ))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

// Regression: a relay that died while delivering a message (SIGKILL, out of memory, an abort)
// rolled its attempt back with its transaction, so a message that killed every relay that
// delivered it was taken first again and again, forever, and the later messages with its
// ordering key waited behind it. Here the relay "dies" by having its batch dropped mid-delivery;
// the e2e test `a_message_that_kills_its_relay_is_dead_lettered_and_the_rest_flows` kills a
// relay process with SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_relay_dies_while_delivering_it_is_dead_lettered_after_max_attempts() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["hang", "after-1", "after-2"] {
        let message = Message::new("hook", payload)
            .key(Key::new(payload).unwrap())
            .ordering_key("account-1");
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_attempts(3)
        .build();
    for crash in 1..=3 {
        // The relay dies while it delivers `hang`.
        let batch = timeout(Duration::from_millis(500), relay.run_once()).await;
        assert!(batch.is_err(), "the batch hangs in the sink: {batch:?}");
        let (state, attempts, _) = row(&pool, &outbox, ids["hang"]).await;
        assert_eq!(
            (state.as_str(), attempts),
            ("pending", crash),
            "the attempt is counted although the relay died"
        );
        // The next relay does not take it at once (the dead relay took it a moment ago) and
        // takes nothing behind it on its ordering key.
        assert_eq!(relay.run_once().await.unwrap().taken, 0);
        // As if the hold (5 s) were over.
        sqlx::query(&format!(
            "UPDATE \"{}\" SET available_at = clock_timestamp() WHERE id = $1",
            outbox.table()
        ))
        .bind(ids["hang"])
        .execute(&pool)
        .await
        .unwrap();
    }
    let hangs = sink.seen().iter().filter(|s| s.key == "hang").count();
    assert_eq!(hangs, 3, "one delivery per attempt");
    // Three attempts, each one's relay died: dead-lettered without a fourth delivery.
    let batch = relay.run_once().await.unwrap();
    assert_eq!((batch.taken, batch.dead), (1, 1));
    let (state, attempts, error) = row(&pool, &outbox, ids["hang"]).await;
    assert_eq!((state.as_str(), attempts), ("dead", 3));
    let error = error.unwrap();
    assert!(
        error.starts_with("relay_crashed: a relay died while delivering it (attempt 3)"),
        "{error}"
    );
    let dead = outbox.dead_letters(&pool, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].last_error.as_deref(), Some(error.as_str()));
    // And the rest of its ordering key flows, in order.
    let done = sink.clone();
    drain(&relay, move || done.delivered().len() == 2).await;
    assert_eq!(sink.delivered(), [ids["after-1"], ids["after-2"]]);
    assert_eq!(
        sink.seen().iter().filter(|s| s.key == "hang").count(),
        3,
        "never delivered again"
    );
}

// Regression: `RelayBuilder::delivery_timeout(Duration::MAX)` panicked in every batch
// (`Duration::MAX * 2 + 5 s` overflowed), and a backoff of `Duration::MAX` could overflow the
// jitter. Every duration setting of the relay and the outbox now saturates: waits longer than
// the clock can express are "never", and what is written to the table is at most 365 days.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_max_in_every_relay_and_outbox_setting_does_not_panic() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["ok", "poison"] {
        let message = Message::new("hook", payload).key(Key::new(payload).unwrap());
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    let later = Message::new("hook", "later")
        .key(Key::new("later").unwrap())
        .delay(Duration::MAX);
    ids.insert("later", outbox.enqueue(&mut tx, &later).await.unwrap());
    tx.commit().await.unwrap();

    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .delivery_timeout(Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX)
        .poll_interval(Duration::MAX)
        .reap_every(Duration::MAX)
        .retain_delivered(Duration::MAX)
        .build();
    let batch = relay.run_once().await.unwrap();
    assert_eq!(
        (batch.taken, batch.delivered, batch.retried),
        (2, 1, 1),
        "`later` is not due"
    );
    // The retry waits between half of 365 days and 365 days; `later` 365 days.
    let waits: BTreeMap<i64, f64> = sqlx::query_as::<_, (i64, f64)>(&format!(
        "SELECT id, EXTRACT(EPOCH FROM available_at - clock_timestamp())::float8 / 86400 \
         FROM \"{}\" WHERE state = 'pending'",
        outbox.table()
    ))
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let poison = waits[&ids["poison"]];
    assert!((182.0..=365.0).contains(&poison), "{poison} days");
    let later = waits[&ids["later"]];
    assert!((364.9..=365.0).contains(&later), "{later} days");
    // Nothing is older than 365 days.
    assert_eq!(outbox.reap(&pool, Duration::MAX).await.unwrap(), 0);

    // Running: no poll (the NOTIFY wakes it), no reaping, no delivery timeout.
    let running = relay.spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut tx = pool.begin().await.unwrap();
    let woken = Message::new("hook", "woken").key(Key::new("woken").unwrap());
    outbox.enqueue(&mut tx, &woken).await.unwrap();
    tx.commit().await.unwrap();
    eventually("the NOTIFY woke the relay", async || {
        sink.delivered().len() == 2
    })
    .await;
    timeout(BOUND, running.stop()).await.unwrap();
    let backlog = outbox.backlog(&pool).await.unwrap();
    assert_eq!((backlog.pending, backlog.dead), (2, 0));
}

// Regression: a message with an ordering key enqueued on a connection in autocommit mode took
// its turn on the key (a transaction-scoped advisory lock) for its own statement only, so
// per-key commit order silently broke; now it is refused before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordering_key_outside_a_transaction_is_refused() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let ordered = |n: u32| {
        Message::new("hook", format!("m{n}"))
            .key(Key::new(format!("m{n}")).unwrap())
            .ordering_key("account-1")
    };
    let count = || {
        let (pool, table) = (pool.clone(), outbox.table().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM \"{table}\""))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // A plain pooled connection: autocommit.
    let mut connection = pool.acquire().await.unwrap();
    let refused = outbox.enqueue(&mut connection, &ordered(1)).await;
    assert!(
        matches!(refused, Err(OutboxError::NotInTransaction)),
        "{refused:?}"
    );
    assert_eq!(count().await, 0, "nothing written");
    // The connection is fine, and a message without an ordering key still commits at once.
    let unordered = Message::new("hook", "u").key(Key::new("u").unwrap());
    outbox.enqueue(&mut connection, &unordered).await.unwrap();
    assert_eq!(count().await, 1);
    // In a transaction: accepted, also one begun by hand.
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, &ordered(2)).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("BEGIN")
        .execute(&mut *connection)
        .await
        .unwrap();
    outbox.enqueue(&mut connection, &ordered(3)).await.unwrap();
    sqlx::query("COMMIT")
        .execute(&mut *connection)
        .await
        .unwrap();
    assert_eq!(count().await, 3);
    // In a transaction aborted by an earlier error: the statement's failure, not a refusal.
    let mut tx = pool.begin().await.unwrap();
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
    let failed = outbox.enqueue(&mut tx, &ordered(4)).await;
    assert!(matches!(failed, Err(OutboxError::Store(_))), "{failed:?}");
    tx.rollback().await.unwrap();
    assert_eq!(count().await, 3);
}

// A key with a backlog of thousands: only its oldest message is ever looked at, so the other
// keys and the messages without a key flow at full speed past it while it waits for a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_ordering_key_does_not_hold_back_the_other_messages() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (destination, message_key, payload, header_names, header_values, \
         ordering_key, available_at) \
         SELECT 'hook', 'hot-' || n, convert_to('poison ' || n, 'UTF8'), '{{}}', '{{}}', 'hot', \
         clock_timestamp() FROM generate_series(1, 5000) n",
        outbox.table()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    for n in 0..40 {
        let message = Message::new("hook", format!("keyed {n}"))
            .key(Key::new(format!("keyed-{n}")).unwrap())
            .ordering_key(format!("k-{n:02}"));
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    for n in 0..10 {
        let message =
            Message::new("hook", format!("free {n}")).key(Key::new(format!("free-{n}")).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .batch_size(16)
        .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .build();
    let mut batches = 0;
    while sink.delivered().len() < 50 {
        let batch = relay.run_once().await.unwrap();
        assert!(batch.taken > 0, "a batch took nothing with messages due");
        batches += 1;
        assert!(batches <= 5, "50 messages in batches of 16");
    }
    let hot: Vec<String> = sink
        .seen()
        .into_iter()
        .filter(|s| s.key.starts_with("hot-"))
        .map(|s| s.key)
        .collect();
    assert_eq!(hot, ["hot-1"], "only the hot key's oldest message, once");
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "the hot key waits"
    );
}

// Which keys a batch takes rotates: with more keys due than a batch holds, each gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_keys_take_turns() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    for key in ["a", "b", "c"] {
        for n in 1..=3 {
            let message = Message::new("hook", format!("{key}{n}"))
                .key(Key::new(format!("{key}{n}")).unwrap())
                .ordering_key(key);
            outbox.enqueue(&mut tx, &message).await.unwrap();
        }
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .batch_size(1)
        .build();
    for _ in 0..9 {
        assert_eq!(relay.run_once().await.unwrap().delivered, 1);
    }
    let order: Vec<String> = sink.seen().into_iter().map(|s| s.key).collect();
    assert_eq!(
        order,
        ["a1", "b1", "c1", "a2", "b2", "c2", "a3", "b3", "c3"]
    );
}
