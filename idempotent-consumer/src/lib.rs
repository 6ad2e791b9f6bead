//! The idempotent receiver: one consumer runtime over a message broker, for the `idempotent`
//! family (sources behind the features `redis-streams`, `nats`, `rabbitmq` and `kafka`).
//!
//! A broker delivers each message at least once: a consumer that crashes before it
//! acknowledges, a broker that restarts, a publisher that retries, all deliver a message
//! again. This runtime turns that into one *effect* per message. You supply a handler; the
//! runtime:
//!
//! 1. decodes the message ([`Decode::decode`]); a message that cannot be decoded is
//!    **malformed** and dead-lettered at once, never handled;
//! 2. derives its idempotency key ([`Decode::key`]: the publisher's message id by default, a
//!    composite or content-based key by choice) and fingerprint ([`Decode::fingerprint`]: the
//!    message's content by default), with the same rules as calls: a key reused with a
//!    different fingerprint is a mismatch, dead-lettered with that reason, never applied;
//! 3. runs the handler under a claim of that key in any [`Store`](idempotent_core::Store)
//!    ([`Consumer::run`], [`Handler`]) or inside the PostgreSQL transaction that records it
//!    ([`Consumer::run_transactional`], [`TxHandler`], feature `postgres`), handing it the
//!    [`ClaimHandle`](idempotent_core::ClaimHandle) (fencing token, operation key, lost signal) and, in the transactional
//!    mode, the transaction — where the [`Outbox`](idempotent_postgres::outbox::Outbox) can enqueue
//!    messages with the effect;
//! 4. acknowledges the message only once the record (or the transaction) is durable; a
//!    message whose key is already recorded is a **duplicate**, acknowledged without running
//!    the handler. In the claim mode, a record whose first write failed is written again in
//!    the background while the claim is held (a duplicate meets it in flight), and the
//!    message waits for that write; should the runtime give up
//!    ([`record_retry`](idempotent_core::IdempotencyBuilder::record_retry)), the message is retried as
//!    transient, never acknowledged as applied;
//! 5. sorts failures: a [`Failure::Malformed`] message is dead-lettered at once; a
//!    [`Failure::Rejected`] one (the data is refused, by a constraint say) is retried and
//!    dead-lettered from its [`max_deliveries`](Consumer::max_deliveries)-th delivery on, as
//!    the **broker** counts deliveries, so the bound survives restarts of every consumer
//!    (where the broker counts none, Kafka, the runtime counts them on the message's record,
//!    and also dead-letters, unhandled, a message whose handling killed its consumer
//!    `max_deliveries` times: [`Source::counts_deliveries`]); a
//!    [`Failure::Transient`] one (a database down, a lock timeout) is retried with backoff
//!    without bound, because the message is not at fault. A dead letter keeps the reason.
//!
//! It bounds concurrency ([`Consumer::concurrency`]), keeps the order of messages that share
//! an [ordering key](Decode::ordering_key), keeps a long handler's message from being
//! delivered to another consumer while it runs ([`Source::keep_alive`]), waits out a broker
//! that goes away (its source reconnects; the runtime never returns because of a broker
//! failure), drains on shutdown (every message it received is finished: handled and
//! acknowledged, or given back), and records [metrics](#metrics).
//!
//! # Sources
//!
//! A [`Source`] knows only its broker: receive, acknowledge, retry later, dead-letter, the
//! delivery count, keep-alive, reconnect. Four come with the library:
//!
//! | source | feature | delivery count | retry later | keep-alive | dead letters |
//! |---|---|---|---|---|---|
//! | [`RedisStreams`](redis_streams::RedisStreams) | `redis-streams` | `XPENDING` | left pending, delivered again after `claim_idle` (`XAUTOCLAIM`) | `XCLAIM … JUSTID` resets the idle time | `STREAM:dead`, copied and acknowledged in one script: exactly once |
//! | [`JetStream`](nats::JetStream) | `nats` | `info.delivered` | `Nak` with the backoff as delay | `Progress` (`+WPI`) resets the ack wait | `STREAM.dead`, with a `Nats-Msg-Id` from the entry: once within the stream's duplicate window |
//! | [`RabbitMq`](rabbitmq::RabbitMq) | `rabbitmq` | `x-delivery-count` (quorum queues) | `nack` with requeue after the backoff | none needed: no redelivery while the channel is open (keep handlers under `consumer_timeout`) | `QUEUE.dead`, published with confirms before the ack: at least once |
//! | [`Kafka`](kafka::Kafka) | `kafka` | none: counted on the message's record by the runtime | kept in the source and handed back after the backoff (in its place, for a message with an ordering key); its partition's commit waits for it | none needed: the source's own thread polls within `max.poll.interval.ms` | `TOPIC.dead` by an idempotent producer (`acks=all`), then the offset moves past it: at least once |
//!
//! Kafka has no per-message acknowledgement: the source commits each partition only up to its
//! lowest message whose effect is not yet recorded, whatever order the concurrent handlers
//! finish in, and on a rebalance finishes (or abandons) the messages of revoked partitions
//! and commits before giving them up; see [`kafka`].
//!
//! # Metrics
//!
//! Through the same [`metrics`](idempotent_core::metrics) facade and naming scheme as calls; `source`
//! is the source's [`name`](Source::name):
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `idempotency.messages` | counter | `source`, `outcome` | messages by how each ended: `applied`, `duplicate`, `retried`, `dead_lettered` |
//! | `idempotency.message.duration` | histogram (s) | `source`, `outcome` | from receipt to the broker's answer to the ack, retry or dead letter |
//! | `idempotency.message.redeliveries` | counter | `source` | messages received that the broker had delivered before |
//! | `idempotency.message.dead_letters` | counter | `source`, `kind` | dead letters by `kind`: `malformed` or `rejected` |
//! | `idempotency.source.errors` | counter | `source`, `operation` | broker operations that failed: `receive`, `ack`, `retry`, `dead_letter`, `keep_alive` |
//!
//! The claims themselves are counted in `idempotency.requests` with `protocol = "message"`.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(any(
    feature = "redis-streams",
    feature = "nats",
    feature = "rabbitmq",
    feature = "kafka"
))]
mod any;
mod builder;
mod effect;
mod failure;
mod handler;
mod message;
mod runner;
mod source;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;

#[cfg(any(
    feature = "redis-streams",
    feature = "nats",
    feature = "rabbitmq",
    feature = "kafka"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "redis-streams",
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka"
    )))
)]
pub use self::any::{AnyDelivery, AnySource, Endpoint};
pub use self::builder::*;
pub use self::failure::Failure;
pub use self::handler::*;
pub use self::message::*;
pub use self::runner::Report;
pub use self::source::*;

/// `idempotency.messages` (counter; labels `source`, `outcome`).
pub const MESSAGES: &str = "idempotency.messages";
/// `idempotency.message.duration` (histogram, seconds; labels `source`, `outcome`).
pub const MESSAGE_DURATION: &str = "idempotency.message.duration";
/// `idempotency.message.redeliveries` (counter; label `source`).
pub const MESSAGE_REDELIVERIES: &str = "idempotency.message.redeliveries";
/// `idempotency.message.dead_letters` (counter; labels `source`, `kind`).
pub const MESSAGE_DEAD_LETTERS: &str = "idempotency.message.dead_letters";
/// `idempotency.source.errors` (counter; labels `source`, `operation`).
pub const SOURCE_ERRORS: &str = "idempotency.source.errors";
