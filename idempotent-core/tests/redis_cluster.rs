//! `RedisStore` on a real Redis Cluster (three primaries, three replicas, started by
//! `scripts/test.sh`): the conformance suite, and records spread over every primary.

use std::collections::BTreeSet;
use std::time::Duration;

use idempotent_core::conformance::{Harness, backend_url, fresh_key};
use idempotent_core::redis::RedisStore;
use idempotent_core::{Claim, Fingerprint, Store};

const URLS_VAR: &str = "IDEMPOTENT_TEST_REDIS_CLUSTER_URLS";

struct Cluster {
    store: RedisStore,
}

impl Harness for Cluster {
    type Store = RedisStore;

    async fn setup() -> Self {
        let urls = backend_url(URLS_VAR).unwrap_or_else(|| "redis://127.0.0.1:1".into());
        let store = RedisStore::connect(&urls)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the cluster at {urls}: {e:?}"));
        Cluster { store }
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
        Some(URLS_VAR)
    }
}

idempotent_core::store_conformance_tests!(Cluster);

/// The primary serving each of `keys`, by asking a node where the key's slot lives.
async fn primaries_of(urls: &str, keys: &[String]) -> BTreeSet<String> {
    let first = urls.split(',').next().unwrap();
    let client = redis::Client::open(first).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let mut primaries = BTreeSet::new();
    for key in keys {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut connection)
            .await
            .unwrap();
        let shards: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut connection)
            .await
            .unwrap();
        for shard in shards {
            let redis::Value::Array(parts) = shard else {
                continue;
            };
            let (redis::Value::Int(start), redis::Value::Int(end)) = (&parts[0], &parts[1]) else {
                continue;
            };
            if (*start..=*end).contains(&i64::from(slot)) {
                if let redis::Value::Array(primary) = &parts[2] {
                    if let redis::Value::Int(port) = &primary[1] {
                        primaries.insert(port.to_string());
                    }
                }
            }
        }
    }
    primaries
}

#[tokio::test]
async fn records_spread_over_every_primary_and_each_is_one_key() {
    let Some(urls) = backend_url(URLS_VAR) else {
        return;
    };
    let store = RedisStore::connect(&urls).await.unwrap();
    let f = Fingerprint::from_bytes(b"spread");
    let keys: Vec<_> = (0..64).map(|_| fresh_key()).collect();
    for key in &keys {
        let Claim::Claimed(token) = store.claim(key, &f, Duration::from_secs(30)).await.unwrap()
        else {
            panic!("a fresh key is claimed");
        };
        store
            .complete(key, token, "done".into(), Duration::from_secs(60))
            .await
            .unwrap();
        match store.claim(key, &f, Duration::from_secs(30)).await.unwrap() {
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
