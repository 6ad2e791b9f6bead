//! The relay: delivers the outbox's committed messages, at least once, with their keys.
//!
//! (Longer than most files here, on purpose: the relay's builder, its loop and its SQL
//! share one set of settings, and about 150 lines are the documentation of its delivery
//! guarantees.)

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgListener, PgPool};
// The executor's own methods, for `Send` futures: see the note in the parent module.
use sqlx::{Executor as _, Row as _};

use super::sink::{Relayed, Sink, SinkError};
use super::table::{MAX_OUTBOX_DELAY, Outbox, RELAY_CRASHED, TAKEN_HOLD};
use super::{OUTBOX_DEAD, OUTBOX_DELIVERIES, OUTBOX_OLDEST_PENDING_AGE, OUTBOX_PENDING};
use crate::{micros, store_error};
use idempotent_core::StoreError;

/// Messages per batch unless [`RelayBuilder::batch_size`] says otherwise. With 0.3's 32, a
/// relay spent most of its time on each batch's statements (BENCHMARKS.md, "0.4: the relay's
/// batch").
pub const DEFAULT_BATCH_SIZE: u32 = 256;

/// Deliveries of a batch under way at once unless [`RelayBuilder::max_in_flight`] says
/// otherwise (0.3 delivered a whole batch at once: 32).
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 64;

/// The bytes of payloads a batch takes at most unless [`RelayBuilder::max_batch_bytes`] says
/// otherwise: 32 MiB (a batch takes its first message however large).
pub const DEFAULT_MAX_BATCH_BYTES: u64 = 32 << 20;

/// Batches of one relay under way at once unless [`RelayBuilder::concurrent_batches`] says
/// otherwise: while one batch delivers and records its messages, the next is taken (0.3 ran
/// one batch at a time).
pub const DEFAULT_CONCURRENT_BATCHES: u32 = 2;

/// The most batches one relay has under way at once, whatever
/// [`RelayBuilder::concurrent_batches`] says: 64.
pub const MAX_CONCURRENT_BATCHES: u32 = 64;

/// What one [`Relay::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batch {
    /// Messages taken.
    pub taken: usize,
    /// Delivered.
    pub delivered: usize,
    /// Failed, to be tried again after a backoff.
    pub retried: usize,
    /// Failed for the last time, or permanently, or their relays died while delivering them
    /// `max_attempts` times: dead-lettered.
    pub dead: usize,
}

/// Settings of a [`Relay`]; see [`RelayBuilder`].
#[derive(Debug, Clone)]
struct Settings {
    batch_size: u32,
    concurrent_batches: u32,
    max_in_flight: u32,
    max_batch_bytes: u64,
    poll_interval: Duration,
    max_attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    delivery_timeout: Duration,
    retain_delivered: Duration,
    reap_every: Duration,
}

/// Delivers an [`Outbox`]'s committed messages to [`Sink`]s, at least once.
///
/// ```no_run
/// use idempotent_postgres::outbox::{Outbox, Relay};
/// # use idempotent_postgres::outbox::{BoxFuture, Relayed, Sink, SinkError};
/// # struct Notifier;
/// # impl Sink for Notifier {
/// #     fn deliver<'a>(&'a self, _: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
/// #         Box::pin(async { Ok(()) })
/// #     }
/// # }
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new();
/// outbox.migrate(&pool).await?;
/// let relay = Relay::builder(pool, outbox).sink("notifications", Notifier).build();
/// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
/// # Ok(())
/// # }
/// ```
///
/// # How it delivers
///
/// - **Connections.** It uses two of the pool's connections: one for the batch, one
///   listening. Give it a pool of at least two, and one more for each batch it may run
///   beside the first (see "Concurrent batches"): those take only connections the pool has
///   to spare.
/// - **Taking a batch.** A batch starts with one statement, committed on its own: it takes up
///   to [`batch_size`](RelayBuilder::batch_size) pending messages that are due, whose
///   destination has a sink here, and that are the oldest pending message of their ordering
///   key (if they have one), with `SELECT … FOR UPDATE SKIP LOCKED`, and **counts the attempt
///   before anything is sent**: `attempts` goes up, `delivering_since` is set, and the message
///   is not due for 5 s. The cost does not grow with the messages waiting behind an ordering
///   key's oldest one (see [`Outbox`]'s table). A message whose last relay died while
///   delivering it is a *suspect*, and is **taken alone**: a batch of one (see "A relay that
///   dies").
/// - **Delivering under row locks.** The batch's transaction then locks the messages it took
///   (`FOR UPDATE`, each only if it still has the attempt count it took), delivers them
///   concurrently, at most [`max_in_flight`](RelayBuilder::max_in_flight) at a time, each
///   within [`delivery_timeout`](RelayBuilder::delivery_timeout), records
///   each outcome and commits. Another relay skips the locked rows, so **many relays share
///   the work and never deliver one message at the same time**; a message another relay took
///   over in between (only possible if this relay needed more than the 5 s to lock it: its
///   count changed) is left to that relay.
/// - **A relay that dies.** A relay that dies mid-batch (a crash, SIGKILL, running out of
///   memory, a lost connection) releases its locks with its connection, but its attempts were
///   counted: 5 s after it took them its messages are taken again by the next batch, which
///   is why delivery is *at least once* and the receiver must deduplicate on the key. Their
///   `last_error` then reads `relay_crashed: a relay died while delivering it (attempt N) …`.
///   **Crashes are charged per message, not per batch**: every message of the dead relay's
///   batch had its attempt counted, but none is known to be the one that killed it, so each
///   is taken again *alone*, in a batch of one, and only a crash during a delivery of that
///   message alone can be its last attempt. A message that makes its relay die each time it is
///   delivered (a sink that aborts on it, a payload that exhausts memory) is therefore
///   dead-lettered, with that error, once its attempts reach
///   [`max_attempts`](RelayBuilder::max_attempts) and its last one was made alone: it does not
///   take every relay down forever, the messages behind it on its ordering key flow again, and
///   the innocent messages of its batches are delivered (again, if the dead relay had sent
///   them: at least once), never dead-lettered for its crashes. A message whose attempts
///   reached the limit in a crashed batch of several gets one more attempt, alone (so with
///   `max_attempts(1)` such a message is tried twice). The batches of one go on at once, one
///   after the other, until no suspect is due; many relays take suspects in parallel.
///   A relay frozen with its connection open holds its rows until PostgreSQL ends its
///   transaction after `idle_in_transaction_session_timeout`, set for the batch to the
///   delivery timeout times one more than its turns of `max_in_flight` deliveries, plus 5 s
///   (twice the delivery timeout plus 5 s for a batch of one turn); if it then wakes in the
///   middle of a delivery, that delivery can overlap another relay's. So can one still
///   running when its connection was cut under it (the server restarted,
///   `pg_terminate_backend`, a network partition): its locks went with the connection. The
///   key makes both harmless; both count as a relay that died.
/// - **Concurrent batches.** While batches come back full (a backlog), up to
///   [`concurrent_batches`](RelayBuilder::concurrent_batches) (default 2) are under way at
///   once: one is taken while another delivers and records its messages. They share the work
///   as separate relays do (the take skips what another batch holds, and an ordering key's
///   next message waits until its head is recorded), with one difference: a relay that dies
///   takes all its batches with it, so "alone" means alone in the relay's [`run`](Self::run).
///   A batch beside others takes no suspect and counts nothing it takes as delivered alone (a
///   crash then charges its messages as a crashed batch of several); a suspect is taken only
///   by a batch that waited for the relay's others to end, and none starts until it has. After
///   waiting for work (a notification, the poll), and when a batch beside others left a
///   suspect (the next starts its search where that one did), the relay's next batch is such
///   a batch. A relay that dies now charges up to `concurrent_batches × batch_size` messages,
///   each then taken again alone; a sink sees up to `concurrent_batches × max_in_flight`
///   deliveries at once. Relays of their own (separate `run`s, clones included, and
///   [`run_once`](Self::run_once)) are separate relays, in one process as in many: give a
///   process one relay per outbox, with the batches it needs, for "alone" to hold when the
///   process dies.
/// - **Waking.** It listens for the `NOTIFY` each enqueue sends on commit, and also polls
///   every [`poll_interval`](RelayBuilder::poll_interval), so a lost notification or a
///   dropped listener connection delays a message by at most one interval. While batches
///   come back full (or cut short by [`max_batch_bytes`](RelayBuilder::max_batch_bytes)), it
///   takes the next at once.
/// - **Failures.** A failed delivery (an error, the timeout, a sink that panicked) is tried
///   again after an exponential backoff (from
///   [`backoff`](RelayBuilder::backoff)'s first delay, doubling, capped, with jitter); after
///   [`max_attempts`](RelayBuilder::max_attempts) attempts, or at once for a
///   [`SinkError::permanent`], the message is **dead-lettered**: kept with `state = 'dead'`
///   and its last error, listed by [`Outbox::dead_letters`], put back by
///   [`Outbox::requeue`]. A dead-lettered message no longer holds back later messages with
///   its ordering key (so a requeued one may follow them). A row that cannot be read
///   (edited by hand) is dead-lettered with the reason.
/// - **Reaping and the backlog.** Every [`reap_every`](RelayBuilder::reap_every), delivered
///   messages older than [`retain_delivered`](RelayBuilder::retain_delivered) are deleted,
///   and the [backlog](Outbox::backlog) is read into the gauges [`OUTBOX_PENDING`],
///   [`OUTBOX_DEAD`] and [`OUTBOX_OLDEST_PENDING_AGE`].
/// - **The database down.** A batch that fails is logged and tried again after the poll
///   interval; nothing is lost (messages not recorded as delivered are delivered again, as
///   after a relay that died).
/// - **Memory.** A batch holds each payload once: each row is dropped as soon as its message
///   is read from it, and each message is moved, not copied, to its delivery. At most
///   [`max_batch_bytes`](RelayBuilder::max_batch_bytes) of payloads (32 MiB by default), or
///   one message's when it alone is larger (at most
///   [`MAX_OUTBOX_PAYLOAD`](super::MAX_OUTBOX_PAYLOAD)), plus one being read; the messages'
///   keys and headers besides. (0.3's batches were bounded by their count alone: up to
///   512 MiB.)
///
/// It counts each attempt in [`OUTBOX_DELIVERIES`] by result, with the recorder installed
/// when it was [built](RelayBuilder::build).
#[derive(Clone)]
pub struct Relay {
    pool: PgPool,
    outbox: Outbox,
    sinks: Arc<HashMap<String, Arc<dyn Sink>>>,
    destinations: Arc<[String]>,
    settings: Settings,
    metrics: Arc<RelayMetrics>,
    /// The batch statement, for this relay's batch size.
    take: Arc<str>,
    /// The ordering key after which the next batch looks for heads first: the last key this
    /// relay took, so that every key gets its turn however many have messages due.
    cursor: Arc<std::sync::Mutex<String>>,
}

/// The relay's counters, registered when it is built.
struct RelayMetrics {
    delivered: metrics::Counter,
    retried: metrics::Counter,
    dead: metrics::Counter,
    pending_now: metrics::Gauge,
    dead_now: metrics::Gauge,
    oldest_pending_age: metrics::Gauge,
}

impl RelayMetrics {
    fn register() -> Self {
        metrics::describe_counter!(
            OUTBOX_DELIVERIES,
            metrics::Unit::Count,
            "Delivery attempts of outbox messages, by result"
        );
        metrics::describe_gauge!(
            OUTBOX_PENDING,
            metrics::Unit::Count,
            "Outbox messages not delivered yet"
        );
        metrics::describe_gauge!(OUTBOX_DEAD, metrics::Unit::Count, "Outbox dead letters");
        metrics::describe_gauge!(
            OUTBOX_OLDEST_PENDING_AGE,
            metrics::Unit::Seconds,
            "How long the oldest pending outbox message has waited"
        );
        let counter =
            |result: &'static str| metrics::counter!(OUTBOX_DELIVERIES, "result" => result);
        RelayMetrics {
            delivered: counter("delivered"),
            retried: counter("retried"),
            dead: counter("dead"),
            pending_now: metrics::gauge!(OUTBOX_PENDING),
            dead_now: metrics::gauge!(OUTBOX_DEAD),
            oldest_pending_age: metrics::gauge!(OUTBOX_OLDEST_PENDING_AGE),
        }
    }
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.outbox)
            .field("destinations", &self.destinations)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Relay`].
#[must_use]
pub struct RelayBuilder {
    pool: PgPool,
    outbox: Outbox,
    sinks: HashMap<String, Arc<dyn Sink>>,
    settings: Settings,
}

impl RelayBuilder {
    /// Delivers the messages of `destination` to `sink`. A relay takes only the messages of
    /// the destinations it has sinks for, so relays with different sinks can share an outbox.
    pub fn sink(mut self, destination: impl Into<String>, sink: impl Sink) -> Self {
        self.sinks.insert(destination.into(), Arc::new(sink));
        self
    }

    /// Messages per batch (default 256, at least 1). A batch costs its statements whatever
    /// its size, so larger batches drain a backlog faster; a relay that dies charges an
    /// attempt to each message of its batches under way (see "A relay that dies" and
    /// "Concurrent batches"), each of which is then taken again alone. See also
    /// [`max_batch_bytes`](Self::max_batch_bytes).
    pub fn batch_size(mut self, size: u32) -> Self {
        self.settings.batch_size = size.max(1);
        self
    }

    /// Batches under way at once in [`Relay::run`] (default 2, at least 1): while the
    /// batches come back full (a backlog), the next is taken while the last delivers and
    /// records its messages, each batch on a connection of its own. The batches beyond the
    /// first are run only with a connection the pool has to spare (an idle one, or room for a
    /// new one, waiting at most a second for it). A message taken again after its relay died
    /// (a *suspect*) is delivered only by a batch that has the relay to itself; see
    /// "Concurrent batches". A sink is called for up to this times
    /// [`max_in_flight`](Self::max_in_flight) messages at once. `1` is 0.3's relay, one batch
    /// at a time; more than [`MAX_CONCURRENT_BATCHES`] is that many.
    pub fn concurrent_batches(mut self, batches: u32) -> Self {
        self.settings.concurrent_batches = batches.clamp(1, MAX_CONCURRENT_BATCHES);
        self
    }

    /// The payloads a batch takes add up to at most this many bytes (default 32 MiB), except
    /// that a batch always takes its first message, however large (up to
    /// [`MAX_OUTBOX_PAYLOAD`](super::MAX_OUTBOX_PAYLOAD)): what a batch holds in memory (see
    /// "Memory"). The messages left out are due for the next batch, taken at once. Each take
    /// still locks up to `batch_size` candidates of each kind for its statement's length.
    pub fn max_batch_bytes(mut self, bytes: u64) -> Self {
        self.settings.max_batch_bytes = bytes;
        self
    }

    /// Deliveries of one batch under way at once (default 64, at least 1): a batch calls its
    /// sinks for at most this many messages at a time, the rest of the batch waiting their
    /// turn (a relay's sinks, for at most this times
    /// [`concurrent_batches`](Self::concurrent_batches)).
    /// The batch's idle-transaction timeout grows with its turns (see
    /// [`delivery_timeout`](Self::delivery_timeout)).
    pub fn max_in_flight(mut self, deliveries: u32) -> Self {
        self.settings.max_in_flight = deliveries.max(1);
        self
    }

    /// How often to look for due messages without a notification (default 1 s, at least
    /// 1 ms). [`Duration::MAX`], or any interval too long for the clock, is never: the relay
    /// then waits for notifications alone.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.settings.poll_interval = every.max(Duration::from_millis(1));
        self
    }

    /// Attempts before a message is dead-lettered (default 10, at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts.clamp(1, i32::MAX as u32);
        self
    }

    /// The backoff after a failed attempt: `first` after the first, doubling after each, at
    /// most `max`, each drawn between half and all of that (default 1 s and 5 min). Both are
    /// at most 365 days: a longer one, [`Duration::MAX`] included, is 365 days.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.first_backoff = first;
        self.settings.max_backoff = max.max(first);
        self
    }

    /// How long one delivery may take before it counts as failed (default 30 s, at least
    /// 1 ms). [`Duration::MAX`], or any timeout too long for the clock, is none: a delivery
    /// may take as long as its sink does. The batch's idle-transaction timeout (this times
    /// one more than the batch's turns of [`max_in_flight`](Self::max_in_flight) deliveries,
    /// plus 5 s: twice this plus 5 s for a batch of one turn; see "How it delivers") is at
    /// most PostgreSQL's largest, about 24.8 days.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.settings.delivery_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long delivered messages are kept before reaping (default 1 h). At most 365 days:
    /// a longer one, [`Duration::MAX`] included, is 365 days.
    pub fn retain_delivered(mut self, retain: Duration) -> Self {
        self.settings.retain_delivered = retain;
        self
    }

    /// How often delivered messages are reaped and the backlog gauges read (default 1 min,
    /// at least 1 ms). [`Duration::MAX`] is never.
    pub fn reap_every(mut self, every: Duration) -> Self {
        self.settings.reap_every = every.max(Duration::from_millis(1));
        self
    }

    /// The relay. Its metrics are registered with the recorder installed now.
    pub fn build(self) -> Relay {
        let mut destinations: Vec<String> = self.sinks.keys().cloned().collect();
        destinations.sort();
        let take = self
            .outbox
            .sql()
            .take(self.settings.batch_size, self.settings.max_batch_bytes)
            .into();
        Relay {
            take,
            pool: self.pool,
            outbox: self.outbox,
            sinks: Arc::new(self.sinks),
            destinations: destinations.into(),
            settings: self.settings,
            metrics: Arc::new(RelayMetrics::register()),
            cursor: Arc::default(),
        }
    }
}

/// How one message's delivery ended.
enum Delivered {
    Ok(i64),
    Failed(i64, u32, SinkError),
}

/// How a batch of [`Relay::run`] shares its relay with the relay's other batches (see
/// "Concurrent batches").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// Alone: no other batch of the relay is under way, so it may take a suspect, and a
    /// message it takes alone was delivered alone.
    Exclusive,
    /// Beside others: takes no suspect, and nothing it takes counts as delivered alone.
    Shared,
}

/// What one batch found, beyond its [`Batch`].
#[derive(Debug, Default)]
struct Outcome {
    batch: Batch,
    /// The byte budget left due messages out: the next batch is due at once.
    cut: bool,
    /// A suspect was among the candidates: taken alone (an exclusive batch), or left for an
    /// exclusive batch (a shared one).
    suspects: bool,
}

impl Outcome {
    /// Whether more messages are due at once after this batch.
    fn more(&self, batch_size: u32) -> bool {
        self.cut || self.suspects || self.batch.taken >= batch_size as usize
    }
}

/// After a batch of the leading lane (`None`: it failed): whether the next is due at once,
/// and its lane. Beside helpers through a backlog; alone after a suspect was taken or left
/// (`left`: a batch beside others left one, and the next starts its search where that one
/// did), and whenever the relay comes back to the outbox after waiting.
fn next_lane(helped: bool, outcome: Option<&Outcome>, left: bool, batch_size: u32) -> (bool, Lane) {
    let Some(outcome) = outcome else {
        return (false, Lane::Exclusive);
    };
    let more = outcome.more(batch_size) || left;
    let lane = if helped && more && !outcome.suspects && !left {
        Lane::Shared
    } else {
        Lane::Exclusive
    };
    (more, lane)
}

/// What the concurrent batches of one [`Relay::run`] share.
struct Lanes {
    /// Held shared by a batch beside others, exclusively by a batch that must have the relay
    /// to itself (one that may take a suspect): see "Concurrent batches".
    gate: tokio::sync::RwLock<()>,
    /// Where the next exclusive batch starts its search: the cursor a batch beside others
    /// started from when it left a suspect or failed, or that an exclusive batch started from
    /// and put back (it took a suspect, or failed). The leading lane waits on it too.
    suspect_at: tokio::sync::watch::Sender<Option<String>>,
    /// The leading batch found a backlog: helpers, take batches beside it.
    backlog: tokio::sync::Notify,
}

impl Lanes {
    fn new() -> Self {
        Lanes {
            gate: tokio::sync::RwLock::new(()),
            suspect_at: tokio::sync::watch::Sender::new(None),
            backlog: tokio::sync::Notify::new(),
        }
    }

    /// Marks `cursor` as where the next exclusive batch starts, unless a mark is there.
    fn leave_suspect(&self, cursor: &str) {
        self.suspect_at.send_if_modified(|at| {
            if at.is_some() {
                return false;
            }
            *at = Some(cursor.to_owned());
            true
        });
    }

    /// Whether a mark is there.
    fn suspect_left(&self) -> bool {
        self.suspect_at.borrow().is_some()
    }
}

/// A row the batch statement took, read.
enum Taken {
    /// To deliver.
    Outgoing(Relayed),
    /// To dead-letter without delivering: the row cannot be read (its id, attempt and why).
    Unreadable(i64, u32, sqlx::Error),
}

impl Relay {
    /// A relay for `outbox` on `pool`, without sinks yet.
    pub fn builder(pool: PgPool, outbox: Outbox) -> RelayBuilder {
        RelayBuilder {
            pool,
            outbox,
            sinks: HashMap::new(),
            settings: Settings {
                batch_size: DEFAULT_BATCH_SIZE,
                concurrent_batches: DEFAULT_CONCURRENT_BATCHES,
                max_in_flight: DEFAULT_MAX_IN_FLIGHT,
                max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
                poll_interval: Duration::from_secs(1),
                max_attempts: 10,
                first_backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(300),
                delivery_timeout: Duration::from_secs(30),
                retain_delivered: Duration::from_secs(3600),
                reap_every: Duration::from_secs(60),
            },
        }
    }

    /// Deletes the messages delivered more than
    /// [`retain_delivered`](RelayBuilder::retain_delivered) ago, in batches of 1,000; returns
    /// how many. Pending messages and dead letters are kept. A running relay does this every
    /// [`reap_every`](RelayBuilder::reap_every); call it yourself to reap at a time of your
    /// choosing (from a scheduled job, say).
    pub async fn reap(&self) -> Result<u64, StoreError> {
        self.outbox
            .reap(&self.pool, self.settings.retain_delivered)
            .await
    }

    /// Delivers one batch: see "How it delivers". The batch is a relay of its own (see
    /// "Concurrent batches"): it does not wait for the batches of a [`run`](Self::run) on a
    /// clone, and may take a suspect.
    pub async fn run_once(&self) -> Result<Batch, StoreError> {
        let connection = self.pool.acquire().await.map_err(store_error)?;
        let cursor = lock(&self.cursor).clone();
        let outcome = self.run_batch(connection, false, &cursor, true).await?;
        Ok(outcome.batch)
    }

    /// One batch of [`run`](Self::run) in `lane`: the gate first, then the connection (a
    /// batch waiting for the gate holds no connection, so the batches it waits for can always
    /// get theirs), then the batch; `None` when `spare` and the pool has no connection to
    /// spare. A shared batch that saw a suspect (or failed) marks where it started; an
    /// exclusive one starts from that mark, and puts it back if it took a suspect (or failed).
    async fn batch_in(
        &self,
        lanes: &Lanes,
        lane: Lane,
        spare: bool,
    ) -> Option<Result<Outcome, StoreError>> {
        let (_exclusive, _shared);
        if lane == Lane::Exclusive {
            _exclusive = lanes.gate.write().await;
        } else {
            _shared = lanes.gate.read().await;
        }
        let connection = if spare {
            self.spare_connection().await?
        } else {
            match self.pool.acquire().await {
                Ok(connection) => connection,
                Err(error) => return Some(Err(store_error(error))),
            }
        };
        // An exclusive batch starts where a suspect was left, if one was (and then leaves the
        // relay's cursor where the others have moved it since).
        let start = match lane {
            Lane::Exclusive => lanes.suspect_at.send_replace(None),
            Lane::Shared => None,
        };
        let from_mark = start.is_some();
        let cursor = start.unwrap_or_else(|| lock(&self.cursor).clone());
        let result = self
            .run_batch(connection, lane == Lane::Shared, &cursor, !from_mark)
            .await;
        // The mark is left (or put back) where this batch started when a suspect may be
        // there still: a shared batch that saw one, or failed (after its take, perhaps, which
        // moved the relay's cursor past it); an exclusive batch from the mark that took one
        // (the next may be beside it) or failed.
        let suspects = result.as_ref().map_or(true, |outcome| outcome.suspects);
        if suspects && (lane == Lane::Shared || from_mark) {
            lanes.leave_suspect(&cursor);
        }
        Some(result)
    }

    /// A connection for a helping batch: an idle one, or a new one if the pool has room for
    /// it (waiting at most a second, should another task take that room first); `None` if
    /// the pool has none to spare.
    async fn spare_connection(&self) -> Option<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        if let Some(connection) = self.pool.try_acquire() {
            return Some(connection);
        }
        if self.pool.size() >= self.pool.options().get_max_connections() {
            return None;
        }
        tokio::time::timeout(Duration::from_secs(1), self.pool.acquire())
            .await
            .ok()?
            .ok()
    }

    /// Files how one delivery of a batch ended: delivered, or failed with its error.
    fn settle(
        &self,
        done: Result<Delivered, tokio::task::JoinError>,
        spawned: &HashMap<tokio::task::Id, (i64, u32)>,
        delivered: &mut Vec<i64>,
        failed: &mut Vec<(i64, u32, SinkError)>,
    ) {
        match done {
            Ok(Delivered::Ok(id)) => delivered.push(id),
            Ok(Delivered::Failed(id, attempt, error)) => failed.push((id, attempt, error)),
            // A sink that panicked failed this attempt: retried like any failure, and
            // dead-lettered after the last.
            Err(error) => {
                tracing::error!(outbox = %self.outbox.table(), error = %error, "an outbox sink panicked");
                if let Some((id, attempt)) = spawned.get(&error.id()) {
                    failed.push((*id, *attempt, SinkError::retry("the sink panicked")));
                }
            }
        }
    }

    /// Delivers one batch on `connection`, and says what it found. `shared`: beside other
    /// batches of the relay (the take takes no suspect and marks nothing alone). `cursor`:
    /// where the search for ordering keys' heads starts; `advance`: whether the batch then
    /// moves the relay's cursor past the keys it took.
    async fn run_batch(
        &self,
        mut connection: sqlx::pool::PoolConnection<sqlx::Postgres>,
        shared: bool,
        cursor: &str,
        advance: bool,
    ) -> Result<Outcome, StoreError> {
        let settings = &self.settings;
        // Committed at once (autocommit): each attempt is counted before anything is sent.
        let take = sqlx::query(&self.take)
            .bind(&self.destinations[..])
            .bind(i32::try_from(settings.max_attempts).unwrap_or(i32::MAX))
            .bind(cursor)
            .bind(shared);
        let mut rows = (&mut *connection)
            .fetch_all(take)
            .await
            .map_err(store_error)?;
        // Whether the next batch is due at once: the batch statement left due messages out for
        // the byte budget (`cut`), or took or left a suspect (a message whose last relay died
        // while delivering it, taken alone so that another crash charges it and nothing else;
        // see also "Concurrent batches"). Both come in every row, and in the one row of NULLs
        // the statement answers when it took nothing.
        let flag = |column| {
            rows.first()
                .and_then(|row| row.try_get::<bool, _>(column).ok())
        };
        let mut outcome = Outcome {
            cut: flag(11).unwrap_or(false),
            suspects: flag(12).unwrap_or(false),
            ..Outcome::default()
        };
        if rows
            .first()
            .is_some_and(|row| matches!(row.try_get::<Option<i64>, _>(0), Ok(None)))
        {
            rows.clear();
        }
        let mut batch = Batch::default();
        if rows.is_empty() {
            return Ok(outcome);
        }
        // Every row is read before anything is sent: a row that cannot be read (stored data
        // edited by hand) is dead-lettered on its own instead of failing the batch. Each row
        // is dropped once read, so that each payload is held once.
        let mut taken = Vec::with_capacity(rows.len());
        let mut keys = Vec::new();
        for row in rows {
            let id: i64 = row.try_get(0).map_err(store_error)?;
            let attempt = attempt(row.try_get(6).map_err(store_error)?);
            if let Ok(Some(key)) = row.try_get::<Option<String>, _>(9) {
                keys.push(key);
            }
            if row.try_get::<bool, _>(7).map_err(store_error)? {
                // Its relays died delivering it `max_attempts` times: dead-lettered by the
                // batch statement itself.
                let error = row.try_get::<Option<String>, _>(10).ok().flatten();
                tracing::warn!(outbox = %self.outbox.table(), id, attempts = attempt, error = error.as_deref().unwrap_or(RELAY_CRASHED), "outbox message dead-lettered: its relay died while delivering it, max_attempts times");
                batch.taken += 1;
                batch.dead += 1;
                continue;
            }
            if row.try_get::<bool, _>(8).unwrap_or(false) {
                tracing::warn!(outbox = %self.outbox.table(), id, attempt, "outbox message taken again, alone: its relay died while delivering it");
            }
            taken.push(match message(row) {
                Ok(message) => Taken::Outgoing(message),
                Err(error) => Taken::Unreadable(id, attempt, error),
            });
        }
        // A batch that started where a suspect was left leaves the cursor where the others
        // have moved it since.
        if advance {
            self.advance_cursor(cursor, keys);
        }
        if taken.is_empty() {
            self.metrics.dead.increment(batch.dead as u64);
            outcome.batch = batch;
            return Ok(outcome);
        }

        // The batch's transaction, with its timeouts, in one round trip (integers in ms). Its
        // deliveries run in turns of at most `max_in_flight`, each turn within the delivery
        // timeout: the transaction waits for them all, and one timeout more.
        let turns = u32::try_from(taken.len().div_ceil(settings.max_in_flight as usize))
            .unwrap_or(u32::MAX);
        let idle = settings
            .delivery_timeout
            .saturating_mul(turns.saturating_add(1))
            .saturating_add(Duration::from_secs(5));
        let begin = format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL lock_timeout = {}",
            idle.as_millis().min(i32::MAX as u128),
            TAKEN_HOLD.as_millis(),
        );
        let mut tx = sqlx::Connection::begin_with(&mut *connection, begin)
            .await
            .map_err(store_error)?;
        // Held until the commit: while this relay delivers, no other takes these messages.
        let (ids, attempts): (Vec<i64>, Vec<i32>) = taken
            .iter()
            .map(|taken| match taken {
                Taken::Outgoing(message) => (message.id, message.attempt),
                Taken::Unreadable(id, attempt, _) => (*id, *attempt),
            })
            .map(|(id, attempt)| (id, i32::try_from(attempt).unwrap_or(i32::MAX)))
            .unzip();
        let lock = sqlx::query(&self.outbox.sql().lock)
            .bind(&ids)
            .bind(&attempts);
        let locked: std::collections::HashSet<i64> = (&mut *tx)
            .fetch_all(lock)
            .await
            .map_err(store_error)?
            .iter()
            .map(|row| row.try_get::<i64, _>(0))
            .collect::<Result<_, _>>()
            .map_err(store_error)?;
        let mut failed = Vec::new();
        let mut messages = Vec::with_capacity(taken.len());
        for taken in taken {
            let id = match &taken {
                Taken::Outgoing(message) => message.id,
                Taken::Unreadable(id, ..) => *id,
            };
            if !locked.contains(&id) {
                // Taken over by another relay between the take and the lock (this relay took
                // longer than the hold to lock it): that relay delivers it.
                tracing::debug!(outbox = %self.outbox.table(), id, "outbox message taken over by another relay");
                continue;
            }
            batch.taken += 1;
            match taken {
                Taken::Outgoing(message) => messages.push(message),
                Taken::Unreadable(id, _, error) => failed.push((
                    id,
                    u32::MAX,
                    SinkError::permanent(format!("the stored message cannot be read: {error}")),
                )),
            }
        }
        let mut deliveries = tokio::task::JoinSet::new();
        let mut spawned = HashMap::new();
        let mut delivered = Vec::new();
        let max_in_flight = settings.max_in_flight as usize;
        for message in messages {
            let Some(sink) = self.sinks.get(&message.destination).cloned() else {
                continue;
            };
            if deliveries.len() >= max_in_flight
                && let Some(done) = deliveries.join_next().await
            {
                self.settle(done, &spawned, &mut delivered, &mut failed);
            }
            let timeout = settings.delivery_timeout;
            let (id, attempt) = (message.id, message.attempt);
            // The message moves into its delivery: its payload is not copied.
            let task = deliveries.spawn(async move {
                match tokio::time::timeout(timeout, sink.deliver(&message)).await {
                    Ok(Ok(())) => Delivered::Ok(message.id),
                    Ok(Err(error)) => Delivered::Failed(message.id, message.attempt, error),
                    Err(_) => Delivered::Failed(
                        message.id,
                        message.attempt,
                        SinkError::retry(format!("no delivery within {timeout:?}")),
                    ),
                }
            });
            spawned.insert(task.id(), (id, attempt));
        }
        while let Some(done) = deliveries.join_next().await {
            self.settle(done, &spawned, &mut delivered, &mut failed);
        }
        if !delivered.is_empty() {
            let update = sqlx::query(&self.outbox.sql().delivered).bind(&delivered);
            (&mut *tx).execute(update).await.map_err(store_error)?;
        }
        for (id, attempt, error) in &failed {
            let dead = error.is_permanent() || *attempt >= settings.max_attempts;
            let text = error.to_string().replace('\0', "\u{FFFD}");
            let update = if dead {
                sqlx::query(&self.outbox.sql().dead).bind(id).bind(text)
            } else {
                sqlx::query(&self.outbox.sql().failed)
                    .bind(id)
                    .bind(text)
                    .bind(micros(self.backoff(*id, *attempt)))
            };
            (&mut *tx).execute(update).await.map_err(store_error)?;
            if dead {
                batch.dead += 1;
                tracing::warn!(outbox = %self.outbox.table(), id, attempt, error = %error, "outbox message dead-lettered");
            } else {
                batch.retried += 1;
                tracing::info!(outbox = %self.outbox.table(), id, attempt, error = %error, "outbox message not delivered; will retry");
            }
        }
        tx.commit().await.map_err(store_error)?;
        batch.delivered = delivered.len();
        self.metrics.delivered.increment(batch.delivered as u64);
        self.metrics.retried.increment(batch.retried as u64);
        self.metrics.dead.increment(batch.dead as u64);
        outcome.batch = batch;
        Ok(outcome)
    }

    /// Moves the cursor past the ordering keys the batch took: the next batch looks for
    /// heads after the last of them, in the order the batch statement visits keys (those
    /// after the cursor, then from the first key on).
    fn advance_cursor(&self, cursor: &str, keys: Vec<String>) {
        let (after, wrapped): (Vec<String>, Vec<String>) =
            keys.into_iter().partition(|key| key.as_str() > cursor);
        if let Some(last) = after
            .into_iter()
            .max()
            .or_else(|| wrapped.into_iter().max())
        {
            *lock(&self.cursor) = last;
        }
    }

    /// The backoff of message `id` after attempt `attempt` (from 1): `first × 2^(attempt-1)`,
    /// at most `max` (both at most 365 days), then a point between half and all of it, drawn
    /// from a hash of the message, the attempt and the time, so that the retries of one batch
    /// spread out.
    fn backoff(&self, id: i64, attempt: u32) -> Duration {
        let first = self.settings.first_backoff.min(MAX_OUTBOX_DELAY);
        let max = self.settings.max_backoff.min(MAX_OUTBOX_DELAY);
        let ceiling = first
            .saturating_mul(1 << attempt.saturating_sub(1).min(20))
            .min(max);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut hasher = blake3::Hasher::new();
        hasher.update(&id.to_le_bytes());
        hasher.update(&attempt.to_le_bytes());
        hasher.update(&now.to_le_bytes());
        let draw = u64::from_le_bytes(
            hasher.finalize().as_bytes()[..8]
                .try_into()
                .unwrap_or([0; 8]),
        );
        let half = ceiling / 2;
        half.saturating_add(half.mul_f64(draw as f64 / u64::MAX as f64))
    }

    /// Delivers batches until `shutdown` completes: at once while batches come back full (or
    /// cut short by the byte budget), on each `NOTIFY` from an enqueue, and every poll
    /// interval. Every batch in hand when `shutdown` completes is finished first. Failures are
    /// logged and retried; it never returns early.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let lanes = Arc::new(Lanes::new());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        // Dropped with this future, the helpers are aborted with it, as the leading batch is.
        let mut helpers = tokio::task::JoinSet::new();
        for _ in 1..self.settings.concurrent_batches {
            let (relay, lanes, stopped) = (self.clone(), lanes.clone(), stopped.clone());
            helpers.spawn(async move { relay.help(&lanes, stopped).await });
        }
        self.lead(shutdown, &lanes).await;
        // Each helper finishes the batch in hand.
        stop.send_replace(true);
        while helpers.join_next().await.is_some() {}
    }

    /// A helping lane of [`run`](Self::run): on each backlog the leading batch finds, takes
    /// batches beside it while they come back full, with connections the pool has to spare.
    async fn help(&self, lanes: &Lanes, mut stopped: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = stopped.wait_for(|stop| *stop) => return,
                () = lanes.backlog.notified() => {}
            }
            while !*stopped.borrow() {
                match self.batch_in(lanes, Lane::Shared, true).await {
                    // Full: more due at once. A suspect it left is marked for the leading lane,
                    // which turns to it alone.
                    Some(Ok(outcome))
                        if !outcome.suspects && outcome.more(self.settings.batch_size) => {}
                    Some(Err(error)) => {
                        tracing::warn!(outbox = %self.outbox.table(), error = &error as &dyn std::error::Error, "outbox batch failed; the relay's leading batch goes on");
                        break;
                    }
                    // No connection to spare, the backlog gone, or a suspect left.
                    _ => break,
                }
            }
        }
    }

    /// The leading lane of [`run`](Self::run): the loop that listens, polls and reaps.
    async fn lead(&self, shutdown: impl Future<Output = ()>, lanes: &Lanes) {
        let helped = self.settings.concurrent_batches > 1;
        // Alone at first: a suspect left by a relay that died may be due.
        let mut lane = Lane::Exclusive;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut listener: Option<PgListener> = None;
        let mut last_reap = tokio::time::Instant::now();
        loop {
            if listener.is_none() {
                tokio::select! {
                    () = &mut shutdown => return,
                    listening = self.listen() => listener = listening,
                }
            }
            // Notifications that arrived meanwhile are all answered by this batch.
            if !drain(&mut listener).await {
                listener = None;
            }
            // A suspect a batch beside others left: the next batch looks for it, alone.
            if lanes.suspect_left() {
                lane = Lane::Exclusive;
            }
            let result = self.batch_in(lanes, lane, false).await;
            if let Some(Err(error)) = &result {
                tracing::warn!(outbox = %self.outbox.table(), error = error as &dyn std::error::Error, "outbox batch failed; retrying after the poll interval");
            }
            let outcome = result.and_then(Result::ok);
            let failed = outcome.is_none();
            let more;
            (more, lane) = next_lane(
                helped,
                outcome.as_ref(),
                lanes.suspect_left(),
                self.settings.batch_size,
            );
            if lane == Lane::Shared {
                lanes.backlog.notify_waiters();
            }
            if last_reap.elapsed() >= self.settings.reap_every {
                last_reap = tokio::time::Instant::now();
                if let Err(error) = self.reap().await {
                    tracing::warn!(outbox = %self.outbox.table(), error = &error as &dyn std::error::Error, "could not reap delivered outbox messages");
                }
                match self.outbox.backlog(&self.pool).await {
                    Ok(backlog) => {
                        self.metrics.pending_now.set(backlog.pending as f64);
                        self.metrics.dead_now.set(backlog.dead as f64);
                        let age = backlog.oldest_pending.unwrap_or_default();
                        self.metrics.oldest_pending_age.set(age.as_secs_f64());
                    }
                    Err(error) => {
                        tracing::warn!(outbox = %self.outbox.table(), error = &error as &dyn std::error::Error, "could not read the outbox's backlog")
                    }
                }
            }
            if more {
                if futures_ready(&mut shutdown).await {
                    return;
                }
                continue;
            }
            let wait = tokio::time::sleep(self.settings.poll_interval);
            let mut left = lanes.suspect_at.subscribe();
            tokio::select! {
                () = &mut shutdown => return,
                () = wait => {}
                // A helper left a suspect meanwhile. Not after a failed batch: its mark would
                // wake it at once, again and again while the database fails; the poll interval
                // then brings the next batch to the mark.
                _ = left.wait_for(Option::is_some), if !failed => {}
                notified = recv(&mut listener) => {
                    if !notified {
                        listener = None;
                    }
                }
            }
        }
    }

    /// Runs the relay ([`run`](Self::run)) on a task of its own until the returned handle's
    /// [`stop`](RunningRelay::stop). Requires a tokio runtime.
    pub fn spawn(self) -> RunningRelay {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            self.run(async move {
                // Ends on `stop`, and when the handle is dropped.
                let _ = stopped.wait_for(|stop| *stop).await;
            })
            .await;
        });
        RunningRelay { stop, task }
    }

    /// A listener on the outbox's channel, or `None` (polling alone) if it cannot be had now.
    async fn listen(&self) -> Option<PgListener> {
        let mut listener = match PgListener::connect_with(&self.pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::debug!(error = %error, "outbox relay cannot listen now; polling");
                return None;
            }
        };
        match listener.listen(self.outbox.channel()).await {
            Ok(()) => Some(listener),
            Err(error) => {
                tracing::debug!(error = %error, "outbox relay cannot listen now; polling");
                None
            }
        }
    }
}

/// Waits for a notification: `true` on one, `false` if the listener failed; never completes
/// without a listener.
async fn recv(listener: &mut Option<PgListener>) -> bool {
    match listener {
        Some(listener) => matches!(listener.try_recv().await, Ok(Some(_))),
        None => std::future::pending().await,
    }
}

/// A relay running on its own task ([`Relay::spawn`]). Dropping it stops the relay as
/// [`stop`](Self::stop) does, without waiting for it.
#[derive(Debug)]
pub struct RunningRelay {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningRelay {
    /// Stops the relay once every batch in hand is finished, and waits for it.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }
}

/// Takes every notification already received, without waiting: `false` if the listener
/// failed.
async fn drain(listener: &mut Option<PgListener>) -> bool {
    let Some(listening) = listener else {
        return true;
    };
    while let Some(_notification) = listening.next_buffered() {}
    loop {
        tokio::select! {
            biased;
            received = listening.try_recv() => match received {
                Ok(Some(_)) => {}
                _ => return false,
            },
            () = std::future::ready(()) => return true,
        }
    }
}

/// Whether `shutdown` has completed, without waiting for it.
async fn futures_ready(shutdown: &mut Pin<&mut impl Future<Output = ()>>) -> bool {
    tokio::select! {
        biased;
        () = shutdown.as_mut() => true,
        () = std::future::ready(()) => false,
    }
}

/// The value behind `mutex`, even if a thread panicked holding it (each is written whole).
fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The attempt a row's `attempts` (counted by the batch statement) stands for, from 1.
fn attempt(attempts: i32) -> u32 {
    u32::try_from(attempts).unwrap_or(0).max(1)
}

/// The message in a row of the batch statement, which is dropped here: its payload is copied
/// out of the row once, into the message, and the row's copy freed at once.
fn message(row: sqlx::postgres::PgRow) -> Result<Relayed, sqlx::Error> {
    let names: Vec<String> = row.try_get(4)?;
    let values: Vec<String> = row.try_get(5)?;
    if names.len() != values.len() {
        return Err(sqlx::Error::Decode(
            "header_names and header_values differ in length".into(),
        ));
    }
    Ok(Relayed {
        id: row.try_get(0)?,
        destination: row.try_get(1)?,
        key: row.try_get(2)?,
        payload: Bytes::from(row.try_get::<Vec<u8>, _>(3)?),
        headers: names.into_iter().zip(values).collect(),
        attempt: attempt(row.try_get(6)?),
        ordering_key: row.try_get(9)?,
    })
}

#[cfg(test)]
mod tests {
    use super::{Batch, Lane, MAX_CONCURRENT_BATCHES, Outcome, Relay, next_lane};
    use crate::outbox::Outbox;

    /// `concurrent_batches` is at least 1 and at most `MAX_CONCURRENT_BATCHES`, whatever it is
    /// given (a relay spawns a task for each batch beyond the first).
    #[tokio::test]
    async fn concurrent_batches_is_kept_between_one_and_its_maximum() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/unused")
            .unwrap();
        for (asked, kept) in [(0, 1), (1, 1), (2, 2), (64, 64), (65, 64), (u32::MAX, 64)] {
            let relay = Relay::builder(pool.clone(), Outbox::new())
                .concurrent_batches(asked)
                .build();
            assert_eq!(relay.settings.concurrent_batches, kept, "{asked}");
        }
        assert_eq!(MAX_CONCURRENT_BATCHES, 64);
    }

    fn outcome(taken: usize, cut: bool, suspects: bool) -> Outcome {
        Outcome {
            batch: Batch {
                taken,
                ..Batch::default()
            },
            cut,
            suspects,
        }
    }

    /// The leading lane's next step after each kind of batch (batches of 4).
    #[test]
    fn the_leading_lane_runs_beside_helpers_only_through_a_backlog_without_suspects() {
        use Lane::{Exclusive, Shared};
        let cases = [
            // (helped, outcome, a suspect left by a helper) => (at once, lane)
            (true, None, false, (false, Exclusive)),
            (true, Some(outcome(4, false, false)), false, (true, Shared)),
            (
                false,
                Some(outcome(4, false, false)),
                false,
                (true, Exclusive),
            ),
            (true, Some(outcome(2, true, false)), false, (true, Shared)),
            (
                true,
                Some(outcome(1, false, true)),
                false,
                (true, Exclusive),
            ),
            (
                true,
                Some(outcome(0, false, true)),
                false,
                (true, Exclusive),
            ),
            (
                true,
                Some(outcome(4, false, false)),
                true,
                (true, Exclusive),
            ),
            (
                true,
                Some(outcome(0, false, false)),
                true,
                (true, Exclusive),
            ),
            (
                true,
                Some(outcome(3, false, false)),
                false,
                (false, Exclusive),
            ),
            (
                true,
                Some(outcome(0, false, false)),
                false,
                (false, Exclusive),
            ),
            // A failed batch waits for the poll interval, mark or not.
            (true, None, true, (false, Exclusive)),
        ];
        for (helped, outcome, left, expected) in cases {
            assert_eq!(
                next_lane(helped, outcome.as_ref(), left, 4),
                expected,
                "{helped} {outcome:?} {left}"
            );
        }
    }
}
