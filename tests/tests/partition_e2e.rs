//! The `payments` example over a store cut off by a real network partition: the store's server
//! runs in a network namespace of its own joined to the host by a veth pair, and the host's end
//! goes down for 8 s (packets vanish, connections hang: neither a stopped process nor a refused
//! connection). Payments are sent at a steady pace, each with a new key, before, during and
//! after the partition. Once the link is back the service answers again within about a second
//! of it (a connection whose command timed out is replaced, not waited on until TCP's next
//! retransmission), answers nothing but `201` from then on, and no payment runs twice.
//!
//! Needs `ip` (iproute2) and root for the namespace; skipped with a notice otherwise (a
//! failure under `IDEMPOTENT_REQUIRE_BACKENDS=1`).

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use idempotent_test_kit::netns::Netns;
use idempotent_test_kit::postgres::PrivatePostgres;
use idempotent_test_kit::redis::PrivateRedis;
use support::{Client, Protocol, Server, payment_id};
use tokio::sync::Mutex;
use tokio::time::Instant;

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

/// The spacing of the payments sent.
const PACE: Duration = Duration::from_millis(100);
/// How long the store is cut off.
const PARTITION: Duration = Duration::from_secs(8);
/// How long payments keep coming after the heal: longer than TCP's retransmission backoff
/// leaves a connection that was mid-command during the partition stuck (5–6 s).
const AFTER_HEAL: Duration = Duration::from_secs(8);
/// Within how many payments sent after the heal (at [`PACE`]) one must be `201`: about one
/// second.
const RECOVERED_WITHIN: usize = 10;
/// Payments sent at once before the workload, to warm the service up.
const WARM_UP: usize = 32;
/// The most one payment may take to be answered before the test counts it as unanswered.
const ANSWER_LIMIT: Duration = Duration::from_secs(20);

/// One payment sent by the workload.
struct Sent {
    key: String,
    at: Instant,
    /// Its status, or `None` if it got no answer within [`ANSWER_LIMIT`].
    status: Option<StatusCode>,
    id: Option<u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_answers_within_a_second_of_the_heal() {
    let Some(netns) = Netns::create() else {
        return;
    };
    let Some(redis) = PrivateRedis::start_in("partition", &netns).await else {
        return;
    };
    partition_and_heal("redis", &redis.url(), &netns).await;
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_answers_within_a_second_of_the_heal() {
    let Some(netns) = Netns::create() else {
        return;
    };
    let Some(postgres) = PrivatePostgres::start_in(&netns).await else {
        return;
    };
    partition_and_heal("postgres", &postgres.url(), &netns).await;
    drop(postgres);
}

async fn partition_and_heal(label: &str, store: &str, netns: &Netns) {
    let server = Server::payments_logged(&[("IDEMPOTENCY_STORE", store)]).await;
    let client = Client::new(Protocol::Http1);
    let url = server.url("/payments");
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();

    // A warm service: a burst of concurrent payments opens several pooled connections, as
    // a service under load has, which the partition then finds idle.
    let burst: Vec<_> = (0..WARM_UP)
        .map(|n| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let key = format!("warm-{n}");
                let answer = client.post(&url, Some(&key), Some("alice"), PAYMENT).await;
                assert_eq!(answer.status, StatusCode::CREATED, "warm-up payment {n}");
                Sent {
                    key,
                    at: Instant::now(),
                    status: Some(answer.status),
                    id: Some(payment_id(&answer)),
                }
            })
        })
        .collect();
    for payment in burst {
        let payment = tokio::time::timeout(ANSWER_LIMIT, payment)
            .await
            .expect("a warm-up payment was not answered in time")
            .expect("a warm-up payment failed");
        sent.lock().await.push(payment);
    }

    // A steady workload: one payment every PACE with a new key, each on a task of its own so
    // that one that hangs does not hold back the next.
    let workload = {
        let (client, url, sent) = (client.clone(), url.clone(), sent.clone());
        let total =
            (Duration::from_secs(1) + PARTITION + AFTER_HEAL).as_millis() / PACE.as_millis();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(PACE);
            let mut tasks = Vec::new();
            for n in 0..total {
                ticks.tick().await;
                let key = format!("partition-{n}");
                let at = Instant::now();
                let index = {
                    let mut sent = sent.lock().await;
                    sent.push(Sent {
                        key: key.clone(),
                        at,
                        status: None,
                        id: None,
                    });
                    sent.len() - 1
                };
                let (client, url, sent) = (client.clone(), url.clone(), sent.clone());
                tasks.push(tokio::spawn(async move {
                    let answer = tokio::time::timeout(
                        ANSWER_LIMIT,
                        client.try_send(
                            http::Method::POST,
                            &url,
                            &[
                                ("content-type", "application/json"),
                                ("idempotency-key", &key),
                                ("authorization", "Bearer alice"),
                            ],
                            PAYMENT,
                        ),
                    )
                    .await;
                    if let Ok(Ok(answer)) = answer {
                        let mut sent = sent.lock().await;
                        sent[index].status = Some(answer.status);
                        if answer.status == StatusCode::CREATED {
                            sent[index].id = Some(payment_id(&answer));
                        }
                    }
                }));
            }
            for task in tasks {
                let _ = task.await;
            }
        })
    };

    tokio::time::sleep(Duration::from_secs(1)).await;
    netns.cut();
    tokio::time::sleep(PARTITION).await;
    netns.heal();
    let healed = Instant::now();
    tokio::time::timeout(
        AFTER_HEAL + ANSWER_LIMIT + Duration::from_secs(10),
        workload,
    )
    .await
    .expect("the workload did not finish in time")
    .expect("the workload panicked");

    let sent = std::mem::take(&mut *sent.lock().await);
    let show = |s: &Sent| match s.status {
        Some(status) => status.as_u16().to_string(),
        None => "---".into(),
    };
    let before: Vec<String> = sent.iter().filter(|s| s.at < healed).map(show).collect();
    let after: Vec<&Sent> = sent.iter().filter(|s| s.at >= healed).collect();
    let after_shown: Vec<String> = after.iter().map(|s| show(s)).collect();
    eprintln!(
        "{label}: sent before the heal: {}\n{label}: sent after the heal (every {PACE:?}): {}",
        before.join(" "),
        after_shown.join(" ")
    );

    // The service answered before the partition.
    assert!(
        sent.iter()
            .take(5)
            .any(|s| s.status == Some(StatusCode::CREATED)),
        "{label}: no payment was answered 201 before the partition"
    );
    let first = after
        .iter()
        .position(|s| s.status == Some(StatusCode::CREATED))
        .unwrap_or_else(|| panic!("{label}: no payment sent after the heal was answered 201"));
    assert!(
        first < RECOVERED_WITHIN,
        "{label}: the first 201 after the heal was payment {} sent after it (one every \
         {PACE:?}); expected within {RECOVERED_WITHIN}: {}",
        first + 1,
        after_shown.join(" ")
    );
    let refused: Vec<usize> = after
        .iter()
        .enumerate()
        .skip(first)
        .filter(|(_, s)| s.status != Some(StatusCode::CREATED))
        .map(|(n, _)| n + 1)
        .collect();
    assert!(
        refused.is_empty(),
        "{label}: payments sent after the heal, after the first 201, were not answered 201 \
         (their positions after the heal: {refused:?}): {}",
        after_shown.join(" ")
    );

    // Nothing ran twice: every payment not answered 201 is retried until it is (its claim,
    // if it landed unanswered, is given back once the store answers), and then each key has
    // one payment and the handler ran once per key.
    let mut ids = std::collections::HashMap::new();
    for s in &sent {
        let id = match s.id {
            Some(id) => id,
            None => retry_until_created(&client, &url, &s.key).await,
        };
        ids.insert(s.key.clone(), id);
    }
    let distinct: std::collections::HashSet<u64> = ids.values().copied().collect();
    assert_eq!(
        distinct.len(),
        sent.len(),
        "{label}: two keys were answered with one payment"
    );
    assert_eq!(
        client.count(&server).await,
        sent.len() as u64,
        "{label}: the handler ran a number of times other than once per key"
    );
}

/// Sends the payment under `key` again until it is answered `201` (bounded), and its id.
async fn retry_until_created(client: &Client, url: &str, key: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let answer = client.post(url, Some(key), Some("alice"), PAYMENT).await;
        if answer.status == StatusCode::CREATED {
            return payment_id(&answer);
        }
        assert!(
            Instant::now() < deadline,
            "the payment {key} was still answered {} 45 s after the partition",
            answer.status
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
