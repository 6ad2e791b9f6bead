//! The cache tier of the `idempotent` family: finished records kept in front of the
//! authoritative store, so a replay is answered without a round trip to it.
//!
//! ```
//! use idempotent_cache::{CacheTier, Cached};
//! use idempotent_core::Idempotency;
//! use idempotent_core::memory::MemoryStore;
//!
//! # async fn example() {
//! // Any store (a PostgresStore, say); 100,000 finished records in this process, at most
//! // 64 MiB of them (the default).
//! let idempotency = Idempotency::new(Cached::new(MemoryStore::new(), CacheTier::memory(100_000)));
//! # let _ = idempotency;
//! # }
//! ```
//!
//! Two kinds of tier: [`CacheTier::memory`] keeps records in this process (each instance its
//! own), and a [shared](CacheTier::shared) tier keeps them where every instance reads them: the
//! Redis tier of `idempotent-redis` (`RedisCacheBuilder::new(url).connect()`, its feature
//! `cache`), in front of a slower store (PostgreSQL), or a [`SharedTier`] of yours.
//! [`Cached`] puts either in front of any [`Store`];
//! `idempotent_any::AnyStoreBuilder::cache` (and `IDEMPOTENCY_CACHE`) does it for
//! a store chosen by URL.
//!
//! Where to read on: [`Cached`] for the rules a tier keeps so that it can never serve a wrong
//! answer (only finished records, checked, never negative, never past their record) and its
//! metrics; [`CacheTier`] for the two kinds of tier; [`SharedTier`] to put a tier of yours
//! outside the process.

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

// Tokio's clock, as the memory store's: paused in a test, it holds both still.
use tokio::time::Instant;

use bytes::Bytes;
use metrics::{Counter, Unit};

use idempotent_core::store::envelope::{self, Integrity};
use idempotent_core::{
    Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError, StoreWrapper,
};

mod memory;

pub use idempotent_core::store::BoxFuture;

/// `idempotency.cache.lookups` (counter; labels `tier`, `outcome`).
pub const CACHE_LOOKUPS: &str = "idempotency.cache.lookups";
/// `idempotency.cache.writes` (counter; labels `tier`, `result`).
pub const CACHE_WRITES: &str = "idempotency.cache.writes";

/// The default bound on the bytes an in-process tier holds: 64 MiB.
pub const DEFAULT_MEMORY_BYTES: u64 = 64 * 1024 * 1024;

/// A finished record as a tier holds it. Made only by this crate, from the authoritative
/// store's answer (a completed record of the request that asked, whose envelope reads back
/// whole): the type is the first rule. A [`SharedTier`] is handed them to keep.
#[derive(Clone)]
pub struct Finished {
    fingerprint: Fingerprint,
    payload: Bytes,
    /// When the record expires, by this process's clock, or earlier.
    expires_at: Instant,
}

impl fmt::Debug for Finished {
    /// The payload's length only: it is a result, which logs should not hold.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Finished")
            .field("fingerprint", &self.fingerprint)
            .field("payload_len", &self.payload.len())
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

impl Finished {
    /// The record `answer` reports, if it may be cached: a completed record, of the request that
    /// asked (`asked_with`), whose envelope reads back whole, with time left. `asked_at` is when
    /// the question was sent: the store's "time left" counts from a moment after it, so the copy
    /// expires no later than the record.
    fn from_answer(
        answer: &Claim,
        asked_with: &Fingerprint,
        asked_at: Instant,
        integrity: Integrity,
    ) -> Option<Finished> {
        let Claim::Completed {
            fingerprint,
            payload,
            expires_in,
        } = answer
        else {
            return None;
        };
        if fingerprint != asked_with
            || expires_in.is_zero()
            || envelope::decode(payload, integrity).is_err()
        {
            return None;
        }
        Some(Finished {
            fingerprint: *fingerprint,
            payload: payload.clone(),
            expires_at: asked_at.checked_add(*expires_in)?,
        })
    }

    /// The store's answer this entry stands for, at `now`; `None` once it has expired.
    fn answer(&self, now: Instant) -> Option<Claim> {
        let expires_in = self.expires_at.checked_duration_since(now)?;
        (!expires_in.is_zero()).then(|| Claim::Completed {
            fingerprint: self.fingerprint,
            payload: self.payload.clone(),
            expires_in,
        })
    }

    /// The fingerprint of the request that made the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The record's payload: its envelope, as the store keeps it.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// When the record expires, by this process's clock, or earlier: a shared tier's entry must
    /// expire no later.
    pub fn expires_at(&self) -> Instant {
        self.expires_at
    }

    /// What the entry weighs in a tier: its payload and what comes with it.
    fn weight(&self) -> u64 {
        self.payload.len() as u64 + 96
    }
}

/// A tier outside this process that every instance shares: the Redis tier of
/// `idempotent-redis` (`RedisCacheBuilder`), or one of yours. Made into a
/// [`CacheTier`] with [`CacheTier::shared`], which keeps the rules of the [crate] around
/// it: only finished records of the asking request are put in, lookups are counted, and a
/// failed lookup is a miss.
///
/// A shared tier is only a hint: whatever [`get`](SharedTier::get) returns is checked again by
/// the runtime (fingerprint, envelope) before it is replayed, so an entry that is wrong costs a
/// refusal, never a wrong answer; it must still never return an entry past its
/// [`expires_at`](Finished::expires_at).
pub trait SharedTier: Send + Sync + 'static {
    /// The `tier` label of its metrics (`redis`, say).
    fn name(&self) -> &'static str;

    /// The finished record of `key`, as a [`Claim::Completed`], if the tier has a live one;
    /// `Err(TierUnavailable)` when the tier failed or rests after a failure (counted as
    /// `error`, and the request goes to the store).
    fn get<'a>(
        &'a self,
        key: &'a StorageKey,
    ) -> BoxFuture<'a, Result<Option<Claim>, TierUnavailable>>;

    /// Keeps `finished` as `key`'s record, in the background if it likes (a hint need not
    /// delay the answer), reporting how the write went to `writes`.
    fn insert(&self, key: StorageKey, finished: Finished, writes: TierWrites);
}

/// A [`SharedTier`] could not be asked: it is down, slow, or resting after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierUnavailable;

/// Where a [`SharedTier`] reports its writes: the `idempotency.cache.writes` counter of its tier.
/// Cheap to clone.
#[derive(Clone)]
pub struct TierWrites {
    metrics: Arc<TierMetrics>,
}

impl fmt::Debug for TierWrites {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierWrites").finish_non_exhaustive()
    }
}

impl TierWrites {
    /// The entry was written (`result="ok"`).
    pub fn written(&self) {
        self.metrics.written.increment(1);
    }

    /// The write failed (`result="error"`).
    pub fn failed(&self) {
        self.metrics.write_error.increment(1);
    }

    /// The write was not tried: too many were pending (`result="dropped"`).
    pub fn dropped(&self) {
        self.metrics.dropped.increment(1);
    }
}

/// Where a [`Cached`] store keeps finished records: in this process ([`CacheTier::memory`]) or
/// in a tier every instance shares ([`CacheTier::shared`], the Redis tier of
/// `idempotent-redis`). Cheap to clone: clones share the same entries.
#[derive(Clone)]
pub struct CacheTier {
    kind: Arc<Kind>,
    metrics: Arc<TierMetrics>,
}

enum Kind {
    Memory(memory::MemoryTier),
    Shared(Box<dyn SharedTier>),
}

impl fmt::Debug for CacheTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheTier")
            .field("tier", &self.name())
            .finish_non_exhaustive()
    }
}

impl CacheTier {
    /// An in-process tier of at most `entries` finished records and
    /// [`DEFAULT_MEMORY_BYTES`] of them (`moka`, whose policy admits and evicts by how often
    /// and how recently each key was asked for). Each instance has its own: nothing is shared,
    /// nothing goes over the network.
    ///
    /// `entries` of 0 is taken as 1.
    pub fn memory(entries: u64) -> CacheTier {
        CacheTier::memory_bounded(entries, DEFAULT_MEMORY_BYTES)
    }

    /// An in-process tier of at most `entries` finished records and `max_bytes` bytes of them
    /// (payloads and about 100 bytes each of what comes with them). A record larger than an
    /// even share (`max_bytes / entries`) counts as its own size; a smaller one counts as
    /// the share, so neither bound can be passed.
    pub fn memory_bounded(entries: u64, max_bytes: u64) -> CacheTier {
        CacheTier::new(Kind::Memory(memory::MemoryTier::new(entries, max_bytes)))
    }

    /// A tier every instance shares, such as the Redis tier of `idempotent-redis`.
    pub fn shared(tier: impl SharedTier) -> CacheTier {
        CacheTier::new(Kind::Shared(Box::new(tier)))
    }

    fn new(kind: Kind) -> CacheTier {
        let metrics = Arc::new(TierMetrics::register(kind_name(&kind)));
        CacheTier {
            kind: Arc::new(kind),
            metrics,
        }
    }

    /// `memory`, or the shared tier's name (`redis`): the `tier` label of its metrics.
    pub fn name(&self) -> &'static str {
        kind_name(&self.kind)
    }

    /// How many entries the in-process tier holds now (approximately: evictions are applied
    /// in batches); `None` for a shared tier.
    pub fn entries(&self) -> Option<u64> {
        match &*self.kind {
            Kind::Memory(tier) => Some(tier.entries()),
            Kind::Shared(_) => None,
        }
    }

    /// The claim of a cached store: the tier's finished record if it has one, else the store's
    /// answer, kept in the tier when it is a finished record of this request. What
    /// [`Cached`]'s claim is, for a store that keeps its own tier in front of whichever
    /// backend it holds (an `AnyStore`).
    pub async fn claim_through<S: Store + ?Sized>(
        &self,
        store: &S,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_maybe_labelled(store, key, fingerprint, (lease, ttl), None)
            .await
    }

    /// [`claim_through`](Self::claim_through), with the key's label for the store to keep
    /// ([`Store::claim_labelled`]).
    pub async fn claim_labelled_through<S: Store + ?Sized>(
        &self,
        store: &S,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        self.claim_maybe_labelled(store, key, fingerprint, terms, Some(label))
            .await
    }

    async fn claim_maybe_labelled<S: Store + ?Sized>(
        &self,
        store: &S,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        label: Option<&idempotent_core::inspect::KeyLabel>,
    ) -> Result<Claim, StoreError> {
        if let Some(hit) = self.lookup(key).await {
            return Ok(hit);
        }
        let asked_at = Instant::now();
        let answer = match label {
            Some(label) => {
                store
                    .claim_labelled(key, fingerprint, (lease, ttl), label)
                    .await?
            }
            None => store.claim(key, fingerprint, lease, ttl).await?,
        };
        let integrity = if store.keeps_records_in_process() {
            Integrity::InProcess
        } else {
            Integrity::Checksummed
        };
        if let Some(finished) = Finished::from_answer(&answer, fingerprint, asked_at, integrity) {
            self.put(*key, finished);
        }
        Ok(answer)
    }

    /// The finished record of `key` as the store would answer it now, if the tier has it.
    /// Counted in `idempotency.cache.lookups`; a tier that failed is a miss (`error`).
    pub async fn lookup(&self, key: &StorageKey) -> Option<Claim> {
        let found = match &*self.kind {
            Kind::Memory(tier) => Ok(tier.get(key).and_then(|entry| entry.answer(Instant::now()))),
            // A shared tier is not trusted with ownership: only a finished record is an
            // answer; anything else it returns is counted as its failure and goes to the store.
            Kind::Shared(tier) => match tier.get(key).await {
                Ok(Some(finished @ Claim::Completed { .. })) => Ok(Some(finished)),
                Ok(Some(other)) => {
                    tracing::warn!(
                        storage_key = %key,
                        tier = tier.name(),
                        answer = ?std::mem::discriminant(&other),
                        "a shared cache tier answered something other than a finished record; ignored"
                    );
                    Err(TierUnavailable)
                }
                Ok(None) => Ok(None),
                Err(TierUnavailable) => Err(TierUnavailable),
            },
        };
        let answer = match found {
            Ok(answer) => answer,
            Err(TierUnavailable) => {
                self.metrics.lookup_error.increment(1);
                return None;
            }
        };
        match &answer {
            Some(_) => self.metrics.hit.increment(1),
            None => self.metrics.miss.increment(1),
        }
        answer
    }

    /// Keeps `finished` as `key`'s record. A shared tier may write in the background: a hint
    /// need not delay the answer.
    fn put(&self, key: StorageKey, finished: Finished) {
        match &*self.kind {
            Kind::Memory(tier) => {
                tier.insert(key, finished);
                self.metrics.written.increment(1);
            }
            Kind::Shared(tier) => tier.insert(
                key,
                finished,
                TierWrites {
                    metrics: Arc::clone(&self.metrics),
                },
            ),
        }
    }

    /// Keeps the record a transactional completion committed: `payload` (its envelope) for
    /// a request with `fingerprint`, completed with `ttl` no earlier than `completed_from`.
    /// The caller calls this only after the commit (a transactional mode, such as
    /// `idempotent-postgres`'s): a record seen inside an uncommitted transaction may yet be
    /// rolled back.
    pub fn put_committed(
        &self,
        key: StorageKey,
        fingerprint: Fingerprint,
        payload: Bytes,
        ttl: Duration,
        completed_from: std::time::Instant,
    ) {
        let answer = Claim::Completed {
            fingerprint,
            payload,
            expires_in: idempotent_core::limits::clamp_ttl(ttl),
        };
        if let Some(finished) = Finished::from_answer(
            &answer,
            &fingerprint,
            Instant::from_std(completed_from),
            Integrity::Checksummed,
        ) {
            self.put(key, finished);
        }
    }
}

fn kind_name(kind: &Kind) -> &'static str {
    match kind {
        Kind::Memory(_) => "memory",
        Kind::Shared(tier) => tier.name(),
    }
}

/// The handles of one tier's metrics, registered with the recorder installed when it was
/// created.
struct TierMetrics {
    hit: Counter,
    miss: Counter,
    lookup_error: Counter,
    written: Counter,
    write_error: Counter,
    dropped: Counter,
}

impl TierMetrics {
    fn register(tier: &'static str) -> TierMetrics {
        metrics::describe_counter!(
            CACHE_LOOKUPS,
            Unit::Count,
            "Claims a cache tier was asked about first, by tier and outcome."
        );
        metrics::describe_counter!(
            CACHE_WRITES,
            Unit::Count,
            "Finished records put in a cache tier, by tier and result."
        );
        let lookup = |outcome: &'static str| metrics::counter!(CACHE_LOOKUPS, "tier" => tier, "outcome" => outcome);
        let write = |result: &'static str| metrics::counter!(CACHE_WRITES, "tier" => tier, "result" => result);
        TierMetrics {
            hit: lookup("hit"),
            miss: lookup("miss"),
            lookup_error: lookup("error"),
            written: write("ok"),
            write_error: write("error"),
            dropped: write("dropped"),
        }
    }
}

/// A store with a [`CacheTier`] in front: claims of finished records are answered from the
/// tier when it has them; everything else goes to `store`.
///
/// Its [`name`](Store::name) and [`keeps_records_in_process`](Store::keeps_records_in_process)
/// are the store's: metrics and checks are those of the store behind it.
///
#[doc = include_str!("../docs/rules.md")]
#[derive(Clone)]
pub struct Cached<S> {
    store: S,
    tier: CacheTier,
}

impl<S: fmt::Debug> fmt::Debug for Cached<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cached")
            .field("store", &self.store)
            .field("tier", &self.tier)
            .finish()
    }
}

impl<S: Store> Cached<S> {
    /// `store` with `tier` in front.
    pub fn new(store: S, tier: CacheTier) -> Self {
        Cached { store, tier }
    }

    /// The authoritative store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The tier in front of it.
    pub fn tier(&self) -> &CacheTier {
        &self.tier
    }
}

/// Sessions and checkpoints are the store's own: a tier caches finished records only.
impl<S: Store> StoreWrapper for Cached<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        &self.store
    }
}

impl<S: Store> Store for Cached<S> {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.tier
            .claim_through(&self.store, key, fingerprint, lease, ttl)
            .await
    }

    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        self.tier
            .claim_labelled_through(&self.store, key, fingerprint, terms, label)
            .await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.store.complete(key, token, payload, ttl).await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.store.release(key, token).await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.store.renew(key, token, lease).await
    }

    fn name(&self) -> &'static str {
        self.store.name()
    }

    fn keeps_records_in_process(&self) -> bool {
        self.store.keeps_records_in_process()
    }

    fn location(&self) -> Option<String> {
        self.store.location()
    }

    async fn wait_for_change(&self, key: &StorageKey, max_wait: Duration) {
        self.store.wait_for_change(key, max_wait).await;
    }
}

/// Forwarded to the store behind the tier. A repair changes the store, not the tier: a copy of
/// a completed record the tier holds (in this process, or a shared one) is replayed until it
/// expires, so a record forgotten or given up behind a tier is seen by the tier's users only
/// once their copy is gone (at most the record's TTL; restarting a process empties its memory
/// tier).
impl<S: idempotent_core::inspect::InspectStore> idempotent_core::inspect::InspectStore
    for Cached<S>
{
    async fn inspect(
        &self,
        key: &StorageKey,
    ) -> Result<Option<idempotent_core::inspect::RecordInfo>, StoreError> {
        self.store.inspect(key).await
    }

    async fn list(
        &self,
        query: &idempotent_core::inspect::ListQuery,
    ) -> Result<idempotent_core::inspect::Page, StoreError> {
        self.store.list(query).await
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &idempotent_core::inspect::Repair,
        force: bool,
    ) -> Result<idempotent_core::inspect::Repaired, StoreError> {
        self.store.repair(key, token, repair, force).await
    }

    async fn session_state(
        &self,
        session: &idempotent_core::SessionKey,
    ) -> Result<Option<idempotent_core::session::SessionState>, StoreError> {
        self.store.session_state(session).await
    }
}
