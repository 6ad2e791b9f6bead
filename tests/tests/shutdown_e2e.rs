//! SIGTERM to a real `payments` process during a long request, with a second instance on the
//! same Redis: the request in flight finishes and is recorded before the process exits, so its
//! retry on the other instance replays it; requests arriving meanwhile get `503 shutting_down`.

mod support;

use std::time::Duration;

use http::StatusCode;
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use support::{Client, Protocol, Server};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_long_request_records_it_and_the_other_instance_replays_it() {
    let Some(redis) = redis_url() else {
        return;
    };
    let env = [("IDEMPOTENCY_STORE", redis.as_str())];
    let mut stopping = Server::payments_logged(&env).await;
    let other = Server::payments(&env).await;
    let client = Client::new(Protocol::Http1);
    // Unique per run: the shared Redis outlives the test.
    let run = unique("run");
    let (long, late) = (format!("sigterm-long-{run}"), format!("sigterm-late-{run}"));

    let in_flight = tokio::spawn({
        let (client, url, key) = (
            client.clone(),
            stopping.url("/payments?delay_ms=1500"),
            long.clone(),
        );
        async move { client.post(&url, Some(&key), Some("alice"), PAYMENT).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    stopping.signal("TERM");
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Shutting down: a new payment is refused with a hint, and nothing runs for it.
    let refused = client
        .post(
            &stopping.url("/payments"),
            Some(&late),
            Some("alice"),
            PAYMENT,
        )
        .await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.problem_code(), "shutting_down");
    assert!(refused.headers.contains_key("retry-after"));

    // The request in flight gets its response, and the process then exits cleanly.
    let first = in_flight.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let exit = tokio::time::timeout(Duration::from_secs(15), stopping.child.wait())
        .await
        .expect("the process exits once its requests are done")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    assert!(
        stopping
            .logs
            .text()
            .contains("every request in flight finished"),
        "{}",
        stopping.logs.text()
    );

    // The client's retry lands on the other instance and replays the recorded response.
    // (The same request: its query is part of the fingerprint.)
    let retry = client
        .post(
            &other.url("/payments?delay_ms=1500"),
            Some(&long),
            Some("alice"),
            PAYMENT,
        )
        .await;
    assert!(retry.replayed(), "status {}", retry.status);
    assert_eq!(retry.body, first.body);
    // The refused request was never claimed: it runs there, once.
    let late_retry = client
        .post(&other.url("/payments"), Some(&late), Some("alice"), PAYMENT)
        .await;
    assert_eq!(late_retry.status, StatusCode::CREATED);
    assert!(!late_retry.replayed());
    assert_eq!(client.count(&other).await, 1);
}
