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
use idempotent_core::conformance::backend_url;
use support::{Client, Protocol, Server};

const URLS_VAR: &str = "IDEMPOTENT_TEST_REDIS_CLUSTER_URLS";
const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

/// One cluster test at a time: a failover moves primaries under the others' feet.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A prefix for this run's keys: records outlive a test run in the cluster.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

/// The ports of the cluster's nodes, from the URLs.
fn ports(urls: &str) -> Vec<u16> {
    urls.split(',')
        .map(|url| url.rsplit(':').next().unwrap().parse().unwrap())
        .collect()
}

async fn redis(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `ROLE` of the node on `port`: `master` or `slave`.
async fn role(port: u16) -> String {
    let role: Vec<redis::Value> = redis::cmd("ROLE")
        .query_async(&mut redis(port).await)
        .await
        .unwrap();
    match &role[0] {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        other => panic!("unexpected ROLE reply {other:?}"),
    }
}

async fn wait_for_cluster_ok(ports: &[u16]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for &port in ports {
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut redis(port).await)
                .await
                .unwrap();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster did not settle");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_across_two_instances_on_a_cluster_execute_once_per_key() {
    let Some(urls) = backend_url(URLS_VAR) else {
        return;
    };
    let _turn = CLUSTER.lock().await;
    let env = [("IDEMPOTENCY_STORE", urls.as_str())];
    let a = Server::payments(&env).await;
    let b = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    let run = run_id();
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
    let Some(urls) = backend_url(URLS_VAR) else {
        return;
    };
    let _turn = CLUSTER.lock().await;
    let ports = ports(&urls);
    wait_for_cluster_ok(&ports).await;
    let server = Server::payments(&[("IDEMPOTENCY_STORE", urls.as_str())]).await;
    let client = Client::new(Protocol::Http1);
    let pay = |key: String| {
        let (client, url) = (client.clone(), server.url("/payments"));
        async move { client.post(&url, Some(&key), Some("alice"), PAYMENT).await }
    };

    // Before: fresh payments, each answered with its id.
    let run = run_id();
    let mut answered = BTreeMap::new();
    for n in 0..60 {
        let key = format!("{run}-before-{n}");
        let answer = pay(key.clone()).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        answered.insert(key, answer.json()["id"].clone());
    }

    // A replica takes over its primary (a coordinated failover: it first catches up).
    let mut replica = None;
    for &port in &ports {
        if role(port).await == "slave" {
            replica = Some(port);
            break;
        }
    }
    let replica = replica.expect("the cluster has replicas");
    let _: String = redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .query_async(&mut redis(replica).await)
        .await
        .unwrap();

    // During and after: new payments and replays of the old ones, until the replica is a
    // primary and twenty requests in a row have succeeded. Only 201 or a clean 503 (the
    // store briefly unreachable: fail closed) may come back.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut in_a_row, mut unavailable, mut n) = (0, 0, 0);
    let keys: Vec<String> = answered.keys().cloned().collect();
    while in_a_row < 20 || role(replica).await != "master" {
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
