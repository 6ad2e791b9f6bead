//! What the user supplies: [`Decode`] (input, key, fingerprint, scope, ordering key), the
//! [`Handler`] or [`TxHandler`], and the three kinds of [`Failure`].

use serde::Serialize;
use std::future::Future;

use super::failure::Failure;
use super::message::Message;
use idempotent_core::{ClaimHandle, Fingerprint, Key};

/// How a message becomes the handler's input, its key, its fingerprint and its ordering key.
pub trait Decode: Send + Sync + 'static {
    /// What the handler works on.
    type Input: Send + Sync + 'static;

    /// The input, or why the message is malformed ([`Failure::Malformed`]; any other failure
    /// is taken as it is).
    fn decode(&self, message: &Message) -> Result<Self::Input, Failure>;

    /// The idempotency key. By default the publisher's [message id](Message::id); a message
    /// without one is malformed.
    fn key(&self, message: &Message, input: &Self::Input) -> Result<Key, Failure> {
        let _ = input;
        let id = message
            .id()
            .ok_or_else(|| Failure::Malformed("the message has no message id".into()))?;
        key(id)
    }

    /// What a reuse of the key must match. By default the message's
    /// [content](Message::content_fingerprint).
    fn fingerprint(&self, message: &Message, input: &Self::Input) -> Result<Fingerprint, Failure> {
        let _ = input;
        Ok(message.content_fingerprint())
    }

    /// The scope the key is claimed in (a tenant, a principal), as a call's
    /// [`scope`](idempotent_core::Call::scope): the same key in two scopes is two records. `None` (the
    /// default): unscoped.
    fn scope(&self, message: &Message, input: &Self::Input) -> Option<idempotent_core::Scope> {
        let _ = (message, input);
        None
    }

    /// Messages with the same ordering key are handled one at a time, in the order received;
    /// `None`: no order kept. A message retried later is received again after those that came
    /// behind it. By default the broker's own [message key](Message::key) (a Kafka record's
    /// key, as lossy UTF-8), which the other brokers do not have: on Kafka the records of one
    /// key run in order, as its producer partitions them, and records with different keys run
    /// concurrently, in one partition or many.
    fn ordering_key(&self, message: &Message, input: &Self::Input) -> Option<String> {
        let _ = input;
        message
            .key()
            .map(|key| String::from_utf8_lossy(key).into_owned())
    }
}

/// A valid key from `text`, or [`Failure::Malformed`] saying why not.
pub fn key(text: &str) -> Result<Key, Failure> {
    Key::new(text)
        .map_err(|e| Failure::Malformed(format!("the message id is not a valid key: {e}")))
}

/// The handler of [`Consumer::run`](crate::Consumer::run): runs under a claim of the message's key in the
/// runtime's store.
pub trait Handler: Decode {
    /// Kept in the record (as JSON), as a call's result is.
    type Output: Serialize + Send + 'static;

    /// Applies the message. `claim` is the key's claim: its
    /// [`operation_key`](idempotent_core::KeyClaim::operation_key) is the same for every attempt of this
    /// message (hand it to downstream systems), its [`token`](idempotent_core::KeyClaim::token) fences
    /// writes, [`lost`](idempotent_core::KeyClaim::lost) says when to stop. An `Err` releases the claim: the
    /// message is retried or dead-lettered as the [`Failure`] says.
    fn handle(
        &self,
        input: &Self::Input,
        claim: &ClaimHandle,
    ) -> impl Future<Output = Result<Self::Output, Failure>> + Send;
}

/// The handler of [`Consumer::run_transactional`](crate::Consumer::run_transactional) (feature `postgres`): runs inside the
/// PostgreSQL transaction that claims the key and records the result.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub trait TxHandler: Decode {
    /// Kept in the record (as JSON).
    type Output: Serialize + Send + Sync + 'static;

    /// Runs first in each transaction, before the claim: session settings
    /// (`SET LOCAL lock_timeout`, `statement_timeout`). Does nothing by default.
    fn begin(
        &self,
        tx: &mut sqlx::PgConnection,
    ) -> impl Future<Output = Result<(), Failure>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// Applies the message with `tx`, the transaction that will record it: the effect, the
    /// record and anything enqueued in the [`Outbox`](idempotent_postgres::outbox::Outbox) commit
    /// together, or not at all. An `Err` rolls the transaction back. [`sql_failure`] sorts a
    /// statement's error.
    fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        input: &Self::Input,
        claim: &ClaimHandle,
    ) -> impl Future<Output = Result<Self::Output, Failure>> + Send;
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use super::effect::sql_failure;
