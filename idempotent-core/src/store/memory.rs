//! The in-memory store: one process, bounded, on dashmap.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::{Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError, limits};

/// Default bound on the number of records: one million.
pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// Default bound on the bytes held by records: 256 MiB.
pub const DEFAULT_MAX_BYTES: usize = 256 << 20;
/// Default period of the background sweep that deletes expired records: 10 s.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// What one record is charged against the byte bound besides its payload: the map slot, the
/// key, the record, the payload's allocation and the map's spare capacity. Measured resident
/// memory per record (BENCHMARKS.md) stays below payload + this at 100k and 1M records, so the
/// byte bound is an upper bound on what records really use.
pub const RECORD_OVERHEAD: usize = 256;

const NEVER: u64 = u64::MAX;

/// Completions with payloads this small are accepted even when the byte bound is reached, so
/// the byte bound can be exceeded by at most this much per in-flight record.
const ALWAYS_FITS: usize = 64;

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
///   is built inside a tokio runtime; the task ends when the last clone is dropped); and a claim
///   that finds the store full sweeps once before refusing. An abandoned claim (its lease
///   ended, or it was released) is kept until the TTL it was claimed with, so that the next
///   owner continues its lifetime and [operation key](crate::ClaimHandle::operation_key); a
///   full store's sweep deletes abandoned claims too, and the next owner of such a key then
///   begins a new lifetime.
/// - **Fenced**: tokens come from one counter per store, so they increase per key even across
///   deletions.
/// - **Expiring**: every record expires; a lease above [`limits::MAX_LEASE`] or a TTL above
///   [`limits::MAX_TTL`] is recorded as that ceiling, and the clock's arithmetic saturates
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

struct Inner {
    records: DashMap<StorageKey, Record>,
    clock: Arc<dyn Clock>,
    max_entries: usize,
    max_bytes: usize,
    entries: AtomicUsize,
    bytes: AtomicUsize,
    last_token: AtomicU64,
    changed: Notify,
    waiters: AtomicUsize,
    capacity_sweep_gap: u64,
    last_capacity_sweep: AtomicU64,
    sweeper: OnceLock<tokio::task::AbortHandle>,
}

enum Record {
    InFlight {
        token: u64,
        /// The token that began the record's lifetime.
        lifetime: u64,
        fingerprint: Fingerprint,
        lease_until: u64,
        /// Until when the record is kept once its lease ended (or it was released), so that a
        /// takeover of the same request continues its lifetime.
        kept_until: u64,
    },
    Completed {
        token: u64,
        fingerprint: Fingerprint,
        payload: Bytes,
        expires: u64,
    },
}

impl Record {
    /// What a claim at `now` reports about this record, or `None` if it has expired and may
    /// be claimed.
    fn report(&self, now: u64) -> Option<Claim> {
        match self {
            Record::InFlight {
                fingerprint,
                lease_until,
                ..
            } if *lease_until > now => Some(Claim::InFlight {
                fingerprint: *fingerprint,
                retry_after: Duration::from_nanos(lease_until - now),
            }),
            Record::Completed {
                fingerprint,
                payload,
                expires,
                ..
            } if *expires > now => Some(Claim::Completed {
                fingerprint: *fingerprint,
                payload: payload.clone(),
            }),
            _ => None,
        }
    }

    /// Whether a sweep at `now` keeps the record: it is live, or (unless `pressed`: the store is
    /// full) an abandoned claim still within the TTL it was claimed with.
    fn is_kept(&self, now: u64, pressed: bool) -> bool {
        match self {
            Record::InFlight {
                lease_until,
                kept_until,
                ..
            } => *lease_until > now || (!pressed && *kept_until > now),
            Record::Completed { expires, .. } => *expires > now,
        }
    }

    /// The lifetime an abandoned claim of `fingerprint` at `now` continues, if this record is
    /// one.
    fn continued_by(&self, fingerprint: &Fingerprint, now: u64) -> Option<u64> {
        match self {
            Record::InFlight {
                lifetime,
                fingerprint: recorded,
                kept_until,
                ..
            } if *kept_until > now && recorded == fingerprint => Some(*lifetime),
            _ => None,
        }
    }

    fn cost(&self) -> usize {
        match self {
            Record::InFlight { .. } => RECORD_OVERHEAD,
            Record::Completed { payload, .. } => RECORD_OVERHEAD + payload.len(),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
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
            records: DashMap::new(),
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
        let removed = inner.sweep(false);
        if removed > 0 {
            tracing::trace!(removed, "idempotency memory store swept expired records");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.sweeper.get() {
            task.abort();
        }
    }
}

impl Inner {
    fn now(&self) -> u64 {
        nanos(self.clock.now())
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.last_token.fetch_add(1, Ordering::AcqRel) + 1)
    }

    fn try_reserve(&self, entries: usize, bytes: usize) -> Result<(), StoreError> {
        if entries > 0
            && self.entries.fetch_add(entries, Ordering::AcqRel) + entries > self.max_entries
        {
            self.entries.fetch_sub(entries, Ordering::AcqRel);
            return Err(StoreError::Capacity {
                what: "max entries",
            });
        }
        if self.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes > self.max_bytes {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.entries.fetch_sub(entries, Ordering::AcqRel);
            return Err(StoreError::Capacity { what: "max bytes" });
        }
        Ok(())
    }

    fn unreserve(&self, entries: usize, bytes: usize) {
        self.entries.fetch_sub(entries, Ordering::AcqRel);
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Reserves capacity, sweeping once if the store is full and a sweep is due. Must be called
    /// with no shard lock held: the sweep takes every shard's lock.
    fn reserve(&self, entries: usize, bytes: usize, now: u64) -> Result<(), StoreError> {
        match self.try_reserve(entries, bytes) {
            Ok(()) => Ok(()),
            Err(full) => {
                if self.sweep_if_due(now) > 0 {
                    self.try_reserve(entries, bytes)
                } else {
                    Err(full)
                }
            }
        }
    }

    /// Sweeps a full store: abandoned claims go too (their successors begin new lifetimes).
    fn sweep_if_due(&self, now: u64) -> usize {
        let last = self.last_capacity_sweep.load(Ordering::Acquire);
        if last != NEVER && now < last.saturating_add(self.capacity_sweep_gap) {
            return 0;
        }
        if self
            .last_capacity_sweep
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return 0; // another caller is sweeping
        }
        self.sweep(true)
    }

    fn sweep(&self, pressed: bool) -> usize {
        let now = self.now();
        let (mut removed, mut freed) = (0, 0);
        self.records.retain(|_, record| {
            let live = record.is_kept(now, pressed);
            if !live {
                removed += 1;
                freed += record.cost();
            }
            live
        });
        self.unreserve(removed, freed);
        removed
    }

    fn notify_changed(&self) {
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.changed.notify_waiters();
        }
    }

    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let now = self.now();
        // Replays and in-flight reports need only the shard's read lock.
        if let Some(found) = self.records.get(key).and_then(|r| r.report(now)) {
            return Ok(found);
        }
        let lease_until = now.saturating_add(nanos(limits::clamp_lease(lease)));
        let kept_until = now
            .saturating_add(nanos(limits::clamp_ttl(ttl)))
            .max(lease_until);
        let in_flight = |token: FencingToken, lifetime: Option<u64>| {
            let record = Record::InFlight {
                token: token.get(),
                lifetime: lifetime.unwrap_or(token.get()),
                fingerprint: *fingerprint,
                lease_until,
                kept_until,
            };
            let claim = match lifetime {
                Some(lifetime) => Claim::TakenOver {
                    token,
                    lifetime: FencingToken::new(lifetime),
                },
                None => Claim::Claimed(token),
            };
            (record, claim)
        };
        let mut reserved = false;
        loop {
            match self.records.entry(*key) {
                Entry::Occupied(mut slot) => {
                    if reserved {
                        self.unreserve(1, RECORD_OVERHEAD);
                    }
                    if let Some(found) = slot.get().report(now) {
                        return Ok(found);
                    }
                    // Expired or abandoned: reclaimed in place; the slot keeps its entry, the
                    // payload's bytes are freed.
                    let freed = slot.get().cost() - RECORD_OVERHEAD;
                    let lifetime = slot.get().continued_by(fingerprint, now);
                    let (record, claim) = in_flight(self.next_token(), lifetime);
                    slot.insert(record);
                    self.bytes.fetch_sub(freed, Ordering::AcqRel);
                    return Ok(claim);
                }
                Entry::Vacant(slot) => {
                    if reserved {
                        let (record, claim) = in_flight(self.next_token(), None);
                        slot.insert(record);
                        return Ok(claim);
                    }
                    // Reserve outside the shard lock (a full store sweeps every shard), then
                    // look again: the key may have been claimed meanwhile.
                    drop(slot);
                    self.reserve(1, RECORD_OVERHEAD, now)?;
                    reserved = true;
                }
            }
        }
    }

    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = self.now();
        let extra = payload.len();
        // Reserve before locking the record; give it back if the token is rejected. A payload of
        // at most ALWAYS_FITS bytes is accepted even by a full store: that is how the runtime
        // records "done, result not retained" when the result itself did not fit, and refusing
        // it too would let the claim lapse and the work run again.
        match self.reserve(0, extra, now) {
            Ok(()) => {}
            Err(_) if extra <= ALWAYS_FITS => {
                self.bytes.fetch_add(extra, Ordering::AcqRel);
            }
            Err(full) => return Err(full),
        }
        let completed = match self.records.get_mut(key) {
            Some(mut record) => match &*record {
                Record::InFlight {
                    token: current,
                    fingerprint,
                    lease_until,
                    ..
                } if *current == token.get() && *lease_until > now => {
                    *record = Record::Completed {
                        token: token.get(),
                        fingerprint: *fingerprint,
                        payload,
                        expires: now.saturating_add(nanos(limits::clamp_ttl(ttl))),
                    };
                    Completion::Written
                }
                // This owner's earlier completion landed: done already, nothing changes.
                Record::Completed {
                    token: current,
                    expires,
                    ..
                } if *current == token.get() && *expires > now => Completion::Repeated,
                _ => Completion::Rejected,
            },
            None => Completion::Rejected,
        };
        if completed == Completion::Written {
            self.notify_changed();
            Ok(())
        } else if completed == Completion::Repeated {
            self.unreserve(0, extra);
            Ok(())
        } else {
            self.unreserve(0, extra);
            Err(StoreError::TokenRejected)
        }
    }

    /// Ends the lease at once; the record is kept as an abandoned claim (see `is_kept`).
    fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let now = self.now();
        let released = match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                ..
            }) if *current == token.get() && *lease_until > now => {
                *lease_until = now;
                true
            }
            _ => false,
        };
        if released {
            self.notify_changed();
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }

    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = self.now();
        match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                kept_until,
                ..
            }) if *current == token.get() && *lease_until > now => {
                *lease_until = now.saturating_add(nanos(limits::clamp_lease(lease)));
                *kept_until = (*kept_until).max(*lease_until);
                Ok(())
            }
            _ => Err(StoreError::TokenRejected),
        }
    }
}

/// What a completion found.
#[derive(PartialEq, Eq)]
enum Completion {
    Written,
    /// The same owner's completion had landed already.
    Repeated,
    Rejected,
}

struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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
        self.inner.claim(key, fingerprint, lease, ttl)
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
}
