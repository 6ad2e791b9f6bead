//! The Kafka sink (feature `kafka`).

use std::fmt;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

use super::{BoxFuture, Relayed, Sink, SinkError};

/// The header a message's idempotency key travels in: what the consumer runtime's Kafka
/// source reads as the message id (`idempotent_consumer::kafka::KEY_HEADER`).
pub const KAFKA_KEY_HEADER: &str = "idempotency-key";

/// How long a message may wait for the broker's acknowledgement, by default.
pub const DEFAULT_KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

/// A [`Sink`] that produces each message to a Kafka topic (feature `kafka`): its Kafka key is
/// its [ordering key](crate::outbox::Outgoing::ordering_key) when it has one (so the messages
/// of one ordering key land on one partition, in order), else its idempotency key; its
/// idempotency key goes in the header `idempotency-key`, then its own headers in order; the
/// payload is the record's value. Written by an idempotent producer (`enable.idempotence`,
/// `acks=all`): delivered means every in-sync replica has it. A message the broker refuses
/// for its size or content is dead-lettered; anything else (the broker down, a timeout) is
/// retried by the relay.
#[derive(Clone)]
pub struct KafkaSink {
    producer: FutureProducer,
    topic: String,
    timeout: Duration,
}

impl fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSink")
            .field("topic", &self.topic)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// A sink producing to `topic` on `brokers` (`host:port[,host:port]`), each message
    /// waiting at most [`DEFAULT_KAFKA_TIMEOUT`] for the broker. No connection is made until
    /// the first message; an invalid setting is an error now.
    pub fn new(brokers: &str, topic: impl Into<String>) -> Result<Self, KafkaError> {
        Self::with_config(
            ClientConfig::new().set("bootstrap.servers", brokers),
            topic,
            DEFAULT_KAFKA_TIMEOUT,
        )
    }

    /// A sink producing to `topic` with `config` (its brokers, security settings, …), each
    /// message waiting at most `timeout` (at least 1 ms; keep it under the relay's delivery
    /// timeout) for the broker's acknowledgement before its delivery fails and the relay
    /// retries it. The settings delivery relies on override `config`'s:
    /// `enable.idempotence=true`, `acks=all`, `message.timeout.ms` from `timeout`.
    pub fn with_config(
        config: &ClientConfig,
        topic: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, KafkaError> {
        let timeout = timeout.max(Duration::from_millis(1));
        Ok(KafkaSink {
            producer: producer(config, timeout)?,
            topic: topic.into(),
            timeout,
        })
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
}

fn producer(config: &ClientConfig, timeout: Duration) -> Result<FutureProducer, KafkaError> {
    let millis = timeout.as_millis().clamp(1, i32::MAX as u128);
    config
        .clone()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", millis.to_string())
        .create()
}

impl Sink for KafkaSink {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let mut headers =
                OwnedHeaders::new_with_capacity(message.headers.len() + 1).insert(Header {
                    key: KAFKA_KEY_HEADER,
                    value: Some(message.key.as_str()),
                });
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
            let key = message.ordering_key.as_deref().unwrap_or(&message.key);
            let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&self.topic)
                .key(key)
                .payload(message.payload.as_ref())
                .headers(headers);
            match self.producer.send(record, self.timeout).await {
                Ok(_) => Ok(()),
                Err((error, _)) => Err(sort(&self.topic, error)),
            }
        })
    }
}

/// A refusal of the message itself is permanent; anything else may pass.
fn sort(topic: &str, error: KafkaError) -> SinkError {
    let permanent = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
        )
    );
    let text = format!("producing to Kafka topic {topic:?}: {error}");
    if permanent {
        SinkError::permanent(text)
    } else {
        SinkError::retry(text)
    }
}
