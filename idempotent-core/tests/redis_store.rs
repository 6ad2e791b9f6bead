//! `RedisStore` against a real `redis-server` (started by `scripts/test.sh`): the conformance
//! suite, garbage in the store, and an unreachable server.

use std::time::Duration;

use idempotent_core::conformance::{Harness, backend_url, fresh_key};
use idempotent_core::redis::RedisStore;
use idempotent_core::{Fingerprint, Store, StoreError};

const URL_VAR: &str = "IDEMPOTENT_TEST_REDIS_URL";

struct Redis {
    store: RedisStore,
}

impl Harness for Redis {
    type Store = RedisStore;

    async fn setup() -> Self {
        let url = backend_url(URL_VAR).unwrap_or_else(|| "redis://127.0.0.1:1".into());
        let store = RedisStore::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e:?}; is redis-server running?"));
        Redis { store }
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
        Some(URL_VAR)
    }
}

idempotent_core::store_conformance_tests!(Redis);

async fn raw_connection() -> Option<redis::aio::MultiplexedConnection> {
    let url = backend_url(URL_VAR)?;
    let client = redis::Client::open(url).unwrap();
    Some(client.get_multiplexed_async_connection().await.unwrap())
}

#[tokio::test]
async fn garbage_in_the_store_is_a_corrupt_error_never_absent() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&backend_url(URL_VAR).unwrap())
        .await
        .unwrap();
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
        let result = store.claim(&key, &f, Duration::from_secs(5)).await;
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
    assert!(store.claim(&key, &f, Duration::from_secs(5)).await.is_err());
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
    let store = RedisStore::connect(&backend_url(URL_VAR).unwrap())
        .await
        .unwrap();
    let flush = || redis::cmd("SCRIPT").arg("FLUSH").to_owned();
    let lease = Duration::from_secs(30);
    let f = Fingerprint::from_bytes(b"x");

    let key = fresh_key();
    flush().exec_async(&mut raw).await.unwrap();
    let Ok(idempotent_core::Claim::Claimed(token)) = store.claim(&key, &f, lease).await else {
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
        store.claim(&key, &f, lease).await.unwrap(),
        idempotent_core::Claim::Completed { payload, .. } if payload == "done"
    ));

    let other = fresh_key();
    let Ok(idempotent_core::Claim::Claimed(token)) = store.claim(&other, &f, lease).await else {
        panic!("claimed");
    };
    flush().exec_async(&mut raw).await.unwrap();
    store.release(&other, token).await.unwrap();
    assert!(matches!(
        store.claim(&other, &f, lease).await.unwrap(),
        idempotent_core::Claim::Claimed(_)
    ));
}
