//! What a broker is to the runtime: the [`Source`] trait, what it receives and its errors.

use std::future::Future;
use std::time::Duration;

use super::message::Message;

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
    source: idempotent_core::BoxError,
}

impl SourceError {
    /// `source` happened while doing `context`.
    pub fn new(context: impl Into<String>, source: impl Into<idempotent_core::BoxError>) -> Self {
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

    /// Whether the broker counts deliveries ([`Message::deliveries`] holds across consumer
    /// restarts), which the [`max_deliveries`](crate::Consumer::max_deliveries) bound relies
    /// on. `true` by default. A source that returns `false` (Kafka, which has no per-message
    /// delivery count) numbers only the deliveries it made itself; the runtime then counts
    /// each delivery durably, on the message's record, before its handler runs, and a message
    /// delivered more than `max_deliveries` times without an answer (its consumers died while
    /// handling it) is dead-lettered without running its handler again.
    fn counts_deliveries(&self) -> bool {
        true
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
