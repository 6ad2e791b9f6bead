//! The Kafka source against a real Kafka-protocol broker (nisshi; its URL in
//! `IDEMPOTENT_TEST_KAFKA_URL`), each test on topics and a group of its own: one effect per key
//! over duplicates with dead letters for malformed records; a partition committed only up to
//! its lowest record not yet answered while later ones run concurrently; a transient failure
//! retried in its place, its key's later records waiting for it; a rejected record
//! dead-lettered on its `max_deliveries`-th delivery while its partition flows; and a record
//! that kills its consumer (a child process that aborts) dead-lettered, unhandled, after
//! `max_deliveries` crashes, counted on its record, in the claim mode (Redis store) and the
//! transactional mode (PostgreSQL).
//!
//! Longer than most test files: the broker helpers (produce, read the dead letters, read the
//! group's offsets) and the crashing child serve every test here and nowhere else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_consumer::kafka::Kafka;
use idempotent_consumer::{Consumer, Decode, Failure, Handler, Message, Report};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Defaults, Idempotency};
use idempotent_test_kit::backend::kafka_url;
use idempotent_test_kit::names::unique;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

/// The longest any test waits for the state it expects.
const PATIENCE: Duration = Duration::from_secs(60);

fn brokers() -> Option<String> {
    Some(kafka_url()?.trim_start_matches("kafka://").to_owned())
}

async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for result in results {
        result.unwrap_or_else(|(topic, code)| panic!("create topic {topic}: {code}"));
    }
}

fn producer(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap()
}

/// Produces one record to `partition`, with `id` as its `idempotency-key` header.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: Option<&str>,
    id: Option<&str>,
    value: &str,
) {
    let mut headers = OwnedHeaders::new();
    if let Some(id) = id {
        headers = headers.insert(Header {
            key: "idempotency-key",
            value: Some(id),
        });
    }
    let mut record: FutureRecord<'_, str, str> = FutureRecord::to(topic)
        .partition(partition)
        .payload(value)
        .headers(headers);
    if let Some(key) = key {
        record = record.key(key);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
}

/// A dead letter as the test reads it back.
#[derive(Debug)]
struct Dead {
    key: Option<String>,
    value: String,
    headers: HashMap<String, String>,
}

/// Every record on `topic` (all partitions, from the start), waiting until there are at least
/// `at_least`.
async fn read_all(brokers: &str, topic: &str, at_least: usize) -> Vec<Dead> {
    let brokers = brokers.to_owned();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", unique("reader"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[&topic]).unwrap();
        let mut out = Vec::new();
        let deadline = Instant::now() + PATIENCE;
        let mut quiet_since = Instant::now();
        while Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(record)) => {
                    let headers = record
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_owned(),
                                        String::from_utf8_lossy(h.value.unwrap_or_default())
                                            .into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(Dead {
                        key: record
                            .key()
                            .map(|k| String::from_utf8_lossy(k).into_owned()),
                        value: String::from_utf8_lossy(record.payload().unwrap_or_default())
                            .into_owned(),
                        headers,
                    });
                    quiet_since = Instant::now();
                }
                Some(Err(error)) => panic!("reading {topic}: {error}"),
                None => {
                    // A second of quiet after enough records: nothing more is coming.
                    if out.len() >= at_least && quiet_since.elapsed() > Duration::from_secs(1) {
                        break;
                    }
                }
            }
        }
        out
    })
    .await
    .unwrap()
}

/// The group's committed offset of each of `partitions` partitions (`-1`: none).
async fn committed(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let brokers = brokers.to_owned();
    let group = group.to_owned();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        for partition in 0..partitions {
            list.add_partition(&topic, partition);
        }
        let list = consumer
            .committed_offsets(list, Duration::from_secs(10))
            .unwrap();
        (0..partitions)
            .map(|p| match list.find_partition(&topic, p).unwrap().offset() {
                Offset::Offset(offset) => offset,
                _ => -1,
            })
            .collect()
    })
    .await
    .unwrap()
}

/// Waits until `check` holds, or fails saying `what`.
async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    mut check: impl FnMut() -> F,
) {
    let deadline = Instant::now() + PATIENCE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn source(brokers: &str, topic: &str, group: &str) -> Kafka {
    Kafka::builder(brokers, topic, group)
        .session_timeout(Duration::from_secs(6))
        .commit_every(Duration::from_millis(50))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Kafka at {brokers}: {e}"))
}

/// Decodes a record's value as `account:amount` text; anything else is malformed.
#[derive(Clone, Default)]
struct Recorder {
    /// Keys applied, in order.
    applied: Arc<Mutex<Vec<String>>>,
    /// Failures to return, by value: how many times each still fails, and how.
    fail: Arc<Mutex<HashMap<String, (u32, Failure)>>>,
    /// Values whose handler waits until it is let go.
    hold: Arc<Mutex<HashMap<String, Arc<tokio::sync::Notify>>>>,
    deliveries: Arc<Mutex<Vec<(String, u64)>>>,
}

impl Decode for Recorder {
    type Input = String;

    fn decode(&self, message: &Message) -> Result<String, Failure> {
        let text = std::str::from_utf8(message.body())
            .map_err(|_| Failure::Malformed("not UTF-8".into()))?;
        if !text.contains(':') {
            return Err(Failure::Malformed(format!("no colon in {text:?}")));
        }
        Ok(text.to_owned())
    }
}

impl Handler for Recorder {
    type Output = ();

    async fn handle(&self, input: &String, _claim: &ClaimHandle) -> Result<(), Failure> {
        let hold = self.hold.lock().unwrap().get(input).cloned();
        if let Some(hold) = hold {
            hold.notified().await;
        }
        let failure = {
            let mut fail = self.fail.lock().unwrap();
            match fail.get_mut(input) {
                Some((left, failure)) if *left > 0 => {
                    *left -= 1;
                    Some(failure.clone())
                }
                _ => None,
            }
        };
        if let Some(failure) = failure {
            return Err(failure);
        }
        self.applied.lock().unwrap().push(input.clone());
        Ok(())
    }
}

/// Runs a consumer of `topic` until `done` says so (checked every 100 ms), then drains it.
async fn consume_until(
    kafka: Kafka,
    recorder: Recorder,
    concurrency: usize,
    max_deliveries: u64,
    done: impl Fn(&Recorder) -> bool + Send + 'static,
) -> Report {
    let check = recorder.clone();
    let idempotency = Idempotency::new(MemoryStore::new());
    let deliveries = Arc::clone(&recorder.deliveries);
    let consumer = Consumer::new(kafka)
        .concurrency(concurrency)
        .max_deliveries(max_deliveries)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .on_outcome(move |message, _| {
            deliveries
                .lock()
                .unwrap()
                .push((message.position().to_owned(), message.deliveries()));
        });
    let deadline = Instant::now() + PATIENCE;
    consumer
        .run(idempotency, recorder, async move {
            while !done(&check) {
                assert!(
                    Instant::now() < deadline,
                    "the consumer did not finish in time"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_key_takes_effect_once_and_malformed_records_are_dead_lettered() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-once"), unique("group"));
    create_topic(&brokers, &topic, 3).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    // 60 keys over three partitions, each twice (the second copy on another partition), and
    // six malformed records.
    for n in 0..60 {
        let id = format!("id-{n}");
        let value = format!("acct-{}:{n}", n % 7);
        produce(&producer, &topic, n % 3, Some(&value), Some(&id), &value).await;
        produce(
            &producer,
            &topic,
            (n + 1) % 3,
            Some(&value),
            Some(&id),
            &value,
        )
        .await;
    }
    for n in 0..6 {
        produce(
            &producer,
            &topic,
            n % 3,
            None,
            Some(&format!("bad-{n}")),
            &format!("garbage {n}"),
        )
        .await;
    }
    let kafka = source(&brokers, &topic, &group).await;
    let report = consume_until(kafka, Recorder::default(), 8, 3, |r| {
        r.applied.lock().unwrap().len() >= 60
    })
    .await;
    assert_eq!(report.applied, 60, "{report:?}");
    // Every record answered and committed: 126 records, 42 per partition.
    eventually("the group's offsets at the end of each partition", || {
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        async move { committed(&brokers, &group, &topic, 3).await == vec![42, 42, 42] }
    })
    .await;
    let dead = read_all(&brokers, &format!("{topic}.dead"), 6).await;
    assert_eq!(dead.len(), 6, "{dead:?}");
    for letter in &dead {
        assert!(letter.value.starts_with("garbage "), "{letter:?}");
        assert!(letter.headers["reason"].contains("no colon"), "{letter:?}");
        assert_eq!(letter.headers["source-topic"], topic);
        assert!(letter.headers["idempotency-key"].starts_with("bad-"));
        assert!(letter.headers.contains_key("source-offset"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_is_committed_only_up_to_its_lowest_record_not_yet_answered() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-commit"), unique("group"));
    create_topic(&brokers, &topic, 1).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    // Ten records with keys of their own (so they run concurrently); the third waits.
    for n in 0..10 {
        let value = format!("k{n}:{n}");
        produce(
            &producer,
            &topic,
            0,
            Some(&value),
            Some(&format!("c-{n}")),
            &value,
        )
        .await;
    }
    let recorder = Recorder::default();
    let release = Arc::new(tokio::sync::Notify::new());
    recorder
        .hold
        .lock()
        .unwrap()
        .insert("k2:2".into(), Arc::clone(&release));
    let kafka = source(&brokers, &topic, &group).await;
    let applied = Arc::clone(&recorder.applied);
    let run = tokio::spawn(consume_until(kafka, recorder, 8, 3, |r| {
        r.applied.lock().unwrap().len() >= 10
    }));
    eventually("the nine records not held applied", || {
        let applied = Arc::clone(&applied);
        async move { applied.lock().unwrap().len() == 9 }
    })
    .await;
    // Nine answered, commits every 50 ms: the offset stays at the held record.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(committed(&brokers, &group, &topic, 1).await, vec![2]);
    release.notify_one();
    let report = run.await.unwrap();
    assert_eq!(report.applied, 10);
    eventually("the offset past the last record", || {
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        async move { committed(&brokers, &group, &topic, 1).await == vec![10] }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transient_failure_is_retried_in_its_place_and_its_key_waits() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-order"), unique("group"));
    create_topic(&brokers, &topic, 1).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    // Key `a`: three records in order; key `b`: one, after them.
    for (n, key) in ["a", "a", "a", "b"].iter().enumerate() {
        let value = format!("{key}:{n}");
        produce(
            &producer,
            &topic,
            0,
            Some(key),
            Some(&format!("o-{n}")),
            &value,
        )
        .await;
    }
    let recorder = Recorder::default();
    recorder
        .fail
        .lock()
        .unwrap()
        .insert("a:0".into(), (3, Failure::Transient("not yet".into())));
    let kafka = source(&brokers, &topic, &group).await;
    let applied = Arc::clone(&recorder.applied);
    let report = consume_until(kafka, recorder, 8, 3, |r| {
        r.applied.lock().unwrap().len() >= 4
    })
    .await;
    let applied = applied.lock().unwrap().clone();
    let of_a: Vec<&String> = applied.iter().filter(|v| v.starts_with("a:")).collect();
    assert_eq!(of_a, ["a:0", "a:1", "a:2"], "key a's order: {applied:?}");
    // `b` did not wait for `a`'s retries.
    assert_eq!(applied[0], "b:3", "{applied:?}");
    assert_eq!(report.retried, 3, "{report:?}");
    assert_eq!(report.applied, 4, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rejected_record_is_dead_lettered_on_its_last_delivery_and_the_partition_flows() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-reject"), unique("group"));
    create_topic(&brokers, &topic, 1).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    for n in 0..5 {
        let value = format!("r{n}:{n}");
        produce(&producer, &topic, 0, None, Some(&format!("r-{n}")), &value).await;
    }
    let recorder = Recorder::default();
    recorder.fail.lock().unwrap().insert(
        "r1:1".into(),
        (u32::MAX, Failure::Rejected("refused".into())),
    );
    let kafka = source(&brokers, &topic, &group).await;
    let deliveries = Arc::clone(&recorder.deliveries);
    let report = consume_until(kafka, recorder, 4, 3, move |r| {
        r.applied.lock().unwrap().len() >= 4
            && r.deliveries
                .lock()
                .unwrap()
                .iter()
                .any(|(p, d)| p == "0@1" && *d == 3)
    })
    .await;
    assert_eq!(report.applied, 4, "{report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(report.retried, 2, "{report:?}");
    let seen: Vec<u64> = deliveries
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "0@1")
        .map(|(_, d)| *d)
        .collect();
    assert_eq!(seen, [1, 2, 3]);
    eventually("the offset past the dead letter", || {
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        async move { committed(&brokers, &group, &topic, 1).await == vec![5] }
    })
    .await;
    let dead = read_all(&brokers, &format!("{topic}.dead"), 1).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].value, "r1:1");
    assert_eq!(dead[0].headers["reason"], "refused");
    assert_eq!(dead[0].headers["source-offset"], "1");
    assert_eq!(dead[0].key, None);
}

// ----- a record that kills its consumer -----

/// Applies `ok:N` records (appending them to `$APPLIED_FILE`) and aborts the process on
/// `poison`.
struct Crasher {
    applied: std::path::PathBuf,
}

impl Crasher {
    fn apply(&self, input: &str) {
        if input == "poison" {
            std::process::abort();
        }
        use std::io::Write as _;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.applied)
            .unwrap();
        writeln!(file, "{input}").unwrap();
    }
}

impl Decode for Crasher {
    type Input = String;

    fn decode(&self, message: &Message) -> Result<String, Failure> {
        Ok(String::from_utf8_lossy(message.body()).into_owned())
    }
}

impl Handler for Crasher {
    type Output = ();

    async fn handle(&self, input: &String, _claim: &ClaimHandle) -> Result<(), Failure> {
        self.apply(input);
        Ok(())
    }
}

impl idempotent_consumer::TxHandler for Crasher {
    type Output = ();

    async fn handle(
        &self,
        _tx: &mut sqlx::PgConnection,
        input: &String,
        _claim: &ClaimHandle,
    ) -> Result<(), Failure> {
        self.apply(input);
        Ok(())
    }
}

/// Not a test of its own: the consumer that [`a_record_that_kills_its_consumer`] runs as a
/// child process (this test binary, started again with `KAFKA_CRASH_CHILD` set to the mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Ok(mode) = std::env::var("KAFKA_CRASH_CHILD") else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap();
    // A crashed child's partition goes to the next one after a second.
    let kafka = Kafka::builder(var("BROKERS"), var("TOPIC"), var("GROUP"))
        .session_timeout(Duration::from_secs(1))
        .commit_every(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let crasher = Crasher {
        applied: var("APPLIED_FILE").into(),
    };
    // One at a time: the records before the poison are done before it runs.
    let consumer = Consumer::new(kafka)
        .concurrency(1)
        .max_deliveries(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let forever = std::future::pending::<()>();
    match mode.as_str() {
        "claim" => {
            let store = idempotent_redis::RedisStore::builder(var("REDIS_URL"))
                .key_prefix(var("PREFIX"))
                .connect()
                .await
                .unwrap();
            // A crash leaves the record in flight for a second.
            let idempotency = Idempotency::builder(store)
                .defaults(Defaults::new().lease(Duration::from_secs(1)))
                .build();
            consumer.run(idempotency, crasher, forever).await;
        }
        "tx" => {
            let pool = sqlx::PgPool::connect(&var("DATABASE_URL")).await.unwrap();
            let store = idempotent_postgres::PostgresStore::builder(pool.clone())
                .table(var("TABLE"))
                .build()
                .unwrap();
            store.migrate().await.unwrap();
            let transactional = idempotent_postgres::Transactional::new(&store);
            consumer
                .run_transactional(pool, transactional, crasher, forever)
                .await;
        }
        other => panic!("unknown mode {other}"),
    }
}

/// Starts consumers (child processes) one after another until one stays up: each of the
/// first three aborts on the poison record; the fourth finds it delivered three times without
/// an answer (counted on its record), dead-letters it unhandled, and applies the rest.
async fn a_record_that_kills_its_consumer(mode: &str, env: Vec<(&str, String)>) {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-poison"), unique("group"));
    create_topic(&brokers, &topic, 1).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    for (n, value) in ["ok:1", "poison", "ok:2", "ok:3"].iter().enumerate() {
        produce(&producer, &topic, 0, None, Some(&format!("p-{n}")), value).await;
    }
    let dir = std::env::temp_dir().join(unique("kafka-poison"));
    std::fs::create_dir_all(&dir).unwrap();
    let applied = dir.join("applied");
    let mut crashes = 0;
    let mut survivor = None;
    for _ in 0..6 {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env("KAFKA_CRASH_CHILD", mode)
            .env("BROKERS", &brokers)
            .env("TOPIC", &topic)
            .env("GROUP", &group)
            .env("APPLIED_FILE", &applied)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // Either it aborts, or it gets past the poison: the group's offset at the end.
        let deadline = Instant::now() + PATIENCE;
        let survived = loop {
            let tick = tokio::time::sleep(Duration::from_millis(500));
            tokio::select! {
                status = child.wait() => {
                    let status = status.unwrap();
                    use std::os::unix::process::ExitStatusExt as _;
                    assert_eq!(status.signal(), Some(6), "the child aborted: {status:?}");
                    break false;
                }
                () = tick => {
                    if committed(&brokers, &group, &topic, 1).await == vec![4] {
                        break true;
                    }
                    assert!(Instant::now() < deadline, "the child neither crashed nor finished");
                }
            }
        };
        if survived {
            survivor = Some(child);
            break;
        }
        crashes += 1;
    }
    let mut survivor = survivor.expect("a consumer outlived the poison");
    assert_eq!(crashes, 3, "max_deliveries (3) crashes, then a dead letter");
    survivor.kill().await.unwrap();
    let dead = read_all(&brokers, &format!("{topic}.dead"), 1).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].value, "poison");
    assert!(
        dead[0].headers["reason"].contains("3 of its deliveries ended without an answer"),
        "{:?}",
        dead[0].headers
    );
    let applied = std::fs::read_to_string(&applied).unwrap();
    let mut lines: Vec<&str> = applied.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["ok:1", "ok:2", "ok:3"], "each applied once");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_that_kills_its_consumer_is_dead_lettered_after_max_deliveries_claim_mode() {
    let Some(redis) = idempotent_test_kit::backend::redis_url() else {
        return;
    };
    a_record_that_kills_its_consumer(
        "claim",
        vec![
            ("REDIS_URL", redis),
            ("PREFIX", format!("{}:", unique("kafka-poison"))),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_that_kills_its_consumer_is_dead_lettered_after_max_deliveries_in_transactions() {
    let Some(url) = idempotent_test_kit::backend::postgres_url() else {
        return;
    };
    a_record_that_kills_its_consumer(
        "tx",
        vec![
            ("DATABASE_URL", url),
            ("TABLE", format!("records_{}", unique("kp"))),
        ],
    )
    .await;
}

/// A second consumer joins the group while the first has a record in hand: the first
/// finishes it before giving its partitions up, and commits it, so the record is applied once
/// and never delivered to the newcomer; the records produced afterwards are shared between
/// the two, each applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_finishes_the_records_in_hand_and_commits_them_before_giving_up() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-rebalance"), unique("group"));
    create_topic(&brokers, &topic, 2).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    let mut n = 0;
    let batch = |n: &mut i32| {
        let mut values = Vec::new();
        for _ in 0..10 {
            for partition in 0..2 {
                values.push((partition, format!("k{n}:{n}")));
                *n += 1;
            }
        }
        values
    };
    produce(&producer, &topic, 0, Some("held"), Some("held"), "held:0").await;
    for (partition, value) in batch(&mut n) {
        produce(
            &producer,
            &topic,
            partition,
            Some(&value),
            Some(&value),
            &value,
        )
        .await;
    }
    let recorder = Recorder::default();
    let release = Arc::new(tokio::sync::Notify::new());
    recorder
        .hold
        .lock()
        .unwrap()
        .insert("held:0".into(), Arc::clone(&release));
    let all = |r: &Recorder| r.applied.lock().unwrap().len() >= 41;
    let first = tokio::spawn(consume_until(
        source(&brokers, &topic, &group).await,
        recorder.clone(),
        8,
        3,
        all,
    ));
    let applied = Arc::clone(&recorder.applied);
    eventually(
        "the first consumer's records but the held one applied",
        || {
            let applied = Arc::clone(&applied);
            async move { applied.lock().unwrap().len() == 20 }
        },
    )
    .await;
    // The newcomer's join revokes the first consumer's partitions while it holds a record;
    // the record is let go four seconds later (the first consumer hears of the rebalance at
    // its next heartbeat, 1.2 s), inside the revocation's wait.
    let second = tokio::spawn(consume_until(
        source(&brokers, &topic, &group).await,
        recorder.clone(),
        8,
        3,
        all,
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;
    release.notify_one();
    for (partition, value) in batch(&mut n) {
        produce(
            &producer,
            &topic,
            partition,
            Some(&value),
            Some(&value),
            &value,
        )
        .await;
    }
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    let applied = applied.lock().unwrap().clone();
    let mut distinct = applied.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), applied.len(), "applied twice: {applied:?}");
    assert_eq!(applied.len(), 41);
    // Answered once, by the consumer that held it: not delivered again to anyone.
    let outcomes: Vec<(String, u64)> = recorder
        .deliveries
        .lock()
        .unwrap()
        .iter()
        .filter(|(position, _)| position == "0@0")
        .cloned()
        .collect();
    assert_eq!(
        outcomes.len(),
        1,
        "the held record's outcomes: {outcomes:?}"
    );
    assert!(
        second.applied > 0,
        "the newcomer took a partition: {first:?} {second:?}"
    );
    eventually("the offsets at the end of both partitions", || {
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        async move { committed(&brokers, &group, &topic, 2).await == vec![21, 20] }
    })
    .await;
}

/// Absurd settings are taken without a panic: a buffer of zero (one), commits every zero
/// seconds (every millisecond), a revocation wait of `Duration::MAX`, a session timeout of
/// `Duration::MAX` (librdkafka's largest); the consumer with the first three still consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn absurd_settings_are_bounded_not_panics() {
    let Some(brokers) = brokers() else { return };
    let (topic, group) = (unique("kafka-absurd"), unique("group"));
    create_topic(&brokers, &topic, 1).await;
    create_topic(&brokers, &format!("{topic}.dead"), 1).await;
    let producer = producer(&brokers);
    for n in 0..5 {
        let value = format!("a{n}:{n}");
        produce(&producer, &topic, 0, None, Some(&value), &value).await;
    }
    let huge = Kafka::builder(brokers.as_str(), topic.as_str(), unique("other"))
        .session_timeout(Duration::MAX)
        .connect()
        .await;
    drop(huge);
    let kafka = Kafka::builder(brokers.as_str(), topic.as_str(), group.as_str())
        .buffer(0)
        .commit_every(Duration::ZERO)
        .revoke_wait(Duration::MAX)
        .session_timeout(Duration::from_secs(6))
        .connect()
        .await
        .unwrap();
    let report = consume_until(kafka, Recorder::default(), 4, 3, |r| {
        r.applied.lock().unwrap().len() >= 5
    })
    .await;
    assert_eq!(report.applied, 5);
    eventually("the offset at the end", || {
        let (brokers, group, topic) = (brokers.clone(), group.clone(), topic.clone());
        async move { committed(&brokers, &group, &topic, 1).await == vec![5] }
    })
    .await;
}
