//! NATS JetStream in the consumer benchmark: the runtime's source, the bare loop (a durable
//! pull consumer's `fetch`, each message acknowledged), publishing with awaited acks, and
//! deleting a stream.

use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotent_consumer::nats::JetStream;

use super::GROUP;
use crate::consumer::bare::{Bare, RECEIVE_WAIT};
use crate::consumer::postings::Posting;

/// The runtime's source over stream `name`.
pub(crate) async fn source(url: &str, name: &str) -> JetStream {
    JetStream::builder(url, name, GROUP)
        .connect()
        .await
        .unwrap()
}

async fn context(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.unwrap())
}

/// A publisher on stream `name`, created as the runtime's source would create it (it uses an
/// existing stream as it is).
pub(crate) async fn publisher(url: &str, name: &str) -> jetstream::Context {
    let context = context(url).await;
    context
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.entries"), format!("{name}.dead")],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    context
}

/// Publishes `postings` to stream `name` and waits for their acks.
pub(crate) async fn publish(context: &jetstream::Context, name: &str, postings: &[Posting]) {
    let subject = format!("{name}.entries");
    let mut acks = Vec::with_capacity(postings.len());
    for p in postings {
        acks.push(
            context
                .publish(subject.clone(), Bytes::from(p.body()))
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// Deletes stream `name`.
pub(crate) async fn delete(url: &str, name: &str) {
    let _ = context(url).await.delete_stream(name).await;
}

pub(crate) struct BareNats {
    consumer: PullConsumer,
}

impl BareNats {
    /// The bare loop's durable consumer on stream `name`.
    pub(crate) async fn open(url: &str, name: &str) -> BareNats {
        let stream = context(url).await.get_stream(name).await.unwrap();
        let consumer: PullConsumer = stream
            .get_or_create_consumer(
                GROUP,
                pull::Config {
                    durable_name: Some(GROUP.to_owned()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    filter_subject: format!("{name}.entries"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        BareNats { consumer }
    }
}

impl Bare for BareNats {
    type Item = jetstream::Message;

    async fn receive(&self, max: usize) -> Vec<jetstream::Message> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(max)
            .expires(RECEIVE_WAIT)
            .messages()
            .await
            .unwrap();
        let mut out = Vec::with_capacity(max);
        while let Some(message) = batch.next().await {
            out.push(message.unwrap());
        }
        out
    }

    fn posting(item: &jetstream::Message) -> Posting {
        Posting::of_body(&item.message.payload)
    }

    async fn ack(&self, item: &jetstream::Message) {
        item.ack().await.unwrap();
    }
}
