//! Client sessions against the real `payments` example on Redis and PostgreSQL: what a session
//! keeps in the store however many requests it makes, a restart that keeps sessions, and an
//! expired session that refuses instead of running again.

mod support;

use std::time::Duration;

use http::Method;
use idempotent_core::{Key, SessionKey};
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use idempotent_tower::Principal;
use support::{Answer, Client, Protocol, Server};

const NAMESPACE: &[u8] = b"payments-example";

fn session_key(id: &str) -> SessionKey {
    SessionKey::derive(
        NAMESPACE,
        &Principal::new("alice").scope(),
        &Key::new(id).unwrap(),
    )
}

/// Pays `amount` as request `seq` of session `id`, holding every answer up to `ack`.
async fn pay(
    client: &Client,
    server: &Server,
    id: &str,
    (seq, ack): (u64, u64),
    amount: u64,
) -> Answer {
    let session = format!(r#"id="{id}", seq={seq}, ack={ack}"#);
    client
        .send(
            Method::POST,
            &server.url("/payments"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer alice"),
                ("idempotency-session", &session),
            ],
            format!(r#"{{"amount":{amount},"currency":"EUR"}}"#),
        )
        .await
}

fn fresh(answer: &Answer) {
    assert_eq!(
        answer.status,
        201,
        "{:?}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(!answer.replayed());
}

/// Where the test's records live, and how many of one session's records it holds.
enum Backend {
    Redis(redis::aio::MultiplexedConnection),
    Postgres(Database),
}

impl Backend {
    async fn redis() -> Option<(Backend, String)> {
        let url = redis_url()?;
        let connection = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        Some((Backend::Redis(connection), url))
    }

    async fn postgres(name: &str) -> Option<(Backend, String)> {
        let database = Database::create(&format!("{name}_{}", std::process::id())).await?;
        let url = database.url.clone();
        Some((Backend::Postgres(database), url))
    }

    /// The records of session `id` in the store: its own, and one per answer it holds.
    async fn records(&mut self, id: &str) -> u64 {
        let key = session_key(id);
        match self {
            Backend::Redis(connection) => {
                let hex = idempotent_core::StorageKey::from_bytes(*key.as_bytes()).to_hex();
                let pattern = format!("idempotent:{{{hex}}}*");
                let mut found = 0;
                let mut cursor = 0u64;
                loop {
                    let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(connection)
                        .await
                        .unwrap();
                    found += keys.len() as u64;
                    if next == 0 {
                        return found;
                    }
                    cursor = next;
                }
            }
            Backend::Postgres(database) => {
                let pool = database.pool().await;
                let (count,): (i64,) = sqlx::query_as(
                    "SELECT count(*) FROM idempotent_records \
                     WHERE substring(storage_key from 1 for 32) = $1",
                )
                .bind(key.as_bytes().as_slice())
                .fetch_one(&pool)
                .await
                .unwrap();
                pool.close().await;
                u64::try_from(count).unwrap()
            }
        }
    }
}

/// 10,000 payments in one session whose client acknowledges answers late (up to 63 behind):
/// the store never holds more than the window's answers plus the one being made, and every
/// payment is charged once.
async fn storage_stays_within_the_window(mut backend: Backend, url: String) {
    const WINDOW: u64 = 64;
    const REQUESTS: u64 = 10_000;
    let server = Server::payments(&[
        ("IDEMPOTENCY_STORE", &url),
        ("IDEMPOTENCY_SESSION_WINDOW", "64"),
    ])
    .await;
    let client = Client::new(Protocol::Http1);
    let id = unique("bulk");
    let mut most = 0;
    for seq in 1..=REQUESTS {
        // Acknowledges in batches: the mark moves every 32 requests, lagging up to 63.
        let ack = (seq.saturating_sub(32) / 32) * 32;
        let answer = pay(&client, &server, &id, (seq, ack), 100 + seq % 7).await;
        fresh(&answer);
        if seq % 250 == 0 {
            let records = backend.records(&id).await;
            most = most.max(records);
            assert!(
                records <= WINDOW + 2,
                "after {seq} requests (ack {ack}) the store holds {records} records of the session"
            );
        }
    }
    assert_eq!(client.charges(&server).await, REQUESTS);
    // Acknowledging everything leaves the session's own record only.
    let last = pay(&client, &server, &id, (REQUESTS + 1, REQUESTS), 1).await;
    fresh(&last);
    let records = backend.records(&id).await;
    assert!(records <= 2, "{records} records after acknowledging all");
    eprintln!("at most {most} records of the session in the store over {REQUESTS} requests");
    if let Backend::Postgres(database) = backend {
        drop(server);
        database.drop_database().await;
    }
}

/// A server killed and started again on the same store keeps its sessions: answers are
/// replayed, acknowledged numbers refused, new numbers run.
async fn restart_keeps_sessions(url: String) {
    let env = [("IDEMPOTENCY_STORE", url.as_str())];
    let client = Client::new(Protocol::Http1);
    let id = unique("restart");
    let server = Server::payments(&env).await;
    let mut answers = Vec::new();
    for seq in 1..=5 {
        let answer = pay(
            &client,
            &server,
            &id,
            (seq, seq.saturating_sub(3)),
            500 + seq,
        )
        .await;
        fresh(&answer);
        answers.push(answer.body);
    }
    server.signal("KILL");
    drop(server);
    let server = Server::payments(&env).await;
    for seq in 3..=5 {
        let again = pay(&client, &server, &id, (seq, 2), 500 + seq).await;
        assert!(again.replayed(), "request {seq} after the restart");
        assert_eq!(again.body, answers[seq as usize - 1]);
    }
    let acknowledged = pay(&client, &server, &id, (2, 2), 502).await;
    assert_eq!(acknowledged.status, 410);
    assert_eq!(acknowledged.problem_code(), "sequence_acknowledged");
    fresh(&pay(&client, &server, &id, (6, 5), 506).await);
    assert_eq!(
        client.charges(&server).await,
        1,
        "the restarted server charged only request 6"
    );
}

/// A session nobody sends to for its idle time is gone: a request that says it holds answers
/// is refused, and nothing is charged.
async fn an_expired_session_refuses(url: String) {
    let server = Server::payments(&[
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_SESSION_IDLE", "1s"),
    ])
    .await;
    let client = Client::new(Protocol::Http1);
    let id = unique("idle");
    fresh(&pay(&client, &server, &id, (1, 0), 700).await);
    fresh(&pay(&client, &server, &id, (2, 1), 701).await);
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    for (seq, ack) in [(3, 2), (2, 1)] {
        let refused = pay(&client, &server, &id, (seq, ack), 702).await;
        assert_eq!(refused.status, 410, "request {seq}");
        assert_eq!(refused.problem_code(), "session_expired");
    }
    assert_eq!(client.charges(&server).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keeps_at_most_the_window_per_session() {
    let Some((backend, url)) = Backend::redis().await else {
        return;
    };
    storage_stays_within_the_window(backend, url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_at_most_the_window_per_session() {
    let Some((backend, url)) = Backend::postgres("session_storage").await else {
        return;
    };
    storage_stays_within_the_window(backend, url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_keeps_sessions() {
    let Some(url) = redis_url() else { return };
    restart_keeps_sessions(url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_keeps_sessions() {
    let Some((backend, url)) = Backend::postgres("session_restart").await else {
        return;
    };
    restart_keeps_sessions(url).await;
    if let Backend::Postgres(database) = backend {
        database.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_expired_session_refuses() {
    let Some(url) = redis_url() else { return };
    an_expired_session_refuses(url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_expired_session_refuses() {
    let Some((backend, url)) = Backend::postgres("session_idle").await else {
        return;
    };
    an_expired_session_refuses(url).await;
    if let Backend::Postgres(database) = backend {
        database.drop_database().await;
    }
}
