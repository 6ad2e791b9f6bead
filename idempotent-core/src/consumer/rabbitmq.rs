//! The RabbitMQ source (feature `rabbitmq`): a quorum queue consumed with manual
//! acknowledgements, over [`lapin`] on tokio.
//!
//! (Longer than most files here, on purpose: the connection, its reconnection with a
//! generation number, acknowledgements and publisher-confirmed dead letters are one state
//! machine around one channel; about 120 lines are documentation and 60 unit tests.)
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
//!   next delivery. Size: a message is split into frames of `frame_max`, so only the broker's
//!   `max_message_size` (16 MiB by default since RabbitMQ 4.0, 128 MiB before) bounds a dead
//!   letter, and the broker does not tell clients its value. The dead letter adds at most
//!   about 4.2 KiB of headers (`reason`, `deliveries`) to the original: keep messages at
//!   least 8 KiB below `max_message_size`. A dead letter over it is refused (the broker
//!   closes the channel), the message goes back to the queue and is delivered again, and its
//!   dead letter is refused again: a loop, counted in `idempotency.source.errors`
//!   (`dead_letter`) on each delivery.
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

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
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
}

impl fmt::Debug for RabbitMqBuilder {
    // Not the URL: it may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqBuilder")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("consumer_timeout", &self.consumer_timeout)
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
        let original = &delivery.properties;
        let mut headers: BTreeMap<ShortString, AMQPValue> = original
            .headers()
            .as_ref()
            .map(|headers| headers.inner().clone())
            .unwrap_or_default();
        headers.remove(DELIVERY_COUNT);
        headers.insert(
            "reason".into(),
            AMQPValue::LongString(LongString::from(one_line(reason))),
        );
        headers.insert(
            "deliveries".into(),
            AMQPValue::LongString(LongString::from(message.deliveries().to_string())),
        );
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
        let context = format!("dead-letter to {}", inner.dead_queue);
        let confirm = bounded(
            &context,
            link.publisher.basic_publish(
                "",
                &inner.dead_queue,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                message.body(),
                properties,
            ),
        )
        .await?;
        match bounded(&context, confirm).await? {
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

    fn message_of(properties: &BasicProperties) -> Message {
        message(1, properties, Vec::new())
    }
}
