//! `RedisStore` against a real `redis-server` and a real Redis Cluster (three primaries, three
//! replicas; both started by `scripts/test.sh`): the conformance suite on each, records spread
//! over the cluster's primaries, a session's records in one slot and no more of them than its
//! window, checkpoints and the index of saved requests, garbage in the store, and an
//! unreachable server.

use idempotent_core::{CheckpointStore, SessionStore};
use std::time::Duration;

use idempotent_core::conformance::{Harness, fresh_key, fresh_session};
use idempotent_core::inspect::KeyLabel;
use idempotent_core::session::{MAX_SEQ, MAX_SESSION_WINDOW};
use idempotent_core::{
    Claim, Fingerprint, SessionClaim, SessionGate, SessionKey, SessionRequest, Store, StoreError,
};
use idempotent_redis::RedisStore;
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
    use idempotent_core::{
        Claim, Fingerprint, SessionGate, SessionKey, SessionRequest, SessionStore, Store,
        StoreError,
    };
    use idempotent_redis::RedisStore;
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

    /// A session's own record and its requests' records are named as documented and sit in
    /// one Cluster slot, the slot of the session's digest (its hash tag); keys keep their names.
    #[tokio::test]
    async fn a_sessions_records_share_one_slot() {
        let Some(urls) = redis_cluster_urls() else {
            return;
        };
        let store = RedisStore::connect(&urls).await.unwrap();
        let key = fresh_key();
        let hex = key.to_hex();
        let session = SessionKey::from_bytes(*key.as_bytes());
        assert_eq!(store.redis_key(&key), format!("idempotent:{hex}"));
        assert_eq!(
            store.redis_key(&session.record_key()),
            format!("idempotent:{{{hex}}}")
        );
        assert_eq!(
            store.redis_key(&session.seq_key(1_764_000_000_000_000, 42)),
            format!("idempotent:{{{hex}}}:1764000000000000:42")
        );

        // Three requests through the gate, each claimed and answered: the names the store
        // wrote are the ones above.
        let idle = Duration::from_secs(60);
        let f = Fingerprint::from_bytes(b"session");
        let mut names = vec![store.redis_key(&session.record_key())];
        for seq in 1..=3 {
            let SessionGate::Open { epoch } = store
                .open_session(&session, SessionRequest::new(seq, 0, 8, idle))
                .await
                .unwrap()
            else {
                panic!("request {seq} is admitted");
            };
            let record = session.seq_key(epoch, seq);
            let Claim::Claimed(token) = store
                .claim(&record, &f, Duration::from_secs(30), idle)
                .await
                .unwrap()
            else {
                panic!("request {seq}'s record is claimed");
            };
            store
                .complete(&record, token, "done".into(), idle)
                .await
                .unwrap();
            names.push(store.redis_key(&record));
        }
        let mut cluster = redis::cluster::ClusterClient::new(urls.split(',').collect::<Vec<_>>())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        let first = urls.split(',').next().unwrap();
        let mut node = idempotent_test_kit::redis::connect(first).await;
        let slot_of = async |node: &mut redis::aio::MultiplexedConnection, name: &str| -> i64 {
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(name)
                .query_async(node)
                .await
                .unwrap()
        };
        let slot = slot_of(&mut node, &hex).await;
        for name in &names {
            assert_eq!(slot_of(&mut node, name).await, slot, "{name}");
            let exists: i64 = redis::cmd("EXISTS")
                .arg(name)
                .query_async(&mut cluster)
                .await
                .unwrap();
            assert_eq!(exists, 1, "{name} was written");
        }
    }

    /// On a cluster, a key prefix that begins an empty hash tag (which would spread a
    /// session's records over slots) is refused.
    #[tokio::test]
    async fn a_prefix_with_an_empty_hash_tag_is_refused_on_a_cluster() {
        let Some(urls) = redis_cluster_urls() else {
            return;
        };
        match RedisStore::builder(&urls)
            .key_prefix("app{}:")
            .connect()
            .await
        {
            Err(StoreError::Backend(error)) => {
                assert!(error.to_string().contains("empty hash tag"), "{error}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        RedisStore::builder(&urls)
            .key_prefix("app{tenant}:")
            .connect()
            .await
            .expect("a prefix with a hash tag of its own");
    }

    /// Checkpoints, saved requests and `abandoned` on a cluster: the records sit in several
    /// slots, the index of saved requests in one of its own, and each is written with
    /// commands of one slot.
    #[tokio::test]
    async fn abandoned_records_are_found_across_slots() {
        let Some(urls) = redis_cluster_urls() else {
            return;
        };
        let store = super::isolated(&urls).await;
        let mut raw = redis::cluster::ClusterClient::new(urls.split(',').collect::<Vec<_>>())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        let names = super::abandoned_scenario(&store, &mut raw).await;
        let first = urls.split(',').next().unwrap();
        let mut node = idempotent_test_kit::redis::connect(first).await;
        let mut slots = BTreeSet::new();
        for name in &names {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(name)
                .query_async(&mut node)
                .await
                .unwrap();
            slots.insert(slot);
        }
        assert!(slots.len() > 1, "records in several slots: {slots:?}");
        assert!(
            primaries_of(&urls, &names).await.len() > 1,
            "and on several primaries"
        );
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

/// `store`'s claim of request `seq` of `session`, acknowledging `ack`, in a window of 8, with
/// no label.
async fn claim_in(
    store: &RedisStore,
    session: &SessionKey,
    (seq, ack): (u64, u64),
    (idle, lease): (Duration, Duration),
    f: &Fingerprint,
) -> Result<SessionClaim, StoreError> {
    let label = KeyLabel::from_bytes(bytes::Bytes::new());
    store
        .claim_in_session(
            session,
            SessionRequest::new(seq, ack, 8, idle),
            f,
            lease,
            &label,
        )
        .await
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

/// The names of Redis keys under `pattern` (`SCAN MATCH`), measured in Redis.
async fn keys_matching(
    connection: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Vec<String> {
    let mut cursor = 0u64;
    let mut keys = Vec::new();
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .unwrap();
        keys.extend(found);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

/// A session of 1,000 requests, each acknowledging the one before, holds no more than its
/// window of records (and its own) in Redis, however many requests it made.
#[tokio::test]
async fn a_long_session_keeps_at_most_its_window_of_records() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&redis_url().unwrap()).await.unwrap();
    let session = fresh_session();
    let (window, idle, lease) = (8, Duration::from_secs(60), Duration::from_secs(30));
    let mut epochs = std::collections::BTreeSet::new();
    for seq in 1..=1_000u64 {
        let SessionGate::Open { epoch } = store
            .open_session(&session, SessionRequest::new(seq, seq - 1, window, idle))
            .await
            .unwrap()
        else {
            panic!("request {seq} is admitted");
        };
        epochs.insert(epoch);
        let record = session.seq_key(epoch, seq);
        let f = Fingerprint::from_bytes(seq.to_string().as_bytes());
        let Claim::Claimed(token) = store.claim(&record, &f, lease, idle).await.unwrap() else {
            panic!("request {seq}'s record is claimed");
        };
        store
            .complete(&record, token, seq.to_string().into(), idle)
            .await
            .unwrap();
    }
    assert_eq!(epochs.len(), 1, "one incarnation: {epochs:?}");
    let epoch = epochs.pop_first().unwrap();
    let own = store.redis_key(&session.record_key());
    let keys = keys_matching(&mut raw, &format!("{own}*")).await;
    assert!(
        keys.len() as u64 <= window + 1,
        "{} keys for a window of {window}: {keys:?}",
        keys.len()
    );
    // What is left is the session and the last answer, which the client has not acknowledged.
    let last = store.redis_key(&session.seq_key(epoch, 1_000));
    assert!(keys.contains(&own) && keys.contains(&last), "{keys:?}");
}

/// Garbage in a session's own record is a corrupt store, never a new session or a panic; the
/// garbage is left for someone to look at.
#[tokio::test]
async fn garbage_in_a_session_is_a_corrupt_error() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&redis_url().unwrap()).await.unwrap();
    let idle = Duration::from_secs(60);
    let request = |seq: u64, ack: u64| SessionRequest::new(seq, ack, 8, idle);
    let cases: [(&str, &str); 6] = [
        ("a", "x"),
        ("e", "x"),
        ("h", "-1"),
        ("a", "1.5"),
        ("e", "99999999999999999999"),
        // A highest number far past the mark and any window.
        ("h", "100000"),
    ];
    for (field, value) in cases {
        let session = fresh_session();
        assert!(matches!(
            store.open_session(&session, request(1, 0)).await,
            Ok(SessionGate::Open { .. })
        ));
        let name = store.redis_key(&session.record_key());
        let _: () = redis::cmd("HSET")
            .arg(&name)
            .arg(field)
            .arg(value)
            .query_async(&mut raw)
            .await
            .unwrap();
        for (seq, ack) in [(2, 0), (2, 1), (1, 0)] {
            let result = store.open_session(&session, request(seq, ack)).await;
            assert!(
                matches!(result, Err(StoreError::Corrupt(_))),
                "{field} = {value}, request ({seq}, {ack}): {result:?}"
            );
        }
        let still: Option<String> = redis::cmd("HGET")
            .arg(&name)
            .arg(field)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(
            still.as_deref(),
            Some(value),
            "the garbage is left as it was"
        );
    }
    // A hash without the session's fields, and a key of another type, are errors too, never
    // an unknown session.
    let session = fresh_session();
    let name = store.redis_key(&session.record_key());
    let _: () = redis::cmd("HSET")
        .arg(&name)
        .arg("zz")
        .arg("1")
        .query_async(&mut raw)
        .await
        .unwrap();
    let result = store.open_session(&session, request(1, 0)).await;
    assert!(matches!(result, Err(StoreError::Corrupt(_))), "{result:?}");
    let session = fresh_session();
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&session.record_key()))
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    for ack in [0, 1] {
        let result = store.open_session(&session, request(1, ack)).await;
        assert!(matches!(result, Err(StoreError::Backend(_))), "{result:?}");
    }
}

/// A session's numbers stored with leading zeros (the store writes none; a hand or a tool may)
/// are the same numbers: the gate names the request records from them as the store writes
/// numbers, drops the acknowledged one, and writes the epoch again in the store's form.
#[tokio::test]
async fn a_session_whose_numbers_have_leading_zeros_names_its_records_as_the_store_does() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = RedisStore::connect(&redis_url().unwrap()).await.unwrap();
    let session = fresh_session();
    let (idle, lease) = (Duration::from_secs(60), Duration::from_secs(30));
    let f = Fingerprint::from_bytes(b"leading zeros");
    let ask = async |seq: u64, ack: u64| {
        claim_in(&store, &session, (seq, ack), (idle, lease), &f)
            .await
            .unwrap()
    };
    assert!(matches!(
        ask(1, 0).await,
        SessionClaim::Admitted {
            claim: Claim::Claimed(_),
            ..
        }
    ));
    // A short epoch, as a hand would write it, and request 1's answer under it.
    let name = store.redis_key(&session.record_key());
    let _: () = redis::cmd("HSET")
        .arg(&name)
        .arg("e")
        .arg("0042")
        .arg("a")
        .arg("00")
        .arg("h")
        .arg("01")
        .query_async(&mut raw)
        .await
        .unwrap();
    let first_record = store.redis_key(&session.seq_key(42, 1));
    let _: () = redis::cmd("HSET")
        .arg(&first_record)
        .arg("s")
        .arg("c")
        .query_async(&mut raw)
        .await
        .unwrap();
    let SessionClaim::Admitted {
        epoch,
        claim: Claim::Claimed(_),
    } = ask(2, 1).await
    else {
        panic!("request 2 is admitted and claimed");
    };
    assert_eq!(epoch, 42);
    let exists = |key: String| {
        let mut raw = raw.clone();
        async move {
            let n: u64 = redis::cmd("EXISTS")
                .arg(key)
                .query_async(&mut raw)
                .await
                .unwrap();
            n == 1
        }
    };
    assert!(
        exists(store.redis_key(&session.seq_key(42, 2))).await,
        "request 2's record is named from the epoch as the store writes it"
    );
    assert!(
        !exists(first_record).await,
        "request 1's answer, acknowledged, is dropped"
    );
    let fields: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(&name)
        .arg("e")
        .arg("a")
        .arg("h")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        fields,
        [Some("42".into()), Some("1".into()), Some("2".into())],
        "the mark and the highest number moved and are written, and the epoch again in the \
         store's own form, since the scripts that give a claim back name records from it as \
         stored"
    );
}

/// A request outside the ranges the runtime sends is refused before it reaches Redis.
#[tokio::test]
async fn a_session_request_out_of_range_is_refused() {
    let Some(url) = redis_url() else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let idle = Duration::from_secs(60);
    for (seq, ack, window) in [
        (MAX_SEQ + 1, 0, 8),
        (1, MAX_SEQ + 1, 8),
        (1, 0, MAX_SESSION_WINDOW + 1),
    ] {
        let session = fresh_session();
        let result = store
            .open_session(&session, SessionRequest::new(seq, ack, window, idle))
            .await;
        assert!(
            matches!(result, Err(StoreError::Backend(_))),
            "({seq}, {ack}, {window}): {result:?}"
        );
    }
    // The largest numbers are kept exactly.
    let session = fresh_session();
    assert!(matches!(
        store
            .open_session(
                &session,
                SessionRequest::new(MAX_SEQ, 0, MAX_SESSION_WINDOW, idle)
            )
            .await,
        Ok(SessionGate::WindowFull { ack: 0 })
    ));
    let gate = |seq, ack| store.open_session(&session, SessionRequest::new(seq, ack, 1, idle));
    let SessionGate::Open { epoch } = gate(MAX_SEQ, MAX_SEQ - 1).await.unwrap() else {
        panic!("the largest number is admitted");
    };
    assert_eq!(
        gate(MAX_SEQ, MAX_SEQ - 1).await.unwrap(),
        SessionGate::Open { epoch }
    );
    assert_eq!(
        gate(MAX_SEQ - 1, 0).await.unwrap(),
        SessionGate::Acknowledged { ack: MAX_SEQ - 1 }
    );
    assert_eq!(
        gate(MAX_SEQ, MAX_SEQ).await.unwrap(),
        SessionGate::Acknowledged { ack: MAX_SEQ }
    );
}

/// With replicas required, the gate counts only once they have its writes: on a server with
/// none, a session is never started (its retry is refused the same way), and a refusal as
/// expired, which writes nothing, needs none.
#[tokio::test]
async fn without_the_replicas_required_the_session_gate_fails_closed() {
    let Some(url) = redis_url() else {
        return;
    };
    let waiting = RedisStore::builder(&url)
        .replicas(1)
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let session = fresh_session();
    let idle = Duration::from_secs(60);
    assert_eq!(
        waiting
            .open_session(&session, SessionRequest::new(2, 1, 8, idle))
            .await
            .unwrap(),
        SessionGate::Expired
    );
    for _ in 0..2 {
        match waiting
            .open_session(&session, SessionRequest::new(1, 0, 8, idle))
            .await
        {
            Err(StoreError::Unavailable(error)) => assert!(
                error.to_string().contains("acknowledged by 0 of the 1"),
                "{error}"
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

/// A session request's gate and claim (one script) with too few replicas: a claim fails
/// closed and is released (the same request then takes it over at once), and a refusal that
/// wrote nothing (expired) is answered.
#[tokio::test]
async fn without_the_replicas_required_a_session_claim_fails_closed_and_is_released() {
    let Some(url) = redis_url() else {
        return;
    };
    let waiting = RedisStore::builder(&url)
        .replicas(1)
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let plain = RedisStore::connect(&url).await.unwrap();
    let session = fresh_session();
    let (idle, lease) = (Duration::from_secs(60), Duration::from_secs(30));
    let f = Fingerprint::from_bytes(b"session replicas");
    let ask = async |store: &RedisStore, seq: u64, ack: u64| {
        claim_in(store, &session, (seq, ack), (idle, lease), &f).await
    };
    assert!(matches!(
        ask(&waiting, 2, 1).await,
        Ok(SessionClaim::Refused(SessionGate::Expired))
    ));
    match ask(&waiting, 1, 0).await {
        Err(StoreError::Unavailable(error)) => assert!(
            error.to_string().contains("acknowledged by 0 of the 1"),
            "{error}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    match ask(&plain, 1, 0).await {
        Ok(SessionClaim::Admitted {
            claim: Claim::TakenOver { .. },
            ..
        }) => {}
        other => panic!("the refused claim was released: expected a takeover, got {other:?}"),
    }
}

/// A session claim that lands after its caller stopped waiting (the server was frozen) is
/// given back through the session's epoch once the server answers: the same request then
/// takes it over at once instead of waiting out its lease.
#[tokio::test]
async fn a_session_claim_whose_caller_stopped_waiting_is_given_back() {
    let Some(redis) = idempotent_test_kit::redis::PrivateRedis::start("session-give-back").await
    else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let session = fresh_session();
    let (idle, lease) = (Duration::from_secs(60), Duration::from_secs(60));
    let f = Fingerprint::from_bytes(b"session give-back");
    let ask = async |seq: u64| claim_in(&store, &session, (seq, 0), (idle, lease), &f).await;
    // The session starts, so the request's record is found through its epoch.
    let epoch = match ask(1).await.unwrap() {
        SessionClaim::Admitted { epoch, .. } => epoch,
        other => panic!("request 1: {other:?}"),
    };
    let frozen = redis.freeze();
    let late = tokio::time::timeout(Duration::from_secs(2), ask(2)).await;
    assert!(
        matches!(late, Ok(Err(StoreError::Unavailable(_))) | Err(_)),
        "{late:?}"
    );
    drop(frozen);
    // Thawed: the claim lands, then its give-back; the same request takes it over.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match ask(2).await {
            Ok(SessionClaim::Admitted {
                epoch: again,
                claim: Claim::TakenOver { .. },
            }) => {
                assert_eq!(again, epoch);
                break;
            }
            Ok(SessionClaim::Admitted {
                claim: Claim::InFlight { .. },
                ..
            })
            | Err(StoreError::Unavailable(_)) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the late claim was not given back within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("request 2 after the thaw: {other:?}"),
        }
    }
}

/// A full Redis (`maxmemory` reached, `noeviction`) refuses a session request's claim, as it
/// refuses a key's, while a known session's `ack` still frees the answers it covers.
#[tokio::test]
async fn a_full_redis_refuses_a_session_claim_and_still_takes_its_ack() {
    let Some(redis) = idempotent_test_kit::redis::PrivateRedis::start("session-full").await else {
        return;
    };
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let session = fresh_session();
    let (idle, lease) = (Duration::from_secs(60), Duration::from_secs(30));
    let ask = async |seq: u64, ack: u64| {
        let f = Fingerprint::from_bytes(&seq.to_be_bytes());
        claim_in(&store, &session, (seq, ack), (idle, lease), &f).await
    };
    let (epoch, token) = match ask(1, 0).await.unwrap() {
        SessionClaim::Admitted {
            epoch,
            claim: Claim::Claimed(token),
        } => (epoch, token),
        other => panic!("request 1: {other:?}"),
    };
    store
        .complete(&session.seq_key(epoch, 1), token, "1".into(), idle)
        .await
        .unwrap();
    redis.config_set("maxmemory-policy", "noeviction").await;
    redis.config_set("maxmemory", "1").await;
    match ask(2, 1).await {
        Err(StoreError::Capacity { .. }) => {}
        other => panic!("a full Redis claimed: {other:?}"),
    }
    // The ack was taken: request 1 is acknowledged, and its answer is gone.
    let mark = store.session_mark(&session).await.unwrap();
    assert_eq!(mark.map(|m| (m.epoch, m.ack)), Some((epoch, 1)));
    redis.config_set("maxmemory", "0").await;
    assert!(matches!(
        ask(2, 1).await,
        Ok(SessionClaim::Admitted {
            claim: Claim::Claimed(_),
            ..
        })
    ));
}

/// A store with a key prefix of its own, so its index of saved requests holds only what the
/// test writes.
async fn isolated(url: &str) -> RedisStore {
    RedisStore::builder(url)
        .key_prefix(format!("steps-{}:", &fresh_key().to_hex()[..16]))
        .connect()
        .await
        .unwrap()
}

/// The score of `key`'s member of the index of saved requests (`PREFIX + "abandoned"`, member
/// the record's name without the prefix).
async fn index_score(
    store: &RedisStore,
    raw: &mut impl redis::aio::ConnectionLike,
    key: &idempotent_core::StorageKey,
) -> Option<u64> {
    let name = store.redis_key(key);
    let prefix = name.strip_suffix(&key.to_hex()).unwrap();
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(format!("{prefix}abandoned"))
        .arg(key.to_hex())
        .query_async(raw)
        .await
        .unwrap();
    score.map(|s| s as u64)
}

/// Where a record's lease ends (`l`), in the server's milliseconds.
async fn lease_end(
    store: &RedisStore,
    raw: &mut impl redis::aio::ConnectionLike,
    key: &idempotent_core::StorageKey,
) -> u64 {
    redis::cmd("HGET")
        .arg(store.redis_key(key))
        .arg("l")
        .query_async(raw)
        .await
        .unwrap()
}

/// `abandoned` on an isolated store (see [`isolated`]): a released record with a request and
/// one whose lease lapsed are listed once idle long enough, longest idle first; one without
/// a request, one still leased or renewed, one completed and one whose request a new lifetime
/// dropped are not, and the index is tidied as it is read. Returns the records' Redis keys.
async fn abandoned_scenario(
    store: &RedisStore,
    raw: &mut impl redis::aio::ConnectionLike,
) -> Vec<String> {
    let (long, short, ttl) = (
        Duration::from_secs(30),
        Duration::from_millis(200),
        Duration::from_secs(60),
    );
    let idle = Duration::from_millis(300);
    let fp = |label: &str| Fingerprint::from_bytes(label.as_bytes());
    let claim = async |key, label: &str, lease| match store
        .claim(key, &fp(label), lease, ttl)
        .await
        .unwrap()
    {
        Claim::Claimed(token) | Claim::TakenOver { token, .. } => token,
        other => panic!("{label} is claimed: {other:?}"),
    };
    let [
        released,
        bare,
        leased,
        completed,
        lapsed,
        renewed,
        renewed_again,
    ] = std::array::from_fn(|_| fresh_key());

    let token = claim(&released, "released", long).await;
    store
        .save_step(&released, token, "checkpoint".into())
        .await
        .unwrap();
    store
        .save_request(&released, token, "released".into())
        .await
        .unwrap();
    store.release(&released, token).await.unwrap();

    let token = claim(&bare, "bare", long).await;
    store.release(&bare, token).await.unwrap();

    let token = claim(&leased, "leased", long).await;
    store
        .save_request(&leased, token, "leased".into())
        .await
        .unwrap();

    let token = claim(&completed, "completed", long).await;
    store
        .save_request(&completed, token, "completed".into())
        .await
        .unwrap();
    assert!(index_score(store, raw, &completed).await.is_some());
    store
        .complete(&completed, token, "done".into(), ttl)
        .await
        .unwrap();
    assert_eq!(
        index_score(store, raw, &completed).await,
        None,
        "a completion removes its member"
    );

    let token = claim(&lapsed, "lapsed", short).await;
    store
        .save_request(&lapsed, token, "lapsed".into())
        .await
        .unwrap();

    let token = claim(&renewed, "renewed", short).await;
    store
        .save_request(&renewed, token, "renewed".into())
        .await
        .unwrap();
    store.renew(&renewed, token, long).await.unwrap();

    // A request saved, then a new lifetime that saves none: a record written before
    // lifetimes (no `o` field), which its request's next claim begins one on.
    let token = claim(&renewed_again, "first", long).await;
    store
        .save_request(&renewed_again, token, "first".into())
        .await
        .unwrap();
    store.release(&renewed_again, token).await.unwrap();
    let _: i64 = redis::cmd("HDEL")
        .arg(store.redis_key(&renewed_again))
        .arg("o")
        .query_async(raw)
        .await
        .unwrap();
    let Claim::Claimed(token) = store
        .claim(&renewed_again, &fp("first"), long, ttl)
        .await
        .unwrap()
    else {
        panic!("a record without a lifetime begins a new one");
    };
    store.release(&renewed_again, token).await.unwrap();

    assert_eq!(
        store
            .abandoned(Duration::from_secs(60), 100, None)
            .await
            .unwrap(),
        [],
        "nothing idle a minute yet"
    );
    tokio::time::sleep(idle + short + Duration::from_millis(200)).await;

    let found = store.abandoned(idle, 100, None).await.unwrap();
    let keys: Vec<_> = found.iter().map(|a| a.key).collect();
    assert_eq!(keys, [released, lapsed], "longest idle first: {found:?}");
    assert_eq!(&found[0].request[..], b"released");
    assert_eq!(found[0].fingerprint, fp("released"));
    assert_eq!(&found[1].request[..], b"lapsed");
    assert_eq!(found[1].fingerprint, fp("lapsed"));
    assert!(found.iter().all(|a| a.idle >= idle), "{found:?}");
    assert!(found[0].idle > found[1].idle, "{found:?}");
    // A read of the records: they are still there, abandoned.
    let first = store.abandoned(idle, 1, None).await.unwrap();
    assert_eq!(
        first.iter().map(|a| a.key).collect::<Vec<_>>(),
        [released],
        "at most the limit, longest idle first"
    );
    assert!(first[0].idle >= found[0].idle, "idle only grows: {first:?}");

    // The index, tidied: the renewed record's score moved to its lease's end, the dropped
    // request's member removed; the others as they were.
    assert_eq!(
        index_score(store, raw, &renewed).await,
        Some(lease_end(store, raw, &renewed).await)
    );
    assert_eq!(index_score(store, raw, &renewed_again).await, None);
    assert_eq!(index_score(store, raw, &bare).await, None);
    assert_eq!(
        index_score(store, raw, &leased).await,
        Some(lease_end(store, raw, &leased).await)
    );

    // Taken over by its own request, the released record is leased again, then completed.
    let token = match store
        .claim(&released, &fp("released"), long, ttl)
        .await
        .unwrap()
    {
        Claim::TakenOver { token, .. } => token,
        other => panic!("the released record is taken over: {other:?}"),
    };
    assert_eq!(
        &store.load_steps(&released, token).await.unwrap()[..],
        b"checkpoint"
    );
    let keys: Vec<_> = store
        .abandoned(idle, 100, None)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.key)
        .collect();
    assert_eq!(keys, [lapsed], "a record taken over is leased again");
    store
        .complete(&released, token, "done".into(), ttl)
        .await
        .unwrap();
    assert_eq!(index_score(store, raw, &released).await, None);
    let keys: Vec<_> = store
        .abandoned(idle, 100, None)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.key)
        .collect();
    assert_eq!(keys, [lapsed]);
    [
        released,
        bare,
        leased,
        completed,
        lapsed,
        renewed,
        renewed_again,
    ]
    .iter()
    .map(|key| store.redis_key(key))
    .collect()
}

#[tokio::test]
async fn abandoned_reads_the_index_of_saved_requests() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let store = isolated(&redis_url().unwrap()).await;
    abandoned_scenario(&store, &mut raw).await;
}

/// Checkpoints come back as the concatenation of the entries saved; only the current owner
/// of a live claim writes or reads them, or saves a request.
#[tokio::test]
async fn checkpoints_round_trip_and_are_fenced() {
    let Some(url) = redis_url() else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let f = Fingerprint::from_bytes(b"steps");
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let key = fresh_key();
    let Claim::Claimed(first) = store.claim(&key, &f, lease, ttl).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    assert!(store.load_steps(&key, first).await.unwrap().is_empty());
    let one = idempotent_core::steps::encode_checkpoint("reserve", b"\"r-1\"");
    let two = idempotent_core::steps::encode_checkpoint("charge", &[0, 255, 7]);
    store.save_step(&key, first, one.clone()).await.unwrap();
    store.save_step(&key, first, two.clone()).await.unwrap();
    let both = [one.as_ref(), two.as_ref()].concat();
    assert_eq!(store.load_steps(&key, first).await.unwrap(), both);
    store.release(&key, first).await.unwrap();
    let Claim::TakenOver { token: second, .. } = store.claim(&key, &f, lease, ttl).await.unwrap()
    else {
        panic!("taken over");
    };
    let stale = |result: Result<(), StoreError>, what: &str| {
        assert!(
            matches!(result, Err(StoreError::TokenRejected)),
            "{what}: {result:?}"
        )
    };
    stale(
        store.save_step(&key, first, "late".into()).await,
        "a released owner's checkpoint",
    );
    stale(
        store.save_request(&key, first, "late".into()).await,
        "a released owner's request",
    );
    assert!(matches!(
        store.load_steps(&key, first).await,
        Err(StoreError::TokenRejected)
    ));
    assert_eq!(
        store.load_steps(&key, second).await.unwrap(),
        both,
        "unchanged"
    );

    // A lease that lapsed: refused before anyone takes over, and after.
    let short = Duration::from_millis(150);
    let lapsing = fresh_key();
    let Claim::Claimed(token) = store.claim(&lapsing, &f, short, ttl).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    store.save_step(&lapsing, token, one.clone()).await.unwrap();
    tokio::time::sleep(short * 2).await;
    stale(
        store.save_step(&lapsing, token, "late".into()).await,
        "a lapsed owner's checkpoint",
    );
    stale(
        store.save_request(&lapsing, token, "late".into()).await,
        "a lapsed owner's request",
    );
    assert!(matches!(
        store.load_steps(&lapsing, token).await,
        Err(StoreError::TokenRejected)
    ));
    let Claim::TakenOver { token: next, .. } = store.claim(&lapsing, &f, lease, ttl).await.unwrap()
    else {
        panic!("taken over");
    };
    stale(
        store.save_step(&lapsing, token, "late".into()).await,
        "a stale owner's checkpoint",
    );
    assert_eq!(store.load_steps(&lapsing, next).await.unwrap(), one);
    // A record without a claim, or a completed one, takes none.
    let absent = fresh_key();
    stale(
        store.save_step(&absent, next, "x".into()).await,
        "a checkpoint on an absent record",
    );
    store
        .complete(&lapsing, next, "done".into(), ttl)
        .await
        .unwrap();
    stale(
        store.save_step(&lapsing, next, "x".into()).await,
        "a checkpoint on a completed record",
    );
    stale(
        store.save_request(&lapsing, next, "x".into()).await,
        "a request on a completed record",
    );
    assert!(matches!(
        store.load_steps(&lapsing, next).await,
        Err(StoreError::TokenRejected)
    ));
}

/// Garbage in a record the index names is skipped by `abandoned`, never a panic or a record
/// listed, and the other records are still listed; the garbage is left for someone to look
/// at. A member that names no record, a completed record or one without a request is only
/// removed from the index.
/// Checkpoints are handed back as stored: garbage in them is the runtime's to refuse.
#[tokio::test]
async fn garbage_in_saved_requests_is_skipped_and_the_rest_listed() {
    let Some(mut raw) = raw_connection().await else {
        return;
    };
    let url = redis_url().unwrap();
    let fingerprint = [7u8; 32];
    let corrupt: [&[(&str, &[u8])]; 6] = [
        &[
            ("s", b"i"),
            ("f", &fingerprint),
            ("l", b"soon"),
            ("r", b"x"),
        ],
        &[("s", b"i"), ("f", &fingerprint), ("l", b"-5"), ("r", b"x")],
        &[("s", b"i"), ("f", b"short"), ("l", b"0"), ("r", b"x")],
        &[("s", b"i"), ("l", b"0"), ("r", b"x")],
        &[("s", b"zz"), ("f", &fingerprint), ("l", b"0"), ("r", b"x")],
        &[("f", &fingerprint), ("l", b"0"), ("r", b"x")],
    ];
    let dropped: [&[(&str, &[u8])]; 3] = [
        &[
            ("s", b"c"),
            ("f", &fingerprint),
            ("p", b"done"),
            ("r", b"x"),
        ],
        &[("s", b"i"), ("f", &fingerprint), ("l", b"0")],
        &[
            ("s", b"i"),
            ("f", &fingerprint),
            ("l", b"0"),
            ("k", b"\x05ab"),
        ],
    ];
    let write = async |raw: &mut redis::aio::MultiplexedConnection,
                       store: &RedisStore,
                       key: &idempotent_core::StorageKey,
                       fields: &[(&str, &[u8])]| {
        let name = store.redis_key(key);
        let _: () = redis::cmd("HSET")
            .arg(&name)
            .arg(
                fields
                    .iter()
                    .flat_map(|(k, v)| [k.as_bytes().to_vec(), v.to_vec()])
                    .collect::<Vec<_>>(),
            )
            .query_async(raw)
            .await
            .unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg(&name)
            .arg(60_000)
            .query_async(raw)
            .await
            .unwrap();
        let _: () = redis::cmd("ZADD")
            .arg(name.strip_suffix(&key.to_hex()).unwrap().to_owned() + "abandoned")
            .arg(0)
            .arg(key.to_hex())
            .query_async(raw)
            .await
            .unwrap();
    };
    for fields in corrupt {
        let store = isolated(&url).await;
        let key = fresh_key();
        write(&mut raw, &store, &key, fields).await;
        // A good abandoned record beside it.
        let good = fresh_key();
        let Claim::Claimed(token) = store
            .claim(
                &good,
                &Fingerprint::from_bytes(b"good"),
                Duration::from_secs(60),
                Duration::from_secs(60),
            )
            .await
            .unwrap()
        else {
            panic!("claimed");
        };
        store
            .save_request(&good, token, bytes::Bytes::from_static(b"good"))
            .await
            .unwrap();
        store.release(&good, token).await.unwrap();
        let found = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
        assert_eq!(
            found.iter().map(|a| a.key).collect::<Vec<_>>(),
            [good],
            "{fields:?}"
        );
        assert_eq!(index_score(&store, &mut raw, &key).await, Some(0), "left");
    }
    for fields in dropped {
        let store = isolated(&url).await;
        let key = fresh_key();
        write(&mut raw, &store, &key, fields).await;
        assert_eq!(store.abandoned(Duration::ZERO, 10, None).await.unwrap(), []);
        assert_eq!(
            index_score(&store, &mut raw, &key).await,
            None,
            "{fields:?}"
        );
    }

    // A member of the index that names no key, and one whose key is of another type.
    let store = isolated(&url).await;
    let key = fresh_key();
    let index = store
        .redis_key(&key)
        .strip_suffix(&key.to_hex())
        .unwrap()
        .to_owned()
        + "abandoned";
    let _: () = redis::cmd("ZADD")
        .arg(&index)
        .arg(0)
        .arg("not a key")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(store.abandoned(Duration::ZERO, 10, None).await.unwrap(), []);
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(&index)
        .arg(0)
        .arg(-1)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(members.is_empty(), "removed: {members:?}");
    let store = isolated(&url).await;
    let name = store.redis_key(&key);
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(name.strip_suffix(&key.to_hex()).unwrap().to_owned() + "abandoned")
        .arg(0)
        .arg(key.to_hex())
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        store.abandoned(Duration::ZERO, 10, None).await.unwrap(),
        [],
        "a key of another type is skipped"
    );

    // Checkpoints that do not decode come back as they are.
    let store = RedisStore::connect(&url).await.unwrap();
    let key = fresh_key();
    let Claim::Claimed(token) = store
        .claim(
            &key,
            &Fingerprint::from_bytes(b"x"),
            Duration::from_secs(30),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let _: () = redis::cmd("HSET")
        .arg(store.redis_key(&key))
        .arg("k")
        .arg(b"\x05ab".as_slice())
        .query_async(&mut raw)
        .await
        .unwrap();
    let steps = store.load_steps(&key, token).await.unwrap();
    assert_eq!(&steps[..], b"\x05ab");
    assert!(matches!(
        idempotent_core::steps::Checkpoints::decode(steps),
        Err(StoreError::Corrupt(_))
    ));
}

/// With replicas required, a checkpoint or a request counts only once they have it: on a
/// server with none, each fails closed (though written), and a stale token is still refused
/// as such.
#[tokio::test]
async fn without_the_replicas_required_a_checkpoint_fails_closed() {
    let Some(url) = redis_url() else {
        return;
    };
    let waiting = RedisStore::builder(&url)
        .replicas(1)
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let plain = RedisStore::connect(&url).await.unwrap();
    let key = fresh_key();
    let Claim::Claimed(token) = plain
        .claim(
            &key,
            &Fingerprint::from_bytes(b"replicas"),
            Duration::from_secs(30),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    for result in [
        waiting.save_step(&key, token, "step".into()).await,
        waiting.save_request(&key, token, "request".into()).await,
    ] {
        match result {
            Err(StoreError::Unavailable(error)) => assert!(
                error.to_string().contains("acknowledged by 0 of the 1"),
                "{error}"
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(&plain.load_steps(&key, token).await.unwrap()[..], b"step");
    let stale = idempotent_core::FencingToken::new(token.get() - 1);
    assert!(matches!(
        waiting.save_step(&key, stale, "step".into()).await,
        Err(StoreError::TokenRejected)
    ));
    assert!(matches!(
        waiting.save_request(&key, stale, "request".into()).await,
        Err(StoreError::TokenRejected)
    ));
}
