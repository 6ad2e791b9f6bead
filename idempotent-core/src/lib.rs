//! Exactly-once effects on top of at-least-once delivery.
//!
//! Clients time out and retry; brokers redeliver. This crate makes the *effect* of a request
//! happen once per idempotency key: the first call claims the key and runs, concurrent
//! duplicates are refused (or wait), and retries replay the recorded result.
//!
//! ```
//! use idempotent_core::{Call, Fingerprint, Idempotency, MemoryStore, Scope};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let idempotency = Idempotency::new(MemoryStore::new());
//!
//! let call = Call::new("payment-7f3a".parse()?)
//!     .scope(Scope::new().principal("alice"))
//!     .fingerprint(Fingerprint::of(&("EUR", 1999u64))?);
//!
//! let receipt = idempotency.run(&call, async { format!("charged {} cents", 1999) }).await?;
//! let retried = idempotency.run(&call, async { String::from("charged twice!") }).await?;
//! assert_eq!(receipt.get(), retried.get());
//! assert!(retried.is_replayed());
//! # Ok(())
//! # }
//! ```
//!
//! # Concepts
//!
//! - [`Key`]: the client's idempotency key, validated (1–255 bytes of printable ASCII).
//! - [`Scope`]: who the key belongs to (tenant, principal, operation). Scopes never share
//!   records.
//! - [`StorageKey`]: the blake3 digest of namespace, scope and key that a store actually sees.
//! - [`Fingerprint`]: a digest of what the request means. The same key with another fingerprint
//!   is refused with [`Error::FingerprintMismatch`] instead of replaying the wrong response.
//! - **Lease** (default 30 s): how long an in-flight claim lives without renewal; renewed while
//!   the work runs, so only a crashed owner's claim lapses. Separate from the **TTL** (default
//!   24 h): how long a completed result is replayed.
//! - [`FencingToken`]: strictly increasing per key; a caller whose lease lapsed can never
//!   complete, release or renew the new owner's record.
//! - [`Store`]: where records live. [`MemoryStore`] is the embedded default.
//! - [`Idempotency`]: the runtime; see its docs for the exact semantics.
//!
//! # The `#[idempotent]` attribute
//!
//! With the `macros` feature (on by default), one line makes any `async fn` (a handler, a job,
//! a message consumer) idempotent: its effect happens once per key, and retries get the
//! recorded result. The signature does not change; every mistake is a compile error at the
//! offending token.
//!
//! ```
//! # #[cfg(feature = "macros")] {
//! use idempotent_core::{Error, idempotent};
//!
//! #[idempotent(key = delivery_id, ttl = "24h")]
//! async fn apply_payment(delivery_id: &str, cents: u64) -> Result<u64, Error> {
//!     Ok(cents) // the effect, once per delivery id
//! }
//! # }
//! ```
//!
//! Functions run on the process-wide [`default_runtime`] (install yours with
//! [`set_default_runtime`]; otherwise an in-memory one) or on the runtime named by
//! `runtime = ...`. See [`idempotent`](macro@idempotent) for every argument and the
//! limitations.
//!
//! # Features
//!
//! - `memory` (default): [`MemoryStore`].
//! - `macros` (default): the [`#[idempotent]`](macro@idempotent) attribute.
//! - `uuid`: [`ToKey`] for `uuid::Uuid`.
//! - `redis`: [`RedisStore`], shared by many app instances.
//! - `postgres`: [`PostgresStore`], shared by many app instances, and its
//!   [transactional mode](postgres::Transactional), which commits the record in the same
//!   transaction as your database writes.
//! - `test-util`: the store conformance suite ([`conformance`]) for testing any store.
//!
//! # Message consumers
//!
//! Brokers deliver at least once: a consumer that crashes after applying a message but before
//! acknowledging it receives the message again, and a producer that retries publishes it twice.
//! Give every message an idempotency key that is stable across those retries (the producer's
//! message id, not the broker's delivery id), and apply it with `#[idempotent(key = .., tx = ..)]`
//! over the PostgreSQL store's transactional mode:
//!
//! - **What the transaction covers**: the claim, your writes, and the completed record commit
//!   together or not at all. A crash before the commit leaves no effect and no record, so the
//!   redelivery applies the message; a crash after the commit leaves both, so the redelivery
//!   replays it and changes nothing.
//! - **Acknowledge after the commit**, never before: acknowledging first and crashing before the
//!   commit loses the message. Acknowledging after means a crash in between only causes a
//!   redelivery, which the record turns into a no-op.
//! - **What it cannot cover**: an effect outside the database — an e-mail, an HTTP call to a
//!   provider without idempotency keys. No record can say whether such an effect happened before
//!   a crash. Write the intent as a row of an outbox table inside the same transaction, and have
//!   a separate relay deliver outbox rows (at least once, to a receiver that is itself
//!   idempotent, or with the provider's own idempotency key).
//!
//! `examples/ledger.rs` is a complete Redis Streams consumer built this way (`XREADGROUP`,
//! `XAUTOCLAIM` for entries abandoned by dead consumers, a dead-letter stream for malformed
//! entries, `XACK` after commit), and `tests/tests/ledger_e2e.rs` kills its consumers with SIGKILL
//! while 1,000 entries with 20% duplicates flow through, then checks every balance to the unit.
//!
//! # What it cannot do
//!
//! An effect on a system that takes no idempotency key and shares no transaction with the store
//! (sending an e-mail, calling a third-party API without keys) cannot be made exactly-once: a
//! crash between the effect and the completion record leaves no way to know whether it
//! happened. Record the intent in your database in the same transaction as the state change and
//! deliver it from there (the outbox pattern). Effects that *are* writes to a PostgreSQL
//! database close the gap with the [transactional mode](postgres::Transactional): the record
//! commits in the same transaction as the writes.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod claim;
mod clock;
mod envelope;
mod error;
mod fingerprint;
mod key;
mod macro_support;
mod runtime;
pub mod store;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

#[cfg(feature = "test-util")]
pub mod conformance;

pub use claim::ClaimHandle;
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BoxError, Error, StoreError};
pub use fingerprint::{CanonicalError, Fingerprint, FingerprintBuilder};
pub use key::{Key, KeyError, MAX_KEY_LEN, Scope, StorageKey};
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use macro_support::idempotent;
pub use macro_support::{ToKey, default_runtime, set_default_runtime};
pub use runtime::{
    Call, DEFAULT_LEASE, DEFAULT_MAX_RESULT_BYTES, DEFAULT_RECORD_RETRY, DEFAULT_TTL, Execution,
    Idempotency, IdempotencyBuilder, InFlightPolicy, MAX_IN_FLIGHT_RETRY_HINT, Outcome, Retain,
};
pub use store::{Claim, FencingToken, Store};

/// The in-memory store, its statistics and its default bounds.
#[cfg(feature = "memory")]
pub mod memory {
    pub use crate::store::memory::{
        DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_SWEEP_INTERVAL, MemoryStats, MemoryStore,
        MemoryStoreBuilder, RECORD_OVERHEAD,
    };
}
#[cfg(feature = "memory")]
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::RedisStore;

/// The PostgreSQL store and its transactional mode.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    pub use crate::store::postgres::{
        DEFAULT_FENCE_TABLE, DEFAULT_REAP_BATCH, DEFAULT_REAP_GRACE, DEFAULT_TABLE, Fence,
        FenceError, InvalidTableName, PendingRecord, PostgresStore, PostgresStoreBuilder,
        Transactional, TransactionalCall, TransactionalClaim,
    };
}
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PostgresStore, Transactional};
