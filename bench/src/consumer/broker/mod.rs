//! The four brokers as the consumer benchmark uses them, one file each: the runtime's source,
//! the bare loop, publishing and clearing away; here, what picks among them.

pub(crate) mod kafka;
pub(crate) mod nats;
pub(crate) mod rabbitmq;
pub(crate) mod redis_streams;

use std::time::Duration;

use async_nats::jetstream;
use lapin::{Channel, Connection};
use rdkafka::producer::FutureProducer;
use redis::aio::MultiplexedConnection;

use super::postings::{Posting, now_micros};
use super::rows::Broker;

/// The consumer group (Redis) and the durable consumer (NATS).
const GROUP: &str = "bench";

/// A publisher on a row's stream, queue or topic, which it creates (NATS: as the runtime's
/// source would; RabbitMQ: declared as the source declares it; Kafka: with three partitions).
pub(crate) enum Publisher {
    Redis(MultiplexedConnection),
    Nats(jetstream::Context),
    RabbitMq(Box<(Connection, Channel)>),
    Kafka(FutureProducer),
}

impl Publisher {
    pub(crate) async fn open(broker: Broker, url: &str, name: &str) -> Publisher {
        match broker {
            Broker::Redis => Publisher::Redis(redis_streams::connection(url).await),
            Broker::Nats => Publisher::Nats(nats::publisher(url, name).await),
            Broker::RabbitMq => Publisher::RabbitMq(Box::new(rabbitmq::publisher(url, name).await)),
            Broker::Kafka => Publisher::Kafka(kafka::publisher(url, name).await),
        }
    }

    /// Publishes `postings` to `name` in order, in chunks of 1,000 whose acknowledgements
    /// (Redis replies, JetStream acks, publisher confirms, Kafka delivery reports) are awaited
    /// before the next.
    pub(crate) async fn publish(&mut self, name: &str, postings: &[Posting]) {
        for chunk in postings.chunks(1000) {
            match self {
                Publisher::Redis(connection) => {
                    redis_streams::publish(connection, name, chunk).await
                }
                Publisher::Nats(context) => nats::publish(context, name, chunk).await,
                Publisher::RabbitMq(link) => rabbitmq::publish(&link.1, name, chunk).await,
                Publisher::Kafka(producer) => kafka::publish(producer, name, chunk).await,
            }
        }
    }

    /// Publishes `postings` one at a time, `rate` a second, each stamped with its send time,
    /// starting after `delay` (the consumer connects meanwhile).
    pub(crate) async fn paced(
        mut self,
        name: String,
        postings: Vec<Posting>,
        rate: u64,
        delay: Duration,
    ) {
        let start = tokio::time::Instant::now() + delay;
        for (n, mut posting) in postings.into_iter().enumerate() {
            tokio::time::sleep_until(start + Duration::from_secs_f64(n as f64 / rate as f64)).await;
            posting.sent = Some(now_micros());
            self.publish(&name, std::slice::from_ref(&posting)).await;
        }
        self.close().await;
    }

    pub(crate) async fn close(self) {
        if let Publisher::RabbitMq(link) = self {
            let _ = link.0.close(200, "published").await;
        }
    }
}

/// Clears a row's stream, queue or topic away (once its consumers are gone).
pub(crate) async fn delete(broker: Broker, url: &str, name: &str) {
    match broker {
        Broker::Redis => redis_streams::delete(url, name).await,
        Broker::Nats => nats::delete(url, name).await,
        Broker::RabbitMq => rabbitmq::delete(url, name).await,
        Broker::Kafka => kafka::delete(url, name).await,
    }
}
