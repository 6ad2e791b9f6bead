//! Every public duration setting of the runtime, its stores and the cache tier, set to
//! `Duration::MAX` (issue 39: "no `Duration::MAX` setting of any builder panics"), then the code
//! path that uses it exercised (a claim, a replay, a wait, a shutdown, a listing of abandoned
//! operations, a reap) against the real server where the setting is store-specific. Each either
//! works as "no limit" (saturated to what the clock, the store or Redis can take) or is refused
//! where it is written with the message of a `limits::DurationError`.
//!
//! Covered elsewhere: the consumer and its sources (`consumer_runtime_failures`,
//! `consumer_redis_streams`, `consumer_rabbitmq`), the outbox's `Outgoing::delay` and every
//! `RelayBuilder` duration (`postgres_outbox::duration_max_in_every_relay_and_outbox_setting_does_not_panic`),
//! durations passed to the stores' own methods (`limits`, `redis_limits`, `postgres_limits`),
//! the tower layer, the completer and the client (`idempotent-tower/tests/duration_max_settings.rs`,
//! `idempotent-tower/tests/client.rs`).

use std::future::Future;
use std::time::Duration;

use idempotent_any::AnyStore;
use idempotent_cache::Cached;
use idempotent_core::clock::{Clock, ManualClock};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, CallOptions, Defaults, Error, Idempotency, InFlightPolicy, Outcome, Store, limits,
};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use idempotent_test_kit::backend::{postgres_url, redis_cluster_urls, redis_url};
use idempotent_test_kit::names::{free_port, unique};
use idempotent_test_kit::postgres::pool;
use tokio::time::timeout;

/// Longer than any path below takes; a "no limit" setting must never make a test wait this long.
const BOUND: Duration = Duration::from_secs(20);

fn call(key: &str) -> Call {
    Call::new(key.parse().unwrap())
}

/// `what` within [`BOUND`], or a failure naming it.
async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: still waiting after {BOUND:?}"))
}

/// Runs a fresh key once (fresh), again (replayed), and has a duplicate that waits with
/// `InFlightPolicy::Wait { max: Duration::MAX }` get the result of a call still running.
async fn runs_once_and_replays(label: &str, idempotency: &Idempotency) {
    let key = unique("dmax");
    let first = bounded(label, idempotency.run(&call(&key), async { 7_u32 }))
        .await
        .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    assert!(matches!(first, Outcome::Fresh(7)), "{label}: {first:?}");
    let again = bounded(label, idempotency.run(&call(&key), async { 8_u32 }))
        .await
        .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    assert!(matches!(again, Outcome::Replayed(7)), "{label}: {again:?}");

    // A duplicate waiting without a deadline for a call still running.
    let key = unique("dmax_wait");
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let idempotency = idempotency.clone();
        let key = key.clone();
        async move {
            idempotency
                .run(&call(&key), async {
                    let _ = released.await;
                    1_u32
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = tokio::spawn({
        let idempotency = idempotency.clone();
        async move {
            let waits = CallOptions::new().in_flight(InFlightPolicy::Wait { max: Duration::MAX });
            idempotency
                .run(&call(&key).options(waits), async { 2_u32 })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "{label}: the duplicate waits");
    release.send(()).unwrap();
    let ran = bounded(label, running).await.unwrap().unwrap();
    assert!(matches!(ran, Outcome::Fresh(1)), "{label}: {ran:?}");
    let waited = bounded(label, waiting).await.unwrap();
    assert!(
        matches!(waited, Ok(Outcome::Replayed(1))),
        "{label}: {waited:?}"
    );

    // A completer's listing, abandoned for "ever": nothing qualifies, nothing fails.
    let listed = bounded(label, idempotency.abandoned(Duration::MAX, 10, None))
        .await
        .unwrap_or_else(|e| panic!("{label}: abandoned(Duration::MAX): {e:?}"));
    assert!(listed.is_empty(), "{label}: {listed:?}");
}

/// The runtime's settings at the longest each accepts, and waits of any length.
fn longest() -> Defaults {
    Defaults::new()
        .ttl(limits::MAX_TTL)
        .lease(limits::MAX_LEASE)
        .session_idle(limits::MAX_TTL)
        .in_flight(InFlightPolicy::Wait { max: Duration::MAX })
}

fn runtime(
    store: impl idempotent_core::SessionStore + idempotent_core::CheckpointStore,
) -> Idempotency {
    Idempotency::builder(store)
        .defaults(longest())
        .record_retry(limits::MAX_RECORD_RETRY)
        .build()
}

/// TTL, lease, session idle time and record retry have a documented range (`limits`):
/// `Duration::MAX` is clamped to the longest where it is written (never a panic), and
/// `limits::check_*` refuses it, for a value read from outside the program, naming the setting,
/// the range and the value.
#[test]
fn ranged_settings_clamp_duration_max_and_checks_refuse_it() {
    let max = "18446744073709551615.999999999s";
    assert_eq!(
        limits::check_ttl(Duration::MAX).unwrap_err().to_string(),
        format!("ttl must be between 1ms and 365d, got {max}")
    );
    assert_eq!(
        limits::check_lease(Duration::MAX).unwrap_err().to_string(),
        format!("lease must be between 100ms and 365d, got {max}")
    );
    assert_eq!(
        limits::check_record_retry(Duration::MAX)
            .unwrap_err()
            .to_string(),
        format!("record_retry must be between 0s and 365d, got {max}")
    );
    assert_eq!(
        Defaults::new().ttl(Duration::MAX),
        Defaults::new().ttl(limits::MAX_TTL)
    );
    assert_eq!(
        Defaults::new().lease(Duration::MAX),
        Defaults::new().lease(limits::MAX_LEASE)
    );
    assert_eq!(
        Defaults::new().session_idle(Duration::MAX),
        Defaults::new().session_idle(limits::MAX_TTL)
    );
    assert_eq!(
        CallOptions::new().ttl(Duration::MAX),
        CallOptions::new().ttl(limits::MAX_TTL)
    );
    assert_eq!(
        CallOptions::new().lease(Duration::MAX),
        CallOptions::new().lease(limits::MAX_LEASE)
    );
    let _ = Idempotency::builder(MemoryStore::new())
        .record_retry(Duration::MAX)
        .build();
}

/// The in-process store: the longest accepted settings, a sweep interval of `Duration::MAX`
/// ("practically never"), a full store's capacity sweep spaced a tenth of that, and a manual
/// clock moved by `Duration::MAX`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store() {
    let store = MemoryStore::builder()
        .sweep_interval(Some(Duration::MAX))
        .build();
    runs_once_and_replays("memory", &runtime(store)).await;

    // Full: a claim on a full store sweeps (at most every tenth of the sweep interval) and is
    // refused for capacity.
    let full = runtime(
        MemoryStore::builder()
            .max_entries(1)
            .sweep_interval(Some(Duration::MAX))
            .build(),
    );
    bounded("full", full.run(&call("one"), async { 1_u32 }))
        .await
        .unwrap();
    for key in ["two", "three"] {
        let refused = bounded("full", full.run(&call(key), async { 2_u32 })).await;
        assert!(matches!(refused, Err(Error::Store(_))), "{refused:?}");
    }

    // The test clock saturates: moved by `Duration::MAX` it stands at its end, past every
    // record's expiry, and does not wrap around to before them.
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let idempotency = runtime(store);
    bounded("clock", idempotency.run(&call("k"), async { 1_u32 }))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(1));
    clock.advance(Duration::MAX);
    assert_eq!(clock.now(), Duration::from_nanos(u64::MAX));
    clock.advance(Duration::MAX);
    assert_eq!(clock.now(), Duration::from_nanos(u64::MAX));
    let after = bounded("clock", idempotency.run(&call("k"), async { 2_u32 }))
        .await
        .unwrap();
    assert!(matches!(after, Outcome::Fresh(2)), "expired: {after:?}");
}

/// `Idempotency::shutdown(Duration::MAX)`: waits for the call in flight however long it runs
/// (no deadline), returns as soon as it is done, and at once when nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_an_endless_grace() {
    let idempotency = runtime(MemoryStore::new());
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let idempotency = idempotency.clone();
        async move {
            idempotency
                .run(&call("in-flight"), async {
                    let _ = released.await;
                    1_u32
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let shutdown = tokio::spawn({
        let idempotency = idempotency.clone();
        async move { idempotency.shutdown(Duration::MAX).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!shutdown.is_finished(), "waits for the call in flight");
    let late = bounded("late", idempotency.run(&call("late"), async { 2_u32 })).await;
    assert!(matches!(late, Err(Error::ShuttingDown)), "{late:?}");
    release.send(()).unwrap();
    let ran = bounded("the call", running).await.unwrap();
    assert!(matches!(ran, Ok(Outcome::Fresh(1))), "{ran:?}");
    let drained = bounded("shutdown", shutdown).await.unwrap();
    assert!(drained.is_clean(), "{drained:?}");
    // Again, nothing in flight: at once.
    let again = bounded("again", idempotency.shutdown(Duration::MAX)).await;
    assert!(again.is_clean(), "{again:?}");
}

/// `RedisStoreBuilder::timeout(Duration::MAX)`: no connection or response timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_timeout() {
    let Some(url) = redis_url() else {
        return;
    };
    let store = bounded(
        "connect",
        RedisStore::builder(url)
            .key_prefix(format!("{}:", unique("dmax")))
            .timeout(Duration::MAX)
            .connect(),
    )
    .await
    .unwrap();
    runs_once_and_replays("redis", &runtime(store)).await;
}

/// `RedisStoreBuilder::timeout(Duration::MAX)` with `replicas(1)` on the Redis Cluster (whose
/// primaries have a replica each): each `WAIT` waits for the replica with no deadline of its
/// own. Redis refuses a `WAIT` timeout past `i64` milliseconds from now, so the store
/// sends at most 365 days.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_replicas_with_an_endless_timeout() {
    let Some(urls) = redis_cluster_urls() else {
        return;
    };
    let store = bounded(
        "connect",
        RedisStore::builder(urls)
            .key_prefix(format!("{}:", unique("dmax")))
            .replicas(1)
            .timeout(Duration::MAX)
            .connect(),
    )
    .await
    .unwrap();
    runs_once_and_replays("redis cluster, replicas 1", &runtime(store)).await;
}

/// The Redis cache tier with `timeout(Duration::MAX)` and `rest(Duration::MAX)`: reachable, it
/// serves the replay; unreachable, it rests (for as long as the clock can say) and every
/// request goes to the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cache_tier_timeout_and_rest() {
    let Some(url) = redis_url() else {
        return;
    };
    let tier = bounded(
        "connect",
        idempotent_redis::RedisCacheBuilder::new(url)
            .key_prefix(format!("{}:", unique("dmax_cache")))
            .timeout(Duration::MAX)
            .rest(Duration::MAX)
            .connect(),
    )
    .await
    .unwrap();
    let store = Cached::new(MemoryStore::new(), tier);
    runs_once_and_replays("redis tier", &runtime(store)).await;

    let unreachable = bounded(
        "connect",
        idempotent_redis::RedisCacheBuilder::new(format!("redis://127.0.0.1:{}", free_port()))
            .timeout(Duration::MAX)
            .rest(Duration::MAX)
            .connect(),
    )
    .await
    .unwrap();
    let store = Cached::new(MemoryStore::new(), unreachable);
    runs_once_and_replays("unreachable redis tier", &runtime(store)).await;
}

/// `PostgresStoreBuilder::reap_grace(Duration::MAX)` (reaps nothing: nothing expired that
/// long ago), `PostgresStore::spawn_reaper(Duration::MAX)` (never ticks again after its first
/// reap) and `AnyStoreBuilder::reaper(Some(Duration::MAX))`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_reaping() {
    let Some(url) = postgres_url() else {
        return;
    };
    let pool = pool(&url, 4).await;
    let table = unique("dmax");
    let store = PostgresStore::builder(pool.clone())
        .table(&table)
        .reap_grace(Duration::MAX)
        .build()
        .unwrap();
    bounded("migrate", store.migrate()).await.unwrap();
    runs_once_and_replays("postgres", &runtime(store.clone())).await;
    // An expired claim (a store called directly, as a custom runtime may) is not reaped with
    // an endless grace.
    let expired = idempotent_core::conformance::fresh_key();
    bounded(
        "claim",
        store.claim(
            &expired,
            &idempotent_core::Fingerprint::empty(),
            Duration::from_millis(1),
            Duration::from_millis(1),
        ),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(bounded("reap", store.reap()).await.unwrap(), 0);
    let reaper = store.spawn_reaper(Duration::MAX);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!reaper.is_finished(), "the reaper runs (and did not panic)");
    reaper.abort();
    assert!(reaper.await.unwrap_err().is_cancelled());

    let any = bounded(
        "connect",
        AnyStore::builder(url).reaper(Some(Duration::MAX)).connect(),
    )
    .await
    .unwrap();
    runs_once_and_replays("postgres (AnyStore)", &runtime(any)).await;

    sqlx::query(&format!("DROP TABLE IF EXISTS \"{table}\""))
        .execute(&pool)
        .await
        .unwrap();
}
