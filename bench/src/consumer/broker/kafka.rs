//! Kafka in the consumer benchmark: the runtime's source, the bare loop (a `StreamConsumer` in
//! a consumer group, offsets stored per message and committed every 200 ms), publishing with an
//! idempotent producer whose delivery reports are awaited, and deleting a row's topics.
//!
//! A row's topic has [`PARTITIONS`] partitions, created by the publisher; each record's key is
//! its posting's account (1,000 of them), which the runtime takes as the ordering key. Each row
//! has a consumer group of its own (the topic's name): Kafka's groups span topics, and a group
//! shared by the rows would rebalance whenever one row's consumer joined before the previous
//! row's had left.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use idempotent_consumer::kafka::Kafka;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::consumer::bare::{Bare, RECEIVE_WAIT};
use crate::consumer::postings::Posting;

/// Partitions of a row's topic (and of its dead-letter topic).
pub(crate) const PARTITIONS: i32 = 3;
/// How often the bare loop commits the offsets it stored, as the source commits its own.
const COMMIT_EVERY: Duration = idempotent_consumer::kafka::DEFAULT_COMMIT_EVERY;
/// How long an admin request may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// `host:port[,host:port]` from `kafka://host:port[,host:port]` (or the list as it is).
fn brokers(url: &str) -> &str {
    url.strip_prefix("kafka://").unwrap_or(url)
}

fn config(url: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers(url));
    config
}

fn admin(url: &str) -> AdminClient<DefaultClientContext> {
    config(url).create().unwrap()
}

fn admin_options() -> AdminOptions {
    AdminOptions::new().request_timeout(Some(ADMIN_TIMEOUT))
}

/// The runtime's source over topic `name`, in consumer group `name` (the topic exists, made by
/// the publisher; the source creates its dead-letter topic), with the source's defaults but for
/// `buffer` (`--kafka-buffer`), if given.
pub(crate) async fn source(url: &str, name: &str, buffer: Option<usize>) -> Kafka {
    let mut builder = Kafka::builder(brokers(url), name, name).create_topics(PARTITIONS);
    if let Some(records) = buffer {
        builder = builder.buffer(records);
    }
    builder.connect().await.unwrap()
}

/// A publisher on topic `name`, which it creates with [`PARTITIONS`] partitions: an idempotent
/// producer, `acks=all`.
pub(crate) async fn publisher(url: &str, name: &str) -> FutureProducer {
    let created = admin(url)
        .create_topics(
            &[NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1))],
            &admin_options(),
        )
        .await
        .unwrap();
    for result in created {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => panic!("creating the Kafka topic {topic:?}: {code}"),
        }
    }
    config(url)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap()
}

/// Produces `postings` to topic `name`, each keyed by its account, and waits for their
/// delivery reports.
pub(crate) async fn publish(producer: &FutureProducer, name: &str, postings: &[Posting]) {
    let mut deliveries = Vec::with_capacity(postings.len());
    for p in postings {
        let body = p.body();
        let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(name)
            .key(p.account.as_str())
            .payload(body.as_slice());
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((error, _)) => panic!("producing to {name:?}: {error}"),
        }
    }
    for delivery in deliveries {
        if let Err((error, _)) = delivery.await.expect("the producer is alive") {
            panic!("producing to {name:?}: {error}");
        }
    }
}

/// Deletes topic `name` and its dead-letter topic.
pub(crate) async fn delete(url: &str, name: &str) {
    let dead = format!("{name}.dead");
    match admin(url)
        .delete_topics(&[name, &dead], &admin_options())
        .await
    {
        Ok(results) => {
            for result in results {
                match result {
                    Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                    Err((topic, code)) => {
                        eprintln!("consumer bench: cannot delete the Kafka topic {topic:?}: {code}")
                    }
                }
            }
        }
        Err(error) => {
            eprintln!("consumer bench: cannot delete the Kafka topics of {name:?}: {error}")
        }
    }
}

/// The bare loop's consumer: a `StreamConsumer` in group `name`, which stores each message's
/// offset when it is acknowledged and commits the stored offsets every [`COMMIT_EVERY`]
/// (asynchronously, from a task of its own), as the runtime's source commits.
pub(crate) struct BareKafka {
    consumer: Arc<StreamConsumer>,
    committer: tokio::task::JoinHandle<()>,
}

impl BareKafka {
    /// The bare loop's consumer on topic `name`, subscribed (it joins the group as it
    /// receives).
    pub(crate) async fn open(url: &str, name: &str) -> BareKafka {
        let consumer: StreamConsumer = config(url)
            .set("group.id", name)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        consumer.subscribe(&[name]).unwrap();
        let consumer = Arc::new(consumer);
        let committer = tokio::spawn({
            let consumer = Arc::clone(&consumer);
            async move {
                let mut ticks = tokio::time::interval(COMMIT_EVERY);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    // Nothing stored since the last commit is an error (`_NO_OFFSET`): ignored.
                    let _ = consumer.commit_consumer_state(CommitMode::Async);
                }
            }
        });
        BareKafka {
            consumer,
            committer,
        }
    }

    /// Stores `offsets` (partition → the next offset to consume) for the next commit.
    fn store(&self, topic: &str, offsets: impl IntoIterator<Item = (i32, i64)>) {
        let mut list = TopicPartitionList::new();
        for (partition, next) in offsets {
            list.add_partition_offset(topic, partition, Offset::Offset(next))
                .unwrap();
        }
        if let Err(error) = self.consumer.store_offsets(&list) {
            eprintln!("consumer bench: kafka: cannot store offsets: {error}");
        }
    }
}

impl Drop for BareKafka {
    fn drop(&mut self) {
        self.committer.abort();
    }
}

impl Bare for BareKafka {
    type Item = OwnedMessage;

    async fn receive(&self, max: usize) -> Vec<OwnedMessage> {
        let mut out = Vec::with_capacity(max);
        match tokio::time::timeout(RECEIVE_WAIT, self.consumer.recv()).await {
            Err(_) => return out,
            Ok(Ok(message)) => out.push(message.detach()),
            Ok(Err(error)) => {
                eprintln!("consumer bench: kafka: {error}");
                return out;
            }
        }
        // Then whatever the client has fetched already, without waiting.
        while out.len() < max {
            match self.consumer.recv().now_or_never() {
                Some(Ok(message)) => out.push(message.detach()),
                Some(Err(error)) => {
                    eprintln!("consumer bench: kafka: {error}");
                    break;
                }
                None => break,
            }
        }
        out
    }

    fn posting(item: &OwnedMessage) -> Posting {
        Posting::of_body(item.payload().unwrap_or_default())
    }

    async fn ack(&self, item: &OwnedMessage) {
        self.store(item.topic(), [(item.partition(), item.offset() + 1)]);
    }

    async fn ack_all(&self, items: &[OwnedMessage]) {
        let Some(first) = items.first() else {
            return;
        };
        let mut next: BTreeMap<i32, i64> = BTreeMap::new();
        for item in items {
            let offset = next.entry(item.partition()).or_default();
            *offset = (*offset).max(item.offset() + 1);
        }
        self.store(first.topic(), next);
    }
}
