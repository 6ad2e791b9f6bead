//! `RedisStore` against a real `redis-server` and a real Redis Cluster (three primaries, three
//! replicas; both started by `scripts/test.sh`): the conformance suite on each, records spread
//! over the cluster's primaries, garbage in the store, and an unreachable server.

use std::time::Duration;

use idempotent_core::conformance::{Harness, fresh_key};
use idempotent_core::redis::RedisStore;
use idempotent_core::{Claim, Fingerprint, Store, StoreError};
use idempotent_test_kit::backend::{REDIS_CLUSTER_URLS, REDIS_URL, backend_url, redis_url};

/// Where a harness's Redis is: the variable holding its URL.
trait Deployment: Send + Sync + 'static {
    const VAR: &'static str;
    /// Replicas that must acknowledge each claim and completion (`RedisStoreBuilder::replicas`).
    const REPLICAS: usize = 0;
}

/// One `redis-server`.
struct Node;
impl Deployment for Node {
    const VAR: &'static str = REDIS_URL;
}

/// The test cluster.
struct Cluster;
impl Deployment for Cluster {
    const VAR: &'static str = REDIS_CLUSTER_URLS;
}

/// The test cluster, each claim and record acknowledged by its primary's replica.
struct AcknowledgedCluster;
impl Deployment for AcknowledgedCluster {
    const VAR: &'static str = REDIS_CLUSTER_URLS;
    const REPLICAS: usize = 1;
}

struct Redis<D> {
    store: RedisStore,
    deployment: std::marker::PhantomData<D>,
}

impl<D: Deployment> Harness for Redis<D> {
    type Store = RedisStore;

    async fn setup() -> Self {
        let url = backend_url(D::VAR).unwrap_or_else(|| "redis://127.0.0.1:1".into());
        let store = RedisStore::builder(&url)
            .replicas(D::REPLICAS)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e:?}; is redis-server running?"));
        Redis {
            store,
            deployment: std::marker::PhantomData,
        }
    }

    fn store(&self) -> &RedisStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    fn time_unit(&self) -> Duration {
        Duration::from_millis(150)
    }

    fn backend_env() -> Option<&'static str> {
        Some(D::VAR)
    }
}

idempotent_core::store_conformance_tests!(Redis<Node>);

/// The same contract on a Redis Cluster, and records spread over its primaries.
mod cluster {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use idempotent_core::conformance::fresh_key;
    use idempotent_core::redis::RedisStore;
    use idempotent_core::{Claim, Fingerprint, Store};
    use idempotent_test_kit::backend::redis_cluster_urls;

    use super::{Cluster, Redis};

    idempotent_core::store_conformance_tests!(Redis<Cluster>);

    /// The contract holds as well with every claim and record acknowledged by a replica.
    mod acknowledged {
        use super::super::{AcknowledgedCluster, Redis};

        idempotent_core::store_conformance_tests!(Redis<AcknowledgedCluster>);
    }

    /// The ports of the primaries serving `keys`, from the cluster's slot map.
    async fn primaries_of(urls: &str, keys: &[String]) -> BTreeSet<i64> {
        let first = urls.split(',').next().unwrap();
        let mut connection = idempotent_test_kit::redis::connect(first).await;
        let shards: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut connection)
            .await
            .unwrap();
        let mut primaries = BTreeSet::new();
        for key in keys {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut connection)
                .await
                .unwrap();
            for shard in &shards {
                let redis::Value::Array(parts) = shard else {
                    continue;
                };
                if let [
                    redis::Value::Int(start),
                    redis::Value::Int(end),
                    redis::Value::Array(primary),
                    ..,
                ] = parts.as_slice()
                    && (*start..=*end).contains(&slot)
                    && let Some(redis::Value::Int(port)) = primary.get(1)
                {
                    primaries.insert(*port);
                }
            }
        }
        primaries
    }

    #[tokio::test]
    async fn records_spread_over_every_primary_and_each_is_one_key() {
        let Some(urls) = redis_cluster_urls() else {
            return;
        };
        let store = RedisStore::connect(&urls).await.unwrap();
        let f = Fingerprint::from_bytes(b"spread");
        let keys: Vec<_> = (0..64).map(|_| fresh_key()).collect();
        for key in &keys {
            let Claim::Claimed(token) = store
                .claim(key, &f, Duration::from_secs(30), Duration::from_secs(30))
                .await
                .unwrap()
            else {
                panic!("a fresh key is claimed");
            };
            store
                .complete(key, token, "done".into(), Duration::from_secs(60))
                .await
                .unwrap();
            match store
                .claim(key, &f, Duration::from_secs(30), Duration::from_secs(30))
                .await
                .unwrap()
            {
                Claim::Completed { payload, .. } => assert_eq!(&payload[..], b"done"),
                other => panic!("expected the record back, got {other:?}"),
            }
        }
        let redis_keys: Vec<_> = keys.iter().map(|k| store.redis_key(k)).collect();
        assert_eq!(
            primaries_of(&urls, &redis_keys).await.len(),
            3,
            "64 records land on all three primaries"
        );
    }
}

async fn raw_connection() -> Option<redis::aio::MultiplexedConnection> {
    Some(idempotent_test_kit::redis::connect(&redis_url()?).await)
}

#[tokio::test]
async fn garbage_in_the_store_is_a_corrupt_error_never_absent() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&redis_url().unwrap()).await.unwrap();
    let f = Fingerprint::from_bytes(b"x");
    let cases: [&[(&str, &[u8])]; 4] = [
        &[("s", b"c"), ("f", b"short"), ("p", b"payload")],
        &[("s", b"c"), ("f", &[7u8; 32])],
        &[("s", b"zz"), ("f", &[7u8; 32])],
        &[("s", b"i")],
    ];
    for fields in cases {
        let key = fresh_key();
        let redis_key = store.redis_key(&key);
        let _: () = redis::cmd("HSET")
            .arg(&redis_key)
            .arg(
                fields
                    .iter()
                    .flat_map(|(k, v)| [k.as_bytes().to_vec(), v.to_vec()])
                    .collect::<Vec<_>>(),
            )
            .query_async(&mut raw)
            .await
            .unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg(&redis_key)
            .arg(60_000)
            .query_async(&mut raw)
            .await
            .unwrap();
        let result = store
            .claim(&key, &f, Duration::from_secs(5), Duration::from_secs(5))
            .await;
        assert!(
            matches!(result, Err(StoreError::Corrupt(_))),
            "{fields:?}: {result:?}"
        );
        // The garbage is reported, not overwritten.
        let still: i64 = redis::cmd("EXISTS")
            .arg(&redis_key)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(still, 1);
    }
    // A key of another type is an error too, never treated as absent.
    let key = fresh_key();
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&key))
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        store
            .claim(&key, &f, Duration::from_secs(5), Duration::from_secs(5))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn unreachable_server_is_unavailable() {
    // Nothing listens on port 1.
    match RedisStore::builder("redis://127.0.0.1:1")
        .key_prefix("x:")
        .timeout(Duration::from_millis(300))
        .connect()
        .await
    {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// The store sends its scripts by hash (`EVALSHA`); after the server forgets them (a restart,
/// `SCRIPT FLUSH`), each operation loads its script again and succeeds.
#[tokio::test]
async fn scripts_the_server_forgot_are_loaded_again() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&redis_url().unwrap()).await.unwrap();
    let flush = || redis::cmd("SCRIPT").arg("FLUSH").to_owned();
    let lease = Duration::from_secs(30);
    let f = Fingerprint::from_bytes(b"x");

    let key = fresh_key();
    flush().exec_async(&mut raw).await.unwrap();
    let Ok(idempotent_core::Claim::Claimed(token)) = store.claim(&key, &f, lease, lease).await
    else {
        panic!("a fresh key is claimed after SCRIPT FLUSH");
    };
    flush().exec_async(&mut raw).await.unwrap();
    store.renew(&key, token, lease).await.unwrap();
    flush().exec_async(&mut raw).await.unwrap();
    store
        .complete(&key, token, bytes::Bytes::from_static(b"done"), lease)
        .await
        .unwrap();
    flush().exec_async(&mut raw).await.unwrap();
    assert!(matches!(
        store.claim(&key, &f, lease, lease).await.unwrap(),
        idempotent_core::Claim::Completed { payload, .. } if payload == "done"
    ));

    let other = fresh_key();
    let Ok(idempotent_core::Claim::Claimed(token)) = store.claim(&other, &f, lease, lease).await
    else {
        panic!("claimed");
    };
    flush().exec_async(&mut raw).await.unwrap();
    store.release(&other, token).await.unwrap();
    // Released: the same request takes the record over and continues its lifetime.
    assert!(matches!(
        store.claim(&other, &f, lease, lease).await.unwrap(),
        idempotent_core::Claim::TakenOver { lifetime, .. } if lifetime == token
    ));
}

#[tokio::test]
async fn without_the_replicas_required_a_claim_fails_closed_and_is_given_back() {
    let Some(url) = redis_url() else {
        return;
    };
    // One server, no replicas: `WAIT 1` never gets its acknowledgement.
    let waiting = RedisStore::builder(&url)
        .replicas(1)
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let plain = RedisStore::connect(&url).await.unwrap();
    let f = Fingerprint::from_bytes(b"replicas");
    let key = fresh_key();
    match waiting
        .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
        .await
    {
        Err(StoreError::Unavailable(error)) => {
            assert!(
                error.to_string().contains("acknowledged by 0 of the 1"),
                "{error}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Given back: nothing holds the key (the same request continues the given-back claim's
    // lifetime).
    let (Claim::Claimed(token) | Claim::TakenOver { token, .. }) = plain
        .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the refused claim was released");
    };
    let complete = |token: idempotent_core::FencingToken, payload: &'static str| {
        waiting.complete(&key, token, payload.into(), Duration::from_secs(60))
    };
    // A completion that is not acknowledged fails closed too, though the record is written:
    // a retry of the write then finds it done.
    assert!(matches!(
        complete(token, "done").await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        plain
            .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
            .await
            .unwrap(),
        Claim::Completed { .. }
    ));
    // The runtime's retry of that write (the same token, with the same payload or the "not
    // retained" record it falls back to) waits for the replicas again rather than being told
    // its claim is gone, and changes nothing; another token is still refused.
    assert!(matches!(
        complete(token, "done").await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        complete(token, "other").await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        plain
            .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
            .await
            .unwrap(),
        Claim::Completed { payload, .. } if payload == "done"
    ));
    assert!(matches!(
        complete(idempotent_core::FencingToken::new(token.get() + 1), "other").await,
        Err(StoreError::TokenRejected)
    ));
}
