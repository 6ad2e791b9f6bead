//! What a relay delivers to: the [`Sink`] trait, its error, the message as a sink gets it,
//! and the Redis Streams sink.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

/// A boxed future, as [`Sink::deliver`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One committed message, as the relay hands it to a sink. (To test a sink of your own, start
/// from `Relayed::default()` and set the fields.)
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Relayed {
    /// The message's row id (its enqueue order).
    pub id: i64,
    /// Its destination.
    pub destination: String,
    /// Its key: what the receiver deduplicates on.
    pub key: String,
    /// Its payload.
    pub payload: Bytes,
    /// Its headers, in the order given.
    pub headers: Vec<(String, String)>,
    /// Which attempt this is, from 1. Attempts during which a relay died count too.
    pub attempt: u32,
    /// Its [ordering key](crate::outbox::Outgoing::ordering_key), if it has one.
    pub ordering_key: Option<String>,
}

/// Why a sink did not deliver a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkError {
    message: String,
    permanent: bool,
}

impl SinkError {
    /// A failure that may pass (the receiver down, a timeout): the message is tried again
    /// after a backoff, up to the relay's [`max_attempts`](crate::outbox::RelayBuilder::max_attempts).
    pub fn retry(error: impl fmt::Display) -> Self {
        SinkError {
            message: error.to_string(),
            permanent: false,
        }
    }

    /// A failure that retrying cannot change (the receiver refused the message as
    /// malformed): the message is dead-lettered at once.
    pub fn permanent(error: impl fmt::Display) -> Self {
        SinkError {
            message: error.to_string(),
            permanent: true,
        }
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SinkError {}

/// Where a [`Relay`](crate::outbox::Relay) delivers the messages of one destination. Delivery must carry the
/// message's [`key`](Relayed::key) to the receiver, which deduplicates on it: the relay
/// delivers at least once.
pub trait Sink: Send + Sync + 'static {
    /// Delivers `message`; `Ok` once the receiver has it.
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>>;
}

/// A [`Sink`] that adds each message to a Redis stream (feature `redis`): `XADD` with the
/// fields `key` (the message key, which the stream's consumers deduplicate on), `payload`,
/// and each header as a field of its own, in order. A message with a header named `key` or
/// `payload` is dead-lettered (it would shadow those fields).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Clone)]
pub struct RedisStreamSink {
    connection: redis::aio::ConnectionManager,
    stream: String,
    max_len: Option<usize>,
}

#[cfg(feature = "redis")]
impl fmt::Debug for RedisStreamSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamSink")
            .field("stream", &self.stream)
            .field("max_len", &self.max_len)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "redis")]
impl RedisStreamSink {
    /// A sink adding to `stream` through `connection` (which reconnects by itself).
    pub fn new(connection: redis::aio::ConnectionManager, stream: impl Into<String>) -> Self {
        RedisStreamSink {
            connection,
            stream: stream.into(),
            max_len: None,
        }
    }

    /// Trims the stream to about `len` entries on each add (`MAXLEN ~`).
    pub fn max_len(mut self, len: usize) -> Self {
        self.max_len = Some(len);
        self
    }
}

#[cfg(feature = "redis")]
impl Sink for RedisStreamSink {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            if message
                .headers
                .iter()
                .any(|(name, _)| name == "key" || name == "payload")
            {
                return Err(SinkError::permanent(
                    "a header named `key` or `payload` would shadow the entry's own field",
                ));
            }
            let mut add = redis::cmd("XADD");
            add.arg(&self.stream);
            if let Some(len) = self.max_len {
                add.arg("MAXLEN").arg("~").arg(len);
            }
            add.arg("*")
                .arg("key")
                .arg(&message.key)
                .arg("payload")
                .arg(message.payload.as_ref());
            for (name, value) in &message.headers {
                add.arg(name).arg(value);
            }
            let mut connection = self.connection.clone();
            add.query_async::<redis::Value>(&mut connection)
                .await
                .map(drop)
                .map_err(|error| SinkError::retry(format!("XADD to {}: {error}", self.stream)))
        })
    }
}

#[cfg(feature = "kafka")]
pub(super) mod kafka;
