//! The RabbitMQ source (feature `rabbitmq`): a quorum queue consumed with manual
//! acknowledgements, over [`lapin`] on tokio.
//!
//! (Longer than most files here, on purpose: the connection, its reconnection with a
//! generation number, acknowledgements and publisher-confirmed dead letters, fitted to the
//! broker's message size, are one state machine around one channel; about 190 lines are
//! documentation and 190 unit tests.)
//!
//! # Queues
//!
//! Every connect declares, durable, the queue `QUEUE` and the dead-letter queue `QUEUE.dead`,
//! each with the arguments exactly `{"x-queue-type": "quorum"}`. A publisher may declare them
//! first with those same arguments; a queue that exists with other arguments (a classic queue,
//! an `x-delivery-limit`) fails the declaration (`PRECONDITION_FAILED`), and so the connect.
//! Quorum queues are replicated and count deliveries (`x-delivery-count`), which the
//! runtime's [`max_deliveries`](super::Consumer::max_deliveries) relies on. The consumer then
//! sets `basic.qos` to the [prefetch](RabbitMqBuilder::prefetch) and consumes `QUEUE` with
//! manual acknowledgements; a second channel, in confirm mode, publishes dead letters. The
//! connection is named `idempotent:QUEUE` (client property `connection_name`).
//!
//! # Messages
//!
//! | [`Message`] | from the AMQP delivery |
//! |---|---|
//! | [`position`](Message::position) | the delivery tag, as text |
//! | [`id`](Message::id) | the `message-id` property |
//! | [`body`](Message::body) | the body |
//! | [`fields`](Message::fields) | the headers whose value is a string or a byte array, in name order, at most [`MAX_FIELDS`] |
//! | [`deliveries`](Message::deliveries) | the `x-delivery-count` header plus 1 (any integer type; absent: 1) |
//!
//! A quorum queue (RabbitMQ 3.10) sets `x-delivery-count` on a redelivery to the number of
//! earlier deliveries that came back to it: by `nack` with requeue, or by a channel or
//! connection closed with the message unacknowledged — prefetched messages no handler saw
//! included. So each connection lost spends one of
//! [`max_deliveries`](super::Consumer::max_deliveries) of up to the prefetch's messages.
//!
//! # Answers
//!
//! - [`ack`](Source::ack): `basic.ack`.
//! - [`retry`](Source::retry): returns at once; a task waits the delay, then `basic.nack`s the
//!   message with requeue. Meanwhile it stays unacknowledged on this channel, so no other
//!   consumer gets it before the delay.
//! - [`dead_letter`](Source::dead_letter): publishes to the default exchange with routing key
//!   `QUEUE.dead` (mandatory, persistent: `delivery-mode` 2) the body unchanged, the original
//!   `message-id`, `content-type` and `content-encoding`, and the original headers (less
//!   `x-delivery-count`) with `reason` (the reason on one line, at most 4 KiB) and
//!   `deliveries` (the delivery count, in decimal) set, as strings; waits for the publisher
//!   confirm (a `nack`, a return or no answer within 30 s is an error and the message is left
//!   to be delivered again; a return, `QUEUE.dead` gone, also makes the next `receive`
//!   reconnect, which declares it again); then `basic.ack`s the original. At least once: a
//!   consumer that dies between the confirm and the ack dead-letters the message again on its
//!   next delivery. A dead letter that would not fit the broker's limit is fitted, below.
//! - **Dead letters larger than the broker's `max_message_size`** are still dead letters,
//!   never a redelivery loop. The broker does not tell clients its limit, so the source is
//!   told it: [`max_message_size`](RabbitMqBuilder::max_message_size) (default
//!   [`DEFAULT_MAX_MESSAGE_SIZE`], RabbitMQ 4.0's default; 3.x's was 128 MiB). A dead letter
//!   is fitted to it before it is published, counting the body and an upper estimate of its
//!   encoded properties and headers (RabbitMQ itself counts only the body, so this errs on the
//!   safe side), as the NATS source does: the reason is cut to fit (down to
//!   [`MIN_FITTED_REASON`] bytes); if that is not enough, the original's own headers are left
//!   out (`reason` and `deliveries` kept, the reason cut to fit); if the body alone is too
//!   large, the dead letter carries no body and [`BODY_TOO_LARGE`]`: N` (the body's size in
//!   bytes), with `message-id`, `content-type`, `content-encoding`, `reason` and
//!   `deliveries`. A setting above the broker's real limit (the limit lowered after a message
//!   was published, say) is caught too: a dead letter the broker refuses for its size
//!   (`PRECONDITION_FAILED`, "message size N is larger than … max size M", which closes the
//!   dead letters' channel) fails, the message goes back to the queue when the next
//!   [`receive`](Source::receive) reconnects, and the source remembers it (a digest of its
//!   `message-id` and body, at most [`REMEMBERED_REFUSALS`] of them, the oldest forgotten
//!   first, in memory only): its next dead letter is the smallest form, without the body.
//!   So such a message is delivered one more time, or a few when more than
//!   [`REMEMBERED_REFUSALS`] are refused at once or the consumer restarts in between, and
//!   each refusal counts in `idempotency.source.errors` (`dead_letter`). The refusal closes
//!   the dead letters' channel: other dead letters in flight on it lose their confirm, and
//!   their messages are dead-lettered again, whole, on their next delivery (maybe twice on
//!   `QUEUE.dead`: at least once). Only a broker that refuses even an empty body with those
//!   few headers would still loop.
//! - No keep-alive: RabbitMQ never redelivers a message while the channel that holds it is
//!   open, except once `consumer_timeout` (30 minutes by default) passed without an ack, when
//!   the broker closes the channel and the message goes back to the queue. Keep handlers,
//!   and backoff delays, well below it. The source's
//!   [`handling_limit`](Source::handling_limit) is three quarters of the
//!   [`consumer_timeout`](RabbitMqBuilder::consumer_timeout) it is told the broker has: the
//!   runtime stops a handler there and retries its message; the last quarter is left for the
//!   time a message waits in the prefetch and for a retry's delay.
//!
//! # Prefetch
//!
//! The broker sends at most [`prefetch`](RabbitMqBuilder::prefetch) unacknowledged messages
//! to the consumer; the runtime asks for no more than its free handler slots, the rest wait
//! in the client. Messages waiting for a delayed retry are unacknowledged and count against
//! the prefetch, so it must exceed the consumer's
//! [concurrency](super::Consumer::concurrency) by at least the messages expected to wait for
//! a retry at once, or retries starve new deliveries.
//!
//! # Reconnecting
//!
//! lapin does not reconnect. When the connection or a channel fails (the broker restarted,
//! an operator closed the connection, the consumer was cancelled), [`receive`](Source::receive)
//! returns an error and each later call connects again (at most 10 s each), with the
//! declarations and the consumer, until it works. Each delivery keeps the generation of the
//! connection it came on: an answer to a delivery of an earlier connection fails at once
//! without touching the broker, which has requeued the message already. Dropping the source
//! closes its connection: the broker requeues every message it still held, those waiting for
//! a delayed retry included.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::{DeadLettered, MAX_FIELDS, Message, Received, Source, SourceError};

/// Unacknowledged messages the broker sends at most, by default.
pub const DEFAULT_PREFETCH: u16 = 64;
/// RabbitMQ's default `consumer_timeout`: 30 minutes.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How long [`receive`](Source::receive) waits for a first message.
const RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// The most a connect (with its declarations and consumer) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most an ack, a nack or a dead letter's publish and confirm may take.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `reason` header a dead letter gets, in bytes.
const MAX_REASON: usize = 4096;
/// The header in which quorum queues count earlier deliveries.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// The default [`max_message_size`](RabbitMqBuilder::max_message_size): 16 MiB, RabbitMQ
/// 4.0's default (3.x's was 128 MiB).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;
/// The smallest and the largest [`max_message_size`](RabbitMqBuilder::max_message_size) the
/// builder accepts (others are clamped): 4 KiB, room for the smallest dead letter, and
/// 512 MiB, the most RabbitMQ accepts.
const MAX_MESSAGE_SIZE_BOUNDS: (usize, usize) = (4 * 1024, 512 * 1024 * 1024);
/// The shortest a dead letter's reason is cut to, to fit the
/// [`max_message_size`](RabbitMqBuilder::max_message_size), before the original's own
/// headers are left out instead (as the NATS source does).
pub const MIN_FITTED_REASON: usize = 64;
/// The header of a dead letter sent without its body, which did not fit the broker's
/// `max_message_size`: the body's size in bytes (as the NATS source does).
pub const BODY_TOO_LARGE: &str = "body-too-large";
/// How many messages whose dead letter the broker refused for its size the source remembers,
/// to send their next dead letter without the body.
pub const REMEMBERED_REFUSALS: usize = 1024;

/// A [`Source`] consuming a RabbitMQ quorum queue. See the [module](self) documentation.
pub struct RabbitMq {
    inner: Arc<Inner>,
}

impl fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMq")
            .field("queue", &self.inner.queue)
            .field("prefetch", &self.inner.prefetch)
            .field("generation", &self.inner.generation.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Builds a [`RabbitMq`]: [`RabbitMq::builder`].
#[derive(Clone)]
pub struct RabbitMqBuilder {
    url: String,
    queue: String,
    prefetch: u16,
    consumer_tag: String,
    consumer_timeout: Duration,
    max_message_size: usize,
}

impl fmt::Debug for RabbitMqBuilder {
    // Not the URL: it may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqBuilder")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("consumer_timeout", &self.consumer_timeout)
            .field("max_message_size", &self.max_message_size)
            .finish_non_exhaustive()
    }
}

/// The source's handle on one delivery: its tag, the connection it came on, and the
/// properties a dead letter keeps.
#[derive(Debug, Clone)]
pub struct RabbitMqDelivery {
    tag: u64,
    generation: u64,
    properties: BasicProperties,
}

impl RabbitMqDelivery {
    /// The delivery tag, unique on the channel the message came on.
    pub fn delivery_tag(&self) -> u64 {
        self.tag
    }
}

struct Inner {
    url: String,
    queue: String,
    dead_queue: String,
    prefetch: u16,
    consumer_tag: String,
    consumer_timeout: Duration,
    max_message_size: usize,
    /// Digests of the messages whose dead letter the broker refused for its size, the oldest
    /// first, at most [`REMEMBERED_REFUSALS`]: their next dead letter goes without the body.
    refused: Mutex<VecDeque<u64>>,
    /// The last generation opened; each connect takes the next one.
    generation: AtomicU64,
    /// The connection answers go to, while it is healthy as far as `receive` knows.
    current: Mutex<Option<Arc<Link>>>,
    /// The consumer of the current connection; only `receive` takes it.
    receiving: tokio::sync::Mutex<Option<Receiving>>,
}

/// One connection with its two channels.
struct Link {
    generation: u64,
    connection: Connection,
    /// Consumes `QUEUE`, acks and nacks.
    channel: Channel,
    /// Publishes dead letters, in confirm mode.
    publisher: Channel,
    /// Set when something showed the connection needs redoing (a dead letter came back
    /// unroutable: `QUEUE.dead` is gone).
    broken: AtomicBool,
}

impl Link {
    fn healthy(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
            && self.connection.status().connected()
            && self.channel.status().connected()
            && self.publisher.status().connected()
    }
}

struct Receiving {
    link: Arc<Link>,
    consumer: lapin::Consumer,
}

impl RabbitMq {
    /// A builder for a source consuming `queue` on the broker at `url`
    /// (`amqp://user:password@host:port/vhost`, the vhost URL-encoded: `%2f` for `/`).
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> RabbitMqBuilder {
        RabbitMqBuilder {
            url: url.into(),
            queue: queue.into(),
            prefetch: DEFAULT_PREFETCH,
            consumer_tag: String::new(),
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
        }
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// The dead-letter queue: the queue's name followed by `.dead`.
    pub fn dead_letter_queue(&self) -> &str {
        &self.inner.dead_queue
    }
}

impl RabbitMqBuilder {
    /// The most unacknowledged messages the broker sends this consumer (`basic.qos`; default
    /// [`DEFAULT_PREFETCH`], at least 1). It must exceed the consumer's
    /// [concurrency](super::Consumer::concurrency): messages waiting for a delayed retry stay
    /// unacknowledged and count against it.
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// The consumer tag (default: empty, the broker makes one up). Used again on every
    /// reconnect.
    #[must_use]
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// The broker's `consumer_timeout` (default [`DEFAULT_CONSUMER_TIMEOUT`], RabbitMQ's own):
    /// the runtime stops a handler at three quarters of it
    /// ([`handling_limit`](Source::handling_limit)). Tell it the broker's setting when that
    /// was changed.
    #[must_use]
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// The broker's `max_message_size` in bytes (default [`DEFAULT_MAX_MESSAGE_SIZE`];
    /// clamped between 4 KiB and 512 MiB, the most RabbitMQ accepts), which the broker does
    /// not tell clients: dead letters are fitted to it (see the [module](self) documentation).
    /// Tell it the broker's setting when that was changed; one set too high is caught when the
    /// broker refuses a dead letter, at the cost of one more delivery of that message.
    #[must_use]
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes.clamp(MAX_MESSAGE_SIZE_BOUNDS.0, MAX_MESSAGE_SIZE_BOUNDS.1);
        self
    }

    /// Connects, declares both queues and starts consuming. Fails when the broker cannot be
    /// reached or refuses a declaration (a queue exists with other arguments).
    pub async fn connect(self) -> Result<RabbitMq, SourceError> {
        let dead_queue = format!("{}.dead", self.queue);
        let inner = Arc::new(Inner {
            url: self.url,
            queue: self.queue,
            dead_queue,
            prefetch: self.prefetch,
            consumer_tag: self.consumer_tag,
            consumer_timeout: self.consumer_timeout,
            max_message_size: self.max_message_size,
            refused: Mutex::new(VecDeque::new()),
            generation: AtomicU64::new(0),
            current: Mutex::new(None),
            receiving: tokio::sync::Mutex::new(None),
        });
        let receiving = inner.open().await?;
        *inner.receiving.lock().await = Some(receiving);
        Ok(RabbitMq { inner })
    }
}

impl Inner {
    /// A new connection, its declarations, its consumer; made current.
    async fn open(&self) -> Result<Receiving, SourceError> {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let receiving = match tokio::time::timeout(CONNECT_TIMEOUT, self.connect(generation)).await
        {
            Ok(result) => result?,
            Err(_) => {
                return Err(SourceError::new(
                    format!("connect to RabbitMQ for queue {}", self.queue),
                    format!("no answer within {CONNECT_TIMEOUT:?}"),
                ));
            }
        };
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Arc::clone(&receiving.link));
        Ok(receiving)
    }

    async fn connect(&self, generation: u64) -> Result<Receiving, SourceError> {
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current())
            .with_connection_name(format!("idempotent:{}", self.queue).into());
        let connection = Connection::connect(&self.url, properties)
            .await
            .map_err(|e| SourceError::new("connect to RabbitMQ", e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| SourceError::new("open a channel", e))?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| SourceError::new("open the dead letters' channel", e))?;
        for queue in [&self.queue, &self.dead_queue] {
            declare(&channel, queue).await?;
        }
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| SourceError::new("put the dead letters' channel in confirm mode", e))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| SourceError::new(format!("set the prefetch to {}", self.prefetch), e))?;
        let consumer = channel
            .basic_consume(
                &self.queue,
                &self.consumer_tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| SourceError::new(format!("consume queue {}", self.queue), e))?;
        tracing::debug!(queue = %self.queue, generation, "connected to RabbitMQ");
        Ok(Receiving {
            link: Arc::new(Link {
                generation,
                connection,
                channel,
                publisher,
                broken: AtomicBool::new(false),
            }),
            consumer,
        })
    }

    /// Forgets `receiving`'s connection and closes it (the broker requeues what it held).
    fn discard(&self, receiving: Receiving) {
        {
            let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            if current
                .as_ref()
                .is_some_and(|link| link.generation == receiving.link.generation)
            {
                *current = None;
            }
        }
        let Receiving { link, consumer } = receiving;
        drop(consumer);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                link.connection.close(200, "reconnecting"),
            )
            .await;
        });
    }

    /// The connection `generation`, while it is the current one.
    fn link(&self, generation: u64) -> Result<Arc<Link>, SourceError> {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match current.as_ref() {
            Some(link) if link.generation == generation => Ok(Arc::clone(link)),
            _ => Err(SourceError::new(
                "answer RabbitMQ",
                "the connection this message came on is gone; the broker requeued the message",
            )),
        }
    }

    fn refusals(&self) -> std::sync::MutexGuard<'_, VecDeque<u64>> {
        self.refused.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the broker refused a dead letter of the message `digest` for its size.
    fn was_refused(&self, digest: u64) -> bool {
        self.refusals().contains(&digest)
    }

    /// Remembers that the broker refused a dead letter of the message `digest` for its size,
    /// forgetting the oldest beyond [`REMEMBERED_REFUSALS`].
    fn remember_refusal(&self, digest: u64) {
        let mut refused = self.refusals();
        if !refused.contains(&digest) {
            if refused.len() >= REMEMBERED_REFUSALS {
                refused.pop_front();
            }
            refused.push_back(digest);
        }
    }

    fn forget_refusal(&self, digest: u64) {
        self.refusals().retain(|&known| known != digest);
    }
}

/// Declares `queue`, durable, as a quorum queue with no other argument.
async fn declare(channel: &Channel, queue: &str) -> Result<(), SourceError> {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .map(drop)
        .map_err(|e| {
            SourceError::new(
                format!(
                    "declare queue {queue} (durable, arguments exactly {{\"x-queue-type\": \"quorum\"}})"
                ),
                e,
            )
        })
}

/// `operation`, failing after [`OPERATION_TIMEOUT`].
async fn bounded<T>(
    context: &str,
    operation: impl Future<Output = lapin::Result<T>>,
) -> Result<T, SourceError> {
    match tokio::time::timeout(OPERATION_TIMEOUT, operation).await {
        Ok(result) => result.map_err(|e| SourceError::new(context, e)),
        Err(_) => Err(SourceError::new(
            context,
            format!("no answer from RabbitMQ within {OPERATION_TIMEOUT:?}"),
        )),
    }
}

/// `delivery` as the runtime sees it, from the connection `generation`.
fn received(delivery: lapin::message::Delivery, generation: u64) -> Received<RabbitMqDelivery> {
    let lapin::message::Delivery {
        delivery_tag,
        properties,
        data,
        ..
    } = delivery;
    Received {
        message: message(delivery_tag, &properties, data),
        delivery: RabbitMqDelivery {
            tag: delivery_tag,
            generation,
            properties,
        },
    }
}

/// The [`Message`] of a delivery.
fn message(tag: u64, properties: &BasicProperties, data: Vec<u8>) -> Message {
    let mut message = Message::new(tag.to_string(), Bytes::from(data));
    if let Some(id) = properties.message_id() {
        message = message.with_id(id.as_str());
    }
    let mut deliveries = 1;
    if let Some(headers) = properties.headers() {
        let mut kept = 0;
        for (name, value) in headers {
            if name.as_str() == DELIVERY_COUNT {
                deliveries = delivery_count(value).map_or(1, |count| count.saturating_add(1));
            }
            if kept == MAX_FIELDS {
                continue;
            }
            let bytes = match value {
                AMQPValue::LongString(text) => Bytes::copy_from_slice(text.as_bytes()),
                AMQPValue::ShortString(text) => Bytes::copy_from_slice(text.as_str().as_bytes()),
                AMQPValue::ByteArray(bytes) => Bytes::copy_from_slice(bytes.as_slice()),
                _ => continue,
            };
            message = message.with_field(name.as_str(), bytes);
            kept += 1;
        }
    }
    message.with_deliveries(deliveries)
}

/// The count in an `x-delivery-count` header, whatever integer type carries it (a negative
/// one is 0).
fn delivery_count(value: &AMQPValue) -> Option<u64> {
    let count = match *value {
        AMQPValue::ShortShortInt(n) => i64::from(n),
        AMQPValue::ShortShortUInt(n) => i64::from(n),
        AMQPValue::ShortInt(n) => i64::from(n),
        AMQPValue::ShortUInt(n) => i64::from(n),
        AMQPValue::LongInt(n) => i64::from(n),
        AMQPValue::LongUInt(n) => i64::from(n),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => return Some(n),
        _ => return None,
    };
    Some(u64::try_from(count).unwrap_or(0))
}

/// What identifies a message across its deliveries (the delivery tag does not): a digest of
/// its `message-id` and body.
fn digest(message: &Message) -> u64 {
    let mut hasher = DefaultHasher::new();
    message.id().hash(&mut hasher);
    message.body().as_ref().hash(&mut hasher);
    hasher.finish()
}

/// The dead letter's properties: persistent, the original's `message-id`, `content-type` and
/// `content-encoding`, its headers (when `own_headers`) less `x-delivery-count`, `reason`,
/// `deliveries` and, for a dead letter without its body, [`BODY_TOO_LARGE`].
fn dead_properties(
    original: &BasicProperties,
    own_headers: bool,
    reason: &str,
    deliveries: u64,
    body_too_large: Option<usize>,
) -> BasicProperties {
    let mut headers: BTreeMap<ShortString, AMQPValue> = match original.headers() {
        Some(headers) if own_headers => headers.inner().clone(),
        _ => BTreeMap::new(),
    };
    headers.remove(DELIVERY_COUNT);
    headers.insert(
        "reason".into(),
        AMQPValue::LongString(LongString::from(reason)),
    );
    headers.insert(
        "deliveries".into(),
        AMQPValue::LongString(LongString::from(deliveries.to_string())),
    );
    if let Some(size) = body_too_large {
        headers.insert(
            BODY_TOO_LARGE.into(),
            AMQPValue::LongString(LongString::from(size.to_string())),
        );
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(FieldTable::from(headers));
    if let Some(id) = original.message_id() {
        properties = properties.with_message_id(id.clone());
    }
    if let Some(content_type) = original.content_type() {
        properties = properties.with_content_type(content_type.clone());
    }
    if let Some(encoding) = original.content_encoding() {
        properties = properties.with_content_encoding(encoding.clone());
    }
    properties
}

/// The dead letter's properties and body, within `max` bytes (body and properties' upper
/// estimate together) where it can be: the whole original with `reason` and `deliveries`;
/// else with the reason cut to fit (keeping at least [`MIN_FITTED_REASON`] bytes of it); else
/// without the original's own headers, the reason cut to fit; else (and always when
/// `smallest`) without the body, its size in [`BODY_TOO_LARGE`].
fn fitted_dead_letter(
    original: &BasicProperties,
    message: &Message,
    reason: &str,
    max: usize,
    smallest: bool,
) -> (BasicProperties, Bytes) {
    let reason = one_line(reason);
    let body = message.body().clone();
    let deliveries = message.deliveries();
    let make = |own_headers: bool, reason: &str, too_large: Option<usize>| {
        dead_properties(original, own_headers, reason, deliveries, too_large)
    };
    // The room left for the reason's value beside `properties` (whose reason is empty) and a
    // body of `body` bytes.
    let room = |properties: &BasicProperties, body: usize| {
        max.checked_sub(properties_len(properties).saturating_add(body))
    };
    if !smallest {
        let full = make(true, &reason, None);
        if properties_len(&full).saturating_add(body.len()) <= max {
            return (full, body);
        }
        let unreasoned = make(true, "", None);
        if let Some(room) = room(&unreasoned, body.len())
            && room >= MIN_FITTED_REASON.min(reason.len())
        {
            return (make(true, cut(&reason, room), None), body);
        }
        let extras = make(false, "", None);
        if let Some(room) = room(&extras, body.len()) {
            return (make(false, cut(&reason, room), None), body);
        }
    }
    let size = Some(body.len());
    let room = room(&make(false, "", size), 0).unwrap_or(0);
    (make(false, cut(&reason, room), size), Bytes::new())
}

/// An upper estimate of the size of `properties` on the wire: the content header frame.
fn properties_len(properties: &BasicProperties) -> usize {
    // Frame header and end (8), class, weight, body size and flags (14), delivery mode,
    // priority and the other fixed-size properties: 64 in all, more than they take.
    let mut len = 64;
    for text in [
        properties.message_id(),
        properties.content_type(),
        properties.content_encoding(),
        properties.correlation_id(),
        properties.reply_to(),
        properties.expiration(),
        properties.kind(),
        properties.user_id(),
        properties.app_id(),
        properties.cluster_id(),
    ]
    .into_iter()
    .flatten()
    {
        len += 1 + text.as_str().len();
    }
    if let Some(headers) = properties.headers() {
        len += table_len(headers);
    }
    len
}

/// An upper estimate of the encoded size of a field table.
fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(name, value)| 1 + name.as_str().len() + value_len(value))
        .sum::<usize>()
}

/// An upper estimate of the encoded size of a field value, its type tag included.
fn value_len(value: &AMQPValue) -> usize {
    1 + match value {
        AMQPValue::LongString(text) => 4 + text.as_bytes().len(),
        AMQPValue::ShortString(text) => 1 + text.as_str().len(),
        AMQPValue::ByteArray(bytes) => 4 + bytes.as_slice().len(),
        AMQPValue::FieldArray(values) => 4 + values.as_slice().iter().map(value_len).sum::<usize>(),
        AMQPValue::FieldTable(table) => table_len(table),
        // Numbers, booleans, decimals, timestamps, void: at most 8 bytes.
        _ => 8,
    }
}

/// The longest prefix of `text` of at most `max` bytes, on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whether `error` is the broker refusing a message of `size` bytes (the body: what RabbitMQ
/// counts) for its size: `PRECONDITION_FAILED`, "message size N is larger than [configured]
/// max size M". The channel's close fails every dead letter in flight on it with the same
/// error: only the one whose body has that size was refused for it (when the text names no
/// size, any is taken to be).
fn refused_for_size(error: &lapin::Error, size: usize) -> bool {
    let lapin::ErrorKind::ProtocolError(error) = error.kind() else {
        return false;
    };
    if *error.kind() != AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) {
        return false;
    }
    let text = error.get_message().as_str();
    let Some((_, after)) = text.split_once("message size ") else {
        return false;
    };
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse::<usize>()
        .map_or(true, |refused| refused == size)
}

/// The longest a handler may run under a broker whose `consumer_timeout` is `timeout`.
fn handling_limit(timeout: Duration) -> Duration {
    timeout - timeout / 4
}

/// `reason` on one line (control characters become spaces), at most [`MAX_REASON`] bytes.
fn one_line(reason: &str) -> String {
    let mut line = String::with_capacity(reason.len().min(MAX_REASON));
    for c in reason.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if line.len() + c.len_utf8() > MAX_REASON {
            break;
        }
        line.push(c);
    }
    line
}

impl Source for RabbitMq {
    type Delivery = RabbitMqDelivery;

    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    fn handling_limit(&self) -> Option<Duration> {
        Some(handling_limit(self.inner.consumer_timeout))
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<RabbitMqDelivery>>, SourceError> {
        let inner = &self.inner;
        let mut receiving = inner.receiving.lock().await;
        if let Some(current) = receiving.take() {
            if current.link.healthy() {
                *receiving = Some(current);
            } else {
                inner.discard(current);
                return Err(SourceError::new(
                    "receive from RabbitMQ",
                    "the connection or a channel failed; reconnecting on the next call",
                ));
            }
        }
        let current = match receiving.as_mut() {
            Some(current) => current,
            None => receiving.insert(inner.open().await?),
        };
        let generation = current.link.generation;
        let mut batch = Vec::new();
        let mut failure = None;
        let first = match tokio::time::timeout(RECEIVE_WAIT, current.consumer.next()).await {
            Err(_) => return Ok(batch),
            Ok(next) => Some(next),
        };
        let mut next = first;
        while let Some(item) = next.take() {
            match item {
                Some(Ok(delivery)) => batch.push(received(delivery, generation)),
                Some(Err(error)) => {
                    failure = Some(error.to_string());
                    break;
                }
                None => {
                    failure = Some("the broker cancelled the consumer".to_owned());
                    break;
                }
            }
            if batch.len() >= max {
                break;
            }
            next = current.consumer.next().now_or_never();
        }
        if let Some(failure) = failure {
            // What came on a failed channel went back to the queue with it.
            if let Some(current) = receiving.take() {
                inner.discard(current);
            }
            return Err(SourceError::new("receive from RabbitMQ", failure));
        }
        Ok(batch)
    }

    async fn ack(&self, delivery: &RabbitMqDelivery) -> Result<(), SourceError> {
        let link = self.inner.link(delivery.generation)?;
        bounded(
            "basic.ack",
            link.channel
                .basic_ack(delivery.tag, BasicAckOptions::default()),
        )
        .await
    }

    async fn retry(&self, delivery: &RabbitMqDelivery, delay: Duration) -> Result<(), SourceError> {
        // Fail now if the message went back to the queue already.
        drop(self.inner.link(delivery.generation)?);
        let inner: Weak<Inner> = Arc::downgrade(&self.inner);
        let (tag, generation) = (delivery.tag, delivery.generation);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // A dropped source closed its connection: the broker has the message back.
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let nacked = match inner.link(generation) {
                Ok(link) => {
                    let nack = BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    };
                    bounded("basic.nack", link.channel.basic_nack(tag, nack)).await
                }
                Err(error) => Err(error),
            };
            if let Err(error) = nacked {
                tracing::debug!(queue = %inner.queue, %error, "delayed retry not sent; the broker requeues the message itself");
            }
        });
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &RabbitMqDelivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        let inner = &self.inner;
        let link = inner.link(delivery.generation)?;
        let digest = digest(message);
        let smallest = inner.was_refused(digest);
        let (properties, body) = fitted_dead_letter(
            &delivery.properties,
            message,
            reason,
            inner.max_message_size,
            smallest,
        );
        let context = format!("dead-letter to {}", inner.dead_queue);
        let publish = async {
            link.publisher
                .basic_publish(
                    "",
                    &inner.dead_queue,
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &body,
                    properties,
                )
                .await?
                .await
        };
        let confirmation = match tokio::time::timeout(OPERATION_TIMEOUT, publish).await {
            Ok(Ok(confirmation)) => confirmation,
            Ok(Err(error)) => {
                if refused_for_size(&error, body.len()) {
                    // The broker's limit is below the setting: without the body next time.
                    inner.remember_refusal(digest);
                    tracing::warn!(queue = %inner.queue, size = body.len(), %error, "a dead letter was refused for its size; the next one of this message goes without its body");
                }
                return Err(SourceError::new(context, error));
            }
            Err(_) => {
                return Err(SourceError::new(
                    context,
                    format!("no answer from RabbitMQ within {OPERATION_TIMEOUT:?}"),
                ));
            }
        };
        match confirmation {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                // Unroutable: the dead-letter queue is gone. Reconnecting declares it again.
                link.broken.store(true, Ordering::Relaxed);
                return Err(SourceError::new(
                    context,
                    format!(
                        "the broker returned the message: {} {}",
                        returned.reply_code, returned.reply_text
                    ),
                ));
            }
            Confirmation::Nack(None) => {
                return Err(SourceError::new(
                    context,
                    "the broker refused the message (publisher nack)",
                ));
            }
            Confirmation::NotRequested => {
                return Err(SourceError::new(
                    context,
                    "the channel is not in confirm mode",
                ));
            }
        }
        if smallest {
            inner.forget_refusal(digest);
        }
        bounded(
            "basic.ack after the dead letter",
            link.channel
                .basic_ack(delivery.tag, BasicAckOptions::default()),
        )
        .await?;
        Ok(DeadLettered::Now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_counts_of_any_integer_type() {
        assert_eq!(delivery_count(&AMQPValue::LongLongInt(2)), Some(2));
        assert_eq!(delivery_count(&AMQPValue::LongInt(-3)), Some(0));
        assert_eq!(delivery_count(&AMQPValue::ShortShortUInt(7)), Some(7));
        assert_eq!(delivery_count(&AMQPValue::LongString("1".into())), None);
    }

    #[test]
    fn handlers_stop_at_three_quarters_of_the_consumer_timeout() {
        assert_eq!(
            handling_limit(DEFAULT_CONSUMER_TIMEOUT),
            Duration::from_secs(22 * 60 + 30)
        );
        assert!(handling_limit(Duration::MAX) < Duration::MAX);
        assert_eq!(handling_limit(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn reasons_are_one_bounded_line() {
        assert_eq!(one_line("a\nb\r\tc"), "a b  c");
        let long = "é".repeat(MAX_REASON);
        let line = one_line(&long);
        assert!(line.len() <= MAX_REASON && line.len() > MAX_REASON - 2);
    }

    #[test]
    fn messages_map_headers_and_delivery_count() {
        let mut headers = FieldTable::default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(-1));
        headers.insert("text".into(), AMQPValue::LongString("v".into()));
        headers.insert("number".into(), AMQPValue::LongInt(4));
        let properties = BasicProperties::default()
            .with_message_id("m".into())
            .with_headers(headers.clone());
        let message = message(9, &properties, b"body".to_vec());
        assert_eq!(message.position(), "9");
        assert_eq!(message.id(), Some("m"));
        assert_eq!(message.body().as_ref(), b"body");
        assert_eq!(
            message.fields(),
            &[("text".to_owned(), Bytes::from_static(b"v"))]
        );
        assert_eq!(message.deliveries(), 1);
        headers.insert("x-delivery-count".into(), AMQPValue::ShortInt(2));
        let properties = BasicProperties::default().with_headers(headers);
        let message = message_of(&properties);
        assert_eq!(message.id(), None);
        assert_eq!(message.deliveries(), 3);
    }

    fn original(extra: usize) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1));
        headers.insert(
            "extra".into(),
            AMQPValue::LongString("x".repeat(extra).into()),
        );
        BasicProperties::default()
            .with_message_id("m".into())
            .with_content_type("text/plain".into())
            .with_headers(headers)
    }

    fn header(properties: &BasicProperties, name: &str) -> Option<String> {
        match properties.headers().as_ref()?.inner().get(name)? {
            AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into()),
            _ => None,
        }
    }

    #[test]
    fn dead_letters_are_fitted_step_by_step() {
        let reason = "r".repeat(1000);
        let fit = |extra: usize, body: usize, max: usize, smallest: bool| {
            let properties = original(extra);
            let message = message(1, &properties, vec![b'b'; body]);
            let (dead, body) = fitted_dead_letter(&properties, &message, &reason, max, smallest);
            assert!(properties_len(&dead) + body.len() <= max);
            (dead, body)
        };
        // Whole: the original's headers (less x-delivery-count), the reason, the body.
        let (dead, body) = fit(10, 100, 8192, false);
        assert_eq!(body.len(), 100);
        assert_eq!(header(&dead, "reason"), Some(reason.clone()));
        assert_eq!(header(&dead, "extra").map(|e| e.len()), Some(10));
        assert_eq!(header(&dead, "deliveries").as_deref(), Some("2"));
        assert!(
            !dead
                .headers()
                .as_ref()
                .unwrap()
                .contains_key("x-delivery-count")
        );
        // The reason cut, the rest kept.
        let (dead, body) = fit(10, 7600, 8192, false);
        assert_eq!(body.len(), 7600);
        let cut = header(&dead, "reason").unwrap().len();
        assert!((MIN_FITTED_REASON..1000).contains(&cut), "{cut}");
        assert!(header(&dead, "extra").is_some());
        // The original's headers left out, the body and the whole reason kept.
        let (dead, body) = fit(3000, 6000, 8192, false);
        assert_eq!(body.len(), 6000);
        assert_eq!(header(&dead, "extra"), None);
        assert_eq!(header(&dead, "reason"), Some(reason.clone()));
        assert_eq!(header(&dead, BODY_TOO_LARGE), None);
        assert_eq!(dead.message_id().as_ref().map(|id| id.as_str()), Some("m"));
        // The body left out.
        let (dead, body) = fit(10, 9000, 8192, false);
        assert!(body.is_empty());
        assert_eq!(header(&dead, BODY_TOO_LARGE).as_deref(), Some("9000"));
        assert_eq!(header(&dead, "reason"), Some(reason.clone()));
        assert_eq!(header(&dead, "extra"), None);
        // The smallest form, asked for: no body even when it would fit.
        let (dead, body) = fit(10, 100, 8192, true);
        assert!(body.is_empty());
        assert_eq!(header(&dead, BODY_TOO_LARGE).as_deref(), Some("100"));
        // The smallest limit still holds the smallest form with a reason.
        let (dead, body) = fit(10, 9000, MAX_MESSAGE_SIZE_BOUNDS.0, false);
        assert!(body.is_empty());
        assert_eq!(header(&dead, "reason"), Some(reason.clone()));
    }

    #[test]
    fn max_message_sizes_are_clamped() {
        let builder = |bytes| RabbitMq::builder("amqp://x", "q").max_message_size(bytes);
        assert_eq!(builder(0).max_message_size, MAX_MESSAGE_SIZE_BOUNDS.0);
        assert_eq!(builder(usize::MAX).max_message_size, 512 * 1024 * 1024);
        assert_eq!(builder(8192).max_message_size, 8192);
        assert_eq!(
            RabbitMq::builder("amqp://x", "q").max_message_size,
            DEFAULT_MAX_MESSAGE_SIZE
        );
    }

    #[test]
    fn size_refusals_are_recognised_by_the_refused_size() {
        let error = |kind, text: &str| {
            lapin::Error::from(lapin::ErrorKind::ProtocolError(
                lapin::protocol::AMQPError::new(kind, text.into()),
            ))
        };
        let precondition = AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED);
        let refused = error(
            precondition.clone(),
            "PRECONDITION_FAILED - message size 12000 is larger than configured max size 8192",
        );
        assert!(refused_for_size(&refused, 12000));
        // Another dead letter in flight on the channel the broker closed.
        assert!(!refused_for_size(&refused, 100));
        let other = error(precondition, "PRECONDITION_FAILED - inequivalent arg");
        assert!(!refused_for_size(&other, 12000));
        let not_found = error(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "message size 12000",
        );
        assert!(!refused_for_size(&not_found, 12000));
    }

    #[test]
    fn refusals_remembered_are_bounded() {
        let inner = Inner {
            url: String::new(),
            queue: "q".into(),
            dead_queue: "q.dead".into(),
            prefetch: 1,
            consumer_tag: String::new(),
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            refused: Mutex::new(VecDeque::new()),
            generation: AtomicU64::new(0),
            current: Mutex::new(None),
            receiving: tokio::sync::Mutex::new(None),
        };
        for digest in 0..REMEMBERED_REFUSALS as u64 + 10 {
            inner.remember_refusal(digest);
            inner.remember_refusal(digest);
        }
        assert_eq!(inner.refusals().len(), REMEMBERED_REFUSALS);
        assert!(!inner.was_refused(9));
        assert!(inner.was_refused(10));
        inner.forget_refusal(10);
        assert!(!inner.was_refused(10));
    }

    fn message_of(properties: &BasicProperties) -> Message {
        message(1, properties, Vec::new())
    }
}
