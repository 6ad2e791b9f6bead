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
//! - [`Call`]: one call's key, scope and fingerprint, with its [`CallOptions`] (TTL, lease,
//!   in-flight policy, largest retained result) overriding the runtime's [`Defaults`]. The
//!   runtime, the transactional mode, the attribute and the HTTP and gRPC layers all take these
//!   two types; nothing else sets a call's TTL or lease.
//! - [`Retain`]: whether a fresh outcome is kept for replay or its key released, the one
//!   decision every API asks for.
//! - [`limits`]: the accepted range of every duration (leases 100 ms to 365 days, TTLs 1 ms
//!   to 365 days). Setters panic on a duration out of range, the attribute refuses one at
//!   compile time, and [`limits::check_lease`] and its siblings check values read from outside
//!   the program.
//! - [`FencingToken`]: strictly increasing per key; a caller whose lease lapsed can never
//!   complete, release or renew the new owner's record.
//! - [`ClaimHandle`]: the running claim as the work sees it: its token, the downstream
//!   operation key, and whether it is still held (see the *Failure model*).
//! - [`Store`]: where records live. [`memory::MemoryStore`] is the embedded default.
//! - [`Idempotency`]: the runtime; see its docs for the exact semantics.
//!   [`Idempotency::shutdown`] drains it before the process exits: new calls are refused with
//!   [`Error::ShuttingDown`], calls in flight finish and record their outcome, work still
//!   running at the deadline is stopped and its claim released ([`Drained`] says what was
//!   left).
//! - [`Error`] and its [`ProblemCode`]: every refusal has one stable code with one HTTP status
//!   and one [`GrpcCode`], the same in logs and on the wire.
//! - [`metrics`]: what the runtime and the layers count and time, through the `metrics`
//!   facade (requests by outcome, store operation and work durations, claims in flight, lost
//!   claims, completion retries), for whatever recorder the application installs.
//!
//! # Public API
//!
//! Every public item, each at exactly one path:
//!
//! | where | what |
//! |---|---|
//! | the root: the runtime | [`Idempotency`], [`IdempotencyBuilder`], [`Drained`], [`DEFAULT_RECORD_RETRY`], [`CLAIM_TIMEOUT`] |
//! | the root: one call | [`Call`], [`CallOptions`], [`Defaults`], [`InFlightPolicy`], [`DEFAULT_TTL`], [`DEFAULT_LEASE`], [`DEFAULT_MAX_RESULT_BYTES`] |
//! | the root: outcomes | [`Retain`], [`Outcome`], [`Execution`], [`ClaimHandle`], [`StepError`], [`RunToEnd`] |
//! | the root: identity | [`Key`], [`KeyError`], [`MAX_KEY_LEN`], [`ToKey`], [`Scope`], [`StorageKey`], [`SessionPlace`], [`RecordBytes`], [`Fingerprint`], [`FingerprintBuilder`], [`CanonicalError`] |
//! | the root: errors | [`Error`], [`StoreError`], [`BoxError`], [`ProblemCode`], [`GrpcCode`], [`MAX_IN_FLIGHT_RETRY_HINT`] |
//! | the root: the store contract | [`Store`], [`Claim`], [`FencingToken`], [`RequestOwner`], [`SessionKey`], [`SessionRequest`], [`SessionGate`], [`SessionMark`] |
//! | the root: the attributes | [`idempotent`](macro@idempotent) and [`step`](macro@step) (feature `macros`), [`default_runtime`], [`set_default_runtime`] |
//! | [`limits`] | the accepted range of every duration, and checks for values read at run time |
//! | [`session`] | client sessions: the protocol, [`session::InSession`] (a call's place), the window and idle defaults |
//! | [`steps`] | recovery points: the checkpoint encoding ([`steps::Checkpoints`]), [`steps::CheckpointError`], [`steps::Abandoned`] and the limits; the steps themselves are [`ClaimHandle::step`], [`ClaimHandle::try_step`] ([`StepError`]) and [`step`](macro@step) (feature `macros`) |
//! | [`clock`] | the memory store's time source; `ManualClock` with feature `test-util` |
//! | [`metrics`] | the metric names, their labels ([`metrics::ProtocolLabel`], [`metrics::RequestOutcome`]) and [`metrics::describe`] |
//! | [`store`] | the contract a store is built on, with its stability promise: envelopes, claim answers, settings, metrics, the give-back |
//! | `memory` (feature `memory`) | `MemoryStore`, its builder, statistics and bounds |
//! | `conformance` (feature `test-util`) | the store conformance suite and `FaultyStore` |
//!
//! The stores (`idempotent-redis`, `idempotent-postgres`), the cache tier (`idempotent-cache`),
//! the consumer runtime (`idempotent-consumer`), `AnyStore` (`idempotent-any`) and the HTTP and
//! gRPC layers (`idempotent-tower`) are crates of their own, built on this one.
//!
//! Where the code lives, for readers of the source: `runtime.rs` (the runtime and its call
//! flow), `call.rs` (calls, options, defaults), `outcome.rs`, `claim.rs` (the running claim),
//! `lease.rs` (renewal and per-operation bounds), `claim_answer.rs` (what a claim's answer
//! means under the in-flight policy, shared with the transactional mode), `session.rs` (client
//! sessions and the gate's rules), `steps.rs` (checkpoints), `recording.rs`
//! (recording an outcome, with retries), `execute.rs` (one call), `run_to_end.rs`,
//! `shutdown.rs`, `metrics.rs`, `problem.rs`, `error.rs`, `key.rs`, `fingerprint/`,
//! `envelope.rs` (the stored record format), `store/` (the contract, the timed store, the
//! give-back and the memory store), `attribute.rs`, `to_key.rs` and `default_runtime.rs` (the
//! attribute's public side) and `expansion/` (the hidden module the attribute expands into,
//! `__private`).
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
//! - `memory` (default): `memory::MemoryStore`.
//! - `macros` (default): the [`#[idempotent]`](macro@idempotent) attribute.
//! - `uuid`: [`ToKey`] for `uuid::Uuid`.
//! - `test-util`: the store conformance suite (`conformance`) and `clock::ManualClock`, for
//!   testing any store.
//!
//! No feature brings in a backend: the Redis and PostgreSQL stores, the cache tier and the
//! consumer runtime are the crates `idempotent-redis`, `idempotent-postgres`,
//! `idempotent-cache` and `idempotent-consumer`.
//!
//! # Message consumers
//!
//! Brokers deliver at least once: a consumer that crashes after applying a message but before
//! acknowledging it receives the message again, and a producer that retries publishes it twice.
//! The consumer runtime (`idempotent-consumer`) makes each message's effect
//! happen once over Redis Streams, NATS JetStream or RabbitMQ: you write a handler; it keys each
//! message (the publisher's message id, not the broker's delivery id), claims the key, runs the
//! handler — in the PostgreSQL transaction that records it, with `postgres` — acknowledges
//! after the record is durable, and retries, dead-letters, bounds and drains:
//!
//! - **What the transaction covers**: the claim, your writes, and the completed record commit
//!   together or not at all. A crash before the commit leaves no effect and no record, so the
//!   redelivery applies the message; a crash after the commit leaves both, so the redelivery
//!   is a duplicate and changes nothing.
//! - **Acknowledge after the commit**, never before: acknowledging first and crashing before the
//!   commit loses the message.
//! - **What it cannot cover**: an effect outside the database — an e-mail, an HTTP call to a
//!   provider without idempotency keys. Enqueue it in the outbox (`idempotent_postgres::outbox::Outbox`) in the
//!   same transaction; the relay delivers it at least once with a key.
//!
//! `examples/ledger.rs` is a consumer on all three brokers built this way, and
//! `tests/tests/consumer_chaos_e2e.rs` kills its consumers — and the broker — with SIGKILL
//! while 1,000 entries with duplicates and malformed ones flow through, then checks every
//! balance to the unit.
//!
//! # Failure model
//!
//! A claim makes the *record* exactly-once: of any number of duplicates, one owner runs and
//! the others wait or replay. The *effect* needs more when a fault separates the two: an owner
//! can run while the store has already given its key to a successor (a store stalled past the
//! lease), or crash after its effect and before its record. Three defences close that gap,
//! each for a kind of effect; the running work gets what each needs from its [`ClaimHandle`]:
//!
//! | the effect is… | defence | how |
//! |---|---|---|
//! | a write to the PostgreSQL database that holds the record | **same transaction** | the transactional mode (`idempotent_postgres::Transactional`): claim, writes and record commit together or not at all |
//! | a call to a system that accepts an idempotency key (a payment provider, a service behind this library, a deduplicating consumer, the outbox relay) | **downstream key** | pass [`ClaimHandle::operation_key`]: the same for every owner and attempt of one operation (one *record lifetime*: from the claim that finds no live record, through every takeover and retry after a release, until the record expires), so a stalled owner and its successor cause one effect, and a key reused after its record expired is a new operation downstream too |
//! | a write to a resource that can compare numbers (a row in another database, storage with conditional writes) | **fencing token** | the resource refuses a [`ClaimHandle::token`] below the highest it has seen (`idempotent_postgres::Fence` does it in one statement of your transaction) |
//! | a call to another system that must follow a database change if and only if it commits | **transactional outbox** | `idempotent_postgres::outbox::Outbox` writes the message in the change's transaction; `idempotent_postgres::outbox::Relay` delivers it after the commit, at least once, with its key (by default the claim's operation key) |
//! | a call that takes no key, shares no transaction and compares nothing (an SMTP send) | none | at least once, through the outbox; see *What it cannot do* |
//!
//! What each fault does, and what is guaranteed:
//!
//! | fault | the record | the effect |
//! |---|---|---|
//! | **app crash** mid-call | the claim stays until its lease ends (duplicates: [`Error::InFlight`], HTTP 409), then one retry runs as a new owner with a higher token | the crashed attempt may have made its effect: protected by any of the three defences; the same transaction also undoes it |
//! | **store stall or outage inside the lease** (up to about three quarters of it) | renewals that fail or hang are retried (each abandoned after a sixth of the lease, at most a twelfth of it apart); the owner keeps its claim, duplicates get 409, the work runs once | once |
//! | **store stall past the lease** | the owner's claim is lost when its lease ends ([`ClaimHandle::lost`] fires); after the store recovers, a retry runs as a new owner; the stale owner's record write is refused by its token | once with a downstream key or a fencing token; without either, twice. Behind the tower layer the stale owner's client gets its handler's response (or, with `OnClaimLost::Cancel`, a 503 `claim_lost` to retry) |
//! | **store frozen before the claim** (a stopped process, hung connections) | the claim is abandoned after [`CLAIM_TIMEOUT`] (5 s, or a sixth of a shorter lease) and the call fails closed ([`Error::Store`], HTTP 503 `store_unavailable`); nothing runs. A claim the store makes when it runs again is given back by Redis and PostgreSQL as soon as they answer (its caller was told to retry), so the retry runs within moments of the thaw instead of after a lease | once |
//! | **another request under a lapsed or released key** (another body after a crash, a partition past the lease or a `5xx`) | refused: the store answers [`Claim::InFlight`] with the record's fingerprint and a zero `retry_after`, and the call fails with [`Error::FingerprintMismatch`] (HTTP 422); nothing changes. The key is its first request's until its record expires: the first attempt may have taken effect | the first request's retry takes the operation over and finishes or replays it, with the same operation key |
//! | **key reused after its record expired** | a new record, a new lifetime: the work runs again, as the contract and the IETF draft say | a new operation key, so the provider makes the new charge instead of answering the old one |
//! | **store outage** | before the work: the call fails closed ([`Error::Store`], HTTP 503) and nothing runs. After it: the call returns, the record write is retried for up to [`IdempotencyBuilder::record_retry`] (default 60 s) while the lease is renewed; duplicates get 409, then the replay | once if the outage ends within the lease; a longer outage is a stall past the lease |
//! | **store full** (memory store bounds, Redis `maxmemory` with `noeviction`, PostgreSQL disk full) | new claims fail with `store_capacity` (503). A result that does not fit is recorded as "ran, not retained" (retries get [`Error::ResultNotRetained`]); if even that is refused, the write is retried while the lease is kept alive (a Redis renewal needs no memory), then the result is replayed once there is room | once; a full PostgreSQL disk can refuse renewals too, which makes it a stall past the lease |
//! | **failover** | Redis replicates asynchronously: a claim or record acknowledged and not yet replicated is lost, and a duplicate right after the failover may run again. PostgreSQL with synchronous replication loses nothing acknowledged | with Redis, once only with a downstream key (or a fencing token whose resource is not on the failed server) |
//! | **crash between two [`steps`]** of an operation | as an app crash; the retry (or a completer) takes the operation over and gets the saved checkpoints | each step whose checkpoint was saved: once. The step that was running: again, unless protected by its [`ClaimHandle::step_key`] or run with `PostgresStore::step_in_transaction` |
//! | **clock step** | leases run on the store's clock: a forward step ends leases early (a stall past the lease, above); the app servers' clocks play no part | as for a stall past the lease |
//!
//! What a [`FencingToken`] promises, per store:
//!
//! - `memory::MemoryStore`: one counter per store; strictly increasing for every key, unaffected by
//!   clocks. The store lives and dies with the process.
//! - `PostgresStore`: a sequence; strictly increasing per key across owners, expiry, deletion
//!   and restarts, unaffected by clock steps. After a failover to an asynchronous replica,
//!   values handed out just before it may be handed out again; with synchronous replication
//!   they are not.
//! - `RedisStore`: the server's `TIME` in microseconds at the claim; strictly increasing per
//!   key as long as the server's clock never steps back and a failover does not move to a
//!   server whose clock is behind. A backward step can issue a token below one already
//!   issued: where a fencing token must hold across clock steps and failovers, keep the claims
//!   on PostgreSQL.
//!
//! A panic in deciding or encoding a result after the work ran (a `retain` closure, a
//! `Serialize` implementation) is caught, the call recorded as "ran, not retained" (retries
//! get [`Error::ResultNotRetained`], never a second run), and the panic resumed for its
//! caller. A completion repeated by its owner (its first reply was lost, or it retries with
//! the "not retained" record) finds its own record and succeeds: no false "claim lost".
//!
//! `tests/tests/effect_faults_e2e.rs` causes these faults to real processes (Redis and
//! PostgreSQL frozen with `SIGSTOP` past the lease and twice inside it, Redis at `maxmemory`
//! while a result is recorded) behind the `payments` example, whose handler charges a
//! simulated provider with the downstream key: one charge every time.
//! `tests/tests/store_edges_e2e.rs` freezes Redis and PostgreSQL before a claim (503 within
//! ten seconds, the key answered right after the thaw, one run) and reuses a key after its
//! record expired (a second charge).
//! [`conformance::FaultyStore`](crate::conformance) injects the same faults into any store
//! for unit tests.
//!
//! # What it cannot do
//!
//! An effect on a system that takes no idempotency key and shares no transaction with the store
//! (sending an e-mail, calling a third-party API without keys) cannot be made exactly-once: a
//! crash between the effect and the completion record leaves no way to know whether it
//! happened. Record the intent in your database in the same transaction as the state change and
//! deliver it from there: `idempotent_postgres::outbox::Outbox` and `idempotent_postgres::outbox::Relay` (at least once, with a key
//! the receiver can deduplicate on). Effects that *are* writes to a PostgreSQL
//! database close the gap with the transactional mode (`idempotent_postgres::Transactional`): the record
//! commits in the same transaction as the writes.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod attribute;
mod call;
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
mod outcome;
mod problem;
mod recording;
mod run_to_end;
mod runtime;
mod shutdown;
pub mod store;
mod to_key;

pub mod clock;
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
pub use claim::{ClaimHandle, StepError};
pub use claim_answer::MAX_IN_FLIGHT_RETRY_HINT;
pub use default_runtime::{default_runtime, set_default_runtime};
pub use error::{BoxError, Error, StoreError};
pub use fingerprint::{CanonicalError, Fingerprint, FingerprintBuilder};
pub use key::{Key, KeyError, MAX_KEY_LEN, RecordBytes, Scope, SessionPlace, StorageKey};
pub use outcome::{Execution, Outcome, Retain};
pub use problem::{GrpcCode, ProblemCode};
pub use run_to_end::RunToEnd;
pub use runtime::{CLAIM_TIMEOUT, DEFAULT_RECORD_RETRY, Idempotency, IdempotencyBuilder};
pub use session::{SessionGate, SessionKey, SessionMark, SessionRequest};
pub use shutdown::Drained;
pub use store::{Claim, FencingToken, RequestOwner, Store};
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
