//! The cache tier (`IDEMPOTENCY_CACHE`) end to end, with real processes and real servers: two
//! `payments` instances on one shared store (Redis, PostgreSQL), each with an in-process cache
//! of finished records; a Redis tier in front of PostgreSQL whose Redis is killed and comes
//! back empty under load; an instance started while its Redis tier is down; and malformed
//! values.
//!
//! What is checked is what the rules of `idempotent-cache` promise, seen from outside:
//!
//! - a cached record replays byte for byte on every instance, and the cache is used (its
//!   `idempotency_cache_lookups_total{outcome="hit"}` grows);
//! - a cached copy never outlives its record: once the TTL has passed, the key runs again on
//!   whichever instance gets it first, and every instance then replays the new answer, not the
//!   copy it held;
//! - nothing in flight is cached: a duplicate of a running request gets `409 in_flight` from
//!   both instances, then both replay the answer;
//! - the Redis tier is a hint: while it is down every request goes to PostgreSQL (lookups count
//!   as `error`), nothing runs twice, and once it is back (empty) it is filled and hit again.
//!
//! Each instance has its own simulated payment provider, so "charged once" across instances is
//! the sum of their charges. Needs the `payments` example built
//! (`cargo build -p examples --examples --all-features`), the shared Redis and PostgreSQL
//! servers (`IDEMPOTENT_TEST_REDIS_URL`, `IDEMPOTENT_TEST_POSTGRES_URL`) and `redis-server` on
//! `PATH` for the private ones; without them a test says loudly that it did not run, or fails
//! where backends are required (`IDEMPOTENT_REQUIRE_BACKENDS=1`).

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http::StatusCode;
use idempotent_test_kit::backend::{postgres_url, redis_url};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::process::{eventually, within};
use idempotent_test_kit::redis::PrivateRedis;
use support::{Answer, Client, Protocol, Server, metric, payment_id};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;
const PRINCIPAL: &str = "alice";
/// The records' time to live in the tests of expiry: short, so a test waits it out.
const TTL: &str = "3s";
const TTL_DURATION: Duration = Duration::from_secs(3);
/// The servers' log filter: the library's warnings (a failing Redis tier says so), printed when
/// a test fails.
const LOG: &str = "warn";

// ----- requests and counters -----

/// `POST path` with the test's body and principal under `key`; bounded.
async fn pay(client: &Client, server: &Server, path: &str, key: &str) -> Answer {
    within(
        &format!("POST {path} ({key}) to port {}", server.port),
        Duration::from_secs(30),
        client.post(&server.url(path), Some(key), Some(PRINCIPAL), PAYMENT),
    )
    .await
}

/// Asserts `answer` is a fresh (not replayed) `201 Created`.
fn assert_fresh(answer: &Answer, what: &str) {
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "{what}: {:?}",
        answer.body
    );
    assert!(!answer.replayed(), "{what}: replayed, expected a fresh run");
}

/// Asserts `answer` replays `original`: the same status, body and `Location`, marked replayed.
fn assert_replays(answer: &Answer, original: &Answer, what: &str) {
    assert_eq!(answer.status, original.status, "{what}: {:?}", answer.body);
    assert!(answer.replayed(), "{what}: not marked replayed");
    assert_eq!(
        answer.body, original.body,
        "{what}: the replay is not byte-identical"
    );
    assert_eq!(
        answer.headers.get("location"),
        original.headers.get("location"),
        "{what}"
    );
}

/// Charges the instances' providers made, together.
async fn charges(client: &Client, servers: &[&Server]) -> u64 {
    let mut total = 0;
    for server in servers {
        total += within(
            "GET /payments/count",
            Duration::from_secs(10),
            client.charges(server),
        )
        .await;
    }
    total
}

/// Handler runs on the instances, together.
async fn executions(client: &Client, servers: &[&Server]) -> u64 {
    let mut total = 0;
    for server in servers {
        total += within(
            "GET /payments/count",
            Duration::from_secs(10),
            client.count(server),
        )
        .await;
    }
    total
}

/// The instance's metrics, in Prometheus's text format.
async fn scrape(client: &Client, server: &Server) -> String {
    let answer = within(
        "GET /metrics",
        Duration::from_secs(10),
        client.get(&server.url("/metrics")),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    String::from_utf8_lossy(&answer.body).into_owned()
}

/// `idempotency_cache_lookups_total{tier, outcome}` in `scrape`; every outcome is exported
/// once the tier exists.
fn lookups(scrape: &str, tier: &str, outcome: &str) -> f64 {
    metric(
        scrape,
        "idempotency_cache_lookups_total",
        &[("tier", tier), ("outcome", outcome)],
    )
    .unwrap_or_else(|| {
        panic!("no idempotency_cache_lookups_total{{tier={tier},outcome={outcome}}} in:\n{scrape}")
    })
}

/// `idempotency_cache_writes_total{tier, result}` in `scrape`.
fn writes(scrape: &str, tier: &str, result: &str) -> f64 {
    metric(
        scrape,
        "idempotency_cache_writes_total",
        &[("tier", tier), ("result", result)],
    )
    .unwrap_or_else(|| {
        panic!("no idempotency_cache_writes_total{{tier={tier},result={result}}} in:\n{scrape}")
    })
}

/// Two `payments` instances on the store `store`, each with an in-process cache of 1000
/// finished records and records living [`TTL`].
async fn two_cached_instances(store: &str) -> (Server, Server) {
    let env = [
        ("IDEMPOTENCY_STORE", store),
        ("IDEMPOTENCY_CACHE", "memory:1000"),
        ("IDEMPOTENCY_TTL", TTL),
        ("RUST_LOG", LOG),
    ];
    (
        Server::payments_logged(&env).await,
        Server::payments_logged(&env).await,
    )
}

// ----- two instances with in-process caches on one shared store -----

/// A key answered by one instance replays on both, from their caches; once its record has
/// expired, it runs again on the instance that gets it first, and both replay the new answer,
/// never the copy they held.
async fn cached_replays_across_instances_and_expiry(store: &str) {
    let (a, b) = two_cached_instances(store).await;
    let client = Client::new(Protocol::Http1);
    let both = [&a, &b];
    // One key answered first by each instance, so that each instance's stale copy is the
    // first one asked after the expiry on one of them.
    let by_a = unique("cache_by_a");
    let by_b = unique("cache_by_b");

    let first_a = pay(&client, &a, "/payments", &by_a).await;
    let first_b = pay(&client, &b, "/payments", &by_b).await;
    // Each record expires at most TTL after its answer arrived.
    let expired_at = Instant::now() + TTL_DURATION + Duration::from_millis(300);
    assert_fresh(&first_a, "first request of the key on A");
    assert_fresh(&first_b, "first request of the key on B");
    for round in 0..3 {
        for (name, server) in [("A", &a), ("B", &b)] {
            for (key, first) in [(&by_a, &first_a), (&by_b, &first_b)] {
                let retry = pay(&client, server, "/payments", key).await;
                assert_replays(&retry, first, &format!("round {round}: {key} on {name}"));
            }
        }
    }
    assert_eq!(client.charges(&a).await, 1, "A charged its key once");
    assert_eq!(client.charges(&b).await, 1, "B charged its key once");
    assert_eq!(executions(&client, &both).await, 2, "one run per key");
    for (name, server) in [("A", &a), ("B", &b)] {
        let metrics = scrape(&client, server).await;
        assert!(
            lookups(&metrics, "memory", "hit") > 0.0,
            "{name} answered no replay from its cache:\n{metrics}"
        );
        assert!(
            writes(&metrics, "memory", "ok") > 0.0,
            "{name} cached nothing:\n{metrics}"
        );
    }

    // Past the TTL, the records are gone: a cached copy must not answer.
    sleep_until(expired_at).await;
    for (key, first, runs, other) in [(&by_a, &first_a, &a, &b), (&by_b, &first_b, &b, &a)] {
        let before = client.charges(runs).await;
        let renewed = pay(&client, runs, "/payments", key).await;
        assert_fresh(&renewed, &format!("{key} after its TTL"));
        assert_ne!(
            renewed.body, first.body,
            "{key}: the expired answer was served"
        );
        assert!(
            payment_id(&renewed) > payment_id(first),
            "{key}: a new payment, not the expired one"
        );
        assert_eq!(
            client.charges(runs).await,
            before + 1,
            "{key}: charged again once, a new operation"
        );
        // The other instance held a copy of the expired record: it replays the new one.
        for (name, server) in [("the other instance", other), ("the same instance", runs)] {
            for attempt in 0..2 {
                let retry = pay(&client, server, "/payments", key).await;
                assert_replays(
                    &retry,
                    &renewed,
                    &format!("{key} after its TTL, on {name}, attempt {attempt}"),
                );
            }
        }
    }
    assert_eq!(
        charges(&client, &both).await,
        4,
        "two keys, each charged once per record lifetime"
    );
    assert_eq!(executions(&client, &both).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_caches_on_redis_replay_across_instances_and_never_outlive_the_record() {
    let Some(store) = redis_url() else {
        return;
    };
    cached_replays_across_instances_and_expiry(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_caches_on_postgres_replay_across_instances_and_never_outlive_the_record() {
    let Some(store) = postgres_url() else {
        return;
    };
    cached_replays_across_instances_and_expiry(&store).await;
}

/// A duplicate arriving while the first request runs gets 409 from both instances (nothing in
/// flight is cached, and nothing negative), then both replay the answer.
async fn in_flight_duplicates_on_both_instances(store: &str) {
    let (a, b) = two_cached_instances(store).await;
    let client = Client::new(Protocol::Http1);
    let key = unique("cache_in_flight");
    // The query is part of the request: every duplicate sends the same one.
    let path = "/payments?delay_ms=2000";
    let first = tokio::spawn({
        let (client, url, key) = (client.clone(), a.url(path), key.clone());
        async move {
            within(
                "the first request",
                Duration::from_secs(30),
                client.post(&url, Some(&key), Some(PRINCIPAL), PAYMENT),
            )
            .await
        }
    });
    sleep(Duration::from_millis(300)).await;
    for attempt in 0..2 {
        for (name, server) in [("A", &a), ("B", &b)] {
            let duplicate = pay(&client, server, path, &key).await;
            assert_eq!(
                duplicate.status,
                StatusCode::CONFLICT,
                "attempt {attempt} on {name}: {:?}",
                duplicate.body
            );
            assert_eq!(duplicate.problem_code(), "in_flight");
            assert!(duplicate.headers.contains_key("retry-after"));
        }
    }
    let first = first.await.unwrap();
    assert_fresh(&first, "the first request");
    for attempt in 0..3 {
        for (name, server) in [("A", &a), ("B", &b)] {
            let retry = pay(&client, server, path, &key).await;
            assert_replays(&retry, &first, &format!("attempt {attempt} on {name}"));
        }
    }
    assert_eq!(charges(&client, &[&a, &b]).await, 1, "charged once");
    assert_eq!(executions(&client, &[&a, &b]).await, 1, "run once");
    for (name, server) in [("A", &a), ("B", &b)] {
        let metrics = scrape(&client, server).await;
        assert!(
            lookups(&metrics, "memory", "hit") > 0.0,
            "{name} answered no replay from its cache:\n{metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_flight_get_409_from_both_cached_instances_on_redis() {
    let Some(store) = redis_url() else {
        return;
    };
    in_flight_duplicates_on_both_instances(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_flight_get_409_from_both_cached_instances_on_postgres() {
    let Some(store) = postgres_url() else {
        return;
    };
    in_flight_duplicates_on_both_instances(&store).await;
}

// ----- a Redis tier in front of PostgreSQL -----

/// Distinct keys of the load.
const KEYS: usize = 300;
/// Keys run at once.
const WORKERS: usize = 16;
/// Keys from this one on wait until Redis is back.
const AFTER_RESTART: usize = 200;
/// Redis is killed once this many keys are done.
const KILL_AFTER: usize = 100;

/// A `201` answer, as kept for the checks.
struct Seen {
    body: Bytes,
    replayed: bool,
}

/// Sends `key` to `server` until it is answered: a `409 in_flight` is "retry later"; anything
/// but `201` and `409` fails the test. The answer, and how many 409s came first.
async fn settle(client: &Client, server: &Server, path: &str, key: &str) -> (Seen, u64) {
    let mut conflicts = 0;
    within(
        &format!("an answer to {key} from port {}", server.port),
        Duration::from_secs(60),
        async {
            loop {
                let answer = client
                    .post(&server.url(path), Some(key), Some(PRINCIPAL), PAYMENT)
                    .await;
                match answer.status {
                    StatusCode::CREATED => {
                        return (
                            Seen {
                                replayed: answer.replayed(),
                                body: answer.body,
                            },
                            conflicts,
                        );
                    }
                    StatusCode::CONFLICT => {
                        assert_eq!(answer.problem_code(), "in_flight", "{key}");
                        conflicts += 1;
                        sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!(
                        "{key} on port {}: unexpected {other}: {:?}",
                        server.port, answer.body
                    ),
                }
            }
        },
    )
    .await
}

/// The path every request of key number `i` uses: one key in four runs for 50 ms, so its
/// concurrent duplicates overlap it.
fn load_path(i: usize) -> &'static str {
    if i.is_multiple_of(4) {
        "/payments?delay_ms=50"
    } else {
        "/payments"
    }
}

/// Sends key number `i` five times, alternating between the instances; for one key in four
/// the first three at once. Every answer, and the 409s met.
async fn drive_key(
    client: &Client,
    servers: &[Server; 2],
    i: usize,
    key: &str,
) -> (Vec<Seen>, u64) {
    let path = load_path(i);
    let (x, y) = (&servers[i % 2], &servers[1 - i % 2]);
    let mut seen = Vec::new();
    let mut conflicts = 0;
    let mut keep = |(answer, met): (Seen, u64)| {
        seen.push(answer);
        conflicts += met;
    };
    if i.is_multiple_of(4) {
        let (one, two, three) = tokio::join!(
            settle(client, x, path, key),
            settle(client, y, path, key),
            settle(client, x, path, key),
        );
        keep(one);
        keep(two);
        keep(three);
    } else {
        keep(settle(client, x, path, key).await);
        keep(settle(client, y, path, key).await);
        keep(settle(client, x, path, key).await);
    }
    keep(settle(client, y, path, key).await);
    keep(settle(client, x, path, key).await);
    (seen, conflicts)
}

/// What a worker of the load hands back: each key it drove, with its answers and 409s.
type Driven = Vec<(usize, (Vec<Seen>, u64))>;

/// Waits until `done` reaches `at_least`. No worker ends before the last third of the load is
/// let through, so one that has ended panicked: the wait stops there.
async fn progress(done: &AtomicUsize, at_least: usize, workers: &[JoinHandle<Driven>]) {
    eventually(
        &format!("{at_least} keys answered"),
        Duration::from_secs(120),
        || async move {
            assert!(
                !workers.iter().any(JoinHandle::is_finished),
                "a worker of the load stopped early (it panicked; see its message above)"
            );
            done.load(Ordering::SeqCst) >= at_least
        },
    )
    .await;
}

/// `lookups(…, "redis", outcome)` of each instance.
async fn redis_lookups(client: &Client, servers: &[Server; 2], outcome: &str) -> [f64; 2] {
    let a = scrape(client, &servers[0]).await;
    let b = scrape(client, &servers[1]).await;
    [lookups(&a, "redis", outcome), lookups(&b, "redis", outcome)]
}

/// Redis in front of PostgreSQL, SIGKILLed under load and started again empty on its port: the
/// tier is only a hint. Every key runs once across both instances, every answer of a key is
/// byte-identical, nothing fails; the tier is hit before the kill, fails over to PostgreSQL
/// while Redis is down, and is filled and hit again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_tier_over_postgres_survives_redis_killed_and_restarted_empty() {
    let Some(store) = postgres_url() else {
        return;
    };
    // No persistence: started again, it is empty.
    let Some(mut redis) = PrivateRedis::start("cache-tier").await else {
        return;
    };
    let tier = redis.url();
    let env = [
        ("IDEMPOTENCY_STORE", store.as_str()),
        ("IDEMPOTENCY_CACHE", tier.as_str()),
        ("RUST_LOG", LOG),
    ];
    let servers = Arc::new([
        Server::payments_logged(&env).await,
        Server::payments_logged(&env).await,
    ]);
    let client = Client::new(Protocol::Http1);
    let prefix = unique("cache_load");
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("{prefix}-{i}")).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let (restarted, restarted_rx) = tokio::sync::watch::channel(false);

    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (client, servers, keys, next, done) = (
                client.clone(),
                Arc::clone(&servers),
                Arc::clone(&keys),
                Arc::clone(&next),
                Arc::clone(&done),
            );
            let mut restarted = restarted_rx.clone();
            tokio::spawn(async move {
                let mut answered: Driven = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= KEYS {
                        return answered;
                    }
                    if i >= AFTER_RESTART {
                        restarted.wait_for(|up| *up).await.unwrap();
                    }
                    answered.push((i, drive_key(&client, &servers, i, &keys[i]).await));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    // Under load, with Redis up: the tier answers replays.
    progress(&done, KILL_AFTER, &workers).await;
    let hits_before = redis_lookups(&client, &servers, "hit").await;
    let errors_before = redis_lookups(&client, &servers, "error").await;
    for (instance, hits) in hits_before.iter().enumerate() {
        assert!(*hits > 0.0, "instance {instance}: no hit before the kill");
    }

    // Redis dies mid-run; the load goes on.
    redis.kill().await;
    let killed_at = Instant::now();
    // A key of its own per instance while Redis is down: run on one, replayed on both.
    let mut probes = Vec::new();
    for (instance, (runs, other)) in [(&servers[0], &servers[1]), (&servers[1], &servers[0])]
        .into_iter()
        .enumerate()
    {
        let key = format!("{prefix}-outage-{instance}");
        let first = pay(&client, runs, "/payments", &key).await;
        assert_fresh(&first, &format!("{key} while Redis is down"));
        for server in [other, runs] {
            let retry = pay(&client, server, "/payments", &key).await;
            assert_replays(&retry, &first, &format!("{key} while Redis is down"));
        }
        probes.push((key, first));
    }
    progress(&done, AFTER_RESTART, &workers).await;
    sleep_until(killed_at + Duration::from_secs(1)).await;
    let errors_down = redis_lookups(&client, &servers, "error").await;
    for instance in 0..2 {
        assert!(
            errors_down[instance] > errors_before[instance],
            "instance {instance}: no lookup failed while Redis was down \
             ({} before the kill, {} after)",
            errors_before[instance],
            errors_down[instance]
        );
    }

    // Redis comes back, empty, on the same port. Once the tier has reconnected (after its
    // rest) and been filled, it answers replays again; then the rest of the load runs.
    redis.restart().await;
    let hits_at_restart = redis_lookups(&client, &servers, "hit").await;
    eventually(
        "both instances hitting the restarted Redis",
        Duration::from_secs(30),
        || {
            let (client, servers, probes) = (&client, &servers, &probes);
            async move {
                let hits = redis_lookups(client, servers, "hit").await;
                if hits[0] > hits_at_restart[0] && hits[1] > hits_at_restart[1] {
                    return true;
                }
                for (key, first) in probes {
                    for server in servers.iter() {
                        let retry = pay(client, server, "/payments", key).await;
                        assert_replays(&retry, first, &format!("{key} after the restart"));
                    }
                }
                sleep(Duration::from_millis(100)).await;
                false
            }
        },
    )
    .await;
    restarted.send(true).unwrap();
    let mut answers: BTreeMap<usize, Vec<Seen>> = BTreeMap::new();
    let mut conflicts = 0;
    for worker in workers {
        for (i, (seen, met)) in within("the load", Duration::from_secs(300), worker)
            .await
            .unwrap()
        {
            answers.insert(i, seen);
            conflicts += met;
        }
    }
    assert_eq!(answers.len(), KEYS, "every key was driven");

    // Every key: one fresh run, every answer byte-identical.
    for (i, seen) in &answers {
        let fresh: Vec<_> = seen.iter().filter(|s| !s.replayed).collect();
        assert_eq!(fresh.len(), 1, "key {i}: {} fresh answers", fresh.len());
        for answer in seen {
            assert_eq!(
                answer.body, fresh[0].body,
                "key {i}: answers differ: {:?} and {:?}",
                answer.body, fresh[0].body
            );
        }
    }
    assert!(
        conflicts > 0,
        "no concurrent duplicate overlapped its first request"
    );

    // Every key replays on both instances once more, through the tier being filled again
    // (only what was answered since the restart is in it).
    let replays = futures_util::stream::iter(0..KEYS)
        .map(|i| {
            let (client, servers, key) = (&client, &servers, &keys[i]);
            async move {
                let a = settle(client, &servers[0], load_path(i), key).await.0;
                let b = settle(client, &servers[1], load_path(i), key).await.0;
                (i, [a, b])
            }
        })
        .buffer_unordered(WORKERS)
        .collect::<Vec<_>>()
        .await;
    for (i, pair) in replays {
        for answer in pair {
            assert!(answer.replayed, "key {i} ran again after the restart");
            assert_eq!(answer.body, answers[&i][0].body, "key {i}");
        }
    }
    for (key, first) in &probes {
        for server in servers.iter() {
            let retry = pay(&client, server, "/payments", key).await;
            assert_replays(&retry, first, key);
        }
    }

    let distinct = (KEYS + probes.len()) as u64;
    let both = [&servers[0], &servers[1]];
    assert_eq!(
        charges(&client, &both).await,
        distinct,
        "one charge per distinct key across both instances"
    );
    assert_eq!(
        executions(&client, &both).await,
        distinct,
        "one run per distinct key across both instances"
    );
}

/// The Redis tier connects lazily: an instance started while its Redis cannot be reached
/// serves from the store (every lookup counts as `error`), and uses the tier once Redis is
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_while_its_redis_tier_is_down_serves_from_the_store() {
    let Some(store) = postgres_url() else {
        return;
    };
    let Some(mut redis) = PrivateRedis::start("cache-lazy").await else {
        return;
    };
    let tier = redis.url();
    // Its port now refuses connections.
    redis.kill().await;
    let env = [
        ("IDEMPOTENCY_STORE", store.as_str()),
        ("IDEMPOTENCY_CACHE", tier.as_str()),
        ("RUST_LOG", LOG),
    ];
    let server = Server::payments_logged(&env).await;
    let client = Client::new(Protocol::Http1);
    let key = unique("cache_lazy");
    let first = pay(&client, &server, "/payments", &key).await;
    assert_fresh(&first, "the first request with the tier down");
    for attempt in 0..3 {
        let retry = pay(&client, &server, "/payments", &key).await;
        assert_replays(
            &retry,
            &first,
            &format!("replay {attempt} with the tier down"),
        );
    }
    let metrics = scrape(&client, &server).await;
    assert!(
        lookups(&metrics, "redis", "error") > 0.0,
        "lookups went to an unreachable tier without failing:\n{metrics}"
    );
    assert_eq!(lookups(&metrics, "redis", "hit"), 0.0, "{metrics}");

    // Redis comes up on that port: the tier connects and is used.
    redis.restart().await;
    eventually(
        "the tier connecting once Redis is up",
        Duration::from_secs(30),
        || {
            let (client, server, key, first) = (&client, &server, &key, &first);
            async move {
                let retry = pay(client, server, "/payments", key).await;
                assert_replays(&retry, first, "a replay while the tier connects");
                let metrics = scrape(client, server).await;
                if lookups(&metrics, "redis", "hit") > 0.0 {
                    return true;
                }
                sleep(Duration::from_millis(100)).await;
                false
            }
        },
    )
    .await;
    assert_eq!(client.charges(&server).await, 1, "charged once");
    assert_eq!(client.count(&server).await, 1, "run once");
}

// ----- configuration -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cache_setting_exits_with_status_2_naming_the_variable() {
    for value in [
        "memory:0",
        "memory:x",
        "memory:",
        "memory:-1",
        "memory",
        "ftp://x",
        "100",
    ] {
        let refused = support::refused_at_start(
            tokio::process::Command::new(support::example_binary("payments"))
                .env("PORT", "0")
                .env_remove("IDEMPOTENCY_STORE")
                .env("IDEMPOTENCY_CACHE", value),
            &format!("payments with IDEMPOTENCY_CACHE={value:?}"),
        )
        .await;
        let stderr = refused.stderr;
        assert!(
            stderr.contains(&format!("IDEMPOTENCY_CACHE={value:?} is not a cache tier")),
            "{value:?}: {stderr}"
        );
        assert!(
            !refused.stdout.contains("listening"),
            "{value:?}: it listened"
        );
    }
}

/// A Redis tier in front of the memory store is refused: it would go on answering for records
/// the store forgets with its process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_tier_in_front_of_the_memory_store_is_refused() {
    let stderr = support::refused_at_start(
        tokio::process::Command::new(support::example_binary("payments"))
            .env("PORT", "0")
            .env_remove("IDEMPOTENCY_STORE")
            .env("IDEMPOTENCY_CACHE", "redis://127.0.0.1:1"),
        "payments with a Redis tier on the memory store",
    )
    .await
    .stderr;
    assert!(
        stderr.contains("IDEMPOTENCY_CACHE: a Redis cache tier in front of the memory store"),
        "{stderr}"
    );
}
