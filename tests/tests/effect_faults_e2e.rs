//! The payments example's *effect* under store faults, with real processes and real faults: a
//! private `redis-server` or PostgreSQL server per test, frozen with `SIGSTOP` / `SIGCONT` or
//! made to refuse writes (`CONFIG SET maxmemory 1`) while a payment runs.
//!
//! - A store frozen for longer than the lease lets the claim lapse: a retry takes the key over
//!   and runs the handler a second time while the first run still goes on. The claim cannot
//!   prevent that; the downstream key can: both runs charge the simulated provider with the
//!   claim's operation key, so it charges once, and every answer names the same payment
//!   (Redis, PostgreSQL).
//! - Short freezes inside the lease do not cost the owner its claim: duplicates get 409, the
//!   handler runs once.
//! - A store that refuses the completion write (out of memory) after the handler ran does not
//!   turn into a second run: duplicates get 409 while the runtime retries the write with the
//!   lease kept alive, and the retry replays the first answer once the store takes writes again.
//!
//! Each test needs `redis-server` on `PATH`, or PostgreSQL's server binaries
//! (`IDEMPOTENT_TEST_PG_BIN` or `/usr/lib/postgresql/*/bin`), and the `payments` example built
//! (`cargo build -p examples --examples --all-features`). Without the server binary a test says
//! loudly that it did not run, or fails where backends are required
//! (`IDEMPOTENT_REQUIRE_BACKENDS=1`, CI), as the test kit's `backend::installed` decides. The example's log is captured and printed when a test
//! fails.

mod support;

use std::time::Duration;

use http::StatusCode;
use idempotent_test_kit::postgres::PrivatePostgres;
use idempotent_test_kit::process::Frozen;
use idempotent_test_kit::process::within;
use idempotent_test_kit::redis::PrivateRedis;
use support::{Answer, Client, Protocol, Server, payment_id};
use tokio::time::{Instant, sleep};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;
const PRINCIPAL: &str = "alice";

// ----- bounded steps -----

/// `POST path` with the test's body, principal and `key`; bounded.
async fn pay(client: &Client, server: &Server, path: &str, key: &str) -> Answer {
    within(
        &format!("POST {path} ({key})"),
        Duration::from_secs(60),
        client.post(&server.url(path), Some(key), Some(PRINCIPAL), PAYMENT),
    )
    .await
}

/// [`pay`] on a task of its own: the first request, still in its handler while the test
/// causes a fault.
fn spawn_pay(
    client: &Client,
    server: &Server,
    path: &str,
    key: &'static str,
) -> tokio::task::JoinHandle<Answer> {
    let (client, url) = (client.clone(), server.url(path));
    tokio::spawn(async move {
        within(
            "the first request",
            Duration::from_secs(60),
            client.post(&url, Some(key), Some(PRINCIPAL), PAYMENT),
        )
        .await
    })
}

/// Handler runs and provider charges so far.
async fn counts(client: &Client, server: &Server) -> (u64, u64) {
    let limit = Duration::from_secs(10);
    let count = within("GET /payments/count", limit, client.count(server)).await;
    let charges = within("GET /payments/count", limit, client.charges(server)).await;
    (count, charges)
}

/// Sends the request again, as a client honouring `Retry-After` would, while the answer is
/// 409 `in_flight` or 503; the first other answer, and every status seen. Bounded by `limit`.
async fn retry_until_answered(
    client: &Client,
    server: &Server,
    path: &str,
    key: &str,
    limit: Duration,
) -> (Answer, Vec<StatusCode>) {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let answer = pay(client, server, path, key).await;
        seen.push(answer.status);
        match answer.status {
            StatusCode::CONFLICT => assert_eq!(answer.problem_code(), "in_flight"),
            StatusCode::SERVICE_UNAVAILABLE => {}
            _ => return (answer, seen),
        }
        assert!(
            Instant::now() < deadline,
            "no answer but 409/503 within {limit:?}: {seen:?}"
        );
        sleep(Duration::from_millis(200)).await;
    }
}

// ----- the tests -----

/// The store stalls for longer than the lease while the first run of a payment is inside its
/// handler; the retry takes over. What the design promises here is one *effect*, not one run.
async fn store_frozen_past_the_lease(server: &Server, freeze: impl FnOnce() -> Frozen) {
    let client = Client::new(Protocol::Http1);
    let key = "frozen-past-the-lease";
    // The handler sleeps 9 s and then charges: well past the 3 s lease and the 4.5 s freeze.
    let path = "/payments?delay_ms=9000";
    let first = spawn_pay(&client, server, path, key);

    // The first request holds the claim: a duplicate is refused.
    sleep(Duration::from_millis(500)).await;
    let duplicate = pay(&client, server, path, key).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{:?}",
        duplicate.body
    );
    assert_eq!(duplicate.problem_code(), "in_flight");

    // The store answers nothing for longer than the lease: no renewal gets through and the
    // claim lapses (the store's clock kept running while its process was stopped).
    let frozen = freeze();
    sleep(Duration::from_millis(4500)).await;
    frozen.thaw();

    // The retry takes the key over and runs the handler again, while the first run, which
    // outlived its claim, is still sleeping and will charge too.
    let (retry, statuses) =
        retry_until_answered(&client, server, path, key, Duration::from_secs(40)).await;
    let first = within("the first request", Duration::from_secs(60), first)
        .await
        .unwrap();
    let replay = pay(&client, server, path, key).await;
    let (count, charges) = counts(&client, server).await;
    eprintln!(
        "first: {} replayed={} {:?}; retries: {statuses:?} -> {} replayed={} {:?}; \
         replay: {} replayed={}; count={count} charges={charges}",
        first.status,
        first.replayed(),
        String::from_utf8_lossy(&first.body),
        retry.status,
        retry.replayed(),
        String::from_utf8_lossy(&retry.body),
        replay.status,
        replay.replayed(),
    );

    // One effect: both runs charged with the claim's operation key, so the provider charged
    // once and answered the second run with the first charge.
    assert_eq!(charges, 1, "the provider charged more than once");
    // Two runs: the first (its claim lapsed, and it does not stop itself: with a downstream
    // key it need not) and the retry's, which took over the lapsed claim. The claim alone
    // cannot prevent the second run; this is why the effect needs the downstream key.
    assert_eq!(count, 2, "handler runs: the first and the takeover");

    // The retry ran (it took the key over) and its record is the one kept.
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed(), "the retry took the key over and ran");
    assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    // Every 2xx answer names the same payment. The first run's answer is a success too: its
    // charge went through (it is the charge), only its record was refused.
    assert!(
        first.status.is_success(),
        "the first run charged, yet answered {}: {:?}",
        first.status,
        first.body
    );
    assert!(!first.replayed());
    assert_eq!(payment_id(&first), payment_id(&retry));
    assert_eq!(first.body, retry.body, "both runs answer the same payment");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_past_the_lease_runs_the_handler_twice_but_charges_once() {
    let Some(redis) = PrivateRedis::start("past-lease").await else {
        return;
    };
    let url = redis.url();
    let server = Server::payments_logged(&[
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_LEASE", "3s"),
    ])
    .await;
    store_frozen_past_the_lease(&server, || redis.freeze()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_frozen_past_the_lease_runs_the_handler_twice_but_charges_once() {
    let Some(postgres) = PrivatePostgres::start().await else {
        return;
    };
    let url = postgres.url();
    let server = Server::payments_logged(&[
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_LEASE", "3s"),
    ])
    .await;
    store_frozen_past_the_lease(&server, || postgres.freeze()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_short_redis_freezes_inside_the_lease_keep_the_claim_and_run_once() {
    let Some(redis) = PrivateRedis::start("short-freezes").await else {
        return;
    };
    let url = redis.url();
    // Renewals every 2 s; each freeze covers one renewal (at 2 s and 4 s).
    let server = Server::payments_logged(&[
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_LEASE", "6s"),
    ])
    .await;
    let client = Client::new(Protocol::Http1);
    let key = "short-freezes";
    let path = "/payments?delay_ms=5000";
    let started = Instant::now();
    let first = spawn_pay(&client, &server, path, key);

    for freeze_at in [1500, 3500] {
        tokio::time::sleep_until(started + Duration::from_millis(freeze_at)).await;
        let frozen = redis.freeze();
        sleep(Duration::from_secs(1)).await;
        frozen.thaw();
        // The owner kept its claim through the pause: the duplicate is refused, not run.
        let duplicate = pay(&client, &server, path, key).await;
        assert_eq!(
            duplicate.status,
            StatusCode::CONFLICT,
            "after the freeze at {freeze_at} ms: {:?}",
            duplicate.body
        );
        assert_eq!(duplicate.problem_code(), "in_flight");
    }

    let first = within("the first request", Duration::from_secs(60), first)
        .await
        .unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed());
    let replay = pay(&client, &server, path, key).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
    assert!(replay.replayed(), "the result was recorded");
    assert_eq!(replay.body, first.body);
    assert_eq!(payment_id(&replay), payment_id(&first));
    assert_eq!(counts(&client, &server).await, (1, 1), "(runs, charges)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refusing_the_result_write_answers_409_then_replays_without_a_second_run() {
    let Some(redis) = PrivateRedis::start("maxmemory").await else {
        return;
    };
    let url = redis.url();
    // A short lease: the store refuses writes for longer than one lease, so the claim must be
    // kept alive (renewed) while the result waits to be recorded.
    let server = Server::payments_logged(&[
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_LEASE", "3s"),
    ])
    .await;
    let client = Client::new(Protocol::Http1);
    let key = "refused-write";
    let path = "/payments?delay_ms=2000";
    let first = spawn_pay(&client, &server, path, key);

    // While the handler runs, Redis runs out of memory (policy noeviction): it refuses every
    // write that may grow it, the completion among them.
    sleep(Duration::from_millis(500)).await;
    redis.config_set("maxmemory", "1").await;

    // The handler ran and charged: its caller gets the fresh answer.
    let first = within("the first request", Duration::from_secs(60), first)
        .await
        .unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed());

    // The result is not recorded yet; the key stays claimed, so retries are refused, not run.
    // Over 4 s (more than the lease) in all.
    for _ in 0..5 {
        let retry = pay(&client, &server, path, key).await;
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "a retry while the store refuses writes: {:?}",
            retry.body
        );
        assert_eq!(retry.problem_code(), "in_flight");
        sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(counts(&client, &server).await, (1, 1), "(runs, charges)");

    // Writes are taken again: the runtime's retried completion gets through and the retry
    // replays the first answer.
    redis.config_set("maxmemory", "0").await;
    let (replay, statuses) =
        retry_until_answered(&client, &server, path, key, Duration::from_secs(20)).await;
    eprintln!("retries after the store recovered: {statuses:?}");
    assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
    assert!(
        replay.replayed(),
        "the retry ran again instead of replaying"
    );
    assert_eq!(replay.body, first.body);
    assert_eq!(payment_id(&replay), payment_id(&first));
    assert_eq!(counts(&client, &server).await, (1, 1), "(runs, charges)");
}

// An owner's completion that landed, repeated while Redis refused new data (its reply was
// lost, or the replicas had not acknowledged it), was refused as "store full" instead of
// finding the owner's own record: the runtime kept retrying it, or fell back to the "not
// retained" record, which was refused as another owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_repeated_while_redis_is_full_recognises_its_own_record() {
    use idempotent_core::conformance::fresh_key;
    use idempotent_core::{Claim, FencingToken, Fingerprint, Store, StoreError};
    use idempotent_redis::RedisStore;

    let Some(redis) = PrivateRedis::start("full-repeat").await else {
        return;
    };
    let plain = RedisStore::connect(&redis.url()).await.unwrap();
    // One server, no replica: a `WAIT 1` is never acknowledged, as with a replica behind.
    let waiting = RedisStore::builder(redis.url())
        .replicas(1)
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let f = Fingerprint::from_bytes(b"full");
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let claim = |key| {
        let plain = plain.clone();
        async move {
            match plain.claim(&key, &f, lease, ttl).await.unwrap() {
                Claim::Claimed(token) => token,
                other => panic!("a fresh key is claimed: {other:?}"),
            }
        }
    };
    let (done, unacknowledged) = (fresh_key(), fresh_key());
    let done_token = claim(done).await;
    plain
        .complete(&done, done_token, "done".into(), ttl)
        .await
        .unwrap();
    let unacknowledged_token = claim(unacknowledged).await;
    assert!(matches!(
        waiting
            .complete(&unacknowledged, unacknowledged_token, "done".into(), ttl)
            .await,
        Err(StoreError::Unavailable(_))
    ));

    redis.config_set("maxmemory", "1").await;
    // The store is really full: a new key is refused.
    assert!(matches!(
        plain.claim(&fresh_key(), &f, lease, ttl).await,
        Err(StoreError::Capacity { .. })
    ));
    // The owner's repeated completions find its own record: done, whatever the payload.
    plain
        .complete(&done, done_token, "done".into(), ttl)
        .await
        .expect("the owner's repeated completion");
    plain
        .complete(&done, done_token, "not retained".into(), ttl)
        .await
        .expect("the owner's fallback completion");
    // Another token is not the owner's: refused.
    assert!(matches!(
        plain
            .complete(
                &done,
                FencingToken::new(done_token.get() + 1),
                "x".into(),
                ttl
            )
            .await,
        Err(StoreError::TokenRejected)
    ));
    // With replicas required, the repeat waits for the replicas again (fails closed until
    // they acknowledge) instead of failing as full.
    assert!(matches!(
        waiting
            .complete(&unacknowledged, unacknowledged_token, "done".into(), ttl)
            .await,
        Err(StoreError::Unavailable(_))
    ));
    redis.config_set("maxmemory", "0").await;
    assert!(matches!(
        plain.claim(&done, &f, lease, ttl).await.unwrap(),
        Claim::Completed { payload, .. } if payload == "done"
    ));
}
