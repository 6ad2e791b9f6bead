//! The idempotent receiver: one consumer runtime over a message broker (feature `consumer`).
//!
//! A broker delivers each message at least once: a consumer that crashes before it
//! acknowledges, a broker that restarts, a publisher that retries, all deliver a message
//! again. This runtime turns that into one *effect* per message. You supply a handler; the
//! runtime:
//!
//! 1. decodes the message ([`Decode::decode`]); a message that cannot be decoded is
//!    **malformed** and dead-lettered at once, never handled;
//! 2. derives its idempotency key ([`Decode::key`]: the publisher's message id by default, a
//!    composite or content-based key by choice) and fingerprint ([`Decode::fingerprint`]: the
//!    message's content by default), with the same rules as calls: a key reused with a
//!    different fingerprint is a mismatch, dead-lettered with that reason, never applied;
//! 3. runs the handler under a claim of that key in any [`Store`](crate::Store)
//!    ([`Consumer::run`], [`Handler`]) or inside the PostgreSQL transaction that records it
//!    ([`Consumer::run_transactional`], [`TxHandler`], feature `postgres`), handing it the
//!    [`ClaimHandle`] (fencing token, operation key, lost signal) and, in the transactional
//!    mode, the transaction — where the [`Outbox`](crate::postgres::Outbox) can enqueue
//!    messages with the effect;
//! 4. acknowledges the message only once the record (or the transaction) is durable; a
//!    message whose key is already recorded is a **duplicate**, acknowledged without running
//!    the handler;
//! 5. sorts failures: a [`Failure::Malformed`] message is dead-lettered at once; a
//!    [`Failure::Rejected`] one (the data is refused, by a constraint say) is retried and
//!    dead-lettered from its [`max_deliveries`](Consumer::max_deliveries)-th delivery on, as
//!    the **broker** counts deliveries, so the bound survives restarts of every consumer; a
//!    [`Failure::Transient`] one (a database down, a lock timeout) is retried with backoff
//!    without bound, because the message is not at fault. A dead letter keeps the reason.
//!
//! It bounds concurrency ([`Consumer::concurrency`]), keeps the order of messages that share
//! an [ordering key](Decode::ordering_key), keeps a long handler's message from being
//! delivered to another consumer while it runs ([`Source::keep_alive`]), waits out a broker
//! that goes away (its source reconnects; the runtime never returns because of a broker
//! failure), drains on shutdown (every message it received is finished: handled and
//! acknowledged, or given back), and records [metrics](#metrics).
//!
//! # Sources
//!
//! A [`Source`] knows only its broker: receive, acknowledge, retry later, dead-letter, the
//! delivery count, keep-alive, reconnect. Three come with the library:
//!
//! | source | feature | delivery count | retry later | keep-alive | dead letters |
//! |---|---|---|---|---|---|
//! | [`RedisStreams`](redis_streams::RedisStreams) | `redis-streams` | `XPENDING` | left pending, delivered again after `claim_idle` (`XAUTOCLAIM`) | `XCLAIM … JUSTID` resets the idle time | `STREAM:dead`, copied and acknowledged in one script: exactly once |
//! | [`JetStream`](nats::JetStream) | `nats` | `info.delivered` | `Nak` with the backoff as delay | `Progress` (`+WPI`) resets the ack wait | `STREAM.dead`, with a `Nats-Msg-Id` from the entry: once within the stream's duplicate window |
//! | [`RabbitMq`](rabbitmq::RabbitMq) | `rabbitmq` | `x-delivery-count` (quorum queues) | `nack` with requeue after the backoff | none needed: no redelivery while the channel is open (keep handlers under `consumer_timeout`) | `QUEUE.dead`, published with confirms before the ack: at least once |
//!
//! # Metrics
//!
//! Through the same [`metrics`](crate::metrics) facade and naming scheme as calls; `source`
//! is the source's [`name`](Source::name):
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `idempotency.messages` | counter | `source`, `outcome` | messages by how each ended: `applied`, `duplicate`, `retried`, `dead_lettered` |
//! | `idempotency.message.duration` | histogram (s) | `source`, `outcome` | from receipt to the broker's answer to the ack, retry or dead letter |
//! | `idempotency.message.redeliveries` | counter | `source` | messages received that the broker had delivered before |
//! | `idempotency.message.dead_letters` | counter | `source`, `kind` | dead letters by `kind`: `malformed` or `rejected` |
//! | `idempotency.source.errors` | counter | `source`, `operation` | broker operations that failed: `receive`, `ack`, `retry`, `dead_letter`, `keep_alive` |
//!
//! The claims themselves are counted in `idempotency.requests` with `protocol = "message"`.

#[cfg(any(feature = "redis-streams", feature = "nats", feature = "rabbitmq"))]
mod any;
mod effect;
mod runner;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::{ClaimHandle, Fingerprint, Key};

#[cfg(any(feature = "redis-streams", feature = "nats", feature = "rabbitmq"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "redis-streams", feature = "nats", feature = "rabbitmq")))
)]
pub use self::any::{AnyDelivery, AnySource, Endpoint};
pub use self::runner::Report;

/// `idempotency.messages` (counter; labels `source`, `outcome`).
pub const MESSAGES: &str = "idempotency.messages";
/// `idempotency.message.duration` (histogram, seconds; labels `source`, `outcome`).
pub const MESSAGE_DURATION: &str = "idempotency.message.duration";
/// `idempotency.message.redeliveries` (counter; label `source`).
pub const MESSAGE_REDELIVERIES: &str = "idempotency.message.redeliveries";
/// `idempotency.message.dead_letters` (counter; labels `source`, `kind`).
pub const MESSAGE_DEAD_LETTERS: &str = "idempotency.message.dead_letters";
/// `idempotency.source.errors` (counter; labels `source`, `operation`).
pub const SOURCE_ERRORS: &str = "idempotency.source.errors";

/// The most headers a NATS or AMQP [`Message`] keeps, and the most fields a dead letter
/// copies from a Redis Streams entry.
pub const MAX_FIELDS: usize = 64;

/// One message as a source received it: its content, the publisher's id, and how many times
/// the broker has delivered it.
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    position: String,
    id: Option<String>,
    body: Bytes,
    fields: Vec<(String, Bytes)>,
    deliveries: u64,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("position", &self.position)
            .field("id", &self.id)
            .field("body_len", &self.body.len())
            .field("fields", &self.fields.len())
            .field("deliveries", &self.deliveries)
            .finish()
    }
}

impl Message {
    /// A message at `position` (the broker's own name for it: a stream entry id, a stream
    /// sequence, a delivery tag) with `body`, first delivered.
    pub fn new(position: impl Into<String>, body: impl Into<Bytes>) -> Self {
        Message {
            position: position.into(),
            id: None,
            body: body.into(),
            fields: Vec::new(),
            deliveries: 1,
        }
    }

    /// With the publisher's message id.
    #[must_use]
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// With one more field (a Redis Streams entry's field, a NATS or AMQP header).
    #[must_use]
    pub fn with_field(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.fields.push((name.into(), value.into()));
        self
    }

    /// Delivered this many times, this delivery included (at least 1).
    #[must_use]
    pub fn with_deliveries(mut self, deliveries: u64) -> Self {
        self.deliveries = deliveries.max(1);
        self
    }

    /// The broker's name for this message: a Redis Streams entry id, a JetStream stream
    /// sequence, a RabbitMQ delivery tag. For logs; not a key (a publisher's retry is a new
    /// position).
    pub fn position(&self) -> &str {
        &self.position
    }

    /// The publisher's message id, the default idempotency key: a Redis Streams entry's `id`
    /// field, NATS's `Nats-Msg-Id` header, AMQP's `message-id` property.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The body (empty for a Redis Streams entry, whose content is its fields).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The fields: a Redis Streams entry's fields in order (all of them), or the headers of a
    /// NATS or AMQP message (those whose value is text or bytes, at most [`MAX_FIELDS`]).
    pub fn fields(&self) -> &[(String, Bytes)] {
        &self.fields
    }

    /// The value of the field `name`, when it occurs exactly once.
    pub fn field(&self, name: &str) -> Option<&Bytes> {
        let mut values = self.fields.iter().filter(|(k, _)| k == name);
        let (_, value) = values.next()?;
        values.next().is_none().then_some(value)
    }

    /// How many times the broker has delivered this message, this delivery included.
    pub fn deliveries(&self) -> u64 {
        self.deliveries
    }

    /// A key derived from the content (`content-` and the hex digest of its
    /// [fingerprint](Self::content_fingerprint)): for messages whose publishers give no id,
    /// where the same content twice means the same message. Return it from [`Decode::key`].
    pub fn content_key(&self) -> Key {
        let mut text = String::with_capacity(8 + 64);
        text.push_str("content-");
        for byte in self.content_fingerprint().as_bytes() {
            text.push_str(&format!("{byte:02x}"));
        }
        Key::new(text).expect("a hex digest with a prefix is a valid key")
    }

    /// A fingerprint of the content: the body and, for a Redis Streams entry, its fields in
    /// order. The default [`Decode::fingerprint`].
    pub fn content_fingerprint(&self) -> Fingerprint {
        let mut builder = Fingerprint::builder().field(&self.body);
        if !self.body.is_empty() {
            return builder.finish();
        }
        for (name, value) in &self.fields {
            builder.push_field(name.as_bytes());
            builder.push_field(value);
        }
        builder.finish()
    }
}

/// A message and the source's handle to answer the broker about it.
#[derive(Debug)]
pub struct Received<D> {
    /// The message.
    pub message: Message,
    /// What the source needs to acknowledge it, retry it or dead-letter it.
    pub delivery: D,
}

/// A broker operation failed. The runtime logs it, counts it in
/// `idempotency.source.errors`, and carries on: a message not acknowledged is delivered
/// again.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct SourceError {
    context: String,
    #[source]
    source: crate::BoxError,
}

impl SourceError {
    /// `source` happened while doing `context`.
    pub fn new(context: impl Into<String>, source: impl Into<crate::BoxError>) -> Self {
        SourceError {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// What a dead letter found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLettered {
    /// The message was copied to the dead letters and acknowledged.
    Now,
    /// The message was no longer this consumer's to answer (another consumer acknowledged
    /// or dead-lettered it meanwhile); nothing was written.
    Already,
}

/// A broker, as the runtime sees it. Implement it to consume from a broker the library does
/// not cover; the runtime calls `receive` from one task and the other methods from many at
/// once.
///
/// Every method may fail with a [`SourceError`]; a source reconnects by itself on the next
/// call after its broker went away (the runtime waits and calls again).
pub trait Source: Send + Sync + 'static {
    /// The source's handle on one delivered message.
    type Delivery: Send + Sync + 'static;

    /// The `source` label of the metrics: `redis_streams`, `nats`, `rabbitmq`.
    fn name(&self) -> &'static str;

    /// Up to `max` messages, waiting a short while (about a second) when there are none: the
    /// runtime checks for shutdown between calls.
    fn receive(
        &self,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Received<Self::Delivery>>, SourceError>> + Send;

    /// Acknowledges the message: the broker will not deliver it again.
    fn ack(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Asks for the message again, not before `delay` where the broker can wait.
    fn retry(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Copies the message, unchanged, to the dead letters with `reason`, then acknowledges it.
    fn dead_letter(
        &self,
        message: &Message,
        delivery: &Self::Delivery,
        reason: &str,
    ) -> impl Future<Output = Result<DeadLettered, SourceError>> + Send;

    /// Tells the broker the message is still being worked on, so that it is not delivered to
    /// another consumer meanwhile. Called every [`keep_alive_every`](Self::keep_alive_every)
    /// while the handler runs.
    fn keep_alive(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        let _ = delivery;
        async { Ok(()) }
    }

    /// How often to [`keep_alive`](Self::keep_alive) a message in hand; `None` (the default)
    /// when the broker needs no such thing.
    fn keep_alive_every(&self) -> Option<Duration> {
        None
    }

    /// The longest a message may stay in hand before the broker takes it back whatever the
    /// consumer does (RabbitMQ's `consumer_timeout`); `None` (the default) when keep-alives
    /// hold it as long as needed. Counted from the message's receipt: the runtime stops a
    /// handler that reaches it, does not start one for a message that waited in hand that
    /// long, and retries the message.
    fn handling_limit(&self) -> Option<Duration> {
        None
    }
}

/// Why a message was not applied, and so what becomes of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The message is at fault whatever the moment (it cannot be decoded, its key is reused
    /// for other content): dead-lettered at once.
    Malformed(String),
    /// The data was refused (a constraint, an overflow), which can depend on the moment:
    /// retried, and dead-lettered from its
    /// [`max_deliveries`](Consumer::max_deliveries)-th delivery on.
    Rejected(String),
    /// The system failed, not the message: retried with backoff until it succeeds.
    Transient(String),
}

impl Failure {
    /// The reason kept with the dead letter and logged.
    pub fn reason(&self) -> &str {
        match self {
            Failure::Malformed(reason) | Failure::Rejected(reason) | Failure::Transient(reason) => {
                reason
            }
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Failure::Malformed(_) => "malformed",
            Failure::Rejected(_) => "rejected",
            Failure::Transient(_) => "transient",
        };
        write!(f, "{kind}: {}", self.reason())
    }
}

impl std::error::Error for Failure {}

/// An invalid key is the message's fault: [`Failure::Malformed`].
impl From<crate::KeyError> for Failure {
    fn from(error: crate::KeyError) -> Self {
        Failure::Malformed(format!("the key is not valid: {error}"))
    }
}

/// A fingerprint that cannot be computed is the message's fault: [`Failure::Malformed`].
impl From<crate::CanonicalError> for Failure {
    fn from(error: crate::CanonicalError) -> Self {
        Failure::Malformed(format!("cannot fingerprint the message: {error}"))
    }
}

/// How a message becomes the handler's input, its key, its fingerprint and its ordering key.
pub trait Decode: Send + Sync + 'static {
    /// What the handler works on.
    type Input: Send + Sync + 'static;

    /// The input, or why the message is malformed ([`Failure::Malformed`]; any other failure
    /// is taken as it is).
    fn decode(&self, message: &Message) -> Result<Self::Input, Failure>;

    /// The idempotency key. By default the publisher's [message id](Message::id); a message
    /// without one is malformed.
    fn key(&self, message: &Message, input: &Self::Input) -> Result<Key, Failure> {
        let _ = input;
        let id = message
            .id()
            .ok_or_else(|| Failure::Malformed("the message has no message id".into()))?;
        key(id)
    }

    /// What a reuse of the key must match. By default the message's
    /// [content](Message::content_fingerprint).
    fn fingerprint(&self, message: &Message, input: &Self::Input) -> Result<Fingerprint, Failure> {
        let _ = input;
        Ok(message.content_fingerprint())
    }

    /// The scope the key is claimed in (a tenant, a principal), as a call's
    /// [`scope`](crate::Call::scope): the same key in two scopes is two records. `None` (the
    /// default): unscoped.
    fn scope(&self, message: &Message, input: &Self::Input) -> Option<crate::Scope> {
        let _ = (message, input);
        None
    }

    /// Messages with the same ordering key are handled one at a time, in the order received;
    /// `None` (the default): no order kept. A message retried later is received again after
    /// those that came behind it.
    fn ordering_key(&self, message: &Message, input: &Self::Input) -> Option<String> {
        let _ = (message, input);
        None
    }
}

/// A valid key from `text`, or [`Failure::Malformed`] saying why not.
pub fn key(text: &str) -> Result<Key, Failure> {
    Key::new(text)
        .map_err(|e| Failure::Malformed(format!("the message id is not a valid key: {e}")))
}

/// The handler of [`Consumer::run`]: runs under a claim of the message's key in the
/// runtime's store.
pub trait Handler: Decode {
    /// Kept in the record (as JSON), as a call's result is.
    type Output: Serialize + Send + 'static;

    /// Applies the message. `claim` is the key's claim: its
    /// [`operation_key`](ClaimHandle::operation_key) is the same for every attempt of this
    /// message (hand it to downstream systems), its [`token`](ClaimHandle::token) fences
    /// writes, [`lost`](ClaimHandle::lost) says when to stop. An `Err` releases the claim: the
    /// message is retried or dead-lettered as the [`Failure`] says.
    fn handle(
        &self,
        input: &Self::Input,
        claim: &ClaimHandle,
    ) -> impl Future<Output = Result<Self::Output, Failure>> + Send;
}

/// The handler of [`Consumer::run_transactional`] (feature `postgres`): runs inside the
/// PostgreSQL transaction that claims the key and records the result.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub trait TxHandler: Decode {
    /// Kept in the record (as JSON).
    type Output: Serialize + Send + Sync + 'static;

    /// Runs first in each transaction, before the claim: session settings
    /// (`SET LOCAL lock_timeout`, `statement_timeout`). Does nothing by default.
    fn begin(
        &self,
        tx: &mut sqlx::PgConnection,
    ) -> impl Future<Output = Result<(), Failure>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// Applies the message with `tx`, the transaction that will record it: the effect, the
    /// record and anything enqueued in the [`Outbox`](crate::postgres::Outbox) commit
    /// together, or not at all. An `Err` rolls the transaction back. [`sql_failure`] sorts a
    /// statement's error.
    fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        input: &Self::Input,
        claim: &ClaimHandle,
    ) -> impl Future<Output = Result<Self::Output, Failure>> + Send;
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use self::effect::sql_failure;

/// The runtime's settings over one [`Source`]. Build one, then [`run`](Consumer::run) it.
pub struct Consumer<S> {
    source: Arc<S>,
    settings: Settings,
}

impl<S> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    pub(crate) max_deliveries: u64,
    pub(crate) backoff: (Duration, Duration),
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) observer: Option<Observer>,
}

type Observer = Arc<dyn Fn(&Message, Outcome<'_>) + Send + Sync>;

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("max_deliveries", &self.max_deliveries)
            .field("backoff", &self.backoff)
            .field("handler_timeout", &self.handler_timeout)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// How one message ended, as an [observer](Consumer::on_outcome) sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Outcome<'a> {
    /// Applied now, and acknowledged.
    Applied,
    /// Recorded already: acknowledged without running the handler.
    Duplicate,
    /// Not applied; left for the broker to deliver again, not before `delay` where the broker
    /// can wait.
    Retried {
        /// Why it was not applied.
        failure: &'a Failure,
        /// The backoff asked of the broker.
        delay: Duration,
    },
    /// Dead-lettered now, with `failure`'s reason.
    DeadLettered {
        /// Why.
        failure: &'a Failure,
    },
}

/// Messages handled at once, by default.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Messages asked of the broker at once, at most, by default.
pub const DEFAULT_BATCH: usize = 32;
/// Deliveries after which a rejected message is dead-lettered, by default.
pub const DEFAULT_MAX_DELIVERIES: u64 = 5;
/// The first retry's delay and the longest, by default.
pub const DEFAULT_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(30));

impl<S: Source> Consumer<S> {
    /// A consumer of `source` with the default settings.
    pub fn new(source: S) -> Self {
        Consumer {
            source: Arc::new(source),
            settings: Settings {
                concurrency: DEFAULT_CONCURRENCY,
                batch: DEFAULT_BATCH,
                max_deliveries: DEFAULT_MAX_DELIVERIES,
                backoff: DEFAULT_BACKOFF,
                handler_timeout: None,
                observer: None,
            },
        }
    }

    /// The most messages handled at once (default [`DEFAULT_CONCURRENCY`]; at least 1).
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency.max(1);
        self
    }

    /// The most messages asked of the broker at once (default [`DEFAULT_BATCH`]; at least 1).
    /// At most `concurrency + batch` messages are in hand; a batch is asked for once there is
    /// room for half of one. Messages waiting for a handler slot are kept alive meanwhile.
    /// RabbitMQ's prefetch should exceed `concurrency + batch`.
    #[must_use]
    pub fn batch(mut self, batch: usize) -> Self {
        self.settings.batch = batch.max(1);
        self
    }

    /// A message the data rejects ([`Failure::Rejected`]) is dead-lettered from this delivery
    /// on, as the broker counts them (default [`DEFAULT_MAX_DELIVERIES`]; at least 1).
    #[must_use]
    pub fn max_deliveries(mut self, max_deliveries: u64) -> Self {
        self.settings.max_deliveries = max_deliveries.max(1);
        self
    }

    /// The delay before a failed message's first retry, doubled with each delivery up to
    /// `max` (default [`DEFAULT_BACKOFF`]). Where a broker cannot delay a retry (Redis
    /// Streams) its own redelivery delay applies.
    #[must_use]
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = (first, max.max(first));
        self
    }

    /// Stops a handler that runs longer than `timeout` (its claim released, or its transaction
    /// rolled back) and retries its message as [`Failure::Transient`]. Default: none, except
    /// the source's [`handling_limit`](Source::handling_limit) (RabbitMQ's consumer timeout),
    /// which always applies.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = Some(timeout);
        self
    }

    /// Calls `observer` with each message's outcome, once the broker has been answered (an
    /// application's own log lines or audit trail). It runs on the message's task: keep it
    /// quick.
    #[must_use]
    pub fn on_outcome(
        mut self,
        observer: impl Fn(&Message, Outcome<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.settings.observer = Some(Arc::new(observer));
        self
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Consumes until `shutdown` completes, running `handler` under claims of `idempotency`'s
    /// store; then stops receiving, finishes every message in hand and returns what it did.
    /// Broker failures never end it: it waits and tries again.
    pub async fn run<H: Handler>(
        self,
        idempotency: crate::Idempotency,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Report {
        let effect = effect::Claimed {
            idempotency,
            handler,
        };
        runner::run(self.source, self.settings, Arc::new(effect), shutdown).await
    }

    /// Consumes until `shutdown` completes, running `handler` inside a transaction of `pool`
    /// that claims the key and records the result through `transactional`; the message is
    /// acknowledged after the commit. Otherwise as [`run`](Self::run).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn run_transactional<H: TxHandler>(
        self,
        pool: sqlx::PgPool,
        transactional: crate::postgres::Transactional,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Report {
        let effect = effect::InTransaction {
            pool,
            transactional,
            handler,
        };
        runner::run(self.source, self.settings, Arc::new(effect), shutdown).await
    }
}

/// The delay before retrying a message on its `deliveries`-th delivery: `first` doubled per
/// earlier delivery, at most `max`.
pub(crate) fn backoff_delay((first, max): (Duration, Duration), deliveries: u64) -> Duration {
    let doublings = u32::try_from(deliveries.saturating_sub(1))
        .unwrap_or(u32::MAX)
        .min(30);
    first.saturating_mul(1 << doublings).min(max)
}

/// A message read as a flat record of named text values, whichever broker carried it: a
/// Redis Streams entry's fields, or a body holding a JSON object whose values are strings.
/// For applications whose publishers send the same record to several kinds of broker.
#[derive(Debug)]
pub struct Fields<'a> {
    message: &'a Message,
    object: Option<serde_json::Map<String, serde_json::Value>>,
}

impl<'a> Fields<'a> {
    /// The record `message` holds: its JSON object body, or (with an empty body) its fields,
    /// at most [`MAX_FIELDS`]. Malformed: a body that is not a JSON object, more fields than
    /// that.
    pub fn of(message: &'a Message) -> Result<Fields<'a>, Failure> {
        if message.body().is_empty() {
            if message.fields().len() > MAX_FIELDS {
                return Err(Failure::Malformed(format!(
                    "the entry has {} fields, more than {MAX_FIELDS}",
                    message.fields().len()
                )));
            }
            return Ok(Fields {
                message,
                object: None,
            });
        }
        match serde_json::from_slice(message.body()) {
            Ok(object) => Ok(Fields {
                message,
                object: Some(object),
            }),
            Err(_) => Err(Failure::Malformed("the body is not a JSON object".into())),
        }
    }

    /// The value of `name` parsed as a `T` (an integer, say); else why the message is
    /// malformed.
    pub fn parse<T: std::str::FromStr>(&self, name: &str) -> Result<T, Failure> {
        let value = self.text(name)?;
        value.parse().map_err(|_| {
            Failure::Malformed(format!(
                "field `{name}` is not a valid {}: {value:?}",
                std::any::type_name::<T>()
            ))
        })
    }

    /// The value of `name`: present once, text, not empty; else why the message is malformed.
    pub fn text(&self, name: &str) -> Result<&str, Failure> {
        let malformed = |what: &str| Failure::Malformed(format!("field `{name}` {what}"));
        let value = match &self.object {
            None => match self.message.field(name) {
                Some(value) => std::str::from_utf8(value).map_err(|_| malformed("is not UTF-8"))?,
                None if self.message.fields().iter().any(|(k, _)| k == name) => {
                    return Err(malformed("is repeated"));
                }
                None => return Err(Failure::Malformed(format!("missing field `{name}`"))),
            },
            Some(object) => match object.get(name) {
                Some(serde_json::Value::String(value)) => value.as_str(),
                Some(_) => return Err(malformed("is not a string")),
                None => return Err(Failure::Malformed(format!("missing field `{name}`"))),
            },
        };
        match value.is_empty() {
            true => Err(malformed("is empty")),
            false => Ok(value),
        }
    }
}
