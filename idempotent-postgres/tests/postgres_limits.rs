//! `PostgresStore` given durations past the ceilings of `limits` (`Duration::MAX`, `u64::MAX`
//! milliseconds): the interval never overflows, and every row's `expires_at` is at most the
//! ceiling away. Against a real PostgreSQL server (started by `scripts/test.sh`).

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::conformance::fresh_key;
use idempotent_core::{Call, CallOptions, Claim, Defaults, Fingerprint, StorageKey, Store, limits};
use idempotent_postgres::PostgresStore;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::shared_pool;
use sqlx::postgres::{PgPool, PgPoolOptions};

async fn postgres() -> Option<(PostgresStore, PgPool)> {
    let pool = shared_pool(2).await?;
    let table = unique("limits");
    let store = PostgresStore::builder(pool.clone())
        .table(table)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    Some((store, pool))
}

/// The row's state and how far its `expires_at` is from the database's clock.
async fn row(store: &PostgresStore, pool: &PgPool, key: &StorageKey) -> (String, Duration) {
    let (state, micros): (String, i64) = sqlx::query_as(&format!(
        "SELECT state, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8 \
         FROM {} WHERE storage_key = $1",
        store.table()
    ))
    .bind(key.as_bytes().as_slice())
    .fetch_one(pool)
    .await
    .unwrap();
    (state, Duration::from_micros(u64::try_from(micros).unwrap()))
}

/// Within a minute below `ceiling`, and never above it.
fn near(left: Duration, ceiling: Duration) -> bool {
    left <= ceiling && left >= ceiling - Duration::from_secs(60)
}

const HUGE: [Duration; 3] = [
    Duration::MAX,
    Duration::from_millis(u64::MAX),
    Duration::from_secs(400 * 24 * 3600),
];

#[tokio::test]
async fn a_huge_lease_is_recorded_as_the_longest_lease() {
    let Some((store, pool)) = postgres().await else {
        return;
    };
    for lease in HUGE {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) =
            store.claim(&key, &Fingerprint::empty(), lease, lease).await
        else {
            panic!("a fresh key is claimed with {lease:?}");
        };
        let (state, left) = row(&store, &pool, &key).await;
        assert_eq!(state, "in_flight");
        assert!(near(left, limits::MAX_LEASE), "lease {lease:?}: {left:?}");
        match store.claim(&key, &Fingerprint::empty(), lease, lease).await {
            Ok(Claim::InFlight { retry_after, .. }) => {
                assert!(near(retry_after, limits::MAX_LEASE), "{retry_after:?}");
            }
            other => panic!("expected InFlight, got {other:?}"),
        }
        store
            .renew(&key, token, lease)
            .await
            .unwrap_or_else(|e| panic!("renew with {lease:?}: {e:?}"));
        let (_, left) = row(&store, &pool, &key).await;
        assert!(near(left, limits::MAX_LEASE), "renewed {lease:?}: {left:?}");
    }
}

#[tokio::test]
async fn a_huge_ttl_is_recorded_as_the_longest_ttl() {
    let Some((store, pool)) = postgres().await else {
        return;
    };
    for ttl in HUGE {
        let key = fresh_key();
        let Ok(Claim::Claimed(token)) = store
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
        store
            .complete(&key, token, Bytes::from_static(b"done"), ttl)
            .await
            .unwrap_or_else(|e| panic!("complete with {ttl:?}: {e:?}"));
        let (state, left) = row(&store, &pool, &key).await;
        assert_eq!(state, "completed");
        assert!(near(left, limits::MAX_TTL), "ttl {ttl:?}: {left:?}");
    }
}

/// The transactional mode's settings take the same ranges as the runtime's.
/// The transactional mode over a pool that never connects: it needs none to be built.
fn lazy_transactional(defaults: Defaults) -> idempotent_postgres::Transactional {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    idempotent_postgres::Transactional::new(&PostgresStore::new(pool)).defaults(defaults)
}

/// Settings out of range are clamped where they are written (never a panic), the
/// transactional mode's too.
#[tokio::test]
async fn the_transactional_modes_settings_are_clamped() {
    let _ = lazy_transactional(Defaults::new().lease(Duration::ZERO));
    assert_eq!(
        CallOptions::new().ttl(Duration::from_secs(366 * 24 * 3600)),
        CallOptions::new().ttl(idempotent_core::limits::MAX_TTL)
    );
    let _ = Call::new("k".parse().unwrap())
        .options(CallOptions::new().ttl(Duration::from_secs(366 * 24 * 3600)));
}

#[tokio::test]
async fn the_transactional_modes_bounds_are_accepted() {
    let transactional = lazy_transactional(
        Defaults::new()
            .ttl(limits::MAX_TTL)
            .lease(limits::MIN_LEASE),
    );
    let call = Call::new("k".parse().unwrap()).options(
        CallOptions::new()
            .ttl(limits::MIN_TTL)
            .lease(limits::MAX_LEASE),
    );
    let _ = transactional.storage_key(&call);
}
