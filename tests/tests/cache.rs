//! The cache tier's rules, each by a test that fails when the rule is broken: only finished
//! records of the asking request are cached; everything that decides ownership reaches the
//! store; nothing negative is remembered; an entry expires with its record; a mismatch is
//! answered from the cache as from the store; the Redis tier is a hint (garbage, a flush, a
//! dead Redis mean slower, never wrong). And the store contract holds with a tier in front:
//! the conformance suite over the in-process tier on Redis and PostgreSQL, and over Redis in
//! front of PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_cache::{CACHE_LOOKUPS, CacheTier, Cached};
use idempotent_core::conformance::{Harness, fresh_key};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::Recorded;
use idempotent_core::{
    Call, CallOptions, Claim, Error, FencingToken, Fingerprint, Idempotency, StorageKey, Store,
    StoreError, StoreWrapper,
};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use idempotent_test_kit::backend::{POSTGRES_URL, REDIS_URL, backend_url, redis_url};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::shared_pool;

// ---------------------------------------------------------------------------------------------
// A store that counts what reaches it
// ---------------------------------------------------------------------------------------------

/// `S`, counting each operation that reaches it; optionally damaging the payloads it answers
/// with, or reporting less time left than the record has.
#[derive(Clone, Default)]
struct Counting<S> {
    inner: S,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    claims: AtomicUsize,
    completes: AtomicUsize,
    releases: AtomicUsize,
    renews: AtomicUsize,
    /// Flip a bit of every completed payload answered.
    damage: AtomicBool,
    /// Report at most this many milliseconds left on a completed record (0: as the store does).
    left_ms: AtomicU64,
}

impl<S: Store> Counting<S> {
    fn new(inner: S) -> Self {
        Counting {
            inner,
            counts: Arc::default(),
        }
    }

    fn claims(&self) -> usize {
        self.counts.claims.load(Ordering::SeqCst)
    }
}

/// Sessions and checkpoints go straight to the store inside.
impl<S: Store> StoreWrapper for Counting<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store> Store for Counting<S> {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.counts.claims.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.claim(key, fingerprint, lease, ttl).await?;
        Ok(match answer {
            Claim::Completed {
                fingerprint,
                payload,
                expires_in,
            } => {
                let payload = if self.counts.damage.load(Ordering::SeqCst) {
                    let mut damaged = payload.to_vec();
                    *damaged.last_mut().unwrap() ^= 0x01;
                    Bytes::from(damaged)
                } else {
                    payload
                };
                let left = self.counts.left_ms.load(Ordering::SeqCst);
                let expires_in = if left > 0 {
                    expires_in.min(Duration::from_millis(left))
                } else {
                    expires_in
                };
                Claim::Completed {
                    fingerprint,
                    payload,
                    expires_in,
                }
            }
            other => other,
        })
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.counts.completes.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(key, token, payload, ttl).await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.counts.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, token).await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.counts.renews.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(key, token, lease).await
    }

    fn keeps_records_in_process(&self) -> bool {
        self.inner.keeps_records_in_process()
    }
}

fn fp(label: &str) -> Fingerprint {
    Fingerprint::from_bytes(label.as_bytes())
}

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

/// A memory store counted, with an in-process tier in front.
fn cached_memory() -> (
    Counting<MemoryStore>,
    Cached<Counting<MemoryStore>>,
    CacheTier,
) {
    let store = Counting::new(MemoryStore::new());
    let tier = CacheTier::memory(1_000);
    (store.clone(), Cached::new(store, tier.clone()), tier)
}

fn token_of(claim: Claim) -> FencingToken {
    match claim {
        Claim::Claimed(token) | Claim::TakenOver { token, .. } => token,
        other => panic!("expected to own the key, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The rules, on the in-process tier
// ---------------------------------------------------------------------------------------------

/// Only finished records enter the tier: a claim, an in-flight record, a renewal, a release
/// and a completion all reach the store, every time; the first replay after the completion
/// reaches it too (the tier is filled by the store's answer), the next ones do not.
#[tokio::test]
async fn only_finished_records_are_cached_and_ownership_always_reaches_the_store() {
    let (store, cached, tier) = cached_memory();
    let key = fresh_key();
    let owner = token_of(cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap());
    for n in 1..=3 {
        let answer = cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap();
        assert!(matches!(answer, Claim::InFlight { .. }), "{answer:?}");
        assert_eq!(
            store.claims(),
            1 + n,
            "an in-flight record is asked of the store"
        );
    }
    assert_eq!(tier.entries(), Some(0), "nothing in flight is cached");
    cached.renew(&key, owner, LEASE).await.unwrap();
    cached.release(&key, owner).await.unwrap();
    let next = token_of(cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap());
    assert_eq!(store.claims(), 5, "a released key is claimed at the store");
    assert!(
        cached
            .complete(&key, owner, Bytes::new(), TTL)
            .await
            .is_err(),
        "the store fences the old owner; the tier does not answer for it"
    );
    cached
        .complete(&key, next, envelope_of(b"done").await, TTL)
        .await
        .unwrap();
    let counts = &store.counts;
    assert_eq!(
        (
            counts.renews.load(Ordering::SeqCst),
            counts.releases.load(Ordering::SeqCst),
            counts.completes.load(Ordering::SeqCst),
        ),
        (1, 1, 2),
        "renew, release and complete reach the store"
    );
    assert_eq!(
        tier.entries(),
        Some(0),
        "a completion does not fill the tier"
    );
    let first = cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap();
    assert!(matches!(first, Claim::Completed { .. }), "{first:?}");
    assert_eq!(store.claims(), 6, "the first replay is the store's answer");
    for _ in 0..10 {
        let again = cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap();
        assert!(matches!(again, Claim::Completed { .. }), "{again:?}");
    }
    assert_eq!(store.claims(), 6, "later replays come from the tier");
    assert_eq!(tier.entries(), Some(1));
}

/// What the runtime records for `result` on an in-process store: its envelope, as `complete`
/// is given it, read back raw from a memory store of its own.
async fn envelope_of(result: &'static [u8]) -> Bytes {
    let store = MemoryStore::new();
    let runtime = Idempotency::new(store.clone());
    let call = Call::new("envelope".parse().unwrap());
    runtime
        .execute(
            &call,
            async { result },
            |_| idempotent_core::Retain::Keep,
            |r| Some(Bytes::from_static(r)),
        )
        .await
        .unwrap();
    let key = StorageKey::derive(b"", &idempotent_core::Scope::new(), call.key());
    match store
        .claim(&key, &Fingerprint::empty(), LEASE, TTL)
        .await
        .unwrap()
    {
        Claim::Completed { payload, .. } => payload,
        other => panic!("{other:?}"),
    }
}

/// A miss is never remembered: a key with no record, or one in flight, is asked of the store
/// on every claim, and a record completed after many misses is replayed at once.
#[tokio::test]
async fn a_miss_is_never_remembered() {
    let (store, cached, tier) = cached_memory();
    let idempotency = Idempotency::new(cached);
    let call = Call::new("never-negative".parse().unwrap());
    // Fails, so the key is released: no record to replay, many times.
    for n in 1..=5 {
        let failed: Result<Result<u32, String>, Error> = idempotency
            .run_with(&call, async { Err("declined".to_owned()) }, |r| {
                if r.is_ok() {
                    idempotent_core::Retain::Keep
                } else {
                    idempotent_core::Retain::Release
                }
            })
            .await
            .map(|done| done.into_inner());
        assert_eq!(failed.unwrap(), Err("declined".to_owned()));
        assert_eq!(store.claims(), n, "each attempt reaches the store");
    }
    assert_eq!(tier.entries(), Some(0));
    let done = idempotency.run(&call, async { 7u32 }).await.unwrap();
    assert_eq!((done.is_replayed(), done.into_inner()), (false, 7));
    let replay = idempotency.run(&call, async { 8u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 7));
}

/// A cached entry expires when its record does: the record's TTL, not a cache TTL; and when the
/// store reports less time left than the TTL, the store's word.
#[tokio::test]
async fn a_cached_entry_expires_with_its_record() {
    let (store, cached, _tier) = cached_memory();
    let idempotency = Idempotency::new(cached);
    let call = Call::new("expiring".parse().unwrap())
        .options(CallOptions::new().ttl(Duration::from_millis(400)));
    let runs = Arc::new(AtomicUsize::new(0));
    let run = |runs: &Arc<AtomicUsize>| {
        let runs = Arc::clone(runs);
        async move { runs.fetch_add(1, Ordering::SeqCst) + 1 }
    };
    assert_eq!(
        idempotency
            .run(&call, run(&runs))
            .await
            .unwrap()
            .into_inner(),
        1
    );
    let replay = idempotency.run(&call, run(&runs)).await.unwrap();
    assert!(replay.is_replayed());
    let claims = store.claims();
    assert!(
        idempotency
            .run(&call, run(&runs))
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(store.claims(), claims, "answered from the tier");
    tokio::time::sleep(Duration::from_millis(450)).await;
    let after = idempotency.run(&call, run(&runs)).await.unwrap();
    assert_eq!(
        (after.is_replayed(), after.into_inner()),
        (false, 2),
        "the record expired, and so did its copy: the work runs again"
    );

    // The store says 200 ms are left of a 60 s TTL: the copy is gone after 200 ms.
    store.counts.left_ms.store(200, Ordering::SeqCst);
    let call = Call::new("store-says".parse().unwrap()).options(CallOptions::new().ttl(TTL));
    idempotency.run(&call, async { 1u8 }).await.unwrap();
    assert!(
        idempotency
            .run(&call, async { 2u8 })
            .await
            .unwrap()
            .is_replayed()
    );
    let claims = store.claims();
    assert!(
        idempotency
            .run(&call, async { 2u8 })
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(store.claims(), claims, "answered from the tier");
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(
        idempotency
            .run(&call, async { 2u8 })
            .await
            .unwrap()
            .is_replayed()
    );
    assert_eq!(
        store.claims(),
        claims + 1,
        "past the time the store reported, the store is asked again"
    );
}

/// A request with another fingerprint meets the cached record's own fingerprint: a mismatch,
/// answered from the tier as the store would answer it.
#[tokio::test]
async fn a_mismatch_is_answered_from_the_cache_as_from_the_store() {
    let (store, cached, _tier) = cached_memory();
    let idempotency = Idempotency::new(cached);
    let paid = Call::new("order-1".parse().unwrap()).fingerprint(fp("pay 10 EUR"));
    idempotency.run(&paid, async { 10u32 }).await.unwrap();
    assert!(
        idempotency
            .run(&paid, async { 0u32 })
            .await
            .unwrap()
            .is_replayed()
    );
    let claims = store.claims();
    let other = Call::new("order-1".parse().unwrap()).fingerprint(fp("pay 99 EUR"));
    for _ in 0..3 {
        let refused = idempotency.run(&other, async { 99u32 }).await;
        assert!(
            matches!(refused, Err(Error::FingerprintMismatch)),
            "{refused:?}"
        );
    }
    assert_eq!(
        store.claims(),
        claims,
        "the mismatches were answered by the tier"
    );
    assert!(
        idempotency
            .run(&paid, async { 0u32 })
            .await
            .unwrap()
            .is_replayed()
    );
}

/// A record is cached only after the request's fingerprint matched it: a mismatching request
/// that meets it first leaves the tier empty.
#[tokio::test]
async fn a_record_enters_the_tier_only_for_its_own_request() {
    let (store, cached, tier) = cached_memory();
    let idempotency = Idempotency::new(cached);
    let paid = Call::new("order-2".parse().unwrap()).fingerprint(fp("pay 10 EUR"));
    idempotency.run(&paid, async { 10u32 }).await.unwrap();
    let other = Call::new("order-2".parse().unwrap()).fingerprint(fp("pay 99 EUR"));
    for n in 1..=3 {
        let refused = idempotency.run(&other, async { 99u32 }).await;
        assert!(matches!(refused, Err(Error::FingerprintMismatch)));
        assert_eq!(
            store.claims(),
            1 + n,
            "not cached: every mismatch asks the store"
        );
    }
    assert_eq!(tier.entries(), Some(0));
}

/// A record that does not read back whole is never cached: every request meets the store's
/// refusal, and the store is asked each time.
#[tokio::test]
async fn a_corrupt_record_is_never_cached() {
    let store = Counting::new(Counting::new(MemoryStore::new()));
    // The inner counter damages nothing; the outer one damages the answer, as a store outside
    // the process could (checked by checksum: not an in-process store).
    let outer = Counting {
        inner: NotInProcess(store.inner.clone()),
        counts: Arc::clone(&store.counts),
    };
    outer.counts.damage.store(true, Ordering::SeqCst);
    let tier = CacheTier::memory(100);
    let idempotency = Idempotency::new(Cached::new(outer.clone(), tier.clone()));
    let call = Call::new("damaged".parse().unwrap());
    idempotency.run(&call, async { 1u32 }).await.unwrap();
    for n in 1..=3 {
        let refused = idempotency.run(&call, async { 2u32 }).await;
        assert!(
            matches!(refused, Err(Error::CorruptRecord(_))),
            "{refused:?}"
        );
        assert_eq!(outer.claims(), 1 + n);
    }
    assert_eq!(tier.entries(), Some(0));
}

/// A store that says its records leave the process, so the runtime checksums them.
#[derive(Clone)]
struct NotInProcess<S>(S);

impl<S: Store> StoreWrapper for NotInProcess<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        &self.0
    }
}

impl<S: Store> Store for NotInProcess<S> {
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.0.claim(key, fingerprint, lease, ttl)
    }
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.complete(key, token, payload, ttl)
    }
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.release(key, token)
    }
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.renew(key, token, lease)
    }
}

/// Hundreds of concurrent duplicates of one call through a cached store: the work runs once,
/// every caller gets its answer, and the tier then answers them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_run_once_and_then_replay_from_the_tier() {
    let (store, cached, _tier) = cached_memory();
    let idempotency = Idempotency::builder(cached)
        .defaults(idempotent_core::Defaults::new().in_flight(
            idempotent_core::InFlightPolicy::Wait {
                max: Duration::from_secs(10),
            },
        ))
        .build();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tasks.push(tokio::spawn(async move {
            let call = Call::new("hot".parse().unwrap());
            idempotency
                .run(&call, async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    runs.fetch_add(1, Ordering::SeqCst) + 1
                })
                .await
                .unwrap()
                .into_inner()
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let claims = store.claims();
    for _ in 0..100 {
        let call = Call::new("hot".parse().unwrap());
        assert!(
            idempotency
                .run(&call, async { 2 })
                .await
                .unwrap()
                .is_replayed()
        );
    }
    assert_eq!(store.claims(), claims, "every later replay from the tier");
}

/// The tier is bounded by entries: the least recently used go first.
#[tokio::test]
async fn the_in_process_tier_is_bounded() {
    let tier = CacheTier::memory(50);
    let idempotency = Idempotency::new(Cached::new(MemoryStore::new(), tier.clone()));
    for n in 0..500 {
        let call = Call::new(format!("bounded-{n}").parse().unwrap());
        idempotency.run(&call, async { n }).await.unwrap();
        assert!(
            idempotency
                .run(&call, async { 0 })
                .await
                .unwrap()
                .is_replayed()
        );
    }
    let entries = tier.entries().unwrap();
    assert!(entries <= 50, "{entries} entries in a tier of 50");
    let bytes = CacheTier::memory_bounded(1_000, 10_000);
    let idempotency = Idempotency::new(Cached::new(MemoryStore::new(), bytes.clone()));
    for n in 0..200 {
        let call = Call::new(format!("heavy-{n}").parse().unwrap());
        idempotency
            .run(&call, async { "x".repeat(1_000) })
            .await
            .unwrap();
        idempotency
            .run(&call, async { String::new() })
            .await
            .unwrap();
    }
    let entries = bytes.entries().unwrap();
    assert!(
        entries <= 10,
        "{entries} entries of over 1,000 bytes in a tier of 10,000 bytes"
    );
}

/// Lookups are counted by outcome, so a hit rate can be read.
#[tokio::test]
async fn lookups_are_counted() {
    let (tier, recorded) = Recorded::capture(|| CacheTier::memory(10));
    let idempotency = Idempotency::new(Cached::new(MemoryStore::new(), tier));
    let call = Call::new("counted".parse().unwrap());
    idempotency.run(&call, async { 1 }).await.unwrap();
    for _ in 0..4 {
        idempotency.run(&call, async { 1 }).await.unwrap();
    }
    let count =
        |outcome| recorded.counter(CACHE_LOOKUPS, &[("tier", "memory"), ("outcome", outcome)]);
    assert_eq!((count("hit"), count("miss"), count("error")), (3, 2, 0));
}

// ---------------------------------------------------------------------------------------------
// The Redis tier: a hint in front of PostgreSQL
// ---------------------------------------------------------------------------------------------

async fn postgres_store() -> Option<PostgresStore> {
    let pool = shared_pool(8).await?;
    let store = PostgresStore::builder(pool)
        .table(format!("records_{}", unique("cache")))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

async fn redis_tier(prefix: &str) -> Option<CacheTier> {
    let url = backend_url(REDIS_URL)?;
    Some(
        idempotent_redis::RedisCacheBuilder::new(url)
            .key_prefix(prefix)
            .connect()
            .await
            .expect("a Redis tier"),
    )
}

async fn redis_connection() -> redis::aio::MultiplexedConnection {
    let url = redis_url().expect("Redis");
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Waits until the background write of a tier entry under `prefix` landed.
async fn entry_written(prefix: &str) -> String {
    let mut redis = redis_connection().await;
    for _ in 0..200 {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut redis)
            .await
            .unwrap();
        if let [key] = keys.as_slice() {
            return key.clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no entry under {prefix}");
}

/// Two instances, each with its own handle on one Redis tier in front of one PostgreSQL
/// table: what one replayed the other replays without asking PostgreSQL; a flush or garbage
/// in Redis sends requests back to PostgreSQL with the right answer; the entry expires with its
/// record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_in_front_of_postgres_is_a_hint() {
    let Some(postgres) = postgres_store().await else {
        return;
    };
    let prefix = format!("{}:", unique("tier"));
    let (Some(tier_a), Some(tier_b)) = (redis_tier(&prefix).await, redis_tier(&prefix).await)
    else {
        return;
    };
    let store_a = Counting::new(postgres.clone());
    let store_b = Counting::new(postgres.clone());
    let a = Idempotency::new(Cached::new(store_a.clone(), tier_a));
    let b = Idempotency::new(Cached::new(store_b.clone(), tier_b));
    let call = Call::new("shared".parse().unwrap())
        .options(CallOptions::new().ttl(Duration::from_secs(3)));
    assert!(!a.run(&call, async { 11u32 }).await.unwrap().is_replayed());
    // A's replay is PostgreSQL's answer, and is written to Redis after it.
    assert_eq!(a.run(&call, async { 0u32 }).await.unwrap().into_inner(), 11);
    let redis_key = entry_written(&prefix).await;
    let mut redis = redis_connection().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&redis_key)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 3_000,
        "the entry expires with its record (3 s), not later: {ttl} ms"
    );
    let before = store_b.claims();
    let replay = b.run(&call, async { 0u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 11));
    assert_eq!(store_b.claims(), before, "B replayed from Redis");

    // Garbage in the entry: ignored, PostgreSQL answers.
    let _: () = redis::cmd("SET")
        .arg(&redis_key)
        .arg("IC\u{1}not an entry at all, forty-three bytes or more")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut redis)
        .await
        .unwrap();
    let replay = b.run(&call, async { 0u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 11));
    assert_eq!(store_b.claims(), before + 1, "garbage sent B to PostgreSQL");
    // PostgreSQL's answer is written over the garbage, in the background.
    let mut repaired = false;
    for _ in 0..200 {
        let value: Vec<u8> = redis::cmd("GET")
            .arg(&redis_key)
            .query_async(&mut redis)
            .await
            .unwrap();
        if !value.starts_with(b"IC\x01not an entry") {
            repaired = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(repaired, "the store's answer replaced the garbage");

    // A write Redis ran late (after a stall), with a long `PX`: its deadline has passed, so it
    // is no entry, whatever Redis still holds.
    let whole: Vec<u8> = redis::cmd("GET")
        .arg(&redis_key)
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut late = whole.clone();
    let past = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        - 1_000;
    late[11..19].copy_from_slice(&past.to_be_bytes());
    let mut hasher = blake3::Hasher::new();
    hasher.update(&late[11..19]);
    hasher.update(&late[19..]);
    late[3..11].copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    let _: () = redis::cmd("SET")
        .arg(&redis_key)
        .arg(late)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut redis)
        .await
        .unwrap();
    let claims = store_b.claims();
    let replay = b.run(&call, async { 0u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 11));
    assert_eq!(
        store_b.claims(),
        claims + 1,
        "a late entry sent B to PostgreSQL"
    );
    // Its answer is written over the late entry; wait for it, then flush.
    for _ in 0..200 {
        let value: Vec<u8> = redis::cmd("GET")
            .arg(&redis_key)
            .query_async(&mut redis)
            .await
            .unwrap();
        if value[11..19] != past.to_be_bytes() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Flushed: slower, never wrong.
    let _: () = redis::cmd("DEL")
        .arg(&redis_key)
        .query_async(&mut redis)
        .await
        .unwrap();
    let replay = b.run(&call, async { 0u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 11));
    assert_eq!(store_b.claims(), before + 3);

    // The record expires; so does its entry, and the work runs again.
    tokio::time::sleep(Duration::from_millis(3_100)).await;
    let again = b.run(&call, async { 12u32 }).await.unwrap();
    assert_eq!((again.is_replayed(), again.into_inner()), (false, 12));
    assert_eq!(a.run(&call, async { 0u32 }).await.unwrap().into_inner(), 12);
}

/// A claim never trusts the tier: an in-flight record in PostgreSQL is found there whatever
/// Redis holds (nothing), and the duplicate is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_never_trusts_the_redis_tier() {
    let Some(postgres) = postgres_store().await else {
        return;
    };
    let Some(tier) = redis_tier(&format!("{}:", unique("tier"))).await else {
        return;
    };
    let cached = Cached::new(postgres, tier);
    let key = fresh_key();
    let owner = token_of(cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap());
    let duplicate = cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap();
    assert!(matches!(duplicate, Claim::InFlight { .. }), "{duplicate:?}");
    cached.release(&key, owner).await.unwrap();
    let next = cached.claim(&key, &fp("a"), LEASE, TTL).await.unwrap();
    assert!(matches!(next, Claim::TakenOver { .. }), "{next:?}");
}

/// A Redis tier that cannot be reached (nothing listens) costs a failed lookup, then rests:
/// every call is answered by the store, correctly, and the failures are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_tier_means_slower_never_wrong() {
    let port = idempotent_test_kit::names::free_port();
    // On this thread, where the recorder is installed: the tier registers its metrics there.
    let (tier, recorded) = Recorded::capture(|| {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(
                idempotent_redis::RedisCacheBuilder::new(format!("redis://127.0.0.1:{port}"))
                    .rest(Duration::from_millis(200))
                    .connect(),
            )
        })
    });
    let tier = tier.expect("connecting does not wait for Redis");
    let store = Counting::new(MemoryStore::new());
    let idempotency = Idempotency::new(Cached::new(store.clone(), tier));
    let call = Call::new("no-redis".parse().unwrap());
    assert!(
        !idempotency
            .run(&call, async { 1 })
            .await
            .unwrap()
            .is_replayed()
    );
    for _ in 0..20 {
        let replay = idempotency.run(&call, async { 2 }).await.unwrap();
        assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 1));
    }
    assert_eq!(store.claims(), 21, "the store answered every call");
    let errors = recorded.counter(CACHE_LOOKUPS, &[("tier", "redis"), ("outcome", "error")]);
    assert_eq!(errors, 21, "every lookup failed or was skipped");
}

// ---------------------------------------------------------------------------------------------
// The store contract, with a tier in front
// ---------------------------------------------------------------------------------------------

/// A store with a tier in front, as one conformance harness runs it: on real servers, in real
/// time.
trait Tiered: Send + Sync + 'static {
    type Behind: Store + Clone;
    /// The variable whose server the store needs.
    const SERVER: &'static str;
    fn setup() -> impl Future<Output = Cached<Self::Behind>> + Send;
}

struct Cache<T: Tiered> {
    store: Cached<T::Behind>,
}

impl<T: Tiered> Harness for Cache<T> {
    type Store = Cached<T::Behind>;

    async fn setup() -> Self {
        Cache {
            store: T::setup().await,
        }
    }

    fn store(&self) -> &Self::Store {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    fn time_unit(&self) -> Duration {
        Duration::from_millis(250)
    }

    fn backend_env() -> Option<&'static str> {
        Some(T::SERVER)
    }
}

/// The in-process tier on Redis.
struct MemoryOnRedis;

impl Tiered for MemoryOnRedis {
    type Behind = RedisStore;
    const SERVER: &'static str = REDIS_URL;

    async fn setup() -> Cached<RedisStore> {
        let url = backend_url(REDIS_URL).unwrap_or_else(|| "redis://127.0.0.1:1".into());
        let store = RedisStore::connect(&url).await.expect("Redis");
        Cached::new(store, CacheTier::memory(10_000))
    }
}

/// The in-process tier on PostgreSQL.
struct MemoryOnPostgres;

impl Tiered for MemoryOnPostgres {
    type Behind = PostgresStore;
    const SERVER: &'static str = POSTGRES_URL;

    async fn setup() -> Cached<PostgresStore> {
        let store = postgres_store().await.expect("PostgreSQL");
        Cached::new(store, CacheTier::memory(10_000))
    }
}

/// Redis in front of PostgreSQL.
struct RedisOnPostgres;

impl Tiered for RedisOnPostgres {
    type Behind = PostgresStore;
    const SERVER: &'static str = POSTGRES_URL;

    async fn setup() -> Cached<PostgresStore> {
        let store = postgres_store().await.expect("PostgreSQL");
        let tier = redis_tier(&format!("{}:", unique("tier")))
            .await
            .expect("Redis");
        Cached::new(store, tier)
    }
}

mod memory_on_redis {
    idempotent_core::store_conformance_tests!(super::Cache<super::MemoryOnRedis>);
}

mod memory_on_postgres {
    idempotent_core::store_conformance_tests!(super::Cache<super::MemoryOnPostgres>);
}

mod redis_on_postgres {
    idempotent_core::store_conformance_tests!(super::Cache<super::RedisOnPostgres>);
}

/// The transactional mode of a runtime over a cached PostgreSQL store answers a duplicate from
/// the tier once the tier holds the record, with no statement to PostgreSQL; it never fills the
/// tier from a row seen inside a transaction (it could be the transaction's own, uncommitted):
/// here the runtime's standalone replay (committed data) fills it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_mode_replays_from_the_tier() {
    use idempotent_core::metrics::STORE_OPERATION_DURATION;
    use idempotent_postgres::TransactionalClaim;
    let Some(postgres) = postgres_store().await else {
        return;
    };
    let pool = postgres.pool().clone();
    let tier = CacheTier::memory(10);
    let ((runtime, transactional), recorded) = Recorded::capture(|| {
        let transactional = idempotent_postgres::Transactional::new(&postgres).tier(tier.clone());
        let runtime = Idempotency::new(Cached::new(postgres, tier.clone()));
        (runtime, transactional)
    });
    let claims = || {
        recorded
            .histogram(STORE_OPERATION_DURATION, &[("operation", "claim")])
            .0
    };
    let call = Call::new("deposit-1".parse().unwrap()).fingerprint(fp("100 to alice"));
    let mut tx = pool.begin().await.unwrap();
    match transactional.claim::<u32>(&call, &mut tx).await.unwrap() {
        TransactionalClaim::Run(pending) => pending.complete(&mut tx, &100u32).await.unwrap(),
        TransactionalClaim::Replay(_) => panic!("a new key replayed"),
    }
    // Seen inside the transaction that wrote it, before the commit: not cached.
    match transactional.claim::<u32>(&call, &mut tx).await.unwrap() {
        TransactionalClaim::Replay(value) => assert_eq!(value, 100),
        TransactionalClaim::Run(_) => panic!("its own completed row ran again"),
    }
    assert_eq!(
        tier.entries(),
        Some(0),
        "nothing uncommitted enters the tier"
    );
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    match transactional.claim::<u32>(&call, &mut tx).await.unwrap() {
        TransactionalClaim::Run(pending) => pending.complete(&mut tx, &100u32).await.unwrap(),
        TransactionalClaim::Replay(_) => panic!("a rolled-back record replayed"),
    }
    tx.commit().await.unwrap();
    let replay = runtime.run(&call, async { 0u32 }).await.unwrap();
    assert_eq!((replay.is_replayed(), replay.into_inner()), (true, 100));
    assert_eq!(
        tier.entries(),
        Some(1),
        "the standalone replay filled the tier"
    );
    for n in 1..=3 {
        let before = claims();
        let mut tx = pool.begin().await.unwrap();
        match transactional.claim::<u32>(&call, &mut tx).await.unwrap() {
            TransactionalClaim::Replay(value) => assert_eq!(value, 100, "replay {n}"),
            TransactionalClaim::Run(_) => panic!("replay {n} ran"),
        }
        assert_eq!(claims(), before, "replay {n} came from the tier");
    }
    let other = Call::new("deposit-1".parse().unwrap()).fingerprint(fp("999 to mallory"));
    let before = claims();
    let mut tx = pool.begin().await.unwrap();
    let refused = transactional.claim::<u32>(&other, &mut tx).await;
    assert!(
        matches!(refused, Err(Error::FingerprintMismatch)),
        "{refused:?}"
    );
    assert_eq!(claims(), before, "the mismatch was answered by the tier");
}
