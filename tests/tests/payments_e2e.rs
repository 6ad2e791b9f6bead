//! The `payments` example as a real process over TCP: every rule of the HTTP layer, over
//! HTTP/1.1 and HTTP/2 (prior knowledge).

mod support;

use std::time::Duration;

use http::{Method, StatusCode};
use support::{Client, PROTOCOLS, Protocol, Server, metric};
use tokio::io::AsyncWriteExt;

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

fn key(protocol: Protocol, name: &str) -> String {
    format!("{protocol:?}-{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_replays_the_payment_with_its_location() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let before = client.count(&server).await;
        let k = key(protocol, "replay");
        let first = client
            .post(&server.url("/payments"), Some(&k), Some("alice"), PAYMENT)
            .await;
        assert_eq!(first.status, StatusCode::CREATED, "{protocol:?}");
        assert!(!first.replayed());
        let body = first.json();
        assert_eq!(body["amount"], 1999);
        assert_eq!(body["currency"], "EUR");
        assert_eq!(body["principal"], "alice");
        let location = first.headers["location"].clone();
        assert_eq!(location, format!("/payments/{}", body["id"]));
        for _ in 0..3 {
            let retry = client
                .post(&server.url("/payments"), Some(&k), Some("alice"), PAYMENT)
                .await;
            assert_eq!(retry.status, StatusCode::CREATED);
            assert!(retry.replayed(), "{protocol:?}");
            assert_eq!(retry.body, first.body);
            assert_eq!(retry.headers["location"], location);
        }
        assert_eq!(client.count(&server).await, before + 1);
    }
    assert_eq!(
        Client::new(Protocol::Http1)
            .get(&server.url("/health"))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_are_protected_too() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let k = key(protocol, "refund");
        let first = client
            .post(
                &server.url("/refunds"),
                Some(&k),
                Some("alice"),
                r#"{"payment_id":7}"#,
            )
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(first.json()["payment_id"], 7);
        let retry = client
            .post(
                &server.url("/refunds"),
                Some(&k),
                Some("alice"),
                r#"{"payment_id":7}"#,
            )
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_malformed_keys_are_400_and_execute_nothing() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let missing = client
            .post(&server.url("/payments"), None, Some("alice"), PAYMENT)
            .await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert_eq!(missing.problem_code(), "missing_key");
        let long = "k".repeat(256);
        for bad in ["\"\"", long.as_str(), "\"open", "a, b", "has space"] {
            let answer = client
                .post(&server.url("/payments"), Some(bad), Some("alice"), PAYMENT)
                .await;
            assert_eq!(
                answer.status,
                StatusCode::BAD_REQUEST,
                "{protocol:?} {bad:?}"
            );
            assert_eq!(answer.problem_code(), "invalid_key");
        }
        let twice = client
            .send(
                Method::POST,
                &server.url("/payments"),
                &[
                    ("content-type", "application/json"),
                    ("idempotency-key", "a"),
                    ("idempotency-key", "a"),
                ],
                PAYMENT,
            )
            .await;
        assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_another_body_query_or_path_is_422() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let k = key(protocol, "mismatch");
        let first = client
            .post(&server.url("/payments"), Some(&k), Some("alice"), PAYMENT)
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        for (path, body) in [
            ("/payments", r#"{"amount":1,"currency":"EUR"}"#),
            ("/payments?delay_ms=0", PAYMENT),
            ("/refunds", r#"{"payment_id":1}"#),
        ] {
            let answer = client
                .post(&server.url(path), Some(&k), Some("alice"), body)
                .await;
            assert_eq!(
                answer.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{protocol:?} {path}"
            );
            assert_eq!(answer.problem_code(), "fingerprint_mismatch");
        }
        let original = client
            .post(&server.url("/payments"), Some(&k), Some("alice"), PAYMENT)
            .await;
        assert!(original.replayed(), "the record is untouched");
        assert_eq!(original.body, first.body);
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principals_never_share_keys() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let k = key(protocol, "shared");
        let alice = client
            .post(&server.url("/payments"), Some(&k), Some("alice"), PAYMENT)
            .await;
        // Bob sends alice's key with the same body: his own payment, not her stored answer.
        let bob = client
            .post(&server.url("/payments"), Some(&k), Some("bob"), PAYMENT)
            .await;
        for answer in [&alice, &bob] {
            assert_eq!(answer.status, StatusCode::CREATED);
            assert!(!answer.replayed());
        }
        assert_eq!(bob.json()["principal"], "bob");
        assert_ne!(alice.json()["id"], bob.json()["id"]);
        // Without a credential there is no principal to scope the key by: refused.
        let anonymous = client
            .post(&server.url("/payments"), Some(&k), None, PAYMENT)
            .await;
        assert_eq!(anonymous.status, StatusCode::FORBIDDEN);
        assert_eq!(anonymous.json()["code"], "missing_scope");
    }
    assert_eq!(Client::new(PROTOCOLS[0]).count(&server).await, 4);
}

/// The scope is the principal, not the credential: alice's token is refreshed between her
/// attempts (`alice.t1`, then `alice.t2`), and her retry still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_a_refreshed_token_replays() {
    let server = Server::payments(&[]).await;
    let client = Client::new(PROTOCOLS[0]);
    let first = client
        .post(
            &server.url("/payments"),
            Some("refresh-1"),
            Some("alice.t1"),
            PAYMENT,
        )
        .await;
    let retry = client
        .post(
            &server.url("/payments"),
            Some("refresh-1"),
            Some("alice.t2"),
            PAYMENT,
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(first.json()["principal"], "alice");
    assert_eq!(client.count(&server).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declines_are_stored_and_provider_errors_released() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let before = client.count(&server).await;
        let declined = key(protocol, "declined");
        let zero = r#"{"amount":0,"currency":"EUR"}"#;
        let first = client
            .post(
                &server.url("/payments"),
                Some(&declined),
                Some("alice"),
                zero,
            )
            .await;
        assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
        assert_eq!(first.json()["error"], "card_declined");
        let retry = client
            .post(
                &server.url("/payments"),
                Some(&declined),
                Some("alice"),
                zero,
            )
            .await;
        assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
        assert!(retry.replayed());

        let failing = key(protocol, "provider");
        let err = r#"{"amount":10,"currency":"err"}"#;
        for _ in 0..2 {
            let answer = client
                .post(&server.url("/payments"), Some(&failing), Some("alice"), err)
                .await;
            assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(answer.json()["error"], "provider_unavailable");
            assert!(
                !answer.replayed(),
                "a 500 is released, so the retry executes again"
            );
        }
        assert_eq!(client.count(&server).await, before + 3);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_in_flight_is_409_with_retry_after() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let k = key(protocol, "in-flight");
        let url = server.url("/payments?delay_ms=600");
        let first = tokio::spawn({
            let (client, url, k) = (client.clone(), url.clone(), k.clone());
            async move { client.post(&url, Some(&k), Some("alice"), PAYMENT).await }
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let dup = client.post(&url, Some(&k), Some("alice"), PAYMENT).await;
        assert_eq!(dup.status, StatusCode::CONFLICT, "{protocol:?}");
        assert_eq!(dup.problem_code(), "in_flight");
        assert_eq!(dup.headers["retry-after"], "1");
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let later = client.post(&url, Some(&k), Some("alice"), PAYMENT).await;
        assert!(later.replayed());
        assert_eq!(later.body, first.body);
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_mode_replays_to_the_concurrent_duplicate() {
    let server = Server::payments(&[("IDEMPOTENCY_IN_FLIGHT", "wait")]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let k = key(protocol, "wait");
        let url = server.url("/payments?delay_ms=400");
        let first = tokio::spawn({
            let (client, url, k) = (client.clone(), url.clone(), k.clone());
            async move { client.post(&url, Some(&k), Some("alice"), PAYMENT).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let dup = client.post(&url, Some(&k), Some("alice"), PAYMENT).await;
        assert_eq!(dup.status, StatusCode::CREATED);
        assert!(dup.replayed());
        assert_eq!(dup.body, first.await.unwrap().body);
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_execute_once() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let before = client.count(&server).await;
        let k = key(protocol, "fifty");
        let url = server.url("/payments?delay_ms=200");
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(50));
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (client, url, k, start) =
                    (client.clone(), url.clone(), k.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    client.post(&url, Some(&k), Some("alice"), PAYMENT).await
                })
            })
            .collect();
        let (mut fresh, mut conflict, mut replayed) = (0, 0, 0);
        for task in tasks {
            let answer = task.await.unwrap();
            match answer.status {
                StatusCode::CREATED if answer.replayed() => replayed += 1,
                StatusCode::CREATED => fresh += 1,
                StatusCode::CONFLICT => conflict += 1,
                other => panic!("{protocol:?}: unexpected {other}"),
            }
        }
        assert_eq!(
            fresh, 1,
            "{protocol:?}: exactly one execution answered fresh"
        );
        assert_eq!(fresh + conflict + replayed, 50);
        assert_eq!(client.count(&server).await, before + 1, "{protocol:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413_before_the_handler() {
    let server = Server::payments(&[]).await;
    let padding = "x".repeat(2 << 20);
    let big = format!(r#"{{"amount":1,"currency":"EUR","padding":"{padding}"}}"#);
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        let answer = client
            .post(
                &server.url("/payments"),
                Some(&key(protocol, "big")),
                Some("alice"),
                &big,
            )
            .await;
        assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE, "{protocol:?}");
        assert_eq!(answer.problem_code(), "request_too_large");
    }
    assert_eq!(Client::new(Protocol::Http1).count(&server).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprotected_methods_pass_through_with_a_key() {
    let server = Server::payments(&[]).await;
    for protocol in PROTOCOLS {
        let client = Client::new(protocol);
        for _ in 0..2 {
            let answer = client
                .send(
                    Method::GET,
                    &server.url("/health"),
                    &[("idempotency-key", "k")],
                    "",
                )
                .await;
            assert_eq!(answer.status, StatusCode::OK);
            assert!(!answer.replayed());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_over_http1_still_records_the_payment() {
    let server = Server::payments(&[]).await;
    let body = PAYMENT;
    let request = format!(
        "POST /payments?delay_ms=500 HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         idempotency-key: gone-h1\r\nauthorization: Bearer alice\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", server.port))
        .await
        .unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(socket); // the client gives up mid-request
    assert_recorded_after_disconnect(&server, "gone-h1", "/payments?delay_ms=500").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_over_http2_still_records_the_payment() {
    let server = Server::payments(&[]).await;
    let url = server.url("/payments?delay_ms=500");
    let client = Client::new(Protocol::Http2);
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        client.post(&url, Some("gone-h2"), Some("alice"), PAYMENT),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the request was abandoned before the response"
    );
    drop(client); // closes the connection (RST_STREAM / GOAWAY)
    assert_recorded_after_disconnect(&server, "gone-h2", "/payments?delay_ms=500").await;
}

async fn assert_recorded_after_disconnect(server: &Server, key: &str, path: &str) {
    let client = Client::new(Protocol::Http1);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        client.count(server).await,
        1,
        "the handler ran to completion"
    );
    let retry = client
        .post(&server.url(path), Some(key), Some("alice"), PAYMENT)
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the retry gets the recorded response");
    assert_eq!(client.count(server).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_exits_with_a_clear_message() {
    for (name, value, expected) in [
        ("IDEMPOTENCY_TTL", "soon", "IDEMPOTENCY_TTL"),
        ("IDEMPOTENCY_LEASE", "0s", "greater than zero"),
        ("IDEMPOTENCY_IN_FLIGHT", "maybe", "reject"),
        ("IDEMPOTENCY_STORE", "mongodb://x", "IDEMPOTENCY_STORE"),
        ("PORT", "http", "PORT"),
    ] {
        let stderr = support::refused_at_start(
            tokio::process::Command::new(support::example_binary("payments")).env(name, value),
            &format!("{name}={value}"),
        )
        .await
        .stderr;
        assert!(stderr.contains(expected), "{name}={value}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_fresh_request_a_replay_a_409_and_a_422() {
    let server = Server::payments(&[]).await;
    let client = Client::new(Protocol::Http1);
    let post = |key: &'static str, url: &'static str, body: &'static str| {
        let (client, url) = (client.clone(), server.url(url));
        async move { client.post(&url, Some(key), Some("alice"), body).await }
    };
    assert_eq!(
        post("m-1", "/payments", PAYMENT).await.status,
        StatusCode::CREATED
    );
    assert!(post("m-1", "/payments", PAYMENT).await.replayed());
    let other = r#"{"amount":1,"currency":"EUR"}"#;
    assert_eq!(
        post("m-1", "/payments", other).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let slow = tokio::spawn(post("m-2", "/payments?delay_ms=1500", PAYMENT));
    // The duplicate arrives while the first sleeps in its handler.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let conflict = post("m-2", "/payments?delay_ms=1500", PAYMENT).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);

    let scrape = client.get(&server.url("/metrics")).await;
    assert_eq!(scrape.status, StatusCode::OK);
    let scrape = String::from_utf8_lossy(&scrape.body).into_owned();
    let requests = |outcome| {
        metric(
            &scrape,
            "idempotency_requests_total",
            &[("protocol", "http"), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("fresh"), Some(2.0), "{scrape}");
    assert_eq!(requests("replayed"), Some(1.0));
    assert_eq!(requests("mismatch"), Some(1.0));
    assert_eq!(requests("in_flight"), Some(1.0));
    assert_eq!(
        requests("store_error"),
        Some(0.0),
        "every outcome is exported"
    );
    assert_eq!(
        metric(
            &scrape,
            "idempotency_store_operation_duration_seconds_count",
            &[
                ("operation", "claim"),
                ("store", "memory"),
                ("result", "ok")
            ],
        ),
        Some(4.0),
        "fresh, mismatch, and the two claims of m-2: the replay is answered from the memory \
         store's record in process, without a claim (Store::completed_in_process)"
    );
    assert_eq!(
        metric(&scrape, "idempotency_work_duration_seconds_count", &[]),
        Some(2.0)
    );
    assert_eq!(
        metric(&scrape, "idempotency_claims_in_flight", &[]),
        Some(0.0)
    );
    assert_eq!(
        metric(&scrape, "idempotency_claims_lost_total", &[]),
        Some(0.0)
    );
}
