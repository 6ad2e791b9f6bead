//! A durable embedded store for [`idempotent_core`]: every record in one SQLite file, shared
//! by the processes of one host.
//!
//! [`SqliteStore`] keeps what the memory store of `idempotent-core` keeps —
//! claims, completed results, [client sessions](idempotent_core::session),
//! [checkpoints](idempotent_core::steps) and the requests a completer runs again — in a file,
//! so that they survive a restart, a crash and (with the default durability) a power loss, and
//! so that several processes on the same machine (workers of one service, a CLI next to a
//! daemon) stay exactly-once together. It needs no server: for many hosts, use the Redis or
//! PostgreSQL store of `idempotent-core` instead.
//!
//! ```
//! use idempotent_core::{Call, Idempotency};
//! use idempotent_sqlite::SqliteStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = std::env::temp_dir().join(format!("idempotent-sqlite-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir)?;
//! # let path = dir.join("idempotency.db");
//! // Creates the file and its tables if missing; WAL journal, fsync on every commit.
//! let store = SqliteStore::open(&path).await?;
//! let idempotency = Idempotency::new(store);
//!
//! let call = Call::new("order-1".parse()?);
//! let first = idempotency.run(&call, async { 42u32 }).await?;
//! let retry = idempotency.run(&call, async { 43u32 }).await?;
//! assert_eq!(first.into_inner(), 42);
//! assert!(retry.is_replayed());
//! assert_eq!(retry.into_inner(), 42);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Where to read on
//!
//! - [`SqliteStore`]: the table, how each operation is one transaction, and the deployment
//!   notes: **durability** (`synchronous = FULL` by default, [`Durability`]), **one host and
//!   one clock** (leases and TTLs are wall-clock times written into the rows), **several
//!   processes** on one file (`BEGIN IMMEDIATE`, the busy timeout), and **reaping** (a
//!   background task deletes expired rows; [`SqliteStoreBuilder::reap_every`]).
//! - [`SqliteStoreBuilder`]: every setting and its range.
//! - The contract every store keeps: [`idempotent_core::Store`]. This store passes the whole
//!   conformance suite of `idempotent-core` (keys, sessions, checkpoints and inspection).
//! - Looking inside and repairing: [`SqliteStore`] implements
//!   [`InspectStore`](idempotent_core::inspect::InspectStore). `inspect` reads one row by its
//!   key; `list` reads one page in order on an index (`{prefix}records_listed` on state,
//!   released, `since` and key; lapsed leases on `{prefix}records_lapsed` by their end),
//!   oldest first, with a cursor of the last record's time and key; `repair` is one
//!   `BEGIN IMMEDIATE` transaction (the token and lease checks and the change), and a give-up's
//!   new token comes from the same counter as a claim's. Each record keeps the label
//!   [`claim_labelled`](idempotent_core::Store::claim_labelled) gives it, whether it was
//!   released, its count of attempts and when it entered its state, in columns
//!   [`migrate`](SqliteStore::migrate) adds to a file made by an earlier version.

mod error;
mod inspect;
mod ops;
mod row;
mod sql;
mod store;
mod write;

pub use self::sql::{DEFAULT_TABLE_PREFIX, InvalidTablePrefix};
pub use self::store::{
    DEFAULT_BUSY_TIMEOUT, DEFAULT_MAX_READERS, DEFAULT_REAP_BATCH, DEFAULT_REAP_EVERY, Database,
    Durability, MAX_BUSY_TIMEOUT, MAX_READERS, SqliteStore, SqliteStoreBuilder,
};
