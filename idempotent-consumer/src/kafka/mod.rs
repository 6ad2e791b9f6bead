//! The Kafka source (feature `kafka`): one topic, read by a consumer group with `rdkafka`
//! (librdkafka), its offsets committed by the runtime's answers, not by the client.
//!
//! Kafka has no per-message acknowledgement: a committed offset covers every record before it
//! in its partition. So this source keeps, per partition, the records in hand
//! ([`Offsets`](self)), and commits a partition only up to its lowest record whose effect is
//! not yet recorded (applied, a duplicate, or dead-lettered), whatever order the runtime's
//! concurrent handlers finish in. A crash therefore never skips a record: everything after
//! the committed offset is delivered again, and what was applied is a duplicate then.
//!
//! - **Concurrency and order.** Records of one partition run concurrently, except that those
//!   with the same [ordering key](crate::Decode::ordering_key) run one at a time in offset
//!   order; by default the ordering key is the record's Kafka key, so the order a producer
//!   keeps per key is kept.
//! - **Retries** stay in this process: a record that fails transiently (or is rejected and not
//!   yet at `max_deliveries`) is handed to the runtime again after its backoff, and its
//!   partition's commit waits for it while the other records flow.
//! - **Delivery count.** Kafka counts no deliveries, so the source numbers only its own (retries
//!   in this process); [`counts_deliveries`](Source::counts_deliveries) is `false`, and the
//!   runtime counts every delivery durably on the record, before the handler runs. A record
//!   that kills its consumer every time is dead-lettered, unhandled, on its
//!   `max_deliveries + 1`-th delivery, and the rest of its partition flows.
//! - **Dead letters** go to the topic `<topic>.dead` (or [`dead_letter_topic`](KafkaBuilder::dead_letter_topic))
//!   with the record's key, value and headers, plus the headers `reason`, `source-topic`,
//!   `source-partition` and `source-offset`, written by an idempotent producer with
//!   `acks=all`; the offset moves past the record only once the broker has acknowledged its
//!   dead letter. At least once: a consumer that dies between the two, or loses the partition
//!   meanwhile, leaves the record to be dead-lettered again (same `source-offset`).
//! - **Rebalances.** When partitions are revoked, their records not yet handed to the runtime
//!   are dropped, those in hand get up to [`revoke_wait`](KafkaBuilder::revoke_wait) to finish,
//!   and what is answered is committed (synchronously) before the partitions are given up;
//!   records still running after that are abandoned: their answers are ignored and the new
//!   owner delivers them again (a duplicate, once their effect is recorded).
//! - **Liveness.** A thread of the source's own polls the consumer whatever the handlers do,
//!   so `max.poll.interval.ms` is never exceeded: when the records waiting for the runtime
//!   have stayed at [`buffer`](KafkaBuilder::buffer) for a second, the source pauses its
//!   partitions and goes on polling (every 100 ms) until half of them are taken. A consumer
//!   that stops heartbeating (killed) loses its partitions after
//!   [`session_timeout`](KafkaBuilder::session_timeout).
//! - **Broker restarts.** librdkafka reconnects by itself; meanwhile `receive` returns nothing
//!   (or the client's error, counted in `idempotency.source.errors`).
//!
//! The default idempotency key is the `idempotency-key` header ([`Message::id`]), which the
//! outbox relay's Kafka sink sets; the position is `PARTITION@OFFSET`.

mod offsets;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};

use self::offsets::Offsets;
use super::{DeadLettered, Message, Received, Source, SourceError};

/// The header a record's idempotency key is read from ([`Message::id`]).
pub const KEY_HEADER: &str = "idempotency-key";

/// Records waiting for the runtime, at most, by default.
pub const DEFAULT_BUFFER: usize = 512;
/// How long revoked partitions' records in hand may take to finish, by default.
pub const DEFAULT_REVOKE_WAIT: Duration = Duration::from_secs(10);
/// How often answered offsets are committed, by default.
pub const DEFAULT_COMMIT_EVERY: Duration = Duration::from_millis(200);
/// After how long without a heartbeat the group gives a consumer's partitions to others, by
/// default (the broker's `group.min.session.timeout.ms` is usually 6 s).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the buffer may stay full before the source pauses its partitions.
const PAUSE_AFTER: Duration = Duration::from_secs(1);
/// How long the source's thread waits in one poll.
const POLL: Duration = Duration::from_millis(100);
/// How long a dead letter may wait for the broker's acknowledgement.
const DEAD_LETTER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `connect` waits for the broker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// When a dead letter failed, the record is handed to the runtime again after this long.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// Builds a [`Kafka`] source; see [`Kafka::builder`].
#[derive(Debug, Clone)]
pub struct KafkaBuilder {
    brokers: String,
    topic: String,
    group: String,
    member: Option<String>,
    dead_letters: Option<String>,
    create: Option<i32>,
    session_timeout: Duration,
    buffer: usize,
    revoke_wait: Duration,
    commit_every: Duration,
    config: Vec<(String, String)>,
}

impl KafkaBuilder {
    /// This consumer's name in the group (librdkafka's `client.id`), for the broker's logs.
    #[must_use]
    pub fn member(mut self, member: impl Into<String>) -> Self {
        self.member = Some(member.into());
        self
    }

    /// Where dead letters go (default `<topic>.dead`).
    #[must_use]
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letters = Some(topic.into());
        self
    }

    /// Creates the topic and the dead-letter topic with `partitions` partitions (at least 1)
    /// when they are missing; a topic that exists is used as it is. Default: neither is
    /// created (the broker's own auto-creation, if on, applies).
    #[must_use]
    pub fn create_topics(mut self, partitions: i32) -> Self {
        self.create = Some(partitions.max(1));
        self
    }

    /// After how long without a heartbeat from this consumer (killed, frozen, cut off) the
    /// group gives its partitions to the others (`session.timeout.ms`; default
    /// [`DEFAULT_SESSION_TIMEOUT`]; the broker bounds it, 6 s to 30 min on most).
    #[must_use]
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// The most records waiting for the runtime (default [`DEFAULT_BUFFER`]; at least 1):
    /// the source takes no more from the client while it is full, and when it stays full for
    /// a second, pauses fetching, still polling, until half of them are taken.
    #[must_use]
    pub fn buffer(mut self, records: usize) -> Self {
        self.buffer = records.max(1);
        self
    }

    /// How long records in hand may take to finish when their partitions are revoked
    /// (default [`DEFAULT_REVOKE_WAIT`]), before what is answered is committed and the rest
    /// is abandoned to the partition's next owner. The rebalance waits for it.
    #[must_use]
    pub fn revoke_wait(mut self, wait: Duration) -> Self {
        self.revoke_wait = wait;
        self
    }

    /// How often answered offsets are committed (default [`DEFAULT_COMMIT_EVERY`]; at least
    /// 1 ms). Records answered after the last commit are delivered again after a crash (as
    /// duplicates).
    #[must_use]
    pub fn commit_every(mut self, every: Duration) -> Self {
        self.commit_every = every.max(Duration::from_millis(1));
        self
    }

    /// Any other librdkafka consumer property (`security.protocol`, `fetch.max.bytes`, …).
    /// The ones this source relies on are set after these and cannot be changed:
    /// `enable.auto.commit` and `enable.auto.offset.store` are `false`.
    #[must_use]
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    /// Connects: creates the topics if asked, checks the broker answers (within 10 s), joins
    /// the group and starts polling.
    pub async fn connect(self) -> Result<Kafka, SourceError> {
        let dead_letters = self
            .dead_letters
            .clone()
            .unwrap_or_else(|| format!("{}.dead", self.topic));
        let mut common = ClientConfig::new();
        common.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.config {
            common.set(key, value);
        }
        if let Some(member) = &self.member {
            common.set("client.id", member);
        }
        if let Some(partitions) = self.create {
            create_topics(&common, &[&self.topic, &dead_letters], partitions).await?;
        }
        let shared = Arc::new(Shared {
            topic: self.topic.clone(),
            revoke_wait: self.revoke_wait,
            buffer: self.buffer,
            state: Mutex::new(State::default()),
            answered: Condvar::new(),
            arrived: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
        });
        let session = millis(self.session_timeout, 1_000);
        let consumer: BaseConsumer<Context> = common
            .clone()
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 5).max(100).to_string())
            .create_with_context(Context {
                shared: Arc::clone(&shared),
            })
            .map_err(|e| SourceError::new("creating the Kafka consumer", e))?;
        let producer: FutureProducer = common
            .clone()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set(
                "message.timeout.ms",
                millis(DEAD_LETTER_TIMEOUT, 1).to_string(),
            )
            .create()
            .map_err(|e| SourceError::new("creating the Kafka producer", e))?;
        // The broker must answer now: a source that connects to nothing would wait silently.
        let topic = self.topic.clone();
        let consumer = Arc::new(consumer);
        let probe = Arc::clone(&consumer);
        tokio::task::spawn_blocking(move || probe.fetch_metadata(Some(&topic), CONNECT_TIMEOUT))
            .await
            .map_err(|e| SourceError::new("asking Kafka for the topic's metadata", e))?
            .map_err(|e| SourceError::new("asking Kafka for the topic's metadata", e))?;
        consumer
            .subscribe(&[&self.topic])
            .map_err(|e| SourceError::new(format!("subscribing to {:?}", self.topic), e))?;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let poller = {
            let consumer = Arc::clone(&consumer);
            let shared = Arc::clone(&shared);
            let commit_every = self.commit_every;
            std::thread::Builder::new()
                .name("idempotent-kafka".into())
                .spawn(move || {
                    poll(&consumer, &shared, commit_every);
                    // The last commit, then leaving the group (revoking: committing again).
                    commit(&consumer, &shared, CommitMode::Sync);
                    drop(consumer);
                    let _ = done_tx.send(());
                })
                .map_err(|e| SourceError::new("starting the Kafka polling thread", e))?
        };
        drop(poller);
        Ok(Kafka {
            shared,
            producer,
            dead_letters,
            stopped: Mutex::new(Some(done_rx)),
        })
    }
}

/// `duration` in whole milliseconds, at least `min`, at most `i32::MAX` (librdkafka's bound).
fn millis(duration: Duration, min: u128) -> u128 {
    duration.as_millis().clamp(min, i32::MAX as u128)
}

/// Creates `topics` with `partitions` partitions each, where missing.
async fn create_topics(
    config: &ClientConfig,
    topics: &[&str],
    partitions: i32,
) -> Result<(), SourceError> {
    let admin: AdminClient<DefaultClientContext> = config
        .create()
        .map_err(|e| SourceError::new("creating the Kafka admin client", e))?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|topic| NewTopic::new(topic, partitions, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().request_timeout(Some(Timeout::After(CONNECT_TIMEOUT)));
    let results = admin
        .create_topics(&new, &options)
        .await
        .map_err(|e| SourceError::new("creating the Kafka topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(SourceError::new(
                    format!("creating the Kafka topic {topic:?}"),
                    code.to_string(),
                ));
            }
        }
    }
    Ok(())
}

/// A Kafka topic read by a consumer group (see the [module](self)).
pub struct Kafka {
    shared: Arc<Shared>,
    producer: FutureProducer,
    dead_letters: String,
    /// Says when the polling thread has committed and left the group.
    stopped: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl fmt::Debug for Kafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kafka")
            .field("topic", &self.shared.topic)
            .field("dead_letters", &self.dead_letters)
            .finish_non_exhaustive()
    }
}

impl Kafka {
    /// A source reading `topic` from `brokers` (`host:port[,host:port]`) in consumer group
    /// `group`.
    pub fn builder(
        brokers: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
    ) -> KafkaBuilder {
        KafkaBuilder {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            member: None,
            dead_letters: None,
            create: None,
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            buffer: DEFAULT_BUFFER,
            revoke_wait: DEFAULT_REVOKE_WAIT,
            commit_every: DEFAULT_COMMIT_EVERY,
            config: Vec::new(),
        }
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.shared.topic
    }

    /// The dead-letter topic.
    pub fn dead_letter_topic(&self) -> &str {
        &self.dead_letters
    }

    /// The offset each partition this consumer holds would be committed at now (the lowest
    /// record in hand not yet answered, or the one after the last answered), for partitions
    /// where anything was answered.
    pub fn positions(&self) -> Vec<(i32, i64)> {
        let state = self.shared.lock();
        let mut positions: Vec<(i32, i64)> = state
            .partitions
            .iter()
            .filter_map(|(partition, owned)| Some((*partition, owned.offsets.position()?)))
            .collect();
        positions.sort_unstable();
        positions
    }
}

impl Drop for Kafka {
    /// Stops polling, commits what is answered and leaves the group, waiting up to 10 s.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let stopped = self
            .stopped
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(stopped) = stopped {
            let _ = stopped.recv_timeout(CONNECT_TIMEOUT);
        }
    }
}

/// The source's handle on one record.
#[derive(Debug, Clone)]
pub struct KafkaDelivery {
    partition: i32,
    offset: i64,
    /// The assignment it was received under: an answer after its partition was revoked (and
    /// perhaps assigned again) is not this consumer's to give.
    generation: u64,
    message: Message,
}

impl KafkaDelivery {
    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The record's offset.
    pub fn offset(&self) -> i64 {
        self.offset
    }
}

/// What the source's thread, the rebalance callbacks and the runtime's calls share.
struct Shared {
    topic: String,
    revoke_wait: Duration,
    buffer: usize,
    state: Mutex<State>,
    /// Signalled when a record in hand is answered (a revocation may be waiting).
    answered: Condvar,
    /// Signalled when records arrive or a retry is queued.
    arrived: tokio::sync::Notify,
    stop: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The partitions assigned to this consumer.
    partitions: HashMap<i32, Owned>,
    /// Records received, not yet handed to the runtime.
    buffer: VecDeque<Received<KafkaDelivery>>,
    /// Records to hand to the runtime again, and when.
    retries: Vec<(Instant, Received<KafkaDelivery>)>,
    generation: u64,
    /// Whether fetching is paused (the buffer is full).
    paused: bool,
    /// The client's last error, for the next `receive` to report.
    error: Option<String>,
}

struct Owned {
    generation: u64,
    offsets: Offsets,
    /// Records handed to the runtime and not answered.
    in_hand: usize,
    /// The offset last committed (or being committed).
    committed: Option<i64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A record fetched by the polling thread.
    fn arrive(&self, record: &BorrowedMessage<'_>) {
        if record.topic() != self.topic {
            return;
        }
        let (partition, offset) = (record.partition(), record.offset());
        let mut message = Message::new(
            format!("{partition}@{offset}"),
            Bytes::copy_from_slice(record.payload().unwrap_or_default()),
        );
        if let Some(key) = record.key() {
            message = message.with_key(Bytes::copy_from_slice(key));
        }
        // The client panics on a header name that is not UTF-8: such a record is delivered
        // without its headers rather than ending this thread.
        let headers = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            record.headers().map_or_else(Vec::new, |headers| {
                headers
                    .iter()
                    .map(|h| {
                        let value = Bytes::copy_from_slice(h.value.unwrap_or_default());
                        (h.key.to_owned(), value)
                    })
                    .collect()
            })
        }))
        .unwrap_or_else(|_| {
            tracing::warn!(
                topic = self.topic,
                partition,
                offset,
                "a header name of the record is not UTF-8: delivered without its headers"
            );
            Vec::new()
        });
        for (name, value) in headers {
            if name == KEY_HEADER
                && let Ok(id) = std::str::from_utf8(&value)
            {
                message = message.with_id(id);
            }
            message = message.with_field(name, value);
        }
        let mut state = self.lock();
        let generation = state.generation;
        // A record of a partition not (or no longer) assigned: its owner fetches it.
        let Some(owned) = state.partitions.get_mut(&partition) else {
            return;
        };
        if owned.generation != generation {
            return;
        }
        owned.offsets.received(offset);
        let delivery = KafkaDelivery {
            partition,
            offset,
            generation,
            message: message.clone(),
        };
        state.buffer.push_back(Received { message, delivery });
        drop(state);
        self.arrived.notify_one();
    }

    /// The partitions of this source's topic in `list`.
    fn partitions_in(&self, list: &TopicPartitionList) -> Vec<i32> {
        list.elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect()
    }

    /// A commit of `list` failed: its partitions are committed again at the next tick.
    fn uncommitted(&self, list: &TopicPartitionList) {
        let mut state = self.lock();
        for partition in self.partitions_in(list) {
            if let Some(owned) = state.partitions.get_mut(&partition) {
                owned.committed = None;
            }
        }
    }

    /// Runs `f` on the record's partition if `delivery` is still this consumer's to answer.
    fn owned<T>(&self, delivery: &KafkaDelivery, f: impl FnOnce(&mut Owned) -> T) -> Option<T> {
        let mut state = self.lock();
        let owned = state.partitions.get_mut(&delivery.partition)?;
        (owned.generation == delivery.generation).then(|| f(owned))
    }

    /// The record is answered: its partition may commit past it.
    fn answer(&self, delivery: &KafkaDelivery) {
        let answered = self.owned(delivery, |owned| {
            owned.in_hand = owned.in_hand.saturating_sub(1);
            owned.offsets.answered(delivery.offset);
        });
        if answered.is_none() {
            tracing::debug!(
                partition = delivery.partition,
                offset = delivery.offset,
                "answered a Kafka record whose partition was revoked meanwhile: its next owner \
                 delivers it again"
            );
        }
        self.answered.notify_all();
    }

    /// Hands the record to the runtime again after `delay`, numbered as its next delivery.
    fn again(&self, delivery: &KafkaDelivery, delay: Duration) {
        let mut state = self.lock();
        let Some(owned) = state.partitions.get_mut(&delivery.partition) else {
            return;
        };
        if owned.generation != delivery.generation {
            return;
        }
        owned.in_hand = owned.in_hand.saturating_sub(1);
        let mut delivery = delivery.clone();
        delivery.message = delivery
            .message
            .clone()
            .with_deliveries(delivery.message.deliveries().saturating_add(1));
        let due = Instant::now()
            .checked_add(delay)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400));
        state.retries.push((
            due,
            Received {
                message: delivery.message.clone(),
                delivery,
            },
        ));
        drop(state);
        self.answered.notify_all();
        self.arrived.notify_one();
    }

    /// Partitions revoked: drops their records not in hand, waits for those in hand (up to
    /// `revoke_wait`), and returns the offsets to commit before giving them up.
    fn revoke(&self, revoked: &[i32]) -> TopicPartitionList {
        let mut state = self.lock();
        state
            .buffer
            .retain(|r| !revoked.contains(&r.delivery.partition));
        state
            .retries
            .retain(|(_, r)| !revoked.contains(&r.delivery.partition));
        // A wait too long to add to the clock (`Duration::MAX`): a year.
        let deadline = Instant::now()
            .checked_add(self.revoke_wait)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400));
        loop {
            let busy = revoked
                .iter()
                .filter_map(|p| state.partitions.get(p))
                .map(|owned| owned.in_hand)
                .sum::<usize>();
            let now = Instant::now();
            if busy == 0 || now >= deadline {
                if busy > 0 {
                    tracing::warn!(
                        topic = self.topic,
                        records = busy,
                        "partitions revoked with records still in hand after {:?}: they are \
                         abandoned to the partitions' next owner",
                        self.revoke_wait
                    );
                }
                break;
            }
            state = self
                .answered
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let mut commits = TopicPartitionList::new();
        for partition in revoked {
            if let Some(owned) = state.partitions.remove(partition)
                && let Some(position) = owned.offsets.position()
                && owned.committed != Some(position)
            {
                let _ =
                    commits.add_partition_offset(&self.topic, *partition, Offset::Offset(position));
            }
        }
        commits
    }
}

/// The consumer's callbacks: rebalances and commits.
struct Context {
    shared: Arc<Shared>,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(list) => {
                let revoked = self.shared.partitions_in(list);
                tracing::info!(
                    topic = self.shared.topic,
                    ?revoked,
                    "Kafka partitions revoked"
                );
                let commits = self.shared.revoke(&revoked);
                if commits.count() > 0
                    && let Err(error) = consumer.commit(&commits, CommitMode::Sync)
                {
                    tracing::warn!(
                        topic = self.shared.topic,
                        %error,
                        "cannot commit revoked partitions: their next owner delivers their \
                         answered records again (as duplicates)"
                    );
                }
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(error) => {
                tracing::warn!(topic = self.shared.topic, %error, "Kafka rebalance failed");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let assigned = self.shared.partitions_in(list);
            tracing::info!(
                topic = self.shared.topic,
                ?assigned,
                "Kafka partitions assigned"
            );
            let mut state = self.shared.lock();
            state.generation += 1;
            let generation = state.generation;
            for partition in assigned {
                state.partitions.insert(
                    partition,
                    Owned {
                        generation,
                        offsets: Offsets::default(),
                        in_hand: 0,
                        committed: None,
                    },
                );
            }
            // A new assignment fetches unpaused.
            state.paused = false;
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(error) = result {
            tracing::warn!(topic = self.shared.topic, %error, "Kafka commit failed; committed again at the next tick");
            self.shared.uncommitted(offsets);
        }
    }
}

/// The polling thread: fetches into the buffer (pausing while it is full), serves the
/// rebalance callbacks, and commits every `commit_every`, until the source is dropped.
fn poll(consumer: &BaseConsumer<Context>, shared: &Shared, commit_every: Duration) {
    let mut last_commit = Instant::now();
    // Since when the buffer has been full without a pause.
    let mut full_since: Option<Instant> = None;
    while !shared.stop.load(Ordering::SeqCst) {
        let flow = {
            let mut state = shared.lock();
            let waiting = state.buffer.len();
            let full = waiting >= shared.buffer;
            if !full || state.paused {
                full_since = None;
            }
            // A full buffer is usually taken from within milliseconds: the client's own
            // queue holds what it fetched ahead meanwhile. Only a buffer full for longer (the
            // handlers stuck, or slower than the broker) pauses the partitions, so that the
            // thread can go on polling (the group's liveness, rebalances) without taking
            // records; they are resumed once half the buffer is taken. (A pause drops what
            // the client fetched ahead; it fetches it again after the resume.)
            if full && !state.paused {
                let since = *full_since.get_or_insert_with(Instant::now);
                if since.elapsed() < PAUSE_AFTER {
                    drop(state);
                    if last_commit.elapsed() >= commit_every {
                        commit(consumer, shared, CommitMode::Async);
                        last_commit = Instant::now();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
            }
            let change = if !state.paused && full {
                Some(true)
            } else if state.paused && waiting <= shared.buffer / 2 {
                Some(false)
            } else {
                None
            };
            if let Some(pause) = change {
                state.paused = pause;
            }
            change
        };
        if let Some(pause) = flow {
            match consumer.assignment() {
                Ok(assignment) => {
                    let changed = if pause {
                        consumer.pause(&assignment)
                    } else {
                        consumer.resume(&assignment)
                    };
                    if let Err(error) = changed {
                        tracing::warn!(%error, "cannot pause or resume Kafka partitions");
                        shared.lock().paused = !pause;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot read the Kafka assignment");
                    shared.lock().paused = !pause;
                }
            }
        }
        match consumer.poll(POLL) {
            Some(Ok(record)) => shared.arrive(&record),
            Some(Err(error)) => {
                tracing::debug!(%error, "Kafka poll failed");
                shared.lock().error = Some(error.to_string());
            }
            None => {}
        }
        if last_commit.elapsed() >= commit_every {
            commit(consumer, shared, CommitMode::Async);
            last_commit = Instant::now();
        }
    }
}

/// Commits every partition whose position moved since its last commit.
fn commit(consumer: &BaseConsumer<Context>, shared: &Shared, mode: CommitMode) {
    let mut list = TopicPartitionList::new();
    {
        let mut state = shared.lock();
        for (partition, owned) in &mut state.partitions {
            if let Some(position) = owned.offsets.position()
                && owned.committed != Some(position)
            {
                let _ =
                    list.add_partition_offset(&shared.topic, *partition, Offset::Offset(position));
                owned.committed = Some(position);
            }
        }
    }
    if list.count() == 0 {
        return;
    }
    if let Err(error) = consumer.commit(&list, mode) {
        tracing::warn!(%error, "cannot commit Kafka offsets; committed again at the next tick");
        shared.uncommitted(&list);
    }
}

impl Source for Kafka {
    type Delivery = KafkaDelivery;

    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<KafkaDelivery>>, SourceError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            let arrived = self.shared.arrived.notified();
            let next_retry = {
                let mut state = self.shared.lock();
                let now = Instant::now();
                let mut out = Vec::new();
                // Retries that are due first, then records in the order fetched.
                let mut i = 0;
                while i < state.retries.len() && out.len() < max {
                    if state.retries[i].0 <= now {
                        out.push(state.retries.swap_remove(i).1);
                    } else {
                        i += 1;
                    }
                }
                while out.len() < max {
                    match state.buffer.pop_front() {
                        Some(received) => out.push(received),
                        None => break,
                    }
                }
                out.retain(|r| {
                    state
                        .partitions
                        .get(&r.delivery.partition)
                        .is_some_and(|owned| owned.generation == r.delivery.generation)
                });
                for received in &out {
                    if let Some(owned) = state.partitions.get_mut(&received.delivery.partition) {
                        owned.in_hand += 1;
                    }
                }
                if !out.is_empty() {
                    return Ok(out);
                }
                if let Some(error) = state.error.take() {
                    return Err(SourceError::new("polling Kafka", error));
                }
                state.retries.iter().map(|(due, _)| *due).min()
            };
            let mut wake = deadline;
            if let Some(due) = next_retry {
                wake = wake.min(tokio::time::Instant::from_std(due));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(Vec::new());
            }
            let _ = tokio::time::timeout_at(wake, arrived).await;
        }
    }

    async fn ack(&self, delivery: &KafkaDelivery) -> Result<(), SourceError> {
        self.shared.answer(delivery);
        Ok(())
    }

    async fn retry(&self, delivery: &KafkaDelivery, delay: Duration) -> Result<(), SourceError> {
        self.shared.again(delivery, delay);
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &KafkaDelivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        if self.shared.owned(delivery, |_| ()).is_none() {
            return Ok(DeadLettered::Already);
        }
        let mut headers = OwnedHeaders::new_with_capacity(message.fields().len() + 4);
        for (name, value) in message.fields() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_ref()),
            });
        }
        let partition = delivery.partition.to_string();
        let offset = delivery.offset.to_string();
        for (name, value) in [
            ("reason", reason),
            ("source-topic", self.shared.topic.as_str()),
            ("source-partition", partition.as_str()),
            ("source-offset", offset.as_str()),
        ] {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.dead_letters).payload(message.body().as_ref());
        if let Some(key) = message.key() {
            record = record.key(key.as_ref());
        }
        record = record.headers(headers);
        match self.producer.send(record, DEAD_LETTER_TIMEOUT).await {
            Ok(_) => {
                self.shared.answer(delivery);
                Ok(DeadLettered::Now)
            }
            Err((error, _)) => {
                // Not answered: this source delivers it again (and dead-letters it then).
                self.shared.again(delivery, DEAD_LETTER_RETRY);
                Err(SourceError::new(
                    format!("dead-lettering to {:?}", self.dead_letters),
                    error,
                ))
            }
        }
    }

    fn counts_deliveries(&self) -> bool {
        false
    }
}
