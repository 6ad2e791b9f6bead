//! The RabbitMQ source against a real RabbitMQ node (`IDEMPOTENT_TEST_AMQP_URL`, started by
//! `scripts/test.sh`): duplicates applied once, malformed messages dead-lettered unchanged,
//! the delivery count bounding rejected messages, delayed retries, reconnection after the
//! broker closes the consumer's connection, queues a publisher declared first, and dead
//! letters over `max_message_size` (fitted to the source's setting; sent without the body
//! after a private node with a lower real limit, 8 KiB, refused one).
//!
//! The reconnection test closes the connection with `rabbitmqctl close_connection`, through the
//! test kit's `shared_rabbitmqctl` (`IDEMPOTENT_TEST_RABBITMQCTL`).
//!
//! Longer than most test files: the broker-side helpers (publishing with confirms, queue
//! counts, `rabbitmqctl`) serve every test here and nowhere else.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_consumer::rabbitmq::RabbitMq;
use idempotent_consumer::{
    Consumer, DeadLettered, Decode, Failure, Handler, Message, Received, Report, Source,
    SourceError,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Idempotency};
use idempotent_test_kit::backend::amqp_url;
use idempotent_test_kit::brokers::{PrivateRabbit, shared_rabbitmqctl};
use idempotent_test_kit::names::unique;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

fn quorum() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    arguments
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// The test's own connection: publishes with confirms, inspects and deletes queues.
struct Broker {
    _connection: Connection,
    channel: Channel,
}

impl Broker {
    async fn connect(url: &str) -> Broker {
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let connection = Connection::connect(url, properties)
            .await
            .unwrap_or_else(|e| {
                panic!("cannot connect to {url}: {e}; is rabbitmq-server running?")
            });
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Broker {
            _connection: connection,
            channel,
        }
    }

    /// Publishes each `(id, body)` to `queue`, persistent, and waits for every confirm.
    async fn publish(&self, queue: &str, messages: &[(String, Vec<u8>)]) {
        let mut confirms = Vec::new();
        for (id, body) in messages {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_content_type("text/plain".into())
                .with_delivery_mode(2)
                .with_headers({
                    let mut headers = FieldTable::default();
                    headers.insert("origin".into(), AMQPValue::LongString("test".into()));
                    headers
                });
            confirms.push(
                self.channel
                    .basic_publish("", queue, BasicPublishOptions::default(), body, properties)
                    .await
                    .unwrap(),
            );
        }
        for confirm in confirms {
            assert_eq!(confirm.await.unwrap(), Confirmation::Ack(None));
        }
    }

    /// Publishes one message to `queue`, persistent, with the headers `origin: test` and
    /// `extra` (`extra` bytes of `x`), and waits for its confirm.
    async fn publish_with_extra(&self, queue: &str, id: &str, body: &[u8], extra: usize) {
        let mut headers = FieldTable::default();
        headers.insert("origin".into(), AMQPValue::LongString("test".into()));
        headers.insert(
            "extra".into(),
            AMQPValue::LongString("x".repeat(extra).into()),
        );
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type("text/plain".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = self
            .channel
            .basic_publish("", queue, BasicPublishOptions::default(), body, properties)
            .await
            .unwrap();
        assert_eq!(confirm.await.unwrap(), Confirmation::Ack(None));
    }

    /// `(ready messages, consumers)` of `queue`.
    async fn counts(&self, queue: &str) -> (u32, u32) {
        let declared = self
            .channel
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        (declared.message_count(), declared.consumer_count())
    }

    /// Every message on `queue`, taken off it.
    async fn take_all(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        let mut taken = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue, BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            taken.push(message);
        }
        taken
    }

    /// Declares each of `queues` as the source does (durable, quorum).
    async fn queue_declare_quorum(&self, queues: &[&str]) {
        for queue in queues {
            self.channel
                .queue_declare(queue, durable(), quorum())
                .await
                .unwrap();
        }
    }

    async fn delete(&self, queues: &[&str]) {
        for queue in queues {
            let _ = self
                .channel
                .queue_delete(queue, QueueDeleteOptions::default())
                .await;
        }
    }
}

/// Waits until `done` holds, at most `within`.
async fn eventually<F: Future<Output = bool>>(
    within: Duration,
    what: &str,
    done: impl FnMut() -> F,
) {
    idempotent_test_kit::process::eventually(what, within, done).await;
}

/// An attempt to handle a message: the delivery count it came with, and when it began.
type Attempt = (u64, Instant);

/// What the handler does with a message, by its id and the attempt (1, 2, …).
type Behaviour = fn(&str, usize) -> Result<(), Failure>;

/// A handler whose bodies must read `ok:…`; it records every attempt and counts effects.
#[derive(Clone)]
struct Counting {
    /// Effects applied, by message id.
    effects: Arc<Mutex<HashMap<String, u32>>>,
    /// Each attempt: the delivery count it came with, and when.
    attempts: Arc<Mutex<HashMap<String, Vec<Attempt>>>>,
    behaviour: Behaviour,
    work: Duration,
    /// The highest delivery count each id was received with (duplicates included).
    received: Arc<Mutex<HashMap<String, u64>>>,
    /// Holds attempts back, for the reconnection test.
    gate: Arc<Mutex<Gate>>,
}

/// Once `from` ids are applied and until `open`, the first `stall` attempts wait (each with
/// its message in hand) and the others take `slow` each.
struct Gate {
    from: usize,
    stall: usize,
    stalled: usize,
    /// Attempts waiting now.
    waiting: usize,
    slow: Duration,
    open: bool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            from: 0,
            stall: 0,
            stalled: 0,
            waiting: 0,
            slow: Duration::ZERO,
            open: true,
        }
    }
}

impl Counting {
    fn new(behaviour: Behaviour, work: Duration) -> Self {
        Counting {
            effects: Arc::default(),
            attempts: Arc::default(),
            received: Arc::default(),
            behaviour,
            work,
            gate: Arc::default(),
        }
    }

    fn applied(&self) -> usize {
        self.effects.lock().unwrap().len()
    }

    fn attempts(&self, id: &str) -> Vec<Attempt> {
        self.attempts
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .unwrap_or_default()
    }
}

struct Input {
    id: String,
    deliveries: u64,
}

impl Decode for Counting {
    type Input = Input;

    fn decode(&self, message: &Message) -> Result<Input, Failure> {
        let id = message.id().unwrap_or_default().to_owned();
        let mut received = self.received.lock().unwrap();
        let highest = received.entry(id.clone()).or_default();
        *highest = (*highest).max(message.deliveries());
        drop(received);
        let body = std::str::from_utf8(message.body())
            .map_err(|_| Failure::Malformed("the body is not UTF-8".into()))?;
        if !body.starts_with("ok:") {
            return Err(Failure::Malformed(
                "the body does not start with ok:".into(),
            ));
        }
        Ok(Input {
            id,
            deliveries: message.deliveries(),
        })
    }
}

impl Handler for Counting {
    type Output = ();

    async fn handle(&self, input: &Input, _claim: &ClaimHandle) -> Result<(), Failure> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let list = attempts.entry(input.id.clone()).or_default();
            list.push((input.deliveries, Instant::now()));
            list.len()
        };
        let applied = self.applied();
        let held = {
            let mut gate = self.gate.lock().unwrap();
            if gate.open || applied < gate.from {
                None
            } else if gate.stalled < gate.stall {
                gate.stalled += 1;
                gate.waiting += 1;
                Some(None)
            } else {
                Some(Some(gate.slow))
            }
        };
        match held {
            None => tokio::time::sleep(self.work).await,
            Some(Some(slow)) => tokio::time::sleep(slow).await,
            Some(None) => {
                while !self.gate.lock().unwrap().open {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                self.gate.lock().unwrap().waiting -= 1;
            }
        }
        (self.behaviour)(&input.id, attempt)?;
        *self
            .effects
            .lock()
            .unwrap()
            .entry(input.id.clone())
            .or_default() += 1;
        Ok(())
    }
}

fn always_ok(_: &str, _: usize) -> Result<(), Failure> {
    Ok(())
}

/// A consumer of `queue` running `handler` on a task; send on the sender to stop it.
fn start<S: Source>(
    consumer: Consumer<S>,
    handler: Counting,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Report>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run =
        tokio::spawn(
            consumer.run(Idempotency::new(MemoryStore::new()), handler, async move {
                let _ = stopped.await;
            }),
        );
    (stop, run)
}

/// A source that counts the messages it answered for good: acknowledged or dead-lettered.
struct Answered<S> {
    source: S,
    answered: Arc<AtomicUsize>,
}

impl<S: Source> Source for Answered<S> {
    type Delivery = S::Delivery;

    fn name(&self) -> &'static str {
        self.source.name()
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<S::Delivery>>, SourceError> {
        self.source.receive(max).await
    }

    async fn ack(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.source.ack(delivery).await?;
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn retry(&self, delivery: &S::Delivery, delay: Duration) -> Result<(), SourceError> {
        self.source.retry(delivery, delay).await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &S::Delivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        let written = self.source.dead_letter(message, delivery, reason).await?;
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(written)
    }
}

async fn source(url: &str, queue: &str) -> RabbitMq {
    RabbitMq::builder(url, queue)
        .prefetch(32)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot start the RabbitMQ source: {e}"))
}

fn header(message: &lapin::message::BasicGetMessage, name: &str) -> Option<String> {
    let headers = message.delivery.properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        other => panic!("header {name} is {other:?}, not a string"),
    }
}

fn id_of(message: &lapin::message::BasicGetMessage) -> String {
    message
        .delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
        .unwrap_or_default()
}

/// 200 messages: 140 valid ids, 50 of them published twice (25 right after the first copy,
/// 25 at the end), and 10 malformed. Each valid id is applied once, the queue drains, and each
/// malformed message is on `QUEUE.dead` with its body unchanged and a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_applied_once_and_malformed_dead_lettered() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("dedup");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    let source = source(&url, &queue).await;
    assert_eq!(source.dead_letter_queue(), dead);

    let valid = |i: usize| (format!("m-{i}"), format!("ok:{i}").into_bytes());
    let mut messages = Vec::new();
    let mut malformed = Vec::new();
    for i in 0..140 {
        messages.push(valid(i));
        if i < 25 {
            messages.push(valid(i));
        }
        if i % 14 == 0 {
            let bad = (
                format!("bad-{i}"),
                format!("garbage {i}\n\u{0}").into_bytes(),
            );
            malformed.push(bad.clone());
            messages.push(bad);
        }
    }
    for i in 25..50 {
        messages.push(valid(i));
    }
    assert_eq!(messages.len(), 200);
    assert_eq!(malformed.len(), 10);
    broker.publish(&queue, &messages).await;

    let handler = Counting::new(always_ok, Duration::from_millis(2));
    let answered = Arc::new(AtomicUsize::new(0));
    let source = Answered {
        source,
        answered: Arc::clone(&answered),
    };
    let started = Instant::now();
    let (stop, run) = start(Consumer::new(source).concurrency(8), handler.clone());
    eventually(
        Duration::from_secs(20),
        "200 messages answered, 140 ids applied, 10 dead letters",
        || async {
            answered.load(Ordering::SeqCst) >= 200
                && handler.applied() == 140
                && broker.counts(&dead).await.0 == 10
                && broker.counts(&queue).await.0 == 0
        },
    )
    .await;
    let elapsed = started.elapsed();
    stop.send(()).unwrap();
    let report = run.await.unwrap();
    eprintln!("200 messages consumed in {elapsed:?}: {report:?}");

    for (id, count) in handler.effects.lock().unwrap().iter() {
        assert_eq!(*count, 1, "{id} applied {count} times");
    }
    assert_eq!(report.applied, 140, "{report:?}");
    assert_eq!(report.duplicates, 50, "{report:?}");
    assert_eq!(report.dead_lettered, 10, "{report:?}");
    assert_eq!(
        answered.load(Ordering::SeqCst),
        200,
        "each message answered once"
    );
    // Once the consumer's connection is closed, whatever it held unacknowledged would be back
    // on the queue: nothing is.
    eventually(
        Duration::from_secs(5),
        "the consumer's connection closed",
        || async { broker.counts(&queue).await.1 == 0 },
    )
    .await;
    assert_eq!(
        broker.counts(&queue).await,
        (0, 0),
        "messages left on {queue}"
    );

    let mut dead_letters = broker.take_all(&dead).await;
    dead_letters.sort_by_key(id_of);
    malformed.sort();
    assert_eq!(dead_letters.len(), malformed.len());
    for (letter, (id, body)) in dead_letters.iter().zip(&malformed) {
        assert_eq!(&id_of(letter), id);
        assert_eq!(&letter.delivery.data, body, "{id}: body changed");
        let reason = header(letter, "reason").unwrap_or_default();
        assert!(reason.contains("ok:"), "{id}: reason {reason:?}");
        assert_eq!(header(letter, "deliveries").as_deref(), Some("1"));
        assert_eq!(
            header(letter, "origin").as_deref(),
            Some("test"),
            "{id}: headers lost"
        );
        let properties = &letter.delivery.properties;
        assert_eq!(*properties.delivery_mode(), Some(2));
        assert_eq!(
            properties.content_type().as_ref().map(|t| t.as_str()),
            Some("text/plain")
        );
    }
    broker.delete(&[&queue, &dead]).await;
}

fn always_rejected(_: &str, _: usize) -> Result<(), Failure> {
    Err(Failure::Rejected("refused by a constraint".into()))
}

/// A message the data always rejects is delivered `max_deliveries` times, as the quorum
/// queue counts them, and dead-lettered at the last, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rejected_dead_lettered_at_max_deliveries() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("rejected");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    let source = source(&url, &queue).await;
    broker
        .publish(&queue, &[("poison".to_owned(), b"ok:poison".to_vec())])
        .await;

    let handler = Counting::new(always_rejected, Duration::ZERO);
    let consumer = Consumer::new(source)
        .max_deliveries(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(100));
    let (stop, run) = start(consumer, handler.clone());
    eventually(
        Duration::from_secs(15),
        "the poison message dead-lettered",
        || async { broker.counts(&dead).await.0 == 1 },
    )
    .await;
    // Nothing more comes after it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();

    let deliveries: Vec<u64> = handler.attempts("poison").iter().map(|(d, _)| *d).collect();
    assert_eq!(deliveries, [1, 2, 3], "the deliveries the handler saw");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(report.applied, 0, "{report:?}");
    let letters = broker.take_all(&dead).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "deliveries").as_deref(), Some("3"));
    assert_eq!(
        header(&letters[0], "reason").as_deref(),
        Some("refused by a constraint")
    );
    assert_eq!(letters[0].delivery.data, b"ok:poison");
    assert_eq!(broker.counts(&queue).await.0, 0);
    broker.delete(&[&queue, &dead]).await;
}

fn transient_once(_: &str, attempt: usize) -> Result<(), Failure> {
    if attempt == 1 {
        Err(Failure::Transient("the database is down".into()))
    } else {
        Ok(())
    }
}

/// A transient failure is retried after the backoff's first delay (the message stays
/// unacknowledged meanwhile) and then applied, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transient_failure_retried_after_backoff() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("transient");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    let source = source(&url, &queue).await;
    broker
        .publish(&queue, &[("flaky".to_owned(), b"ok:flaky".to_vec())])
        .await;

    let first_delay = Duration::from_millis(400);
    let handler = Counting::new(transient_once, Duration::ZERO);
    let consumer = Consumer::new(source).backoff(first_delay, Duration::from_secs(2));
    let (stop, run) = start(consumer, handler.clone());
    eventually(
        Duration::from_secs(10),
        "the flaky message applied",
        || async { handler.applied() == 1 },
    )
    .await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();

    let attempts = handler.attempts("flaky");
    let deliveries: Vec<u64> = attempts.iter().map(|(d, _)| *d).collect();
    assert_eq!(deliveries, [1, 2], "the deliveries the handler saw");
    let waited = attempts[1].1 - attempts[0].1;
    assert!(
        waited >= first_delay,
        "retried after {waited:?}, before {first_delay:?}"
    );
    assert_eq!(handler.effects.lock().unwrap()["flaky"], 1);
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(broker.counts(&dead).await.0, 0);
    broker.delete(&[&queue, &dead]).await;
}

/// The Erlang pids of the connections named `name` (the source names its connections
/// `idempotent:QUEUE`), as `close_connection` takes them.
fn connections_named(name: &str) -> Vec<String> {
    let listed = shared_rabbitmqctl(&[
        "-q",
        "list_connections",
        "--no-table-headers",
        "pid",
        "client_properties",
    ]);
    // One line per connection: `<node.1.2.3>\t[…,{"connection_name","NAME"},…]`.
    let property = format!("{{\"connection_name\",\"{name}\"}}");
    listed
        .lines()
        .filter(|line| line.contains(&property))
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The consumer's connections, listed by `rabbitmqctl`.
async fn connections(name: &str) -> Vec<String> {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || connections_named(&name))
        .await
        .unwrap()
}

/// The broker closes the consumer's connection twice while messages flow: the source
/// reconnects each time, every message is applied once, and the messages in hand at a close,
/// answered only once the source is on its next connection, are not acknowledged there with
/// their old delivery tags (which would close that connection's channel too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reconnects_after_the_broker_closes_the_connection() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("reconnect");
    let dead = format!("{queue}.dead");
    let name = format!("idempotent:{queue}");
    let broker = Broker::connect(&url).await;
    let source = source(&url, &queue).await;
    let messages: Vec<(String, Vec<u8>)> = (0..300)
        .map(|i| (format!("r-{i}"), format!("ok:{i}").into_bytes()))
        .collect();
    broker.publish(&queue, &messages).await;

    let handler = Counting::new(always_ok, Duration::from_millis(2));
    let (stop, run) = start(Consumer::new(source).concurrency(5), handler.clone());
    let mut closed = Vec::new();
    let mut current = String::new();
    for at in [60, 160] {
        // From `at` applied on, four handlers wait with a message in hand; the fifth goes on,
        // slowly, through the close and the reconnect.
        *handler.gate.lock().unwrap() = Gate {
            from: at,
            stall: 4,
            stalled: 0,
            waiting: 0,
            slow: Duration::from_millis(200),
            open: false,
        };
        eventually(Duration::from_secs(15), "four messages in hand", || async {
            handler.gate.lock().unwrap().stalled == 4
        })
        .await;
        let pids = connections(&name).await;
        assert_eq!(pids.len(), 1, "the consumer's connections: {pids:?}");
        assert!(!closed.contains(&pids[0]), "{} was closed already", pids[0]);
        let pid = pids[0].clone();
        tokio::task::spawn_blocking({
            let pid = pid.clone();
            move || shared_rabbitmqctl(&["close_connection", &pid, "test: closed by the broker"])
        })
        .await
        .unwrap();
        closed.push(pid);
        let deadline = Instant::now() + Duration::from_secs(15);
        current = loop {
            let pids = connections(&name).await;
            match pids.as_slice() {
                [pid] if !closed.contains(pid) => break pid.clone(),
                _ => assert!(Instant::now() < deadline, "not reconnected: {pids:?}"),
            }
        };
        assert!(
            handler.applied() < 300,
            "the messages were all applied before the close"
        );
        handler.gate.lock().unwrap().open = true;
        eventually(
            Duration::from_secs(5),
            "the messages in hand released",
            || async { handler.gate.lock().unwrap().waiting == 0 },
        )
        .await;
    }
    eventually(
        Duration::from_secs(20),
        "all 300 messages applied",
        || async { handler.applied() == 300 },
    )
    .await;
    let last = connections(&name).await;
    assert_eq!(
        last,
        [current],
        "the connection opened after the last close was closed too"
    );
    stop.send(()).unwrap();
    let report = run.await.unwrap();
    eprintln!("300 messages across two broker-closed connections: {report:?}");

    for (id, count) in handler.effects.lock().unwrap().iter() {
        assert_eq!(*count, 1, "{id} applied {count} times");
    }
    assert_eq!(report.applied, 300, "{report:?}");
    // At least the acks of the messages in hand at each close failed, and those messages
    // came back as duplicates.
    assert!(report.source_errors >= 8, "{report:?}");
    assert!(report.duplicates >= 8, "{report:?}");
    // The quorum queue counted the deliveries each close returned to it: those in hand and
    // those prefetched.
    let redelivered = handler
        .received
        .lock()
        .unwrap()
        .values()
        .filter(|deliveries| **deliveries > 1)
        .count();
    assert!(
        redelivered >= 8,
        "{redelivered} messages came with a delivery count"
    );
    eventually(
        Duration::from_secs(5),
        "the consumer's connection closed",
        || async { broker.counts(&queue).await.1 == 0 },
    )
    .await;
    assert_eq!(broker.counts(&queue).await, (0, 0));
    assert_eq!(broker.counts(&dead).await.0, 0);
    broker.delete(&[&queue, &dead]).await;
}

/// A publisher that declared both queues first, durable with exactly
/// `{"x-queue-type": "quorum"}`, does not stop the source; a queue declared otherwise does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queues_declared_by_a_publisher_first() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("predeclared");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    for name in [&queue, &dead] {
        broker
            .channel
            .queue_declare(name, durable(), quorum())
            .await
            .unwrap();
    }
    broker
        .publish(&queue, &[("early".to_owned(), b"ok:early".to_vec())])
        .await;
    let source = RabbitMq::builder(&url, &queue)
        .consumer_timeout(Duration::from_secs(60))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("queues declared first were refused: {e}"));
    // Handlers stop at three quarters of the broker's consumer timeout.
    assert_eq!(source.handling_limit(), Some(Duration::from_secs(45)));
    let handler = Counting::new(always_ok, Duration::ZERO);
    let (stop, run) = start(Consumer::new(source), handler.clone());
    eventually(
        Duration::from_secs(10),
        "the early message applied",
        || async { handler.applied() == 1 },
    )
    .await;
    stop.send(()).unwrap();
    assert_eq!(run.await.unwrap().applied, 1);
    broker.delete(&[&queue, &dead]).await;

    // A queue a publisher declared classic: the source refuses to start on it.
    let classic = unique("classic");
    broker
        .channel
        .queue_declare(&classic, durable(), FieldTable::default())
        .await
        .unwrap();
    let refused = RabbitMq::builder(&url, &classic).connect().await;
    let error = refused.expect_err("a classic queue was taken for a quorum queue");
    eprintln!("a classic queue: {error}");
    assert!(
        error.to_string().contains(&classic),
        "the error does not name the queue: {error}"
    );
    broker.delete(&[&classic, &format!("{classic}.dead")]).await;
}

/// `consumer_timeout(Duration::MAX)`, a natural way to say the broker's timeout is disabled,
/// used to overflow the clock in every message's task (the handling limit counted from the
/// message's receipt): each task panicked, no message was ever answered, and the consumer
/// stopped receiving once its hand was full. Now the limit is simply never reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_timeout_of_duration_max_is_no_limit() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("timeout-max");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    let source = RabbitMq::builder(&url, &queue)
        .prefetch(32)
        .consumer_timeout(Duration::MAX)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot start the RabbitMQ source: {e}"));
    let messages: Vec<_> = (0..40)
        .map(|i| (format!("t-{i}"), format!("ok:{i}").into_bytes()))
        .collect();
    broker.publish(&queue, &messages).await;
    let handler = Counting::new(always_ok, Duration::from_millis(1));
    let (stop, run) = start(
        Consumer::new(source)
            .concurrency(2)
            .batch(2)
            .handler_timeout(Duration::MAX),
        handler.clone(),
    );
    eventually(
        Duration::from_secs(20),
        "40 messages applied and the queue drained",
        || async { handler.applied() == 40 && broker.counts(&queue).await.0 == 0 },
    )
    .await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();
    assert_eq!(report.applied, 40, "{report:?}");
    broker.delete(&[&queue, &dead]).await;
}

/// A malformed body (not `ok:…`) of `len` bytes.
fn bad_body(len: usize) -> Vec<u8> {
    let mut body = b"bad:".to_vec();
    body.resize(len, b'x');
    body
}

/// A source that keeps the error of every dead letter that failed, and the id of every
/// message dead-lettered.
struct Refusals<S> {
    source: S,
    errors: Arc<Mutex<Vec<String>>>,
    dead_lettered: Arc<Mutex<Vec<String>>>,
}

impl<S> Refusals<S> {
    fn new(source: S) -> Self {
        Refusals {
            source,
            errors: Arc::default(),
            dead_lettered: Arc::default(),
        }
    }
}

impl<S: Source> Source for Refusals<S> {
    type Delivery = S::Delivery;

    fn name(&self) -> &'static str {
        self.source.name()
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<S::Delivery>>, SourceError> {
        self.source.receive(max).await
    }

    async fn ack(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.source.ack(delivery).await
    }

    async fn retry(&self, delivery: &S::Delivery, delay: Duration) -> Result<(), SourceError> {
        self.source.retry(delivery, delay).await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &S::Delivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        let written = self.source.dead_letter(message, delivery, reason).await;
        match &written {
            Ok(_) => self
                .dead_lettered
                .lock()
                .unwrap()
                .push(message.id().unwrap_or_default().to_owned()),
            Err(error) => self.errors.lock().unwrap().push(error.to_string()),
        }
        written
    }
}

/// Sets the private node's `max_message_size` for the channels opened from now on.
async fn set_max_message_size(rabbit: &PrivateRabbit, bytes: u32) {
    let expression = format!("application:set_env(rabbit, max_message_size, {bytes}).");
    let output = rabbit.rabbitmqctl(&["eval", &expression]).await;
    assert!(
        output.status.success(),
        "rabbitmqctl eval {expression}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A node whose real `max_message_size` (8 KiB) is below the source's setting (the default,
/// 16 MiB) refuses a dead letter of a 12 KB body, published before the limit was lowered: the
/// broker closes the dead letters' channel and the message goes back to the queue. The next
/// delivery sends the dead letter without its body (`body-too-large: 12000`): the message is
/// dead-lettered within a few deliveries, never redelivered for its size again. (Before the
/// fix, the dead letter was refused on every delivery: a loop, and no dead letter.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_refused_for_its_size_is_sent_without_its_body_next_time() {
    let Some(rabbit) = PrivateRabbit::start_with_config("max_message_size = 8192").await else {
        return;
    };
    let url = rabbit.url();
    let queue = unique("refused-size");
    let dead = format!("{queue}.dead");
    // Published before the limit was lowered (or through a route with another limit).
    set_max_message_size(&rabbit, 1024 * 1024).await;
    let broker = Broker::connect(&url).await;
    broker.queue_declare_quorum(&[&queue, &dead]).await;
    broker
        .publish(
            &queue,
            &[
                ("big".to_owned(), bad_body(12_000)),
                ("small".to_owned(), bad_body(100)),
            ],
        )
        .await;
    set_max_message_size(&rabbit, 8192).await;

    let source = RabbitMq::builder(&url, &queue)
        .prefetch(8)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot start the RabbitMQ source: {e}"));
    let source = Refusals::new(source);
    let (errors, dead_lettered) = (
        Arc::clone(&source.errors),
        Arc::clone(&source.dead_lettered),
    );
    let handler = Counting::new(always_ok, Duration::ZERO);
    let (stop, run) = start(Consumer::new(source).concurrency(2), handler.clone());
    eventually(
        Duration::from_secs(30),
        "both messages dead-lettered",
        || async { dead_lettered.lock().unwrap().len() >= 2 },
    )
    .await;
    // Nothing comes back after it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();
    let errors = errors.lock().unwrap().clone();
    eprintln!("report {report:?}; dead letters refused: {errors:?}");

    assert_eq!(report.dead_lettered, 2, "{report:?}");
    let deliveries = handler.received.lock().unwrap().get("big").copied();
    assert!(
        deliveries.is_some_and(|d| (2..=3).contains(&d)),
        "big was delivered {deliveries:?} times; refused: {errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("max size 8192")),
        "the broker never refused a dead letter for its size: {errors:?}"
    );
    let mut ids = dead_lettered.lock().unwrap().clone();
    ids.sort();
    assert_eq!(ids, ["big", "small"], "each dead-lettered once");
    // `small`'s dead letter may be stored twice (at least once: its confirm is lost when the
    // broker closes the channel for `big`'s); `big`'s fitted one once.
    let letters = broker.take_all(&dead).await;
    let big: Vec<_> = letters.iter().filter(|l| id_of(l) == "big").collect();
    let small = letters
        .iter()
        .find(|l| id_of(l) == "small")
        .expect("small's dead letter");
    assert_eq!(big.len(), 1, "big's dead letters");
    let big = big[0];
    assert!(big.delivery.data.is_empty(), "the body was sent");
    assert_eq!(header(big, "body-too-large").as_deref(), Some("12000"));
    let reason = header(big, "reason").unwrap_or_default();
    assert!(reason.contains("ok:"), "reason {reason:?}");
    assert!(header(big, "deliveries").is_some());
    assert_eq!(small.delivery.data, bad_body(100));
    assert_eq!(header(small, "origin").as_deref(), Some("test"));
    assert_eq!(header(small, "body-too-large"), None);
    assert_eq!(broker.counts(&queue).await.0, 0);
}

/// With `max_message_size` set to 8 KiB, dead letters that would exceed it are fitted before
/// they are published, and each message is dead-lettered on its first delivery, acked, never
/// delivered again: one that fits is whole; one whose own headers (3 KB) push it over goes
/// without them (body unchanged, `reason` and `deliveries` kept); one whose body (10 KB) is
/// over goes without its body, `body-too-large: 10000`. (The shared node's own limit is far
/// higher: nothing is refused, the fitting is the source's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_over_max_message_size_are_fitted_before_they_are_sent() {
    let Some(url) = amqp_url() else { return };
    let queue = unique("fitted");
    let dead = format!("{queue}.dead");
    let broker = Broker::connect(&url).await;
    let source = RabbitMq::builder(&url, &queue)
        .prefetch(8)
        .max_message_size(8192)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot start the RabbitMQ source: {e}"));
    broker
        .publish_with_extra(&queue, "whole", &bad_body(100), 10)
        .await;
    broker
        .publish_with_extra(&queue, "headers", &bad_body(6000), 3000)
        .await;
    broker
        .publish_with_extra(&queue, "body", &bad_body(10_000), 10)
        .await;

    let source = Refusals::new(source);
    let (errors, dead_lettered) = (
        Arc::clone(&source.errors),
        Arc::clone(&source.dead_lettered),
    );
    let handler = Counting::new(always_ok, Duration::ZERO);
    let (stop, run) = start(Consumer::new(source).concurrency(2), handler.clone());
    eventually(
        Duration::from_secs(20),
        "three messages dead-lettered",
        || async { dead_lettered.lock().unwrap().len() >= 3 },
    )
    .await;
    // Nothing comes back after them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();

    let errors = errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "dead letters failed: {errors:?}");
    assert_eq!(report.dead_lettered, 3, "{report:?}");
    assert_eq!(report.source_errors, 0, "{report:?}");
    for id in ["whole", "headers", "body"] {
        let deliveries = handler.received.lock().unwrap().get(id).copied();
        assert_eq!(deliveries, Some(1), "{id}: delivered again");
    }
    eventually(
        Duration::from_secs(5),
        "the consumer's connection closed",
        || async { broker.counts(&queue).await.1 == 0 },
    )
    .await;
    assert_eq!(broker.counts(&queue).await, (0, 0), "messages left");

    let mut letters = broker.take_all(&dead).await;
    letters.sort_by_key(id_of);
    assert_eq!(
        letters.iter().map(id_of).collect::<Vec<_>>(),
        ["body", "headers", "whole"]
    );
    for letter in &letters {
        let id = id_of(letter);
        let reason = header(letter, "reason").unwrap_or_default();
        assert!(reason.contains("ok:"), "{id}: reason {reason:?}");
        assert_eq!(header(letter, "deliveries").as_deref(), Some("1"), "{id}");
        assert_eq!(
            letter
                .delivery
                .properties
                .content_type()
                .as_ref()
                .map(|t| t.as_str()),
            Some("text/plain"),
            "{id}"
        );
    }
    let (body, headers, whole) = (&letters[0], &letters[1], &letters[2]);
    assert_eq!(whole.delivery.data, bad_body(100));
    assert_eq!(header(whole, "origin").as_deref(), Some("test"));
    assert_eq!(header(whole, "extra").map(|e| e.len()), Some(10));
    assert_eq!(header(whole, "body-too-large"), None);

    assert_eq!(
        headers.delivery.data,
        bad_body(6000),
        "headers: body changed"
    );
    assert_eq!(header(headers, "extra"), None, "headers: own headers kept");
    assert_eq!(header(headers, "origin"), None);
    assert_eq!(header(headers, "body-too-large"), None);

    assert!(body.delivery.data.is_empty(), "body: the body was sent");
    assert_eq!(header(body, "body-too-large").as_deref(), Some("10000"));
    assert_eq!(header(body, "origin"), None);
    broker.delete(&[&queue, &dead]).await;
}
