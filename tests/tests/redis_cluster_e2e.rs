//! The `payments` example on a real Redis Cluster (three primaries, three replicas, started by
//! `scripts/test.sh`): two instances sharing it execute duplicates once, and a primary's
//! failover in the middle of a load of fresh and replayed requests is ridden out without
//! restarting the app, with no answered key running again. The tests share one cluster and
//! move its primaries, so they take turns.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use idempotent_core::{Claim, Fingerprint, Store};
use idempotent_redis::RedisStore;
use idempotent_test_kit::cluster::Cluster;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::process::Frozen;
use support::{Client, Protocol, Server};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_across_two_instances_on_a_cluster_execute_once_per_key() {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _turn = cluster.turn().await;
    let urls = cluster.urls();
    let env = [("IDEMPOTENCY_STORE", urls)];
    let a = Server::payments(&env).await;
    let b = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    let run = unique("cluster");
    let keys: Vec<&'static str> = ["a", "b", "c"]
        .iter()
        .map(|k| &*format!("cluster-{run}-{k}").leak())
        .collect();
    let start = Arc::new(tokio::sync::Barrier::new(40 * keys.len()));
    let mut tasks = Vec::new();
    for &key in &keys {
        for i in 0..40 {
            let url = if i % 2 == 0 { &a } else { &b }.url("/payments?delay_ms=300");
            let (client, start) = (client.clone(), Arc::clone(&start));
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                (
                    key,
                    client.post(&url, Some(key), Some("alice"), PAYMENT).await,
                )
            }));
        }
    }
    let mut fresh = BTreeMap::<&str, usize>::new();
    for task in tasks {
        let (key, answer) = task.await.unwrap();
        match answer.status {
            StatusCode::CREATED if !answer.replayed() => *fresh.entry(key).or_default() += 1,
            StatusCode::CREATED | StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
    }
    assert_eq!(fresh.values().copied().collect::<Vec<_>>(), [1, 1, 1]);
    let executions = client.count(&a).await + client.count(&b).await;
    assert_eq!(executions, 3, "one execution per key across both instances");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_under_load_loses_no_answered_key_and_needs_no_restart() {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _turn = cluster.turn().await;
    let urls = cluster.urls();
    cluster.wait_until_ok().await;
    let server = Server::payments(&[("IDEMPOTENCY_STORE", urls)]).await;
    let client = Client::new(Protocol::Http1);
    let pay = |key: String| {
        let (client, url) = (client.clone(), server.url("/payments"));
        async move { client.post(&url, Some(&key), Some("alice"), PAYMENT).await }
    };

    // Before: fresh payments, each answered with its id.
    let run = unique("cluster");
    let mut answered = BTreeMap::new();
    for n in 0..60 {
        let key = format!("{run}-before-{n}");
        let answer = pay(key.clone()).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        answered.insert(key, answer.json()["id"].clone());
    }

    // A replica takes over its primary (a coordinated failover: it first catches up).
    let replica = *cluster
        .with_role("slave")
        .await
        .first()
        .expect("the cluster has replicas");
    let failover = tokio::spawn(Cluster::failover_to(replica));

    // During and after: new payments and replays of the old ones, until the replica is a
    // primary and twenty requests in a row have succeeded. Only 201 or a clean 503 (the
    // store briefly unreachable: fail closed) may come back.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut in_a_row, mut unavailable, mut n) = (0, 0, 0);
    let keys: Vec<String> = answered.keys().cloned().collect();
    while in_a_row < 20 || Cluster::role(replica).await != "master" {
        assert!(Instant::now() < deadline, "the app did not recover");
        n += 1;
        let (key, fresh) = if n % 2 == 0 {
            (keys[n % keys.len()].clone(), false)
        } else {
            (format!("{run}-during-{n}"), true)
        };
        let answer = pay(key.clone()).await;
        match answer.status {
            StatusCode::CREATED => {
                in_a_row += 1;
                let id = answer.json()["id"].clone();
                if fresh {
                    assert!(!answer.replayed());
                    answered.insert(key, id);
                } else {
                    assert!(answer.replayed(), "{key} ran again");
                    assert_eq!(id, answered[&key], "{key} answered another payment");
                }
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(answer.problem_code(), "store_unavailable");
                in_a_row = 0;
                unavailable += 1;
                if fresh {
                    // Refused before it ran: retried below like any other key.
                    continue;
                }
            }
            other => panic!("unexpected {other} for {key}: {:?}", answer.body),
        }
    }

    failover.await.unwrap();
    // Every key answered before, during or after the failover replays its own payment, and
    // the handler ran once per answered key.
    for (key, id) in &answered {
        // A result whose write met the failover is written again in the background while
        // its claim is held: its retries get 409 until then.
        let answer = loop {
            let answer = pay(key.clone()).await;
            if answer.status != StatusCode::CONFLICT {
                break answer;
            }
            assert!(Instant::now() < deadline, "{key} stayed in flight");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(answer.replayed(), "{key} ran again after the failover");
        assert_eq!(&answer.json()["id"], id);
    }
    assert_eq!(client.count(&server).await, answered.len() as u64);
    eprintln!(
        "failover: {} keys answered, {unavailable} requests got 503 meanwhile, {n} requests \
         until twenty in a row succeeded on the new primary",
        answered.len()
    );
}

/// Payments answered before a primary is killed with SIGKILL, its replica a second behind,
/// with `replicas` replicas required to acknowledge each claim and record: the app recovers by
/// itself, and returns how many payments were answered and how many of them ran again after
/// the failover.
async fn kill_a_primary_under_load(cluster: &Cluster, replicas: &str) -> (usize, u64) {
    let urls = cluster.urls();
    cluster.wait_until_ok().await;
    let server = Server::payments(&[
        ("IDEMPOTENCY_STORE", urls),
        ("IDEMPOTENCY_REDIS_REPLICAS", replicas),
    ])
    .await;
    let client = Client::new(Protocol::Http1);
    let run = unique("cluster");
    // Load: four clients paying new keys as fast as they can; the primary dies among them.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for worker in 0..4 {
        let (client, url, stop, run) = (
            client.clone(),
            server.url("/payments"),
            Arc::clone(&stop),
            run.clone(),
        );
        load.push(tokio::spawn(async move {
            let mut answered = BTreeMap::new();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                let key = format!("{run}-{worker}-{n}");
                let answer = client.post(&url, Some(&key), Some("alice"), PAYMENT).await;
                match answer.status {
                    StatusCode::CREATED => {
                        answered.insert(key, answer.json()["id"].clone());
                    }
                    StatusCode::SERVICE_UNAVAILABLE => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    other => panic!("unexpected {other}: {:?}", answer.body),
                }
            }
            answered
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let primary = cluster.with_role("master").await[0];
    let replica = cluster.replica_of(primary).await;
    // The replica falls behind: frozen, its link to the primary cut (what the primary had
    // sent it already sits in its socket), then a second of load that reaches only the
    // primary, which then dies with those writes.
    let mut frozen = Frozen::new();
    frozen.stop(Cluster::node_pid(replica));
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut Cluster::node(primary).await)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed = Cluster::kill(primary);
    drop(frozen);
    // The cluster promotes the dead primary's replica after its node timeout (2 s); the load
    // goes on meanwhile, then for a while on the new primary.
    let deadline = Instant::now() + Duration::from_secs(60);
    // The dead node does not answer, so three primaries means its replica took over.
    while cluster.with_role("master").await.len() != 3 {
        assert!(Instant::now() < deadline, "no replica was promoted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut answered = BTreeMap::new();
    for worker in load {
        answered.extend(worker.await.unwrap());
    }
    let before = client.count(&server).await;
    assert_eq!(
        before,
        answered.len() as u64,
        "one execution per answered payment"
    );

    // Every answered payment is retried once, on the cluster as it is now (the killed node
    // still down).
    let deadline = Instant::now() + Duration::from_secs(60);
    for (key, id) in &answered {
        let answer = loop {
            let answer = client
                .post(&server.url("/payments"), Some(key), Some("alice"), PAYMENT)
                .await;
            if answer.status != StatusCode::CONFLICT
                && answer.status != StatusCode::SERVICE_UNAVAILABLE
            {
                break answer;
            }
            assert!(
                Instant::now() < deadline,
                "{key} was never answered again: {} {:?}",
                answer.status,
                answer.body
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{key}: {:?}",
            answer.body
        );
        if answer.replayed() {
            assert_eq!(&answer.json()["id"], id, "{key} answered another payment");
        }
    }
    let ran_again = client.count(&server).await - before;
    if replicas != "0" {
        // The promoted replica has no replica of its own until the killed node rejoins: a
        // new key there cannot be acknowledged, so it is refused and given back.
        let store = RedisStore::builder(urls)
            .replicas(replicas.parse().unwrap())
            .connect()
            .await
            .unwrap();
        let key = loop {
            let key = idempotent_core::conformance::fresh_key();
            let slot = Cluster::slot_of(replica, &store.redis_key(&key)).await;
            if cluster.primary_of_slot(slot).await == replica {
                break key;
            }
        };
        let f = Fingerprint::from_bytes(b"new");
        match store
            .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
            .await
        {
            Err(idempotent_core::StoreError::Unavailable(error)) => {
                assert!(error.to_string().contains("acknowledged by 0"), "{error}");
            }
            other => panic!("a new key on the shard without a replica: {other:?}"),
        }
        cluster.restart(killed).await;
        // With the node back as its replica, the shard takes new keys again (this one
        // continues the lifetime of the claim that was given back).
        assert!(matches!(
            store
                .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(30))
                .await,
            Ok(Claim::Claimed(_) | Claim::TakenOver { .. })
        ));
    } else {
        cluster.restart(killed).await;
    }
    (answered.len(), ran_again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replica_acknowledgement_a_killed_primary_loses_no_answered_key() {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _turn = cluster.turn().await;
    let (answered, ran_again) = kill_a_primary_under_load(&cluster, "1").await;
    eprintln!("SIGKILL with WAIT 1: {answered} payments answered, {ran_again} ran again");
    assert!(answered > 20, "the load ran: {answered} payments");
    assert_eq!(
        ran_again, 0,
        "an answered payment ran again after the failover"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replica_acknowledgement_a_primary_that_dies_ahead_of_its_replica_loses_answered_keys()
 {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _turn = cluster.turn().await;
    // Replication is asynchronous: payments the dead primary answered and had not replicated
    // run again, the documented risk the option closes. The app still recovers by itself
    // and every payment is answered.
    let (answered, ran_again) = kill_a_primary_under_load(&cluster, "0").await;
    eprintln!("SIGKILL without WAIT: {answered} payments answered, {ran_again} ran again");
    assert!(answered > 20, "the load ran: {answered} payments");
    assert!(
        ran_again > 0,
        "with the replica behind, some answered payments are lost with the primary"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_increasing_across_a_failover() {
    let Some(cluster) = Cluster::from_env() else {
        return;
    };
    let _turn = cluster.turn().await;
    let urls = cluster.urls();
    cluster.wait_until_ok().await;
    let store = RedisStore::connect(urls).await.unwrap();
    let f = Fingerprint::from_bytes(b"fence");
    let key = idempotent_core::conformance::fresh_key();
    let lease = Duration::from_millis(500);
    let Claim::Claimed(first) = store.claim(&key, &f, lease, lease).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    // The replica of the key's primary takes over, then the lease lapses there.
    let slot = Cluster::slot_of(cluster.ports()[0], &store.redis_key(&key)).await;
    let primary = cluster.primary_of_slot(slot).await;
    Cluster::failover_to(cluster.replica_of(primary).await).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    tokio::time::sleep(lease * 2).await;
    let second = loop {
        match store.claim(&key, &f, lease, lease).await {
            Ok(Claim::Claimed(token)) => break token,
            Ok(other) => panic!("the lapsed claim is taken over, not {other:?}"),
            Err(_) => {
                assert!(Instant::now() < deadline, "the store did not recover");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(second > first, "{second:?} after {first:?}");
    // The old owner's token is refused on the new primary.
    assert!(
        store
            .complete(&key, first, "stale".into(), Duration::from_secs(60))
            .await
            .is_err()
    );
}
