//! The payments example on Redis, with real processes: two app instances sharing one Redis, an
//! instance killed with SIGKILL mid-request, Redis stopped and started again under load, and
//! the round trips each request costs, counted by the server.

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use idempotent_test_kit::redis::PrivateRedis;
use support::{Client, Protocol, Server};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

/// Commands clients sent to the server, by name, read over `c`. Redis also counts the
/// commands a script runs inside the server; those are not round trips and are left out.
async fn client_commands(
    c: &mut redis::aio::MultiplexedConnection,
) -> std::collections::BTreeMap<String, u64> {
    const INSIDE_SCRIPTS: [&str; 13] = [
        "hmget", "hset", "pexpire", "pttl", "time", "del", "hdel", "hexists", "hget", "hlen",
        "hkeys", "hsetnx", "hincrby",
    ];
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .filter(|(name, _)| !INSIDE_SCRIPTS.contains(&name.as_str()))
        .collect()
}

/// Commands sent between two snapshots, leaving out the `INFO` that took the second one.
fn sent(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> u64 {
    let total = |m: &std::collections::BTreeMap<String, u64>| m.values().sum::<u64>();
    total(after) - total(before) - 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_duplicates_across_two_instances_execute_once() {
    let Some(redis) = PrivateRedis::start_durable("two-instances").await else {
        return;
    };
    let env = [("IDEMPOTENCY_STORE", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a = Server::payments(&env).await;
    let b = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    let start = Arc::new(tokio::sync::Barrier::new(40));
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let url = if i % 2 == 0 {
                a.url("/payments?delay_ms=300")
            } else {
                b.url("/payments?delay_ms=300")
            };
            let (client, start) = (client.clone(), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                client
                    .post(&url, Some("shared-order"), Some("alice"), PAYMENT)
                    .await
            })
        })
        .collect();
    let (mut fresh, mut conflict, mut replayed) = (0, 0, 0);
    let mut ids = std::collections::BTreeSet::new();
    for task in tasks {
        let answer = task.await.unwrap();
        match answer.status {
            StatusCode::CREATED => {
                ids.insert(answer.json()["id"].as_u64().unwrap());
                if answer.replayed() {
                    replayed += 1
                } else {
                    fresh += 1
                }
            }
            StatusCode::CONFLICT => conflict += 1,
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(fresh + conflict + replayed, 40);
    let total = client.count(&a).await + client.count(&b).await;
    assert_eq!(total, 1, "exactly one execution across both instances");
    // A retry on either instance replays the one payment.
    for server in [&a, &b] {
        let retry = client
            .post(
                &server.url("/payments?delay_ms=300"),
                Some("shared-order"),
                Some("alice"),
                PAYMENT,
            )
            .await;
        assert!(retry.replayed());
        ids.insert(retry.json()["id"].as_u64().unwrap());
    }
    assert_eq!(ids.len(), 1, "every answer names the same payment");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_instance_keeps_the_key_until_its_lease_ends_then_the_retry_runs_once() {
    let Some(redis) = PrivateRedis::start_durable("kill").await else {
        return;
    };
    let env = [
        ("IDEMPOTENCY_STORE", redis.url()),
        ("IDEMPOTENCY_LEASE", "2s".into()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut doomed = Server::payments(&env).await;
    let survivor = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);

    // A slow payment starts on the doomed instance, which dies before it finishes.
    let in_flight = tokio::spawn({
        let (client, url) = (client.clone(), doomed.url("/payments?delay_ms=5000"));
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                client.post(&url, Some("crash"), Some("alice"), PAYMENT),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed_at = tokio::time::Instant::now();
    doomed.signal("KILL");
    let _ = doomed.child.wait().await;
    drop(in_flight);

    // Until the dead owner's lease ends, the survivor refuses the retry.
    let url = survivor.url("/payments?delay_ms=5000");
    let retry = client
        .post(&url, Some("crash"), Some("alice"), PAYMENT)
        .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.problem_code(), "in_flight");
    // Then it runs the retry, once.
    let mut answer;
    loop {
        answer = client
            .post(
                &survivor.url("/payments?delay_ms=5000"),
                Some("crash"),
                Some("alice"),
                PAYMENT,
            )
            .await;
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(8),
            "the lease never ended"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        killed_at.elapsed() >= Duration::from_millis(1500),
        "taken over before the lease ended"
    );
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(!answer.replayed());
    let again = client
        .post(
            &survivor.url("/payments?delay_ms=5000"),
            Some("crash"),
            Some("alice"),
            PAYMENT,
        )
        .await;
    assert!(again.replayed());
    assert_eq!(
        client.count(&survivor).await,
        1,
        "the survivor ran the payment exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_fails_closed_and_service_resumes_without_a_restart() {
    let Some(mut redis) = PrivateRedis::start_durable("outage").await else {
        return;
    };
    let env = [("IDEMPOTENCY_STORE", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    let url = server.url("/payments");
    let before = client
        .post(&url, Some("before-outage"), Some("alice"), PAYMENT)
        .await;
    assert_eq!(before.status, StatusCode::CREATED);

    redis.stop().await;
    for i in 0..5 {
        let answer = client
            .post(&url, Some(&format!("during-{i}")), Some("alice"), PAYMENT)
            .await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(answer.problem_code(), "store_unavailable");
        assert!(answer.headers.contains_key("retry-after"));
    }
    assert_eq!(
        client.count(&server).await,
        1,
        "nothing ran while the store was down"
    );

    redis.restart().await;
    let mut recovered = None;
    for _ in 0..50 {
        let answer = client
            .post(&url, Some("after-outage"), Some("alice"), PAYMENT)
            .await;
        if answer.status == StatusCode::CREATED {
            recovered = Some(answer);
            break;
        }
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        recovered.is_some_and(|a| !a.replayed()),
        "service resumed without restarting the app"
    );
    let replay = client
        .post(&url, Some("before-outage"), Some("alice"), PAYMENT)
        .await;
    assert!(
        replay.replayed(),
        "records written before the outage still replay"
    );
    assert_eq!(replay.body, before.body);
    assert_eq!(client.count(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_costs_two_round_trips_and_replay_one() {
    let Some(redis) = PrivateRedis::start_durable("round-trips").await else {
        return;
    };
    let env = [("IDEMPOTENCY_STORE", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    let url = server.url("/payments");
    // Warm up: the server loads each script on first use.
    client
        .post(&url, Some("warm-up"), Some("alice"), PAYMENT)
        .await;
    client
        .post(&url, Some("warm-up"), Some("alice"), PAYMENT)
        .await;

    // One open connection for the snapshots, so no handshake commands are counted.
    let mut stats = redis.connection().await;
    let t0 = client_commands(&mut stats).await;
    assert!(
        !client
            .post(&url, Some("counted"), Some("alice"), PAYMENT)
            .await
            .replayed()
    );
    let t1 = client_commands(&mut stats).await;
    assert!(
        client
            .post(&url, Some("counted"), Some("alice"), PAYMENT)
            .await
            .replayed()
    );
    let t2 = client_commands(&mut stats).await;
    assert_eq!(
        sent(&t0, &t1),
        2,
        "a fresh request: claim + complete; {t0:?} -> {t1:?}"
    );
    assert_eq!(sent(&t1, &t2), 1, "a replay: claim; {t1:?} -> {t2:?}");
    assert_eq!(
        t2["evalsha"] - t0["evalsha"],
        3,
        "every round trip is one script"
    );
}
