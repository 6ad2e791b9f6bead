//! The NATS JetStream source against a real `nats-server -js` (its URL in
//! `IDEMPOTENT_TEST_NATS_URL`), each test on a stream of its own: exactly one effect per key
//! over duplicates and dead letters for malformed messages, dead-lettering on the
//! `max_deliveries`-th delivery, a transient failure retried after its delay, keep-alive of a
//! handler slower than the ack wait, a repeated dead letter stored once, a publisher's stream
//! used as it is, and a stream deleted under a live source set up again.
//!
//! Longer than most test files: the JetStream helpers (publishing, pending counts, the dead
//! subject) serve every test here and nowhere else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::{self, stream};
use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotent_consumer::nats::JetStream;
use idempotent_consumer::{
    Consumer, DeadLettered, Decode, Failure, Handler, Message, Report, Source,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Idempotency, Key};
use idempotent_test_kit::backend::nats_url;
use idempotent_test_kit::names::unique;

/// The longest any test waits for the state it expects.
const PATIENCE: Duration = Duration::from_secs(20);

async fn connect(url: &str, stream: &str, durable: &str, ack_wait: Duration) -> JetStream {
    JetStream::builder(url, stream, durable)
        .ack_wait(ack_wait)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}; is nats-server -js running?"))
}

/// The test's own view of the server.
struct Admin {
    context: jetstream::Context,
}

impl Admin {
    async fn new(url: &str) -> Self {
        let client = async_nats::connect(url).await.unwrap();
        Admin {
            context: jetstream::new(client),
        }
    }

    async fn publish(&self, subject: &str, headers: HeaderMap, body: impl Into<Bytes>) {
        let ack = self
            .context
            .publish_with_headers(subject.to_owned(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(!ack.duplicate, "the test publishes no duplicates by id");
    }

    /// The consumer's (pending, ack pending).
    async fn pending(&self, stream: &str, durable: &str) -> (u64, usize) {
        let stream = self.context.get_stream(stream).await.unwrap();
        let info = stream.consumer_info(durable).await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    /// Every message on `STREAM.dead`, in order.
    async fn dead(&self, stream: &str) -> Vec<async_nats::Message> {
        let handle = self.context.get_stream(stream).await.unwrap();
        let consumer = handle
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::None,
                filter_subject: format!("{stream}.dead"),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut dead = Vec::new();
        loop {
            let mut batch = consumer
                .fetch()
                .max_messages(1000)
                .messages()
                .await
                .unwrap();
            let before = dead.len();
            while let Some(message) = batch.next().await {
                dead.push(message.unwrap().message);
            }
            if dead.len() == before {
                return dead;
            }
        }
    }
}

/// The header `name` of `message`. (Parsed, as the client parses a received message's: a
/// name given as `&str` would miss the client's standard names, `Nats-Msg-Id` and others.)
fn header<'a>(message: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    let name: HeaderName = name.parse().unwrap();
    message.headers.as_ref()?.get(name).map(|v| v.as_str())
}

/// Polls `check` until it holds, panicking with `what` after [`PATIENCE`].
async fn eventually<F: Future<Output = bool>>(what: &str, check: impl FnMut() -> F) {
    idempotent_test_kit::process::eventually(what, PATIENCE, check).await;
}

/// A consumer running on a task of its own, stopped by [`Running::stop`].
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Report>,
}

impl Running {
    fn start(consumer: Consumer<JetStream>, handler: Counting) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let idempotency = Idempotency::new(MemoryStore::new());
        let task = tokio::spawn(consumer.run(idempotency, handler, shutdown));
        Running { stop, task }
    }

    async fn stop(self) -> Report {
        let _ = self.stop.send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the consumer drains within the patience")
            .unwrap()
    }
}

#[derive(Clone, Copy)]
enum Behaviour {
    Apply,
    Reject,
    TransientOnce,
    Slow(Duration),
}

/// Bodies are `KEY:TEXT` (the key is `KEY`); anything without a `:` is malformed. Counts
/// decodes, attempts and effects per key.
#[derive(Clone)]
struct Counting {
    behaviour: Behaviour,
    seen: Arc<Seen>,
}

#[derive(Default)]
struct Seen {
    /// The deliveries of every message decoded, in order.
    deliveries: Mutex<Vec<u64>>,
    /// When each attempt of the handler started, per key.
    attempts: Mutex<HashMap<String, Vec<Instant>>>,
    /// Effects applied, per key.
    effects: Mutex<HashMap<String, u32>>,
}

impl Seen {
    fn decodes(&self) -> usize {
        self.deliveries.lock().unwrap().len()
    }

    fn effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }

    fn attempts(&self, key: &str) -> Vec<Instant> {
        self.attempts
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
}

impl Counting {
    fn new(behaviour: Behaviour) -> Self {
        Counting {
            behaviour,
            seen: Arc::default(),
        }
    }
}

impl Decode for Counting {
    type Input = String;

    fn decode(&self, message: &Message) -> Result<String, Failure> {
        self.seen
            .deliveries
            .lock()
            .unwrap()
            .push(message.deliveries());
        let body = std::str::from_utf8(message.body())
            .map_err(|_| Failure::Malformed("not UTF-8".into()))?;
        let (key, _) = body
            .split_once(':')
            .ok_or_else(|| Failure::Malformed(format!("no key in {body:?}\nsecond line")))?;
        Ok(key.to_owned())
    }

    fn key(&self, _message: &Message, input: &String) -> Result<Key, Failure> {
        idempotent_consumer::key(input)
    }
}

impl Handler for Counting {
    type Output = ();

    async fn handle(&self, key: &String, _claim: &ClaimHandle) -> Result<(), Failure> {
        let attempt = {
            let mut attempts = self.seen.attempts.lock().unwrap();
            let attempts = attempts.entry(key.clone()).or_default();
            attempts.push(Instant::now());
            attempts.len()
        };
        match self.behaviour {
            Behaviour::Apply => {}
            Behaviour::Reject => return Err(Failure::Rejected(format!("{key} refused"))),
            Behaviour::TransientOnce if attempt == 1 => {
                return Err(Failure::Transient("the database is away".into()));
            }
            Behaviour::TransientOnce => {}
            Behaviour::Slow(delay) => tokio::time::sleep(delay).await,
        }
        *self
            .seen
            .effects
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default() += 1;
        Ok(())
    }
}

/// 140 keys, 50 of them published twice (25 right after the first, 25 at the end), and 10
/// malformed messages among them: 200 messages, 140 effects, 10 dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_key_applied_once_and_malformed_dead_lettered_once() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("once");
    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let entries = source.entries_subject().to_owned();
    assert_eq!(source.dead_subject(), format!("{stream}.dead"));
    let admin = Admin::new(&url).await;
    let mut published = 0;
    let mut malformed = Vec::new();
    for i in 0..140 {
        if i % 14 == 0 {
            let body = format!("malformed {i}");
            let mut headers = HeaderMap::new();
            headers.insert("origin", format!("test-{i}").as_str());
            admin.publish(&entries, headers, body.clone()).await;
            malformed.push(body);
            published += 1;
        }
        let body = format!("k{i}:payload {i}");
        admin
            .publish(&entries, HeaderMap::new(), body.clone())
            .await;
        published += 1;
        if i < 25 {
            admin.publish(&entries, HeaderMap::new(), body).await;
            published += 1;
        }
    }
    for i in 25..50 {
        admin
            .publish(&entries, HeaderMap::new(), format!("k{i}:payload {i}"))
            .await;
        published += 1;
    }
    assert_eq!(published, 200);
    assert_eq!(malformed.len(), 10);

    let handler = Counting::new(Behaviour::Apply);
    let seen = Arc::clone(&handler.seen);
    let running = Running::start(Consumer::new(source), handler);
    eventually("every message answered", || async {
        seen.effects().len() == 140 && admin.pending(&stream, "worker").await == (0, 0)
    })
    .await;
    let report = running.stop().await;

    let effects = seen.effects();
    assert_eq!(effects.len(), 140);
    assert!(
        effects.values().all(|&n| n == 1),
        "an effect repeated: {effects:?}"
    );
    assert_eq!(report.applied, 140);
    assert_eq!(report.duplicates, 50);
    assert_eq!(report.dead_lettered, 10);
    assert_eq!(report.source_errors, 0);

    let dead = admin.dead(&stream).await;
    let mut bodies: Vec<String> = dead
        .iter()
        .map(|m| String::from_utf8(m.payload.to_vec()).unwrap())
        .collect();
    bodies.sort();
    malformed.sort();
    assert_eq!(
        bodies, malformed,
        "each malformed message dead-lettered once, unchanged"
    );
    for message in &dead {
        let body = std::str::from_utf8(&message.payload).unwrap();
        let i = body.trim_start_matches("malformed ");
        let reason = header(message, "reason").expect("a reason header");
        assert!(reason.contains("no key in"), "{reason}");
        assert!(!reason.contains('\n'), "{reason:?}");
        assert_eq!(header(message, "deliveries"), Some("1"));
        assert_eq!(
            header(message, "origin"),
            Some(format!("test-{i}").as_str())
        );
    }
}

/// A message the handler always rejects is dead-lettered on its `max_deliveries`-th delivery,
/// not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rejected_message_dead_lettered_on_its_last_delivery() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("rejected");
    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let admin = Admin::new(&url).await;
    admin
        .publish(source.entries_subject(), HeaderMap::new(), "r1:refused")
        .await;
    let handler = Counting::new(Behaviour::Reject);
    let seen = Arc::clone(&handler.seen);
    let consumer = Consumer::new(source)
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let running = Running::start(consumer, handler);
    eventually("the dead letter", || async {
        !admin.dead(&stream).await.is_empty() && admin.pending(&stream, "worker").await == (0, 0)
    })
    .await;
    // Anything still to come would come now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = running.stop().await;

    assert_eq!(
        seen.attempts("r1").len(),
        3,
        "handled on each of the 3 deliveries"
    );
    assert_eq!(*seen.deliveries.lock().unwrap(), vec![1, 2, 3]);
    assert!(seen.effects().is_empty());
    assert_eq!(report.retried, 2);
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.applied, 0);
    let dead = admin.dead(&stream).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(&dead[0].payload[..], b"r1:refused");
    assert_eq!(header(&dead[0], "deliveries"), Some("3"));
    assert_eq!(header(&dead[0], "reason"), Some("r1 refused"));
}

/// A transient failure is retried after the backoff (a `-NAK` with that delay) and applied
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transient_failure_retried_after_its_delay_then_applied_once() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("transient");
    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let admin = Admin::new(&url).await;
    admin
        .publish(source.entries_subject(), HeaderMap::new(), "t1:later")
        .await;
    let handler = Counting::new(Behaviour::TransientOnce);
    let seen = Arc::clone(&handler.seen);
    let consumer = Consumer::new(source)
        .max_deliveries(1)
        .backoff(Duration::from_millis(400), Duration::from_secs(1));
    let running = Running::start(consumer, handler);
    eventually("the effect", || async {
        seen.effects().len() == 1 && admin.pending(&stream, "worker").await == (0, 0)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = running.stop().await;

    assert_eq!(seen.effects().get("t1"), Some(&1));
    assert_eq!(report.applied, 1);
    assert_eq!(report.retried, 1);
    assert_eq!(
        report.dead_lettered, 0,
        "a transient failure is never dead-lettered"
    );
    assert_eq!(*seen.deliveries.lock().unwrap(), vec![1, 2]);
    let attempts = seen.attempts("t1");
    assert_eq!(attempts.len(), 2);
    let gap = attempts[1] - attempts[0];
    assert!(
        gap >= Duration::from_millis(350),
        "redelivered after {gap:?}, before the delay"
    );
    assert!(admin.dead(&stream).await.is_empty());
}

/// A handler three and a half times as slow as the ack wait: kept alive, its message is
/// delivered once, neither to its own consumer again nor to another one on the same durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_handler_kept_alive_past_the_ack_wait() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("slow");
    let ack_wait = Duration::from_secs(1);
    let first = connect(&url, &stream, "worker", ack_wait).await;
    assert_eq!(first.keep_alive_every(), Some(ack_wait / 3));
    let admin = Admin::new(&url).await;
    let slow = Counting::new(Behaviour::Slow(Duration::from_millis(3500)));
    let seen = Arc::clone(&slow.seen);
    let first = Running::start(Consumer::new(first), slow);
    admin
        .publish(&format!("{stream}.entries"), HeaderMap::new(), "s1:slow")
        .await;
    eventually("the handler to start", || async {
        !seen.attempts("s1").is_empty()
    })
    .await;
    let other = Counting::new(Behaviour::Apply);
    let other_seen = Arc::clone(&other.seen);
    let second = Running::start(
        Consumer::new(connect(&url, &stream, "worker", ack_wait).await),
        other,
    );
    eventually("the effect", || async {
        seen.effects().len() == 1 && admin.pending(&stream, "worker").await == (0, 0)
    })
    .await;
    let report = first.stop().await;
    let other_report = second.stop().await;

    assert_eq!(seen.attempts("s1").len(), 1, "the handler ran once");
    assert_eq!(*seen.deliveries.lock().unwrap(), vec![1], "delivered once");
    assert_eq!(report.applied, 1);
    assert_eq!(report.duplicates, 0);
    assert_eq!(report.retried, 0);
    assert_eq!(report.source_errors, 0);
    assert_eq!(
        other_seen.decodes(),
        0,
        "the other consumer saw the message"
    );
    assert_eq!(other_report, Report::default());
}

/// Straight through the `Source` API: the message's mapping, a dead letter repeated (as after
/// a crash before the `+TERM`) stored once, the server's directives left out of the copy, and
/// an empty receive that waits about a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeated_dead_letter_stored_once() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("repeat");
    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let admin = Admin::new(&url).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "m-1");
    headers.insert("zeta", "last");
    headers.insert("alpha", "first");
    // Would refuse the copy on the dead subject if it were copied.
    headers.insert("Nats-Expected-Last-Sequence", "0");
    admin
        .publish(source.entries_subject(), headers, "bad body")
        .await;

    let mut received = Vec::new();
    for _ in 0..5 {
        received.extend(source.receive(10).await.unwrap());
        if !received.is_empty() {
            break;
        }
    }
    assert_eq!(received.len(), 1);
    let message = &received[0].message;
    assert_eq!(message.position(), "1");
    assert_eq!(message.id(), Some("m-1"));
    assert_eq!(&message.body()[..], b"bad body");
    assert_eq!(message.deliveries(), 1);
    let names: Vec<&str> = message.fields().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "Nats-Expected-Last-Sequence",
            "Nats-Msg-Id",
            "alpha",
            "zeta"
        ],
        "the headers, sorted by name"
    );
    assert_eq!(message.field("zeta").map(|v| &v[..]), Some(&b"last"[..]));
    let delivery = &received[0].delivery;
    assert_eq!(delivery.sequence(), Some(1));

    let reason = "cannot read\r\nit";
    let first = source.dead_letter(message, delivery, reason).await.unwrap();
    let again = source.dead_letter(message, delivery, reason).await.unwrap();
    assert_eq!(first, DeadLettered::Now);
    assert_eq!(again, DeadLettered::Already);

    let dead = admin.dead(&stream).await;
    assert_eq!(dead.len(), 1, "stored once");
    let copy = &dead[0];
    assert_eq!(&copy.payload[..], b"bad body");
    assert_eq!(header(copy, "reason"), Some("cannot read  it"));
    assert_eq!(header(copy, "deliveries"), Some("1"));
    assert_eq!(header(copy, "original-id"), Some("m-1"));
    assert_eq!(
        header(copy, "Nats-Msg-Id"),
        Some(format!("dead-{stream}-1").as_str())
    );
    assert_eq!(header(copy, "alpha"), Some("first"));
    assert_eq!(header(copy, "zeta"), Some("last"));
    assert_eq!(header(copy, "Nats-Expected-Last-Sequence"), None);

    // Terminated: never delivered again. An empty receive waits about a second.
    let started = Instant::now();
    assert!(source.receive(10).await.unwrap().is_empty());
    let waited = started.elapsed();
    assert!(
        (Duration::from_millis(800)..Duration::from_millis(2500)).contains(&waited),
        "an empty receive took {waited:?}"
    );
    assert_eq!(admin.pending(&stream, "worker").await, (0, 0));
}

/// A stream a publisher created with its name, subjects and storage alone, holding a message
/// already: used as it is, not replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishers_stream_used_as_it_is() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("existing");
    let admin = Admin::new(&url).await;
    let mut created = admin
        .context
        .create_stream(stream::Config {
            name: stream.clone(),
            // Not in the order the source would list them.
            subjects: vec![format!("{stream}.dead"), format!("{stream}.entries")],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    let before = created.info().await.unwrap().clone();
    admin
        .publish(&format!("{stream}.entries"), HeaderMap::new(), "e1:early")
        .await;

    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let mut received = Vec::new();
    for _ in 0..5 {
        received.extend(source.receive(10).await.unwrap());
        if !received.is_empty() {
            break;
        }
    }
    assert_eq!(
        received.len(),
        1,
        "the message published before the source came"
    );
    assert_eq!(&received[0].message.body()[..], b"e1:early");
    source.ack(&received[0].delivery).await.unwrap();

    let after = admin.context.get_stream(&stream).await.unwrap();
    let after = after.cached_info();
    assert_eq!(after.created, before.created, "the stream was not replaced");
    assert_eq!(
        after.config, before.config,
        "the stream's settings were not changed"
    );
    assert_eq!(after.state.messages, 1);
    eventually("the ack", || async {
        admin.pending(&stream, "worker").await == (0, 0)
    })
    .await;
}

/// The stream deleted under a live source (as by a server restarted without its data): the
/// source fails, then sets the stream and the consumer up again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_deleted_under_the_source_set_up_again() {
    let Some(url) = nats_url() else {
        return;
    };
    let stream = unique("deleted");
    let source = connect(&url, &stream, "worker", Duration::from_secs(30)).await;
    let admin = Admin::new(&url).await;
    admin.context.delete_stream(&stream).await.unwrap();

    let mut failures = 0;
    let mut published = false;
    let mut messages = Vec::new();
    let start = Instant::now();
    while messages.is_empty() {
        assert!(start.elapsed() < PATIENCE, "the source never recovered");
        match source.receive(10).await {
            Err(_) => failures += 1,
            Ok(received) => messages.extend(received),
        }
        // Published once the source has set the stream up again.
        if !published && admin.context.get_stream(&stream).await.is_ok() {
            assert!(
                failures > 0,
                "the stream is back before the source noticed its loss"
            );
            admin
                .publish(source.entries_subject(), HeaderMap::new(), "a1:after")
                .await;
            published = true;
        }
    }
    assert!(failures >= 1, "the receive right after the deletion fails");
    assert_eq!(&messages[0].message.body()[..], b"a1:after");
    assert_eq!(messages[0].message.position(), "1");
    source.ack(&messages[0].delivery).await.unwrap();
}

/// Names that are not subject tokens are refused before any connection is tried.
#[tokio::test]
async fn names_that_are_not_subject_tokens_refused() {
    for (stream, durable) in [
        ("A.B", "worker"),
        ("", "worker"),
        ("ORDERS", "w*"),
        ("ORDERS", "a b"),
    ] {
        let refused = JetStream::builder("nats://127.0.0.1:1", stream, durable)
            .connect()
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("holding whitespace"), "{refused}");
    }
}

/// A `nats-server -js` of the test's own whose `max_payload` is `max_payload` bytes (from a
/// config file: the flag does not exist), on a free loopback port. Killed when dropped.
struct SmallNats {
    child: tokio::process::Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl SmallNats {
    async fn start(max_payload: usize) -> Option<SmallNats> {
        use idempotent_test_kit::backend::installed;
        use idempotent_test_kit::process::{find_program, scratch_dir};
        let bin = installed("nats-server", find_program("nats-server"))?;
        let dir = scratch_dir("nats-small");
        let port = idempotent_test_kit::names::free_port();
        let config = dir.join("nats.conf");
        std::fs::write(
            &config,
            format!(
                "listen: \"127.0.0.1:{port}\"\nmax_payload: {max_payload}\njetstream {{ store_dir: {:?} }}\n",
                dir.join("store")
            ),
        )
        .unwrap();
        let child = tokio::process::Command::new(bin)
            .arg("-c")
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let nats = SmallNats { child, dir, port };
        eventually("the private nats-server to accept clients", || async {
            async_nats::connect(nats.url()).await.is_ok()
        })
        .await;
        Some(nats)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for SmallNats {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Dead letters that would exceed the server's `max_payload` (the reason, up to a KiB, and
/// the other extras added to an entry close to it) are still dead letters: the reason cut to
/// fit; else the entry's own headers left out; else the body left out, its size in
/// `body-too-large`. They used to fail to publish, and the entry, counted as retried without
/// a `-NAK`, came back after every ack wait, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_larger_than_max_payload_are_fitted_not_redelivered() {
    const MAX_PAYLOAD: usize = 4096;
    let Some(nats) = SmallNats::start(MAX_PAYLOAD).await else {
        return;
    };
    let url = nats.url();
    let stream = unique("fit");
    let source = connect(&url, &stream, "fit", Duration::from_secs(1)).await;
    let admin = Admin::new(&url).await;
    let subject = format!("{stream}.entries");
    // Malformed (no `:`): dead-lettered at once, the reason quoting the body (cut to a KiB).
    let cut_reason = "a".repeat(3500);
    let without_own_headers = "b".repeat(3000);
    let without_body = "c".repeat(4060);
    let mut own = HeaderMap::new();
    own.insert("x-big", "h".repeat(1000).as_str());
    admin
        .publish(&subject, HeaderMap::new(), cut_reason.clone())
        .await;
    admin
        .publish(&subject, own, without_own_headers.clone())
        .await;
    admin
        .publish(&subject, HeaderMap::new(), without_body.clone())
        .await;

    let handler = Counting::new(Behaviour::Apply);
    let running = Running::start(Consumer::new(source), handler.clone());
    eventually("three dead letters", || async {
        admin.dead(&stream).await.len() == 3
    })
    .await;
    eventually("nothing pending or in hand", || async {
        admin.pending(&stream, "fit").await == (0, 0)
    })
    .await;
    let report = running.stop().await;
    assert_eq!(report.dead_lettered, 3, "{report:?}");
    assert_eq!(handler.seen.decodes(), 3, "each entry delivered once");

    let dead = admin.dead(&stream).await;
    for letter in &dead {
        assert_eq!(header(letter, "deliveries"), Some("1"));
        assert!(header(letter, "Nats-Msg-Id").is_some());
    }
    // In whatever order the consumer finished them: each by its body.
    let letter = |body: &[u8]| {
        dead.iter()
            .find(|letter| letter.payload.as_ref() == body)
            .unwrap_or_else(|| panic!("no dead letter with a {}-byte body", body.len()))
    };
    // The reason cut to fit, the body and nothing else changed.
    let cut = letter(cut_reason.as_bytes());
    let reason = header(cut, "reason").unwrap();
    assert!(
        reason.len() >= 64 && reason.len() < 1024 && reason.starts_with("no key in"),
        "{reason:?}"
    );
    // The entry's own headers left out; the reason kept (cut), the body unchanged.
    let without_own = letter(without_own_headers.as_bytes());
    assert_eq!(header(without_own, "x-big"), None);
    assert!(
        header(without_own, "reason")
            .unwrap()
            .starts_with("no key in")
    );
    // The body left out, its size said.
    let bodiless = letter(b"");
    assert_eq!(header(bodiless, "body-too-large"), Some("4060"));
    assert!(header(bodiless, "reason").unwrap().starts_with("no key in"));
}
