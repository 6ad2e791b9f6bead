//! The in-memory store: one process, bounded, on dashmap.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::{Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError};

mod inner;

pub use self::inner::RECORD_OVERHEAD;
use self::inner::{Inner, NEVER, Waiting, nanos};

/// Default bound on the number of records: one million.
pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// Default bound on the bytes held by records: 256 MiB.
pub const DEFAULT_MAX_BYTES: usize = 256 << 20;
/// Default period of the background sweep that deletes expired records: 10 s.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// The fewest shards of the records map, each with its own lock. A sweep looks at every
/// record, one shard at a time under that shard's lock: with this many, a shard of a store of
/// ten million records holds about 40,000, so a request on a key of the shard being swept
/// waits about a millisecond (0.9 ms measured), not the whole sweep. (The map's default is four
/// per CPU, rounded up to a power of two: 8 shards of 1.25 million records each on two CPUs;
/// a machine of more than 64 CPUs keeps its larger default.)
const MIN_SHARDS: usize = 256;

/// The map's shards: its default for this machine, and at least [`MIN_SHARDS`].
fn shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    cpus.saturating_mul(4)
        .checked_next_power_of_two()
        .unwrap_or(MIN_SHARDS)
        .max(MIN_SHARDS)
}

/// A [`Store`] in this process's memory, the embedded default.
///
/// It protects one process: use a shared store (Redis, PostgreSQL) when several instances serve
/// the same clients. Cloning is cheap; clones share the records.
///
/// - **Atomic**: `claim` runs under the map shard's lock, so of any number of concurrent claims
///   on one key exactly one wins.
/// - **Bounded** by a number of records and a number of bytes (payload plus
///   [`RECORD_OVERHEAD`] per record); defaults [`DEFAULT_MAX_ENTRIES`] and
///   [`DEFAULT_MAX_BYTES`]. Completions of at most 64 bytes (the runtime's "done, result not
///   retained" record) are accepted even at the byte bound, so a call that ran can always be
///   recorded; the bound may be exceeded by that much per in-flight record. When full of live records it refuses new claims with
///   [`StoreError::Capacity`] — it never evicts a live record, because an evicted claim is a
///   second execution. Replays of existing records keep working when full.
/// - **Reclaimed**: an expired record is replaced in place by the next claim on its key; a
///   background task deletes expired records every [`DEFAULT_SWEEP_INTERVAL`] (when the store
///   is built inside a tokio runtime; the task ends when the last clone is dropped). The sweep
///   looks at every record, so its work grows with the store; it runs on tokio's blocking
///   pool, not on a worker thread, and locks one of the map's shards (at least 256) at a time,
///   so the requests served meanwhile do not stop for it. A claim that finds the store full
///   sweeps once before refusing, itself, on the thread that serves it (at most ten times per
///   sweep interval). An abandoned claim (its lease
///   ended, or it was released) is kept until the TTL it was claimed with, so that the next
///   owner continues its lifetime and [operation key](crate::KeyClaim::operation_key); a
///   full store's sweep deletes abandoned claims too, and the next owner of such a key then
///   begins a new lifetime (whatever its request: the store no longer knows which request the
///   key belonged to).
/// - **Fenced**: tokens come from one counter per store, so they increase per key even across
///   deletions.
/// - **Expiring**: every record expires; a lease above [`limits::MAX_LEASE`](crate::limits::MAX_LEASE) or a TTL above
///   [`limits::MAX_TTL`](crate::limits::MAX_TTL) is recorded as that ceiling, and the clock's arithmetic saturates
///   rather than overflows.
///
/// ```
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::Idempotency;
///
/// let store = MemoryStore::builder().max_entries(10_000).max_bytes(64 << 20).build();
/// let idempotency = Idempotency::new(store);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// How full a [`MemoryStore`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Records held, live or expired but not yet reclaimed.
    pub records: usize,
    /// Bytes charged against the byte bound.
    pub bytes: usize,
}

impl MemoryStore {
    /// A store with the default bounds and the system clock.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            sweep_interval: Some(DEFAULT_SWEEP_INTERVAL),
            clock: None,
        }
    }

    /// How full the store is.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            records: self.inner.entries.load(Ordering::Acquire),
            bytes: self.inner.bytes.load(Ordering::Acquire),
        }
    }

    /// Deletes every expired record now (completed records past their TTL, abandoned claims
    /// past the TTL they were claimed with); returns how many were deleted.
    pub fn sweep(&self) -> usize {
        self.inner.sweep(false)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("stats", &self.stats())
            .field("max_entries", &self.inner.max_entries)
            .field("max_bytes", &self.inner.max_bytes)
            .finish_non_exhaustive()
    }
}

/// Configures a [`MemoryStore`]. Created by [`MemoryStore::builder`].
#[must_use]
pub struct MemoryStoreBuilder {
    max_entries: usize,
    max_bytes: usize,
    sweep_interval: Option<Duration>,
    clock: Option<Arc<dyn Clock>>,
}

impl MemoryStoreBuilder {
    /// The most records held at once (default [`DEFAULT_MAX_ENTRIES`]).
    pub fn max_entries(mut self, max: usize) -> Self {
        self.max_entries = max;
        self
    }

    /// The most bytes held at once, payloads plus [`RECORD_OVERHEAD`] per record (default
    /// [`DEFAULT_MAX_BYTES`]).
    pub fn max_bytes(mut self, max: usize) -> Self {
        self.max_bytes = max;
        self
    }

    /// How often the background sweep deletes expired records (default
    /// [`DEFAULT_SWEEP_INTERVAL`]); `None` turns it off.
    pub fn sweep_interval(mut self, every: Option<Duration>) -> Self {
        self.sweep_interval = every.filter(|d| !d.is_zero());
        self
    }

    /// The time source (default [`SystemClock`]). Tests pass a `clock::ManualClock` (feature `test-util`).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store. The background sweep starts only when called inside a tokio runtime.
    pub fn build(self) -> MemoryStore {
        let sweep_every = self.sweep_interval.unwrap_or(DEFAULT_SWEEP_INTERVAL);
        let inner = Arc::new(Inner {
            records: DashMap::with_shard_amount(shards()),
            clock: self.clock.unwrap_or_else(|| Arc::new(SystemClock::new())),
            max_entries: self.max_entries,
            max_bytes: self.max_bytes,
            entries: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            last_token: AtomicU64::new(0),
            changed: Notify::new(),
            waiters: AtomicUsize::new(0),
            // A full store sweeps at most ten times per sweep interval, so a flood of claims
            // against a full store does not turn into a flood of full scans.
            capacity_sweep_gap: nanos(sweep_every / 10),
            last_capacity_sweep: AtomicU64::new(NEVER),
            sweeper: OnceLock::new(),
        });
        if let (Some(every), Ok(runtime)) =
            (self.sweep_interval, tokio::runtime::Handle::try_current())
        {
            let weak = Arc::downgrade(&inner);
            let task = runtime.spawn(sweep_periodically(weak, every));
            let _ = inner.sweeper.set(task.abort_handle());
        }
        MemoryStore { inner }
    }
}

impl fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_entries", &self.max_entries)
            .field("max_bytes", &self.max_bytes)
            .field("sweep_interval", &self.sweep_interval)
            .finish_non_exhaustive()
    }
}

async fn sweep_periodically(store: Weak<Inner>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = store.upgrade() else { return };
        // A sweep of ten million records takes about a fifth of a second (BENCHMARKS.md): on
        // the blocking pool, so the runtime's workers go on serving requests meanwhile.
        let removed = match tokio::task::spawn_blocking(move || inner.sweep(false)).await {
            Ok(removed) => removed,
            // The sweep panicked (a clock of the caller's that panics): no more sweeps, as
            // when the task itself panicked before.
            Err(error) => {
                tracing::error!(%error, "idempotency memory store's sweep failed; sweeping stops");
                return;
            }
        };
        if removed > 0 {
            tracing::trace!(removed, "idempotency memory store swept expired records");
        }
    }
}

impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fingerprint, lease, ttl, None)
    }

    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        label: &crate::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fingerprint, lease, ttl, Some(label))
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, payload, ttl)
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token)
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease)
    }

    async fn wait_for_change(&self, _key: &StorageKey, max_wait: Duration) {
        self.inner.waiters.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&self.inner.waiters);
        let _ = tokio::time::timeout(max_wait, self.inner.changed.notified()).await;
    }

    /// `true`: records are `Bytes` in this process, handed back as they were given, so the
    /// runtime does not checksum them.
    fn keeps_records_in_process(&self) -> bool {
        true
    }

    /// From its map, under the shard's read lock: the record a claim would report now, if it
    /// is completed and live.
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        self.inner.completed(key)
    }
}

impl crate::SessionStore for MemoryStore {
    async fn open_session(
        &self,
        session: &crate::SessionKey,
        request: crate::SessionRequest,
    ) -> Result<crate::SessionGate, StoreError> {
        self.inner.open_session(session, request)
    }

    async fn session_mark(
        &self,
        session: &crate::SessionKey,
    ) -> Result<Option<crate::SessionMark>, StoreError> {
        Ok(self.inner.session_mark(session))
    }

    /// The three steps of the default in one call, with no `await` between them: the gate,
    /// the claim, and the mark check (the gate drops answers outside the session's lock, so
    /// the check is still needed).
    async fn claim_in_session(
        &self,
        session: &crate::SessionKey,
        request: crate::SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &crate::inspect::KeyLabel,
    ) -> Result<crate::SessionClaim, StoreError> {
        self.inner
            .claim_in_session(session, request, fingerprint, lease, label)
    }
}

impl crate::CheckpointStore for MemoryStore {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.inner.resume(key, fingerprint, lease, ttl)
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> Result<(), StoreError> {
        self.inner.save_step(key, token, &entry)
    }

    async fn load_steps(&self, key: &StorageKey, token: FencingToken) -> Result<Bytes, StoreError> {
        self.inner.load_steps(key, token)
    }

    async fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        self.inner.save_request(key, token, request)
    }

    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&crate::RequestOwner>,
    ) -> Result<Vec<crate::steps::Abandoned>, StoreError> {
        Ok(self.inner.abandoned(idle, limit, owner))
    }
}

impl crate::inspect::InspectStore for MemoryStore {
    async fn inspect(
        &self,
        key: &StorageKey,
    ) -> Result<Option<crate::inspect::RecordInfo>, StoreError> {
        Ok(self.inner.inspect(key))
    }

    async fn list(
        &self,
        query: &crate::inspect::ListQuery,
    ) -> Result<crate::inspect::Page, StoreError> {
        self.inner.list(query)
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &crate::inspect::Repair,
        force: bool,
    ) -> Result<crate::inspect::Repaired, StoreError> {
        self.inner.repair(key, token, repair, force)
    }

    async fn session_state(
        &self,
        session: &crate::SessionKey,
    ) -> Result<Option<crate::session::SessionState>, StoreError> {
        Ok(self.inner.session_state(session))
    }
}
