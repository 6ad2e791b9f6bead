//! Exactly-once effects on top of at-least-once delivery.
//!
//! Clients time out and retry; brokers redeliver. This crate makes the *effect* of a request
//! happen once per idempotency key: the first call claims the key and runs, concurrent
//! duplicates are refused (or wait), and retries replay the recorded result.
//!
//! ```
//! use idempotent_core::memory::MemoryStore;
//! use idempotent_core::{Call, Fingerprint, Idempotency, Scope};
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
//! # Where to read on
//!
//! - [`guide`]: the concepts, every public item, the attribute, the features, the failure
//!   model and what it cannot do.
//! - [`Idempotency`]: the runtime and its exact semantics; [`Call`]: one call and its options.
//! - [`idempotent`](macro@idempotent): the attribute on any `async fn` (feature `macros`).
//! - [`store`]: the contract a store is built on; [`conformance`] (feature `test-util`): the
//!   suite that checks one.
//! - The other crates of the family: `idempotent-redis`, `idempotent-postgres` and
//!   `idempotent-sqlite` (stores), `idempotent-cache`, `idempotent-consumer`, `idempotent-any`
//!   and `idempotent-tower` (HTTP and gRPC).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod attribute;
mod call;
pub mod capability;
mod claim;
mod claim_answer;
mod default_runtime;
mod envelope;
mod error;
mod execute;
mod expansion;
mod fingerprint;
mod key;
mod lease;
mod lent;
mod outcome;
mod problem;
mod recording;
mod run_to_end;
mod runtime;
mod shutdown;
pub mod store;
mod to_key;

pub mod clock;
pub mod inspect;
pub mod guide {
    #![doc = include_str!("../docs/guide.md")]
    // The guide's links name the crate's items as its root does.
    #[allow(unused_imports)]
    use crate::*;
}
pub mod limits;
pub mod metrics;
pub mod session;
pub mod steps;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod conformance;

#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use attribute::{idempotent, step};
pub use call::{
    Call, CallOptions, DEFAULT_LEASE, DEFAULT_MAX_RESULT_BYTES, DEFAULT_TTL, Defaults,
    InFlightPolicy,
};
pub use claim::{ClaimHandle, KeyClaim, StepError};
pub use claim_answer::MAX_IN_FLIGHT_RETRY_HINT;
pub use default_runtime::{default_runtime, set_default_runtime};
pub use error::{BoxError, Error, StoreError};
pub use fingerprint::{CanonicalError, Fingerprint, FingerprintBuilder};
pub use key::{Key, KeyError, MAX_KEY_LEN, RecordBytes, Scope, SessionPlace, StorageKey};
pub use lent::Lent;
pub use outcome::{Execution, Outcome, Retain};
pub use problem::{GrpcCode, ProblemCode};
pub use run_to_end::RunToEnd;
pub use runtime::{CLAIM_TIMEOUT, DEFAULT_RECORD_RETRY, Idempotency, IdempotencyBuilder};
pub use session::{SessionGate, SessionKey, SessionMark, SessionRequest};
pub use shutdown::Drained;
pub use store::{
    CheckpointStore, Claim, FencingToken, RequestOwner, SessionClaim, SessionStore, Store,
    StoreWrapper,
};
pub use to_key::ToKey;

/// What `#[idempotent]` expands into: not a public API (no semver guarantees); only the
/// `idempotent-macros` release this crate pins calls it.
#[doc(hidden)]
pub mod __private {
    #[doc(hidden)]
    pub use crate::expansion::*;
}

/// The in-memory store, the embedded default (feature `memory`): one process, bounded.
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory {
    pub use crate::store::memory::{
        DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_SWEEP_INTERVAL, MemoryStats, MemoryStore,
        MemoryStoreBuilder, RECORD_OVERHEAD,
    };
}
