//! A key whose first attempt's claim lapsed mid-work stays that request's (issue 39, item 10):
//! on real `payments` processes over Redis and PostgreSQL, the process dies in the middle of
//! a request (it aborts right after the charge of `POST /orders`, or is `SIGKILL`ed while
//! `POST /payments` works), its lease (1 s, by the store's clock) lapses, and then:
//!
//! - a request with *another body* under the same key is `422 fingerprint_mismatch` (not a new
//!   operation: the first attempt may have taken effect), however often it is sent;
//! - the first request's retry still takes the operation over and finishes it (the charge is
//!   not made again), and replays it after that; the other body is still `422`.

mod support;

use std::os::unix::process::ExitStatusExt as _;
use std::time::Duration;

use http::{Method, StatusCode};
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use support::{Answer, Client, Protocol, Server};

/// A bound on waits that should take a second or two; never an assertion on speed.
const PATIENCE: Duration = Duration::from_secs(120);

/// The lease the processes run with.
const LEASE: &str = "1s";

/// Longer than [`LEASE`]: by then the dead process's claim has lapsed on the store's clock.
const PAST_THE_LEASE: Duration = Duration::from_millis(2500);

/// The signal `std::process::abort` raises.
const SIGABRT: i32 = 6;
const SIGKILL: i32 = 9;

fn order_body(amount: u64) -> String {
    format!(r#"{{"sku":"tea","quantity":2,"amount":{amount},"currency":"EUR"}}"#)
}

/// `POST {path}` as `alice` with `key`: `Err` when no answer came (the process died).
async fn post(
    client: &Client,
    server: &Server,
    path: &str,
    key: &str,
    body: &str,
) -> Result<Answer, String> {
    client
        .try_send(
            Method::POST,
            &server.url(path),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer alice"),
                ("idempotency-key", key),
            ],
            body.to_owned(),
        )
        .await
}

/// Sends `body` under `key` until it is answered with something other than `409` or `503`.
async fn retry_until_answered(
    client: &Client,
    server: &Server,
    path: &str,
    key: &str,
    body: &str,
) -> Answer {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Ok(answer) = post(client, server, path, key, body).await
            && answer.status != StatusCode::CONFLICT
            && answer.status != StatusCode::SERVICE_UNAVAILABLE
        {
            return answer;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} was not answered within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `body` under `key` is refused as another request's: `422 fingerprint_mismatch`, twice.
async fn assert_mismatch(client: &Client, server: &Server, path: &str, key: &str, body: &str) {
    for attempt in ["first", "second"] {
        let answer = post(client, server, path, key, body)
            .await
            .expect("answered");
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{attempt} request with another body under the lapsed key: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.problem_code(), "fingerprint_mismatch");
    }
}

/// `GET /orders/count` of `server`: the counter `name`.
async fn count(client: &Client, server: &Server, name: &str) -> u64 {
    let answer = client.get(&server.url("/orders/count")).await;
    assert_eq!(answer.status, StatusCode::OK);
    answer.json()[name].as_u64().expect("a count")
}

/// `POST /orders` aborts its process right after the charge; another body under its key is
/// 422 once the lease lapsed, and the first body's retry finishes the order without charging
/// again.
async fn an_order_that_died_after_its_charge(url: &str) {
    let env = [("IDEMPOTENCY_STORE", url), ("IDEMPOTENCY_LEASE", LEASE)];
    let client = Client::new(Protocol::Http1);
    let key = unique("lapsed-order");
    let (body, other) = (order_body(1200), order_body(99_000));

    let mut first = Server::payments_logged(&env).await;
    let sent = post(&client, &first, "/orders?crash_after=charge", &key, &body).await;
    assert!(sent.is_err(), "the process answered instead of aborting");
    let status = tokio::time::timeout(PATIENCE, first.child.wait())
        .await
        .expect("the process exits")
        .unwrap();
    assert_eq!(status.signal(), Some(SIGABRT), "{status:?}");

    let second = Server::payments_logged(&env).await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    assert_mismatch(&client, &second, "/orders", &key, &other).await;
    assert_eq!(count(&client, &second, "runs").await, 0, "nothing ran");

    let answer = retry_until_answered(&client, &second, "/orders", &key, &body).await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(!answer.replayed(), "finished by the retry");
    assert_eq!(answer.json()["amount"], 1200, "the first request's order");
    assert_eq!(count(&client, &second, "runs").await, 1);
    assert_eq!(
        count(&client, &second, "charged").await,
        0,
        "the charge the first process made is not made again"
    );

    let again = post(&client, &second, "/orders", &key, &body)
        .await
        .expect("answered");
    assert!(again.replayed());
    assert_eq!(again.body, answer.body);
    assert_mismatch(&client, &second, "/orders", &key, &other).await;
}

/// `POST /payments` is `SIGKILL`ed while it works (it holds the claim);
/// another body under its key is 422 once the lease lapsed, and the first body's retry runs
/// it and then replays it.
async fn a_payment_killed_while_it_worked(url: &str) {
    let env = [("IDEMPOTENCY_STORE", url), ("IDEMPOTENCY_LEASE", LEASE)];
    let client = Client::new(Protocol::Http1);
    let key = unique("lapsed-payment");
    // The delay is part of the request (its query), so the retry sends it too: long enough
    // that the first process is surely still working when it is killed.
    let path = "/payments?delay_ms=4000";
    let body = r#"{"amount":1999,"currency":"EUR"}"#;
    let other = r#"{"amount":5,"currency":"EUR"}"#;

    let mut first = Server::payments_logged(&env).await;
    let working = tokio::spawn({
        let (client, url, key) = (client.clone(), first.url(path), key.clone());
        async move {
            client
                .try_send(
                    Method::POST,
                    &url,
                    &[
                        ("content-type", "application/json"),
                        ("authorization", "Bearer alice"),
                        ("idempotency-key", &key),
                    ],
                    body.to_owned(),
                )
                .await
        }
    });
    // Claimed (the process logs it), and working: its delay is far longer than the wait.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !first.logs.text().contains("idempotent call claimed") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never claimed: {}",
            first.logs.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.signal("KILL");
    let status = tokio::time::timeout(PATIENCE, first.child.wait())
        .await
        .expect("the process exits")
        .unwrap();
    assert_eq!(status.signal(), Some(SIGKILL), "{status:?}");
    assert!(
        working.await.unwrap().is_err(),
        "the killed process answered"
    );

    let second = Server::payments_logged(&env).await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    assert_mismatch(&client, &second, path, &key, other).await;
    let answer = retry_until_answered(&client, &second, path, &key, body).await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(answer.json()["amount"], 1999, "the first request's payment");
    let again = post(&client, &second, path, &key, body)
        .await
        .expect("answered");
    assert!(again.replayed());
    assert_eq!(again.body, answer.body);
    assert_mismatch(&client, &second, path, &key, other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_another_body_under_a_key_lapsed_after_its_charge_is_422() {
    let Some(url) = redis_url() else { return };
    an_order_that_died_after_its_charge(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_another_body_under_a_key_killed_mid_request_is_422() {
    let Some(url) = redis_url() else { return };
    a_payment_killed_while_it_worked(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_another_body_under_a_key_lapsed_after_its_charge_is_422() {
    let name = format!("lapsed_order_{}", std::process::id());
    let Some(database) = Database::create(&name).await else {
        return;
    };
    an_order_that_died_after_its_charge(&database.url).await;
    database.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_another_body_under_a_key_killed_mid_request_is_422() {
    let name = format!("lapsed_payment_{}", std::process::id());
    let Some(database) = Database::create(&name).await else {
        return;
    };
    a_payment_killed_while_it_worked(&database.url).await;
    database.drop_database().await;
}
