//! A message to enqueue ([`Outgoing`]): its destination, payload, key, headers, ordering key
//! and delay, and why an enqueue refuses one ([`OutboxError`]).

use std::time::Duration;

use bytes::Bytes;

use idempotent_core::{ClaimHandle, Key, KeyError, StoreError};

/// The largest payload [`Outbox::enqueue`](super::Outbox::enqueue) accepts: 16 MiB.
pub const MAX_OUTBOX_PAYLOAD: usize = 16 << 20;

/// A message to send to another system, once the transaction that enqueues it commits.
///
/// ```
/// use idempotent_postgres::outbox::Outgoing;
///
/// let message = Outgoing::new("notifications", r#"{"id":"pay-1","amount":250}"#)
///     .header("content-type", "application/json")
///     .ordering_key("account:alice");
/// ```
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub(super) destination: String,
    pub(super) payload: Bytes,
    pub(super) key: Option<Key>,
    pub(super) operation: Option<Key>,
    pub(super) part: Option<String>,
    pub(super) headers: Vec<(String, String)>,
    pub(super) ordering_key: Option<String>,
    pub(super) delay: Duration,
}

impl Outgoing {
    /// A message for `destination` (the name a [`Relay`](super::Relay) routes to one of its
    /// sinks) carrying `payload`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Outgoing {
            destination: destination.into(),
            payload: payload.into(),
            key: None,
            operation: None,
            part: None,
            headers: Vec::new(),
            ordering_key: None,
            delay: Duration::ZERO,
        }
    }

    /// The message's idempotency key: what the receiver deduplicates on (the HTTP sink sends
    /// it as `Idempotency-Key`, the Redis Streams sink as the `key` field). By default it is
    /// the [operation key](idempotent_core::KeyClaim::operation_key) of the claim given with
    /// [`claim`](Self::claim), else of the running claim ([`ClaimHandle::current`]: inside an
    /// `#[idempotent]` function, the runtime's `run`, a layer's handler): the same for every
    /// owner and attempt of the operation that enqueues it. Set a key of its own only for a
    /// message enqueued outside any claim; with a claim or a [`part`](Self::part) it is refused
    /// ([`OutboxError::KeyConflict`]).
    #[must_use]
    pub fn key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }

    /// Takes its default key from `claim` (its [operation
    /// key](idempotent_core::KeyClaim::operation_key)) instead of the running claim: for the transactional
    /// mode's [`PendingRecord::claim`](crate::PendingRecord::claim), where no claim is
    /// running as [`ClaimHandle::current`].
    #[must_use]
    pub fn claim(mut self, claim: &ClaimHandle) -> Self {
        self.operation = Some(claim.operation_key());
        self
    }

    /// Names this message among several an operation sends to the same receiver: the default
    /// key becomes `<operation key>.<part>`, so each message has its own key and every
    /// attempt of the operation still gives each the same one. A message with a [`key`](Self::key)
    /// of its own has no part: [`Outbox::enqueue`](super::Outbox::enqueue) refuses the two
    /// together with [`OutboxError::KeyConflict`].
    #[must_use]
    pub fn part(mut self, part: impl Into<String>) -> Self {
        self.part = Some(part.into());
        self
    }

    /// A header sent with the message (the HTTP sink sends it as an HTTP header, the Redis
    /// Streams sink as a field). `Idempotency-Key` is refused at the enqueue: the key is
    /// [`key`](Self::key).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Messages with the same ordering key are delivered one at a time, in the order their
    /// transactions committed: a message waits until every earlier one with its ordering key
    /// was delivered or dead-lettered. Transactions that enqueue messages with the same
    /// ordering key take turns (the enqueue takes an advisory lock held until the commit), so
    /// enqueue order and commit order agree. Without one, messages are delivered in any order,
    /// several at once.
    ///
    /// That lock lasts as long as the transaction, so a message with an ordering key must be
    /// enqueued in an explicit transaction (`pool.begin()`): on a connection in autocommit
    /// mode [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) refuses it with [`OutboxError::NotInTransaction`].
    #[must_use]
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Deliver no sooner than `delay` after the enqueue. A delay longer than 365 days,
    /// [`Duration::MAX`] included, is 365 days.
    #[must_use]
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The key the message is sent with: its own, else the running claim's operation key
    /// (with its part).
    pub(super) fn resolved_key(&self) -> Result<Key, OutboxError> {
        if let Some(key) = &self.key {
            if self.operation.is_some() || self.part.is_some() {
                return Err(OutboxError::KeyConflict);
            }
            return Ok(key.clone());
        }
        let operation = match &self.operation {
            Some(operation) => operation.clone(),
            None => ClaimHandle::current()
                .ok_or(OutboxError::NoKey)?
                .operation_key(),
        };
        match &self.part {
            None => Ok(operation),
            Some(part) => Ok(Key::new(format!("{}.{part}", operation.as_str()))?),
        }
    }
}

/// Why a message was not enqueued. The transaction is untouched: roll it back, or go on
/// without the message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// No key or claim was given and no claim is running (outside an `#[idempotent]`
    /// function or the runtime's work): there is no operation key to default to.
    #[error(
        "the message has no key and no claim is running: give it one with Outgoing::key or \
         Outgoing::claim, or enqueue it from the work of an idempotent call"
    )]
    NoKey,
    /// The message was given both a key of its own ([`Outgoing::key`]) and a claim or a part
    /// to derive one from ([`Outgoing::claim`], [`Outgoing::part`]): say one.
    #[error(
        "the message was given a key of its own and a claim or part to derive one from; \
         use Outgoing::key alone, or Outgoing::claim/part"
    )]
    KeyConflict,
    /// The key (or the operation key with its part) is not a valid key.
    #[error("the message key is not valid: {0}")]
    InvalidKey(#[from] KeyError),
    /// The destination is empty or longer than 255 bytes.
    #[error("the destination must be 1 to 255 bytes")]
    InvalidDestination,
    /// A header name or value is not valid in HTTP (a control character, a space in a name),
    /// a header is named `Idempotency-Key` (the key is [`Outgoing::key`]), or a destination or
    /// ordering key holds a NUL byte (PostgreSQL text cannot).
    #[error("a header name or value is not valid HTTP, or a text holds a NUL byte")]
    InvalidHeader,
    /// The payload is over [`MAX_OUTBOX_PAYLOAD`].
    #[error("the payload is {size} bytes, over the outbox's limit of {MAX_OUTBOX_PAYLOAD}")]
    PayloadTooLarge {
        /// The payload's size.
        size: usize,
    },
    /// The message has an [ordering key](Outgoing::ordering_key) and the connection is not in
    /// a transaction (autocommit mode). Its turn on the ordering key would end with the
    /// statement instead of the commit, so the message could be delivered out of order:
    /// enqueue it in a transaction (`pool.begin()`). Nothing was written.
    #[error(
        "a message with an ordering key must be enqueued in a transaction: begin one on the \
         connection (pool.begin()) and commit it after the enqueue"
    )]
    NotInTransaction,
    /// The statement failed; the transaction is aborted: roll it back.
    #[error("the outbox could not be written")]
    Store(#[source] StoreError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> Key {
        Key::new(text.to_owned()).unwrap()
    }

    #[test]
    fn a_key_of_its_own_is_the_key() {
        let message = Outgoing::new("mail", "x").key(key("order-7"));
        assert_eq!(message.resolved_key().unwrap().as_str(), "order-7");
    }

    #[test]
    fn a_key_with_a_part_or_a_claim_is_refused() {
        let with_part = Outgoing::new("mail", "x")
            .key(key("order-7"))
            .part("ledger");
        assert!(matches!(
            with_part.resolved_key(),
            Err(OutboxError::KeyConflict)
        ));
        let mut with_claim = Outgoing::new("mail", "x").key(key("order-7"));
        with_claim.operation = Some(key("operation-1"));
        assert!(matches!(
            with_claim.resolved_key(),
            Err(OutboxError::KeyConflict)
        ));
    }

    #[test]
    fn a_claims_key_takes_its_part() {
        let mut message = Outgoing::new("mail", "x").part("ledger");
        message.operation = Some(key("operation-1"));
        assert_eq!(
            message.resolved_key().unwrap().as_str(),
            "operation-1.ledger"
        );
    }
}
