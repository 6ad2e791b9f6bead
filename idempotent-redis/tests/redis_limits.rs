//! `RedisStore` given durations Redis cannot take: a `PEXPIRE` with a huge TTL or lease used to
//! fail after the script's `HSET` had run, leaving a claim with no expiry or a completed record
//! with the lease's. Against a real `redis-server` (started by `scripts/test.sh`): every record
//! gets an expiry, at most the ceiling of `limits`.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::conformance::fresh_key;
use idempotent_core::{Claim, Fingerprint, StorageKey, Store, limits};
use idempotent_redis::RedisStore;
use idempotent_test_kit::backend::redis_url;

struct Redis {
    store: RedisStore,
    raw: redis::aio::MultiplexedConnection,
}

async fn redis() -> Option<Redis> {
    let url = redis_url()?;
    let store = RedisStore::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e:?}; is redis-server running?"));
    let raw = idempotent_test_kit::redis::connect(&url).await;
    Some(Redis { store, raw })
}

impl Redis {
    /// The key's remaining time to live in milliseconds: `-1` without an expiry, `-2` if the
    /// key is absent.
    async fn pttl(&mut self, key: &StorageKey) -> i64 {
        redis::cmd("PTTL")
            .arg(self.store.redis_key(key))
            .query_async(&mut self.raw)
            .await
            .unwrap()
    }

    async fn state(&mut self, key: &StorageKey) -> Option<String> {
        redis::cmd("HGET")
            .arg(self.store.redis_key(key))
            .arg("s")
            .query_async(&mut self.raw)
            .await
            .unwrap()
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap()
}

/// Within a second below `ceiling`, and never above it.
fn near(pttl: i64, ceiling: Duration) -> bool {
    (ms(ceiling) - 1_000..=ms(ceiling)).contains(&pttl)
}

/// Durations no backend accepts as they are: each must leave the record with the ceiling.
const HUGE: [Duration; 3] = [
    Duration::MAX,
    Duration::from_millis(u64::MAX),
    Duration::from_secs(400 * 24 * 3600),
];

#[tokio::test]
async fn a_huge_lease_is_recorded_as_the_longest_lease() {
    let Some(mut redis) = redis().await else {
        return;
    };
    for lease in HUGE {
        let key = fresh_key();
        let claim = redis
            .store
            .claim(&key, &Fingerprint::empty(), lease, lease)
            .await
            .unwrap_or_else(|e| panic!("claim with {lease:?}: {e:?}"));
        assert!(matches!(claim, Claim::Claimed(_)), "{claim:?}");
        assert_eq!(redis.state(&key).await.as_deref(), Some("i"));
        let pttl = redis.pttl(&key).await;
        assert!(
            near(pttl, limits::MAX_LEASE),
            "lease {lease:?}: PTTL {pttl}"
        );
        match redis
            .store
            .claim(&key, &Fingerprint::empty(), lease, lease)
            .await
        {
            Ok(Claim::InFlight { retry_after, .. }) => {
                assert!(retry_after <= limits::MAX_LEASE, "{retry_after:?}");
            }
            other => panic!("expected InFlight, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_huge_renewal_is_recorded_as_the_longest_lease() {
    let Some(mut redis) = redis().await else {
        return;
    };
    for lease in HUGE {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) = redis
            .store
            .claim(
                &key,
                &Fingerprint::empty(),
                Duration::from_secs(5),
                Duration::from_secs(5),
            )
            .await
        else {
            panic!("a fresh key is claimed");
        };
        redis
            .store
            .renew(&key, token, lease)
            .await
            .unwrap_or_else(|e| panic!("renew with {lease:?}: {e:?}"));
        let pttl = redis.pttl(&key).await;
        assert!(
            near(pttl, limits::MAX_LEASE),
            "lease {lease:?}: PTTL {pttl}"
        );
    }
}

#[tokio::test]
async fn a_huge_ttl_is_recorded_as_the_longest_ttl() {
    let Some(mut redis) = redis().await else {
        return;
    };
    for ttl in HUGE {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) = redis
            .store
            .claim(
                &key,
                &Fingerprint::empty(),
                Duration::from_secs(5),
                Duration::from_secs(5),
            )
            .await
        else {
            panic!("a fresh key is claimed");
        };
        redis
            .store
            .complete(&key, token, Bytes::from_static(b"done"), ttl)
            .await
            .unwrap_or_else(|e| panic!("complete with {ttl:?}: {e:?}"));
        assert_eq!(redis.state(&key).await.as_deref(), Some("c"));
        let pttl = redis.pttl(&key).await;
        assert!(near(pttl, limits::MAX_TTL), "ttl {ttl:?}: PTTL {pttl}");
        assert!(matches!(
            redis
                .store
                .claim(
                    &key,
                    &Fingerprint::empty(),
                    Duration::from_secs(5),
                    Duration::from_secs(5)
                )
                .await,
            Ok(Claim::Completed { .. })
        ));
    }
}

/// Below a millisecond Redis cannot count; `PEXPIRE 0` would delete the record. The store
/// records one millisecond instead, so the record expires at once but exists with an expiry.
#[tokio::test]
async fn a_sub_millisecond_duration_is_one_millisecond() {
    let Some(mut redis) = redis().await else {
        return;
    };
    for short in [Duration::ZERO, Duration::from_micros(500)] {
        let key = fresh_key();
        let claim = redis
            .store
            .claim(&key, &Fingerprint::empty(), short, short)
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Claimed(_)), "{claim:?}");
        let pttl = redis.pttl(&key).await;
        assert!(
            pttl == -2 || (0..=1).contains(&pttl),
            "{short:?}: PTTL {pttl}"
        );
    }
}
