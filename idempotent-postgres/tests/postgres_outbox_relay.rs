//! The outbox's relay against a real PostgreSQL server (fixture: `support::outbox`): messages
//! are delivered at least once by relays sharing the work without ever delivering one message
//! twice at the same time, retried with backoff, dead-lettered (also when their relays die
//! delivering them, and then only the message that killed them, not its batch), woken by
//! NOTIFY; a sink that panics and a row that cannot be read fail
//! only their message; the Redis Streams sink; and a relay stops with its handle.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use idempotent_core::Key;
use idempotent_core::metrics::Recorded;
use idempotent_postgres::outbox::{
    DEFAULT_CONCURRENT_BATCHES, DEFAULT_MAX_BATCH_BYTES, OUTBOX_DELIVERIES, Outbox, Outgoing,
    Relay, RunningRelay, Sink,
};
use idempotent_test_kit::backend::{postgres_url, redis_url};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool_bounding_locks as pool;
use support::outbox::*;
use tokio::time::timeout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_with_backoff_then_dead_lettered_with_the_last_error() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["flaky", "poison", "refuse"] {
        let message = Outgoing::new("hook", payload).key(Key::new(payload).unwrap());
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
                    let message = Outgoing::new("hook", format!("{w}-{n}")).key(key);
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
    eventually("every message delivered", || async {
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

/// A batch is taken whole (the default batch, 256, takes 100 messages at once), but its sink
/// is called for at most `max_in_flight` of them at a time (default 64). The sink holds its
/// first `limit` calls until all of them have arrived, so the limit is reached exactly, and
/// notes the most calls under way at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_delivers_at_most_max_in_flight_at_once() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    for (messages, limit) in [(100, 64), (40, 4)] {
        enqueue_many(&pool, &outbox, &format!("in-flight-{limit}"), messages, 8).await;
        let sink = Gathering::new(limit);
        let builder = Relay::builder(pool.clone(), outbox.clone()).sink("hook", sink.clone());
        let relay = if limit == 64 {
            builder.build()
        } else {
            builder.max_in_flight(limit as u32).build()
        };
        let batch = timeout(BOUND, relay.run_once()).await.unwrap().unwrap();
        assert_eq!(
            (batch.taken, batch.delivered),
            (messages, messages),
            "one batch"
        );
        assert_eq!(sink.most.load(Ordering::SeqCst), limit);
    }
}

/// A sink that holds its first `first` calls until all of them have arrived, and keeps the
/// most calls it had under way at once.
#[derive(Clone)]
struct Gathering {
    first: usize,
    arrived: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    all_here: std::sync::Arc<tokio::sync::Barrier>,
    now: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Gathering {
    fn new(first: usize) -> Self {
        Gathering {
            first,
            arrived: Default::default(),
            all_here: std::sync::Arc::new(tokio::sync::Barrier::new(first)),
            now: Default::default(),
            most: Default::default(),
        }
    }
}

impl idempotent_postgres::outbox::Sink for Gathering {
    fn deliver<'a>(
        &'a self,
        _: &'a idempotent_postgres::outbox::Relayed,
    ) -> idempotent_postgres::outbox::BoxFuture<
        'a,
        Result<(), idempotent_postgres::outbox::SinkError>,
    > {
        Box::pin(async move {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            if self.arrived.fetch_add(1, Ordering::SeqCst) < self.first {
                self.all_here.wait().await;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

/// A relay whose batches the byte budget cuts short takes the next batch at once, without
/// waiting for a poll or a notification: with neither (`poll_interval(Duration::MAX)`, the
/// messages enqueued before it starts), ten messages in batches of two all go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cut_short_by_bytes_is_followed_at_once() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "cut", 10, 1000).await;
    let sink = Recorder::default();
    let running = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_batch_bytes(2_500)
        .poll_interval(Duration::MAX)
        .build()
        .spawn();
    delivered_all(&sink, 10).await;
    timeout(BOUND, running.stop()).await.unwrap();
}

/// A message dead-lettered by the take (its relays died delivering it, `max_attempts` times)
/// counts no bytes and does not stand in for the batch's first message: the batch still takes
/// the oldest message to deliver, however large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_takes_a_message_to_deliver_beside_one_it_dead_letters() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for (key, size) in [("crashed", 10), ("large", 2_000)] {
        let message = Outgoing::new("hook", "x".repeat(size)).key(Key::new(key).unwrap());
        ids.push(outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    // As a relay that died delivering it alone, on its last attempt, leaves it.
    as_if_crashed(&pool, &outbox, &ids[..1], 3, true).await;
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_attempts(3)
        .max_batch_bytes(1_000)
        .build();
    let batch = relay.run_once().await.unwrap();
    assert_eq!((batch.taken, batch.dead, batch.delivered), (2, 1, 1));
    assert_eq!(sink.delivered(), [ids[1]]);
}

/// A batch delivered in turns keeps its transaction (and its locks) for all of them: its
/// idle-transaction timeout counts one delivery timeout per turn. Ten deliveries one at a time,
/// each just under the 1 s timeout, keep the transaction idle about 9 s, longer than twice the
/// timeout plus 5 s (what a batch of one turn gets): the batch still commits, and nothing is
/// delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_in_turns_keeps_its_transaction_for_all_of_them() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "turns", 10, 8).await;
    let sink = Recorder {
        hold: Duration::from_millis(900),
        ..Recorder::default()
    };
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_in_flight(1)
        .delivery_timeout(Duration::from_secs(1))
        .build();
    let batch = timeout(Duration::from_secs(60), relay.run_once())
        .await
        .unwrap()
        .expect("the batch commits after ten turns");
    assert_eq!((batch.taken, batch.delivered), (10, 10));
    assert_eq!(sink.most_in_flight.load(Ordering::SeqCst), 1);
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "all recorded as delivered"
    );
    assert_eq!(sink.delivered().len(), 10);
}

/// A batch takes the oldest messages whose payloads add up to at most `max_batch_bytes`, and
/// always its first message, however large; the ones left out go with the next batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_takes_at_most_max_batch_bytes_of_payloads() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "bytes", 10, 1000).await;
    let sink = Recorder::default();
    let relay = |bytes: u64| {
        Relay::builder(pool.clone(), outbox.clone())
            .sink("hook", sink.clone())
            .max_batch_bytes(bytes)
            .build()
    };
    let three = relay(3_000).run_once().await.unwrap();
    assert_eq!(
        (three.taken, three.delivered),
        (3, 3),
        "3 × 1,000 bytes fit in 3,000"
    );
    let two = relay(2_999).run_once().await.unwrap();
    assert_eq!(two.taken, 2, "a third does not fit in 2,999");
    let one = relay(10).run_once().await.unwrap();
    assert_eq!(one.taken, 1, "the first message, however large");
    let rest = relay(DEFAULT_MAX_BATCH_BYTES).run_once().await.unwrap();
    assert_eq!(rest.taken, 4);
    let delivered: HashSet<i64> = sink.delivered().into_iter().collect();
    assert_eq!(delivered.len(), 10, "each once");
    let seen: Vec<String> = sink
        .seen()
        .iter()
        .map(|s| String::from_utf8(s.payload.clone()).unwrap())
        .collect();
    assert_eq!(seen.len(), 10);
    assert!(seen.iter().all(|p| p.len() == 1000), "whole payloads");
    // Batches take the oldest first: every message of a batch is older than the next's.
    let batches = [&seen[0..3], &seen[3..5], &seen[5..6], &seen[6..10]];
    for pair in batches.windows(2) {
        assert!(pair[0].iter().max() < pair[1].iter().min(), "{:?}", batches);
    }
}

/// `count` messages for the sink "hook", keys `{prefix}-{n}`, payloads `n` padded with zeros
/// to `bytes` bytes (so they sort in the order they were enqueued), in one transaction.
async fn enqueue_many(
    pool: &sqlx::PgPool,
    outbox: &idempotent_postgres::outbox::Outbox,
    prefix: &str,
    count: usize,
    bytes: usize,
) {
    let mut tx = pool.begin().await.unwrap();
    for n in 0..count {
        let message = Outgoing::new("hook", format!("{n:0>bytes$}"))
            .key(Key::new(format!("{prefix}-{n}")).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_wakes_the_relay_before_its_poll_interval() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    woken_by_notify(&pool, &outbox).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_streams_sink_adds_each_message_with_its_key() {
    use idempotent_postgres::outbox::RedisStreamSink;

    let Some(url) = postgres_url() else {
        return;
    };
    let Some(redis_url) = redis_url() else {
        return;
    };
    let pool = pool(&url, 4).await;
    let outbox = outbox(&pool).await;
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let connection = redis::aio::ConnectionManager::new(client).await.unwrap();
    let stream = unique("outbox-test");
    let mut tx = pool.begin().await.unwrap();
    for n in 0..3 {
        let message = Outgoing::new("events", format!("event {n}"))
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
        let message = Outgoing::new("hook", payload)
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
        eventually("the relay listens", || async { listening().await > 0 }).await;
        if drop_it {
            drop(relay);
        } else {
            timeout(BOUND, relay.stop()).await.unwrap();
        }
        eventually(&format!("the relay stops (dropped: {drop_it})"), || async {
            listening().await == 0
        })
        .await;
    }
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
        let message = Outgoing::new("hook", payload)
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

// Regression (issue 39, item 12): the batch statement counted an attempt for every message of
// a batch, so a relay dying while it delivered one message charged the whole batch, and the
// innocent messages taken with it were dead-lettered with it once their relays had died
// `max_attempts` times. Now each message of a crashed batch is taken again alone, and only a
// crash during a delivery made alone can be a message's last attempt: with `max_attempts(1)`
// the messages of a crashed batch of five are all tried again, one at a time; the four
// innocent ones are delivered, and the one that kills its relay is dead-lettered after its
// second crash, the first one alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_mid_batch_charges_only_the_message_that_killed_it() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["ok-0", "ok-1", "hang", "ok-2", "ok-3"] {
        let message = Outgoing::new("hook", payload).key(Key::new(payload).unwrap());
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .max_attempts(1)
        .build();
    let due_now = format!(
        "UPDATE \"{}\" SET available_at = clock_timestamp() WHERE state = 'pending'",
        outbox.table()
    );
    // The relay dies while it delivers its batch of five (`hang` never answers).
    let batch = timeout(Duration::from_millis(500), relay.run_once()).await;
    assert!(batch.is_err(), "the batch hangs in the sink: {batch:?}");
    assert_eq!(
        sink.seen().len(),
        5,
        "the whole batch was handed to the sink"
    );
    for (payload, id) in &ids {
        let (state, attempts, _) = row(&pool, &outbox, *id).await;
        assert_eq!((state.as_str(), attempts), ("pending", 1), "{payload}");
    }
    // As if the hold (5 s) were over: each is taken again alone, and only `hang` kills its
    // relay again.
    sqlx::query(&due_now).execute(&pool).await.unwrap();
    let mut crashes = 1;
    let mut alone = 0;
    let mut dead = 0;
    loop {
        match timeout(Duration::from_millis(500), relay.run_once()).await {
            Err(_) => {
                crashes += 1;
                assert!(crashes <= 2, "delivered again after its last attempt");
                sqlx::query(&due_now).execute(&pool).await.unwrap();
            }
            Ok(batch) => {
                let batch = batch.unwrap();
                if batch.taken == 0 {
                    break;
                }
                // Beside it, only the messages dead-lettered without a delivery.
                assert_eq!(
                    batch.taken - batch.dead,
                    1,
                    "a message of a crashed batch is taken alone: {batch:?}"
                );
                alone += 1;
                dead += batch.dead;
            }
        }
    }
    assert_eq!(crashes, 2);
    // Four innocent ones delivered, and `hang` dead-lettered by the batch statement.
    assert_eq!((alone, dead), (4, 1));
    let mut delivered = sink.delivered();
    delivered.sort_unstable();
    let mut innocent: Vec<i64> = ["ok-0", "ok-1", "ok-2", "ok-3"]
        .iter()
        .map(|p| ids[p])
        .collect();
    innocent.sort_unstable();
    // At least once: the sink had taken each in the crashed batch already, and takes it once
    // more alone (the receiver deduplicates on the key).
    let twice: Vec<i64> = innocent.iter().flat_map(|id| [*id, *id]).collect();
    assert_eq!(
        delivered, twice,
        "each innocent message delivered once more, alone"
    );
    for payload in ["ok-0", "ok-1", "ok-2", "ok-3"] {
        let (state, attempts, _) = row(&pool, &outbox, ids[payload]).await;
        assert_eq!((state.as_str(), attempts), ("delivered", 2), "{payload}");
    }
    let (state, attempts, error) = row(&pool, &outbox, ids["hang"]).await;
    assert_eq!((state.as_str(), attempts), ("dead", 2));
    let error = error.unwrap();
    assert!(
        error.starts_with("relay_crashed: a relay died while delivering it (attempt 2)"),
        "{error}"
    );
    assert_eq!(
        sink.seen().iter().filter(|s| s.key == "hang").count(),
        2,
        "once in the batch, once alone"
    );
    let dead = outbox.dead_letters(&pool, 10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
}

/// Through a backlog, a relay takes its next batch while the last delivers (two batches of
/// four under way: more than four deliveries at once), and with `concurrent_batches(1)` one
/// batch at a time (never more than its four).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_takes_its_next_batch_while_the_last_delivers() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    for (batches, overlapping) in [(2, true), (1, false)] {
        enqueue_many(&pool, &outbox, &format!("lanes-{batches}"), 48, 8).await;
        let sink = Recorder {
            hold: Duration::from_millis(30),
            ..Recorder::default()
        };
        let relay = fours(&pool, &outbox, sink.clone(), batches);
        delivered_all(&sink, 48).await;
        relay.stop().await;
        let most = sink.most_in_flight.load(Ordering::SeqCst);
        assert_eq!(most > 4, overlapping, "most deliveries at once: {most}");
        assert!(
            !sink.overlapped.load(Ordering::SeqCst),
            "one message twice at once"
        );
    }
}

/// A message taken again after its relay died (a suspect) is delivered only while no other
/// batch of the relay is under way, and only such a delivery counts as made alone: a relay
/// with two batches at once works through a backlog with six suspects in it, and its sink
/// reads each message's `delivering_alone` as it is handed over. Every delivery marked alone
/// ran with no other delivery of the relay beside it, each suspect's was marked alone, and
/// the batches did overlap (more than one batch's four deliveries at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_is_delivered_only_while_no_other_batch_of_its_relay_is_under_way() {
    let Some((pool, outbox)) = setup(6).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "suspects", 120, 8).await;
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT id FROM \"{}\" ORDER BY id",
        outbox.table()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let suspects: Vec<i64> = [10, 30, 50, 70, 90, 110].iter().map(|n| ids[*n]).collect();
    // As a relay that died delivering them in a batch of several leaves them, due now.
    as_if_crashed(&pool, &outbox, &suspects, 1, false).await;
    // Its reads on a pool of their own, so as not to take the relay's spare connection.
    let sink = Watching {
        pool: idempotent_test_kit::postgres::pool_bounding_locks(&postgres_url().unwrap(), 8).await,
        table: outbox.table().to_owned(),
        state: Default::default(),
    };
    let relay = fours(&pool, &outbox, sink.clone(), 2);
    let done = sink.clone();
    eventually("the backlog delivered", || {
        let done = done.clone();
        async move { done.state.lock().unwrap().delivered.len() == 120 }
    })
    .await;
    relay.stop().await;
    let state = sink.state.lock().unwrap();
    assert!(state.violations.is_empty(), "{:?}", state.violations);
    for id in &suspects {
        assert!(state.alone.contains(id), "suspect {id} not delivered alone");
    }
    assert!(
        state.most > 4,
        "the batches never overlapped: {}",
        state.most
    );
}

/// A sink that reads each message's `delivering_alone` as it is handed over and notes every
/// delivery marked alone that had another of the relay's deliveries beside it.
#[derive(Clone)]
struct Watching {
    pool: sqlx::PgPool,
    table: String,
    state: std::sync::Arc<std::sync::Mutex<WatchingState>>,
}

#[derive(Default)]
struct WatchingState {
    in_flight: usize,
    alone_under_way: bool,
    most: usize,
    alone: HashSet<i64>,
    delivered: HashSet<i64>,
    violations: Vec<String>,
}

impl Sink for Watching {
    fn deliver<'a>(
        &'a self,
        message: &'a idempotent_postgres::outbox::Relayed,
    ) -> idempotent_postgres::outbox::BoxFuture<
        'a,
        Result<(), idempotent_postgres::outbox::SinkError>,
    > {
        Box::pin(async move {
            // Counted under way from the moment it is handed over, its read included.
            {
                let mut state = self.state.lock().unwrap();
                state.in_flight += 1;
                state.most = state.most.max(state.in_flight);
            }
            let alone: Option<bool> = sqlx::query_scalar(&format!(
                "SELECT delivering_alone FROM \"{}\" WHERE id = $1",
                self.table
            ))
            .bind(message.id)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            let alone = alone == Some(true);
            {
                let mut state = self.state.lock().unwrap();
                if state.alone_under_way || (alone && state.in_flight > 1) {
                    state.violations.push(format!(
                        "message {} (alone: {alone}) beside another delivery",
                        message.id
                    ));
                }
                if alone {
                    state.alone_under_way = true;
                    state.alone.insert(message.id);
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            let mut state = self.state.lock().unwrap();
            state.in_flight -= 1;
            if alone {
                state.alone_under_way = false;
            }
            state.delivered.insert(message.id);
            Ok(())
        })
    }
}

/// On a pool of two (the listener's connection and the batch's), a relay with two batches at
/// once has no connection to spare for the second: it does not wait for one it cannot have
/// (no hang, no batch failing for want of a connection), and delivers everything one batch at
/// a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_a_pool_of_two_delivers_one_batch_at_a_time() {
    let Some((pool, outbox)) = setup(2).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "pool-of-two", 40, 8).await;
    let sink = Recorder {
        hold: Duration::from_millis(5),
        ..Recorder::default()
    };
    let relay = fours(&pool, &outbox, sink.clone(), DEFAULT_CONCURRENT_BATCHES);
    delivered_all(&sink, 40).await;
    relay.stop().await;
    assert!(sink.most_in_flight.load(Ordering::SeqCst) <= 4);
}

/// Stopped while two batches are under way, a relay finishes both before `stop` returns:
/// every message handed to the sink is recorded delivered, none is left mid-delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_mid_backlog_finishes_every_batch_in_hand() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    enqueue_many(&pool, &outbox, "stop-lanes", 200, 8).await;
    let sink = Recorder {
        hold: Duration::from_millis(50),
        ..Recorder::default()
    };
    let relay = fours(&pool, &outbox, sink.clone(), DEFAULT_CONCURRENT_BATCHES);
    let watched = sink.clone();
    eventually("two batches under way", || {
        let watched = watched.clone();
        async move { watched.in_flight.lock().unwrap().len() > 4 }
    })
    .await;
    timeout(BOUND, relay.stop()).await.unwrap();
    let (delivered, mid_delivery): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE state = 'delivered'), \
         count(*) FILTER (WHERE delivering_since IS NOT NULL) FROM \"{}\"",
        outbox.table()
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(mid_delivery, 0, "a batch left mid-delivery");
    assert_eq!(delivered as usize, sink.delivered().len());
    assert!(delivered < 200, "stopped before the end of the backlog");
}

/// A suspect at the head of an ordering key is found within the first pass over the keys
/// through a backlog that lasts: a batch beside others that leaves it (or that comes back
/// empty because all it locked were suspects) has the next batch, alone, start its search where
/// it did. 60 ordering keys with three messages each, batches of four heads, two batches at
/// once; key 30's head is a suspect, then the heads of keys 30 to 33 (a whole batch of them).
/// Each is delivered before two thirds of the backlog are, and its key's messages in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_on_an_ordering_key_is_found_within_a_pass_over_the_keys() {
    let Some((pool, _)) = setup(6).await else {
        return;
    };
    for suspect_keys in [30..31, 30..34] {
        let outbox = outbox(&pool).await;
        let mut tx = pool.begin().await.unwrap();
        let mut suspects = Vec::new();
        let mut followers: HashMap<usize, Vec<i64>> = HashMap::new();
        for round in 0..3 {
            for key in 0..60 {
                let message = Outgoing::new("hook", format!("{round}"))
                    .key(Key::new(format!("ordered-{key}-{round}")).unwrap())
                    .ordering_key(format!("k-{key:02}"));
                let id = outbox.enqueue(&mut tx, &message).await.unwrap();
                if suspect_keys.contains(&key) {
                    match round {
                        0 => suspects.push((key, id)),
                        _ => followers.entry(key).or_default().push(id),
                    }
                }
            }
        }
        tx.commit().await.unwrap();
        let ids: Vec<i64> = suspects.iter().map(|(_, id)| *id).collect();
        as_if_crashed(&pool, &outbox, &ids, 1, false).await;
        let sink = Recorder {
            hold: Duration::from_millis(3),
            ..Recorder::default()
        };
        let relay = fours(&pool, &outbox, sink.clone(), 2);
        delivered_all(&sink, 180).await;
        relay.stop().await;
        let delivered = sink.delivered();
        let at = |id: i64| delivered.iter().position(|d| *d == id).unwrap();
        for (key, suspect) in &suspects {
            assert!(
                at(*suspect) < 120,
                "the suspect of key {key} waited for the backlog: delivered {}th of 180",
                at(*suspect) + 1
            );
            let next = &followers[key];
            assert!(at(*suspect) < at(next[0]) && at(next[0]) < at(next[1]));
        }
    }
}

/// A relay over `outbox` into `sink` ("hook") in batches of four, four deliveries at once
/// each, `batches` batches at once, running.
fn fours<S: Sink>(pool: &sqlx::PgPool, outbox: &Outbox, sink: S, batches: u32) -> RunningRelay {
    Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink)
        .batch_size(4)
        .max_in_flight(4)
        .concurrent_batches(batches)
        .build()
        .spawn()
}
