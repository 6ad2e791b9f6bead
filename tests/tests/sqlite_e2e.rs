//! The `payments` demo on the embedded durable store (`IDEMPOTENCY_STORE=sqlite://PATH`), as
//! real processes: a payment made before a `kill -9` is replayed by the process started after
//! it, and two processes on one database file charge a payment once however their duplicates
//! are spread between them. (Operations in steps that survive SIGKILLs on SQLite are in
//! `steps_e2e`.)

mod support;

use std::os::unix::process::ExitStatusExt as _;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use support::{Client, Protocol, Server};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

/// A `sqlite://` URL on a file in a directory of its own (removed with it).
fn database() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = format!("sqlite://{}", dir.path().join("payments.db").display());
    (dir, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_is_replayed_after_kill_9_and_a_restart() {
    let (_dir, url) = database();
    let env = [("IDEMPOTENCY_STORE", url.as_str())];
    let client = Client::new(Protocol::Http1);
    let mut first_process = Server::payments(&env).await;
    let paid = client
        .post(
            &first_process.url("/payments"),
            Some("order-1"),
            Some("alice"),
            PAYMENT,
        )
        .await;
    assert_eq!(paid.status, StatusCode::CREATED);
    assert!(!paid.replayed());
    first_process.signal("KILL");
    let status = tokio::time::timeout(Duration::from_secs(60), first_process.child.wait())
        .await
        .expect("the process exits")
        .unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");

    let second_process = Server::payments(&env).await;
    let retry = client
        .post(
            &second_process.url("/payments"),
            Some("order-1"),
            Some("alice"),
            PAYMENT,
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the record outlived the process");
    assert_eq!(retry.body, paid.body, "the same payment, replayed");
    assert_eq!(
        client.charges(&second_process).await,
        0,
        "the new process charged nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_one_file_charge_once() {
    let (_dir, url) = database();
    let env = [("IDEMPOTENCY_STORE", url.as_str())];
    let servers = [Server::payments(&env).await, Server::payments(&env).await];
    let client = Client::new(Protocol::Http1);
    for round in 0..5 {
        let key = format!("split-{round}");
        let start = Arc::new(tokio::sync::Barrier::new(20));
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let url = servers[i % 2].url("/payments?delay_ms=100");
                let (client, key, start) = (client.clone(), key.clone(), Arc::clone(&start));
                tokio::spawn(async move {
                    start.wait().await;
                    client.post(&url, Some(&key), Some("alice"), PAYMENT).await
                })
            })
            .collect();
        let mut fresh = 0;
        for task in tasks {
            let answer = task.await.unwrap();
            match answer.status {
                StatusCode::CREATED if !answer.replayed() => fresh += 1,
                StatusCode::CREATED | StatusCode::CONFLICT => {}
                other => panic!(
                    "round {round}: unexpected {other}: {}",
                    String::from_utf8_lossy(&answer.body)
                ),
            }
        }
        assert_eq!(
            fresh, 1,
            "round {round}: exactly one execution answered fresh"
        );
    }
    let mut charges = 0;
    for server in &servers {
        charges += client.charges(server).await;
    }
    assert_eq!(charges, 5, "one charge per key across both processes");
}
