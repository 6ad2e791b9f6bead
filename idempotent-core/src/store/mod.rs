//! The store contract ([`Store`]) and the built-in stores.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::metrics::{Metrics, Operation};
use crate::{Fingerprint, StorageKey, StoreError};

#[cfg(feature = "memory")]
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;

/// Identifies one claim of one storage key. Strictly increasing per storage key: every claim
/// gets a token greater than all tokens issued before it for that key, so a caller whose lease
/// ended can be told apart from the current owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw token value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller now owns the key until its lease ends, and holds this token.
    Claimed(FencingToken),
    /// Another caller owns the key.
    InFlight {
        /// The fingerprint the owner claimed with.
        fingerprint: Fingerprint,
        /// Time left on the owner's lease.
        retry_after: Duration,
    },
    /// The key has a completed record.
    Completed {
        /// The fingerprint of the request that completed.
        fingerprint: Fingerprint,
        /// The stored payload, byte for byte as given to [`Store::complete`].
        payload: Bytes,
    },
}

/// Where records live: the contract every backend keeps.
///
/// Every method is one atomic step: no interleaving of other callers' operations on the same
/// storage key can be observed half-done. Methods take `&self` and are called concurrently from
/// many tasks (and, for shared backends, many processes).
///
/// A [`Store`] keeps one record per [`StorageKey`]: either *in flight* (claimed by one caller
/// holding a [`FencingToken`], until its lease ends) or *completed* (a result to replay, until
/// its TTL ends). The runtime ([`Idempotency`](crate::Idempotency)) drives every store through
/// the same cycle:
///
/// ```text
/// claim ──Claimed(token)──▶ run the work, renew(token) every lease/3 ──▶ complete(token) or release(token)
///   ├──InFlight──▶ reject (409) or wait and claim again
///   └──Completed──▶ replay the stored result
/// ```
///
/// # Implementing a store
///
/// Implement the four required methods so that each is **one atomic step** against your
/// backend, and run the conformance suite (feature `test-util`) against it; see
/// [`conformance`](crate::conformance) when that feature is enabled. The rules every method
/// must keep are in its documentation; in short:
///
/// - a record whose lease or TTL has passed is as good as absent for `claim`, and only for
///   `claim`: `complete`, `release` and `renew` succeed only with the current token of a live
///   in-flight record;
/// - every successful `claim` returns a token greater than every token issued before for that
///   storage key, even if the record was deleted in between;
/// - a record is never overwritten or deleted by a caller that does not hold its current token;
/// - time comes from one place shared by every caller (the backend's clock where it has one),
///   so that app servers with skewed clocks agree on when a lease ends.
///
/// A complete store over a mutex-guarded `HashMap`, with time from [`std::time::Instant`]:
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Mutex;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::{Duration, Instant};
///
/// use bytes::Bytes;
/// use idempotent_core::{Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError};
///
/// enum Record {
///     InFlight { token: FencingToken, fingerprint: Fingerprint, until: Instant },
///     Completed { fingerprint: Fingerprint, payload: Bytes, until: Instant },
/// }
///
/// #[derive(Default)]
/// struct MutexStore {
///     records: Mutex<HashMap<StorageKey, Record>>,
///     // One counter for all keys keeps tokens increasing per key across deletions.
///     last_token: AtomicU64,
/// }
///
/// impl Store for MutexStore {
///     async fn claim(
///         &self,
///         key: &StorageKey,
///         fingerprint: &Fingerprint,
///         lease: Duration,
///     ) -> Result<Claim, StoreError> {
///         let now = Instant::now();
///         let mut records = self.records.lock().unwrap();
///         match records.get(key) {
///             Some(Record::InFlight { fingerprint, until, .. }) if *until > now => {
///                 return Ok(Claim::InFlight { fingerprint: *fingerprint, retry_after: *until - now });
///             }
///             Some(Record::Completed { fingerprint, payload, until }) if *until > now => {
///                 return Ok(Claim::Completed { fingerprint: *fingerprint, payload: payload.clone() });
///             }
///             _ => {} // absent or expired: the caller becomes the owner
///         }
///         let token = FencingToken::new(self.last_token.fetch_add(1, Ordering::SeqCst) + 1);
///         records.insert(*key, Record::InFlight { token, fingerprint: *fingerprint, until: now + lease });
///         Ok(Claim::Claimed(token))
///     }
///
///     async fn complete(
///         &self,
///         key: &StorageKey,
///         token: FencingToken,
///         payload: Bytes,
///         ttl: Duration,
///     ) -> Result<(), StoreError> {
///         let now = Instant::now();
///         let mut records = self.records.lock().unwrap();
///         match records.get(key) {
///             Some(Record::InFlight { token: current, fingerprint, until }) if *current == token && *until > now => {
///                 let fingerprint = *fingerprint;
///                 records.insert(*key, Record::Completed { fingerprint, payload, until: now + ttl });
///                 Ok(())
///             }
///             _ => Err(StoreError::TokenRejected),
///         }
///     }
///
///     async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
///         let now = Instant::now();
///         let mut records = self.records.lock().unwrap();
///         match records.get(key) {
///             Some(Record::InFlight { token: current, until, .. }) if *current == token && *until > now => {
///                 records.remove(key);
///                 Ok(())
///             }
///             _ => Err(StoreError::TokenRejected),
///         }
///     }
///
///     async fn renew(&self, key: &StorageKey, token: FencingToken, lease: Duration) -> Result<(), StoreError> {
///         let now = Instant::now();
///         let mut records = self.records.lock().unwrap();
///         match records.get_mut(key) {
///             Some(Record::InFlight { token: current, until, .. }) if *current == token && *until > now => {
///                 *until = now + lease;
///                 Ok(())
///             }
///             _ => Err(StoreError::TokenRejected),
///         }
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_core::Error> {
/// let idempotency = idempotent_core::Idempotency::new(MutexStore::default());
/// let call = idempotent_core::Call::new("order-1".parse()?);
/// let first = idempotency.run(&call, async { 42u32 }).await?;
/// let retry = idempotency.run(&call, async { 43u32 }).await?;
/// assert_eq!((first.into_inner(), retry.is_replayed(), retry.into_inner()), (42, true, 42));
/// # Ok(())
/// # }
/// ```
///
/// This store never forgets expired records and is bounded by nothing; [`MemoryStore`] shows how
/// to reclaim and bound them.
///
/// [`MemoryStore`]: crate::memory::MemoryStore
pub trait Store: Send + Sync + 'static {
    /// Claims `key` for `lease`, or reports the record that prevents it.
    ///
    /// - No record, or a record whose lease (in flight) or TTL (completed) has passed: stores a
    ///   new in-flight record with `fingerprint`, a lease ending `lease` from now, and a new token
    ///   greater than every token issued before for `key`; returns [`Claim::Claimed`].
    /// - A live in-flight record: returns [`Claim::InFlight`] with its fingerprint and the time
    ///   left on its lease. Nothing is changed.
    /// - A live completed record: returns [`Claim::Completed`] with its fingerprint and payload.
    ///   Nothing is changed.
    ///
    /// Of any number of concurrent claims on an absent key, exactly one returns `Claimed`.
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Turns the caller's in-flight record into a completed one holding `payload`, kept for
    /// `ttl` from now.
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing. The fingerprint is kept from
    /// the claim. May return [`StoreError::Capacity`] if the payload does not fit; the record
    /// then stays in flight.
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the caller's in-flight record, so the next claim runs the work again (the work
    /// failed transiently or was abandoned).
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing. A completed record is never
    /// released.
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the caller's lease to end `lease` from now.
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing (a lease that already ended
    /// cannot be renewed: another caller may have taken over).
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The store's name, the `store` label of its operations' metrics
    /// ([`metrics`](crate::metrics)): `memory`, `redis` and `postgres` for the built-in stores,
    /// `custom` by default. A few distinct values at most: it is a label.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Whether this store keeps the bytes [`complete`](Self::complete) is given in this
    /// process's memory and hands those same bytes back from [`claim`](Self::claim), so
    /// that nothing outside the process can change them. Default `false`.
    ///
    /// The runtime then skips the checksum it otherwise computes over every result it records
    /// and checks on every replay (the rest of the record's envelope is still checked). Return
    /// `true` only for such a store: on any other, a record damaged outside the process would
    /// be replayed instead of refused as corrupt. [`MemoryStore`] returns `true`.
    ///
    /// [`MemoryStore`]: crate::memory::MemoryStore
    fn keeps_records_in_process(&self) -> bool {
        false
    }

    /// Waits until `key` may have changed, or `max_wait` has passed, whichever is first.
    ///
    /// Callers waiting for an in-flight record to complete call this between claims. The
    /// default sleeps for `max_wait` (polling); a store with change notifications should
    /// return early when the record is completed or released. Returning early spuriously is
    /// allowed.
    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        let _ = key;
        tokio::time::sleep(max_wait)
    }
}

impl<S: Store> Store for Arc<S> {
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        S::claim(self, key, fingerprint, lease)
    }
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::complete(self, key, token, payload, ttl)
    }
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::release(self, key, token)
    }
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::renew(self, key, token, lease)
    }
    fn name(&self) -> &'static str {
        S::name(self)
    }
    fn keeps_records_in_process(&self) -> bool {
        S::keeps_records_in_process(self)
    }
    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        S::wait_for_change(self, key, max_wait)
    }
}

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe face of [`Store`], so one runtime type serves every store.
pub(crate) trait DynStore: Send + Sync + 'static {
    fn claim<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;
    fn complete<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn wait_for_change<'a>(&'a self, key: &'a StorageKey, max_wait: Duration) -> BoxFuture<'a, ()>;
    fn keeps_records_in_process(&self) -> bool;
    /// The metrics of the runtime this store serves.
    fn metrics(&self) -> &Metrics;
}

/// A store as a runtime holds it: type-erased, every operation timed into the runtime's
/// [`Metrics`]. The timing lives in the one future each operation is boxed into anyway.
pub(crate) struct Measured<S> {
    store: S,
    metrics: Metrics,
}

impl<S: Store> Measured<S> {
    /// `store`, with the runtime's metrics registered with the current recorder.
    pub(crate) fn new(store: S) -> Self {
        let metrics = Metrics::register(store.name());
        Measured { store, metrics }
    }

    async fn timed<T>(
        &self,
        operation: Operation,
        answer: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let answer = answer.await;
        self.metrics
            .store_operation(operation, answer.as_ref().err(), started.elapsed());
        answer
    }
}

impl<S: Store> DynStore for Measured<S> {
    fn claim<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.timed(Operation::Claim, self.store.claim(key, fingerprint, lease)))
    }
    fn complete<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(
            Operation::Complete,
            self.store.complete(key, token, payload, ttl),
        ))
    }
    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(Operation::Release, self.store.release(key, token)))
    }
    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(Operation::Renew, self.store.renew(key, token, lease)))
    }
    fn wait_for_change<'a>(&'a self, key: &'a StorageKey, max_wait: Duration) -> BoxFuture<'a, ()> {
        Box::pin(self.store.wait_for_change(key, max_wait))
    }
    fn keeps_records_in_process(&self) -> bool {
        self.store.keeps_records_in_process()
    }
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
