//! The outbox relay's Kafka sink (`NOTIFY_URL=kafka://BROKERS/TOPIC`, the `relay` example)
//! through SIGKILLs: 300 notifications are enqueued (half with an ordering key) while two
//! relay processes deliver them to a private Kafka-protocol broker (nisshi); the relays are
//! SIGKILLed and started again five times, and the broker once. Then every notification is
//! on the topic at least once, with its key in the `idempotency-key` header, its ordering key
//! (else its key) as the record key and its payload as the value; the outbox has delivered
//! them all; copies (a relay killed after the broker acknowledged, before the outbox marked
//! it) are counted and printed.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use idempotent_core::Key;
use idempotent_postgres::outbox::{Outbox, Outgoing};
use idempotent_test_kit::brokers::PrivateKafka;
use idempotent_test_kit::postgres::Database;
use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Headers as _;
use support::ledger::{Consumer, Deadline, Rng};

const NOTES: usize = 300;
const TOPIC: &str = "notes";

/// Every record on the topic: (key, value, idempotency-key header).
fn read_topic(brokers: &str) -> Vec<(String, String, String)> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "relay-kafka-reader")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    let mut out = Vec::new();
    let mut quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(5) {
        if let Some(record) = consumer.poll(Duration::from_millis(200)) {
            let record = record.unwrap();
            let text =
                |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
            let id = record
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "idempotency-key"))
                .map(|h| text(h.value))
                .unwrap_or_default();
            out.push((text(record.key()), text(record.payload()), id));
            quiet = Instant::now();
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_sink_delivers_every_notification_through_relay_and_broker_kills() {
    let started = Instant::now();
    let Some(db) = Database::create(&format!("relay_kafka_{}", std::process::id())).await else {
        return;
    };
    let Some(mut kafka) = PrivateKafka::start().await else {
        return;
    };
    let pool = db.pool().await;
    let outbox = Outbox::new();
    outbox.migrate(&pool).await.unwrap();
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        rdkafka::ClientConfig::new()
            .set("bootstrap.servers", kafka.brokers())
            .create()
            .unwrap();
    let topic = rdkafka::admin::NewTopic::new(TOPIC, 3, rdkafka::admin::TopicReplication::Fixed(1));
    for result in admin
        .create_topics([&topic], &rdkafka::admin::AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.url.clone()),
        ("NOTIFY_URL", format!("{}/{TOPIC}", kafka.url())),
        ("RELAY_POLL", "200ms".into()),
        ("RELAY_BACKOFF", "100ms".into()),
        ("RELAY_MAX_ATTEMPTS", "1000".into()),
        ("RELAY_DELIVERY_TIMEOUT", "10s".into()),
    ];
    let mut relays = [
        Consumer::relay(&env, "relay-0").await,
        Consumer::relay(&env, "relay-1").await,
    ];
    let mut killed = Vec::new();
    // The notifications, ten every 100 ms; even ones with an ordering key.
    let enqueue = tokio::spawn({
        let pool = pool.clone();
        let outbox = outbox.clone();
        async move {
            let mut expected = BTreeMap::new();
            for n in 0..NOTES {
                let key = format!("note-{n}");
                let payload = format!("{{\"n\":{n}}}");
                let mut message =
                    Outgoing::new("notifications", payload.clone()).key(Key::new(&key).unwrap());
                let kafka_key = if n % 2 == 0 {
                    let ordering = format!("acct-{}", n % 7);
                    message = message.ordering_key(&ordering);
                    ordering
                } else {
                    key.clone()
                };
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut tx, &message).await.unwrap();
                tx.commit().await.unwrap();
                expected.insert(key, (kafka_key, payload));
                if n % 10 == 9 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            expected
        }
    });
    let mut rng = Rng::from_clock();
    eprintln!("relay kafka seed: {}", rng.0);
    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(300 + rng.below(400))).await;
        if round == 3 {
            kafka.kill().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            kafka.restart().await;
            eprintln!("relay kafka: broker killed and restarted in round {round}");
            continue;
        }
        let victim = rng.below(2) as usize;
        relays[victim].kill().await;
        let next = Consumer::relay(&env, format!("relay-{victim}-{round}")).await;
        killed.push(std::mem::replace(&mut relays[victim], next));
    }
    let expected = enqueue.await.unwrap();
    let deadline = Deadline::after(Duration::from_secs(90), "the outbox never emptied");
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotent_outbox WHERE state <> 'delivered'")
                .fetch_one(&pool)
                .await
                .unwrap();
        if left == 0 {
            break;
        }
        deadline.tick().await;
    }
    for relay in &mut relays {
        relay.stop().await;
    }
    let brokers = kafka.brokers();
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers))
        .await
        .unwrap();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (key, value, id) in &records {
        let Some((kafka_key, payload)) = expected.get(id) else {
            panic!("a record with an unknown idempotency key {id:?}: {key} {value}");
        };
        assert_eq!(key, kafka_key, "{id}'s record key");
        assert_eq!(value, payload, "{id}'s value");
        *seen.entry(id.clone()).or_default() += 1;
    }
    let missing: BTreeSet<&String> = expected.keys().filter(|k| !seen.contains_key(*k)).collect();
    assert!(missing.is_empty(), "never delivered: {missing:?}");
    let copies = records.len() - seen.len();
    eprintln!(
        "relay kafka: {NOTES} notifications delivered through {} relay kills and a broker kill; \
         {} records on the topic ({copies} copies); {:.1} s",
        killed.len(),
        records.len(),
        started.elapsed().as_secs_f64()
    );
    drop(pool);
    db.drop_database().await;
}
