//! RabbitMQ in the consumer benchmark: the runtime's source, the bare loop (`basic.consume`
//! with the source's prefetch, each delivery `basic.ack`ed), publishing with publisher
//! confirms, and deleting a queue.

use futures_util::{FutureExt, StreamExt};
use idempotent_consumer::rabbitmq::RabbitMq;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::consumer::bare::{Bare, RECEIVE_WAIT};
use crate::consumer::postings::Posting;

/// RabbitMQ's prefetch, in the bare loops and the runtime's source (its default).
const PREFETCH: u16 = 64;

/// The runtime's source over queue `name`.
pub(crate) async fn source(url: &str, name: &str) -> RabbitMq {
    RabbitMq::builder(url, name)
        .prefetch(PREFETCH)
        .connect()
        .await
        .unwrap()
}

async fn connection(url: &str) -> Connection {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    Connection::connect(url, properties).await.unwrap()
}

/// A publisher on queue `name`, declared as the runtime's source declares it (durable,
/// `{"x-queue-type": "quorum"}`), with publisher confirms.
pub(crate) async fn publisher(url: &str, name: &str) -> (Connection, Channel) {
    let connection = connection(url).await;
    let channel = connection.create_channel().await.unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            name,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (connection, channel)
}

/// Publishes `postings` to queue `name` (persistent, JSON) and waits for their confirms.
pub(crate) async fn publish(channel: &Channel, name: &str, postings: &[Posting]) {
    let mut confirms = Vec::with_capacity(postings.len());
    for p in postings {
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        confirms.push(
            channel
                .basic_publish(
                    "",
                    name,
                    BasicPublishOptions::default(),
                    &p.body(),
                    properties,
                )
                .await
                .unwrap(),
        );
    }
    for confirm in confirms {
        assert!(matches!(confirm.await.unwrap(), Confirmation::Ack(None)));
    }
}

/// Deletes queue `name` and its dead-letter queue.
pub(crate) async fn delete(url: &str, name: &str) {
    let connection = connection(url).await;
    let channel = connection.create_channel().await.unwrap();
    for name in [name.to_owned(), format!("{name}.dead")] {
        let _ = channel
            .queue_delete(&name, QueueDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "deleted").await;
}

pub(crate) struct BareRabbit {
    _connection: Connection,
    channel: Channel,
    consumer: tokio::sync::Mutex<lapin::Consumer>,
}

impl BareRabbit {
    /// The bare loop's consumer on queue `name`.
    pub(crate) async fn open(url: &str, name: &str) -> BareRabbit {
        let connection = connection(url).await;
        let channel = connection.create_channel().await.unwrap();
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .unwrap();
        let consumer = channel
            .basic_consume(
                name,
                "bare",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        BareRabbit {
            _connection: connection,
            channel,
            consumer: tokio::sync::Mutex::new(consumer),
        }
    }
}

impl Bare for BareRabbit {
    type Item = lapin::message::Delivery;

    async fn receive(&self, max: usize) -> Vec<lapin::message::Delivery> {
        let mut consumer = self.consumer.lock().await;
        let mut out = Vec::with_capacity(max);
        let Ok(first) = tokio::time::timeout(RECEIVE_WAIT, consumer.next()).await else {
            return out;
        };
        let mut next = Some(first);
        while let Some(Some(delivery)) = next.take() {
            out.push(delivery.unwrap());
            if out.len() >= max {
                break;
            }
            next = consumer.next().now_or_never();
        }
        out
    }

    fn posting(item: &lapin::message::Delivery) -> Posting {
        Posting::of_body(&item.data)
    }

    async fn ack(&self, item: &lapin::message::Delivery) {
        self.channel
            .basic_ack(item.delivery_tag, BasicAckOptions::default())
            .await
            .unwrap();
    }
}
