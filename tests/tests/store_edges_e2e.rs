//! Two edges of the store's life, driven through the payments example as a real process:
//!
//! - A store that stops answering *before* a request claims its key (frozen with `SIGSTOP`):
//!   the new payment must be answered `503` within the store timeout, not hang, and once the
//!   store is continued the key must work within seconds: the attempt that timed out must not
//!   leave a claim behind that holds the key for a whole lease (30 s) while nothing runs.
//!   Redis and PostgreSQL, each a private server of the test's own, since it is frozen.
//! - A key reused after its record expired (`IDEMPOTENCY_TTL`) is a new operation: the handler
//!   runs again and the provider charges again, because the downstream operation key differs
//!   per record lifetime (it stays the same across a takeover inside one lifetime:
//!   `effect_faults_e2e`). Memory, Redis and PostgreSQL (the servers scripts/test.sh starts).
//!
//! Each test needs the `payments` example built (`cargo build -p examples --examples
//! --all-features`) and, for Redis and PostgreSQL, the servers' URLs in
//! `IDEMPOTENT_TEST_REDIS_URL` / `IDEMPOTENT_TEST_POSTGRES_URL` (scripts/services.sh), as the
//! test kit's `backend` decides: without them a test says loudly that it did not run, or
//! fails where backends are required (`IDEMPOTENT_REQUIRE_BACKENDS=1`, CI). The frozen-store
//! tests start private servers (`redis-server` on `PATH`; PostgreSQL's binaries from
//! `IDEMPOTENT_TEST_PG_BIN` or `/usr/lib/postgresql/*/bin`) so that freezing them disturbs no
//! other test. The example's log is captured and printed when a test fails.

mod support;

use std::time::Duration;

use http::StatusCode;
use idempotent_test_kit::backend::{postgres_url, redis_url};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::PrivatePostgres;
use idempotent_test_kit::process::Frozen;
use idempotent_test_kit::process::within;
use idempotent_test_kit::redis::PrivateRedis;
use support::{Answer, Client, Protocol, Server, payment_id};
use tokio::time::{Instant, sleep};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;
const PRINCIPAL: &str = "alice";

/// The documented bound on a request's answer while the store does not answer: the store
/// timeout (at most 5 s by default) and some slack.
const STORE_TIMEOUT_BOUND: Duration = Duration::from_secs(10);
/// How soon after the store is continued a retry of the key must be accepted: seconds, not the
/// 30 s lease a claim left behind would hold it for.
const AFTER_THE_THAW_BOUND: Duration = Duration::from_secs(10);
/// The lease the frozen-store tests run with (the example's default, set explicitly): longer
/// than the whole test after the thaw, so that a claim left behind would show.
const LEASE: &str = "30s";

// ----- bounded steps -----

/// `POST /payments` with the test's body and principal and `key`; bounded by `limit`.
async fn pay(client: &Client, server: &Server, key: &str, limit: Duration) -> Answer {
    within(
        &format!("POST /payments ({key})"),
        limit,
        client.post(
            &server.url("/payments"),
            Some(key),
            Some(PRINCIPAL),
            PAYMENT,
        ),
    )
    .await
}

/// `GET /payments/count`: `{"charges": charges the provider made, "count": handler runs}`.
async fn count_document(client: &Client, server: &Server) -> serde_json::Value {
    let answer = within(
        "GET /payments/count",
        Duration::from_secs(10),
        client.get(&server.url("/payments/count")),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    answer.json()
}

/// Handler runs and provider charges so far.
async fn counts(client: &Client, server: &Server) -> (u64, u64) {
    let document = count_document(client, server).await;
    let field = |name: &str| {
        document[name]
            .as_u64()
            .unwrap_or_else(|| panic!("no {name} in {document}"))
    };
    (field("count"), field("charges"))
}

/// `status code` of an answer, for messages.
fn describe(answer: &Answer) -> String {
    let is_problem = answer
        .headers
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    if is_problem {
        format!("{} {}", answer.status.as_u16(), answer.problem_code())
    } else {
        answer.status.as_u16().to_string()
    }
}

// ----- a store frozen before the claim -----

/// A new payment of `key` sent while the store is frozen: it must be refused with 503 (the
/// store cannot be reached; nothing ran) within the store timeout. `what` names the attempt.
async fn refused_while_frozen(client: &Client, server: &Server, key: &str, what: &str) {
    let sent = Instant::now();
    let answer = tokio::time::timeout(
        STORE_TIMEOUT_BOUND,
        client.post(
            &server.url("/payments"),
            Some(key),
            Some(PRINCIPAL),
            PAYMENT,
        ),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{what}, sent while the store is frozen, got no answer within \
             {STORE_TIMEOUT_BOUND:?}: it hangs instead of failing with 503 after the store timeout"
        )
    });
    let took = sent.elapsed();
    eprintln!("{what} while frozen: {} after {took:?}", describe(&answer));
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what} while the store is frozen: {:?}",
        answer.body
    );
    let code = answer.problem_code();
    assert!(
        matches!(code.as_str(), "store_unavailable" | "store_timeout"),
        "{what} while the store is frozen: 503 {code}, not the store's"
    );
    assert!(
        took < STORE_TIMEOUT_BOUND,
        "{what}: answered after {took:?}"
    );
}

/// The store stops answering (every process of it stopped) after the app has its connections
/// and before a new payment claims its key: the payment and its retries get 503 within the
/// store timeout; once the store is continued a retry is accepted within seconds and runs
/// once.
async fn store_frozen_before_the_claim(server: &Server, freeze: impl FnOnce() -> Frozen) {
    let client = Client::new(Protocol::Http1);

    // Warm-up: twenty payments at once, so that the app holds open connections to the store
    // (a pool of several, for PostgreSQL) when it freezes.
    let mut warm_up = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (client, url) = (client.clone(), server.url("/payments"));
        let key = format!("warm-up-{i}");
        warm_up.spawn(async move {
            within(
                &format!("warm-up payment {key}"),
                Duration::from_secs(30),
                client.post(&url, Some(&key), Some(PRINCIPAL), PAYMENT),
            )
            .await
        });
    }
    while let Some(answer) = warm_up.join_next().await {
        let answer = answer.expect("warm-up task");
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    }
    let (count, charges) = counts(&client, server).await;
    assert_eq!(
        (count, charges),
        (20, 20),
        "(runs, charges) after the warm-up"
    );

    let key = "frozen-before-the-claim";
    let frozen = freeze();
    refused_while_frozen(&client, server, key, "the first attempt").await;
    // Retries while it is still frozen: refused the same way, never run.
    for retry in 1..=3 {
        sleep(Duration::from_millis(250)).await;
        refused_while_frozen(&client, server, key, &format!("retry {retry}")).await;
    }

    // The store answers again: a client retrying every 250 ms is accepted within seconds. A
    // claim left behind by an attempt that timed out (written once the store read it, after
    // its caller had given up) would answer 409 in_flight for the whole lease.
    frozen.thaw();
    let thawed = Instant::now();
    let deadline = thawed + AFTER_THE_THAW_BOUND;
    let mut seen = Vec::new();
    let accepted = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let answer = tokio::time::timeout(
            remaining,
            client.post(
                &server.url("/payments"),
                Some(key),
                Some(PRINCIPAL),
                PAYMENT,
            ),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no answer to the retry within {AFTER_THE_THAW_BOUND:?} of the thaw; \
                 answers before: {seen:?}"
            )
        });
        seen.push(describe(&answer));
        match answer.status {
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {}
            _ => break answer,
        }
        assert!(
            Instant::now() + Duration::from_millis(250) < deadline,
            "the key was not accepted within {AFTER_THE_THAW_BOUND:?} of the thaw (lease \
             {LEASE}): {} retries answered {seen:?}",
            seen.len()
        );
        sleep(Duration::from_millis(250)).await;
    };
    eprintln!(
        "after the thaw: {} retries in {:?}: {seen:?}",
        seen.len(),
        thawed.elapsed()
    );
    assert_eq!(
        accepted.status,
        StatusCode::CREATED,
        "the retry after the thaw: {:?}",
        accepted.body
    );
    assert!(
        !accepted.replayed(),
        "nothing ran the key before: the retry runs it"
    );

    // It ran once: the next retry replays it, and the handler and the provider each count one
    // more than after the warm-up.
    let replay = pay(&client, server, key, Duration::from_secs(10)).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
    assert!(replay.replayed());
    assert_eq!(replay.body, accepted.body);
    assert_eq!(payment_id(&replay), payment_id(&accepted));
    assert_eq!(
        counts(&client, server).await,
        (count + 1, charges + 1),
        "(runs, charges): the key ran exactly once"
    );
}

// ----- a key reused after its record expired -----

/// Pays with one key, replays it, waits until its record (TTL 2 s) has expired and pays with
/// the key again: a new payment, charged again.
async fn key_reused_after_its_record_expired(store: &str) {
    let server =
        Server::payments_logged(&[("IDEMPOTENCY_STORE", store), ("IDEMPOTENCY_TTL", "2s")]).await;
    let client = Client::new(Protocol::Http1);
    let key = unique("expired");
    let limit = Duration::from_secs(10);

    let first = pay(&client, &server, &key, limit).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed());
    let replay = pay(&client, &server, &key, limit).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
    assert!(replay.replayed(), "a retry within the TTL replays");
    assert_eq!(payment_id(&replay), payment_id(&first));

    // The record has expired: the key is unused again.
    sleep(Duration::from_millis(3200)).await;
    let again = pay(&client, &server, &key, limit).await;
    let document = count_document(&client, &server).await;
    eprintln!(
        "first: {}; after the TTL: {} replayed={} {}; /payments/count: {document}",
        String::from_utf8_lossy(&first.body),
        again.status,
        again.replayed(),
        String::from_utf8_lossy(&again.body),
    );
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
    assert!(
        !again.replayed(),
        "the record had expired: nothing to replay"
    );
    assert_ne!(
        payment_id(&again),
        payment_id(&first),
        "the key reused after its record expired answered the first payment (/payments/count: \
         {document}): the provider saw the same downstream operation key and did not charge"
    );
    assert_eq!(
        document,
        serde_json::json!({"charges": 2, "count": 2}),
        "two payments, each run and charged once"
    );
}

mod on_memory {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_reused_after_its_record_expired_is_a_new_charge() {
        // Broke: the downstream operation key was the same for every lifetime of a key's
        // record, so a key reused after its record expired got the first payment back from the
        // provider (no charge) instead of a new one.
        key_reused_after_its_record_expired("memory").await;
    }
}

mod on_redis {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_frozen_before_the_claim_answers_503_and_the_key_works_after_the_thaw() {
        // Broke: a claim sent to a frozen Redis timed out (503), but Redis ran it when it was
        // continued, so the key stayed claimed by nobody, 409 in_flight, for the whole lease.
        let Some(redis) = PrivateRedis::start("frozen-before-claim").await else {
            return;
        };
        let url = redis.url();
        let server = Server::payments_logged(&[
            ("IDEMPOTENCY_STORE", url.as_str()),
            ("IDEMPOTENCY_LEASE", LEASE),
        ])
        .await;
        store_frozen_before_the_claim(&server, || redis.freeze()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_reused_after_its_record_expired_is_a_new_charge() {
        // Broke: the downstream operation key was the same for every lifetime of a key's
        // record, so a key reused after its record expired got the first payment back from the
        // provider (no charge) instead of a new one.
        let Some(url) = redis_url() else {
            return;
        };
        key_reused_after_its_record_expired(&url).await;
    }
}

mod on_postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_frozen_before_the_claim_answers_503_and_the_key_works_after_the_thaw() {
        // Broke: a claim sent to a frozen PostgreSQL on an open connection waited for it with
        // no bound (no 503), and a claim that timed out could be committed once the database
        // was continued, holding the key for the whole lease.
        let Some(postgres) = PrivatePostgres::start().await else {
            return;
        };
        let url = postgres.url();
        let server = Server::payments_logged(&[
            ("IDEMPOTENCY_STORE", url.as_str()),
            ("IDEMPOTENCY_LEASE", LEASE),
        ])
        .await;
        store_frozen_before_the_claim(&server, || postgres.freeze()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_reused_after_its_record_expired_is_a_new_charge() {
        // Broke: the downstream operation key was the same for every lifetime of a key's
        // record, so a key reused after its record expired got the first payment back from the
        // provider (no charge) instead of a new one.
        let Some(url) = postgres_url() else {
            return;
        };
        key_reused_after_its_record_expired(&url).await;
    }
}
