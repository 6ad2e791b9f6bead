//! The transactional outbox (feature `postgres`): messages written in the caller's transaction,
//! next to the effect and its idempotency record, and delivered afterwards, at least once and
//! with their keys, by a [`Relay`] to a [`Sink`] per destination.
//!
//! - [`Outgoing`]: a message to enqueue; its key is its claim's operation key (with a
//!   [`part`](Outgoing::part)), or one of its own ([`key`](Outgoing::key)).
//! - [`Outbox`]: the table: [`enqueue`](Outbox::enqueue) in a transaction, dead letters, the
//!   backlog, requeue.
//! - [`Relay`]: takes committed messages, hands each to its destination's [`Sink`] as a
//!   [`Relayed`], retries with backoff, dead-letters, and deletes delivered rows after
//!   [`retain_delivered`](RelayBuilder::retain_delivered).
//! - [`Sink`]: where a destination's messages go; [`RedisStreamSink`] (feature `redis`) adds
//!   them to a Redis stream, `idempotent-tower`'s `HttpSink` posts them over HTTP.

mod message;
mod relay;
mod sink;
mod table;

pub use self::message::{MAX_OUTBOX_PAYLOAD, OutboxError, Outgoing};
pub use self::relay::{
    Batch, DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENT_BATCHES, DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_IN_FLIGHT, MAX_CONCURRENT_BATCHES, Relay, RelayBuilder, RunningRelay,
};
#[cfg(feature = "redis")]
pub use self::sink::RedisStreamSink;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use self::sink::kafka::{DEFAULT_KAFKA_TIMEOUT, KAFKA_KEY_HEADER, KafkaSink};
pub use self::sink::{BoxFuture, Relayed, Sink, SinkError};
pub use self::table::{Backlog, DEFAULT_OUTBOX_TABLE, DeadLetter, Outbox};

/// `idempotency.outbox.deliveries` (counter; label `result`: `delivered`, `retried`, `dead`):
/// delivery attempts of outbox messages, by how each ended.
pub const OUTBOX_DELIVERIES: &str = "idempotency.outbox.deliveries";
/// `idempotency.outbox.pending` (gauge): messages not delivered yet, as a relay last read it.
pub const OUTBOX_PENDING: &str = "idempotency.outbox.pending";
/// `idempotency.outbox.dead` (gauge): dead letters, as a relay last read it.
pub const OUTBOX_DEAD: &str = "idempotency.outbox.dead";
/// `idempotency.outbox.oldest_pending_age` (gauge, seconds): how long the oldest pending
/// message has waited (0 with none pending), as a relay last read it.
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "idempotency.outbox.oldest_pending_age";
