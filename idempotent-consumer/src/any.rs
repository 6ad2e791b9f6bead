//! One of the library's sources, chosen by its URL when the application starts.

use std::time::Duration;

use super::{DeadLettered, Message, Received, Source, SourceError};

#[cfg(feature = "kafka")]
use super::kafka::Kafka;
#[cfg(feature = "nats")]
use super::nats::JetStream;
#[cfg(feature = "rabbitmq")]
use super::rabbitmq::RabbitMq;
#[cfg(feature = "redis-streams")]
use super::redis_streams::RedisStreams;

/// Where an [`AnySource`] consumes from.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `redis://…` (`rediss://`), `nats://…`, `amqp://…` (`amqps://`) or
    /// `kafka://host:port[,host:port]`.
    pub url: String,
    /// The Redis stream, the JetStream stream, the RabbitMQ queue, the Kafka topic.
    pub stream: String,
    /// The Redis consumer group, the JetStream durable consumer, the Kafka consumer group
    /// (unused on RabbitMQ).
    pub group: String,
    /// This consumer's name in the Redis group, its RabbitMQ consumer tag, its Kafka
    /// `client.id` (unused on NATS).
    pub consumer: String,
    /// How long a message left unacknowledged waits for its redelivery: Redis's `claim_idle`,
    /// JetStream's ack wait, Kafka's session timeout (after which a dead consumer's partitions
    /// go to the others); unused on RabbitMQ, which redelivers when a consumer's channel
    /// closes.
    pub redelivery: Duration,
}

/// [`RedisStreams`], [`JetStream`], [`RabbitMq`] or [`Kafka`], as an [`Endpoint`]'s URL says:
/// for an application that lets its deployment pick the broker. Each is there with its
/// feature. On Kafka the topic and its dead-letter topic (`<topic>.dead`) are created with
/// three partitions when missing, and used as they are otherwise.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnySource {
    /// `redis://`, `rediss://`.
    #[cfg(feature = "redis-streams")]
    Redis(RedisStreams),
    /// `nats://`.
    #[cfg(feature = "nats")]
    Nats(JetStream),
    /// `amqp://`, `amqps://`.
    #[cfg(feature = "rabbitmq")]
    RabbitMq(RabbitMq),
    /// `kafka://`.
    #[cfg(feature = "kafka")]
    Kafka(Kafka),
}

/// An [`AnySource`]'s handle on one message.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyDelivery {
    /// From [`AnySource::Redis`].
    #[cfg(feature = "redis-streams")]
    Redis(<RedisStreams as Source>::Delivery),
    /// From [`AnySource::Nats`].
    #[cfg(feature = "nats")]
    Nats(<JetStream as Source>::Delivery),
    /// From [`AnySource::RabbitMq`] (boxed: a delivery carries its properties).
    #[cfg(feature = "rabbitmq")]
    RabbitMq(Box<<RabbitMq as Source>::Delivery>),
    /// From [`AnySource::Kafka`] (boxed: a delivery carries its record).
    #[cfg(feature = "kafka")]
    Kafka(Box<<Kafka as Source>::Delivery>),
}

impl AnySource {
    /// Whether `url` names a broker this build has a source for.
    pub fn supports(url: &str) -> bool {
        let scheme = url.split("://").next().unwrap_or_default();
        match scheme {
            #[cfg(feature = "redis-streams")]
            "redis" | "rediss" => true,
            #[cfg(feature = "nats")]
            "nats" => true,
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => true,
            #[cfg(feature = "kafka")]
            "kafka" => url.len() > "kafka://".len(),
            _ => false,
        }
    }

    /// Connects to `endpoint`'s broker, with the stream (or queue), group and dead letters of
    /// each source's own `connect`.
    pub async fn connect(endpoint: &Endpoint) -> Result<AnySource, SourceError> {
        let Endpoint {
            url,
            stream,
            group,
            consumer,
            redelivery,
        } = endpoint;
        let scheme = url.split("://").next().unwrap_or_default();
        let _ = (stream, group, consumer, redelivery);
        match scheme {
            #[cfg(feature = "redis-streams")]
            "redis" | "rediss" => RedisStreams::builder(url, stream, group, consumer)
                .claim_idle(*redelivery)
                .connect()
                .await
                .map(AnySource::Redis),
            #[cfg(feature = "nats")]
            "nats" => JetStream::builder(url, stream, group)
                .ack_wait(*redelivery)
                .connect()
                .await
                .map(AnySource::Nats),
            #[cfg(feature = "rabbitmq")]
            "amqp" | "amqps" => RabbitMq::builder(url, stream)
                .consumer_tag(consumer.as_str())
                .connect()
                .await
                .map(AnySource::RabbitMq),
            #[cfg(feature = "kafka")]
            "kafka" => Kafka::builder(&url["kafka://".len()..], stream, group)
                .member(consumer.as_str())
                .session_timeout(*redelivery)
                .create_topics(3)
                .connect()
                .await
                .map(AnySource::Kafka),
            _ => Err(SourceError::new(
                format!("the URL {url:?}"),
                "no source of this build takes its scheme",
            )),
        }
    }
}

/// Calls `$method` on whichever source `$self` is, with its own delivery.
macro_rules! each {
    ($self:ident, $delivery:ident, |$source:ident, $d:ident| $body:expr) => {
        match ($self, $delivery) {
            #[cfg(feature = "redis-streams")]
            (AnySource::Redis($source), AnyDelivery::Redis($d)) => $body,
            #[cfg(feature = "nats")]
            (AnySource::Nats($source), AnyDelivery::Nats($d)) => $body,
            #[cfg(feature = "rabbitmq")]
            (AnySource::RabbitMq($source), AnyDelivery::RabbitMq($d)) => $body,
            #[cfg(feature = "kafka")]
            (AnySource::Kafka($source), AnyDelivery::Kafka($d)) => $body,
            #[allow(unreachable_patterns)]
            _ => Err(SourceError::new(
                "answering the broker",
                "a delivery of another source",
            )),
        }
    };
}

fn wrap<D>(
    received: Vec<Received<D>>,
    delivery: impl Fn(D) -> AnyDelivery,
) -> Vec<Received<AnyDelivery>> {
    received
        .into_iter()
        .map(|r| Received {
            message: r.message,
            delivery: delivery(r.delivery),
        })
        .collect()
}

impl Source for AnySource {
    type Delivery = AnyDelivery;

    fn name(&self) -> &'static str {
        match self {
            #[cfg(feature = "redis-streams")]
            AnySource::Redis(source) => source.name(),
            #[cfg(feature = "nats")]
            AnySource::Nats(source) => source.name(),
            #[cfg(feature = "rabbitmq")]
            AnySource::RabbitMq(source) => source.name(),
            #[cfg(feature = "kafka")]
            AnySource::Kafka(source) => source.name(),
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<AnyDelivery>>, SourceError> {
        match self {
            #[cfg(feature = "redis-streams")]
            AnySource::Redis(source) => Ok(wrap(source.receive(max).await?, AnyDelivery::Redis)),
            #[cfg(feature = "nats")]
            AnySource::Nats(source) => Ok(wrap(source.receive(max).await?, AnyDelivery::Nats)),
            #[cfg(feature = "rabbitmq")]
            AnySource::RabbitMq(source) => Ok(wrap(source.receive(max).await?, |d| {
                AnyDelivery::RabbitMq(Box::new(d))
            })),
            #[cfg(feature = "kafka")]
            AnySource::Kafka(source) => Ok(wrap(source.receive(max).await?, |d| {
                AnyDelivery::Kafka(Box::new(d))
            })),
        }
    }

    async fn ack(&self, delivery: &AnyDelivery) -> Result<(), SourceError> {
        each!(self, delivery, |source, d| source.ack(d).await)
    }

    async fn retry(&self, delivery: &AnyDelivery, delay: Duration) -> Result<(), SourceError> {
        each!(self, delivery, |source, d| source.retry(d, delay).await)
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &AnyDelivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        each!(self, delivery, |source, d| source
            .dead_letter(message, d, reason)
            .await)
    }

    async fn keep_alive(&self, delivery: &AnyDelivery) -> Result<(), SourceError> {
        each!(self, delivery, |source, d| source.keep_alive(d).await)
    }

    fn handling_limit(&self) -> Option<Duration> {
        match self {
            #[cfg(feature = "redis-streams")]
            AnySource::Redis(source) => source.handling_limit(),
            #[cfg(feature = "nats")]
            AnySource::Nats(source) => source.handling_limit(),
            #[cfg(feature = "rabbitmq")]
            AnySource::RabbitMq(source) => source.handling_limit(),
            #[cfg(feature = "kafka")]
            AnySource::Kafka(source) => source.handling_limit(),
        }
    }

    fn counts_deliveries(&self) -> bool {
        match self {
            #[cfg(feature = "redis-streams")]
            AnySource::Redis(source) => source.counts_deliveries(),
            #[cfg(feature = "nats")]
            AnySource::Nats(source) => source.counts_deliveries(),
            #[cfg(feature = "rabbitmq")]
            AnySource::RabbitMq(source) => source.counts_deliveries(),
            #[cfg(feature = "kafka")]
            AnySource::Kafka(source) => source.counts_deliveries(),
        }
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        match self {
            #[cfg(feature = "redis-streams")]
            AnySource::Redis(source) => source.keep_alive_every(),
            #[cfg(feature = "nats")]
            AnySource::Nats(source) => source.keep_alive_every(),
            #[cfg(feature = "rabbitmq")]
            AnySource::RabbitMq(source) => source.keep_alive_every(),
            #[cfg(feature = "kafka")]
            AnySource::Kafka(source) => source.keep_alive_every(),
        }
    }
}
