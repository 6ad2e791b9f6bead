//! The example servers read their durations from the environment and check them against
//! `idempotent_core::limits`: a lease of a millisecond used to start a server whose
//! concurrent duplicates both ran. Out of range, the server exits with status 2 and a
//! message naming the variable and the range (the session idle time and window, and the
//! completer's idle time, too); at the ends of the ranges it starts.

mod support;

use http::StatusCode;
use support::{Client, Protocol, Server};

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_out_of_range_exit_with_the_variable_and_the_range() {
    for (name, value, expected) in [
        (
            "IDEMPOTENCY_LEASE",
            "1ms",
            "IDEMPOTENCY_LEASE=\"1ms\": lease must be between 100ms and 365d, got 1ms",
        ),
        (
            "IDEMPOTENCY_LEASE",
            "366d",
            "IDEMPOTENCY_LEASE=\"366d\": lease must be between 100ms and 365d, got 366d",
        ),
        (
            "IDEMPOTENCY_TTL",
            "8761h",
            "IDEMPOTENCY_TTL=\"8761h\": ttl must be between 1ms and 365d, got 8761h",
        ),
        (
            "IDEMPOTENCY_SESSION_IDLE",
            "366d",
            "IDEMPOTENCY_SESSION_IDLE=\"366d\": ttl must be between 1ms and 365d, got 366d",
        ),
        (
            "IDEMPOTENCY_SESSION_IDLE",
            "soon",
            "IDEMPOTENCY_SESSION_IDLE=\"soon\" is not a duration",
        ),
        (
            "IDEMPOTENCY_SESSION_WINDOW",
            "4097",
            "IDEMPOTENCY_SESSION_WINDOW=\"4097\": session window 4097 is out of range; it must be 1 to 4096",
        ),
        (
            "IDEMPOTENCY_SESSION_WINDOW",
            "0",
            "IDEMPOTENCY_SESSION_WINDOW=\"0\" is not a whole number greater than zero",
        ),
        (
            "IDEMPOTENCY_COMPLETER_AFTER",
            "later",
            "IDEMPOTENCY_COMPLETER_AFTER=\"later\" is not a duration",
        ),
        (
            "IDEMPOTENCY_COMPLETER_AFTER",
            "0s",
            "IDEMPOTENCY_COMPLETER_AFTER=\"0s\" must be greater than zero",
        ),
        (
            "IDEMPOTENCY_COMPLETER_AFTER",
            "366d",
            "IDEMPOTENCY_COMPLETER_AFTER=\"366d\": ttl must be between 1ms and 365d, got 366d",
        ),
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
async fn durations_at_the_ends_of_their_ranges_start_the_server() {
    let client = Client::new(Protocol::Http1);
    for (lease, ttl, replayed) in [("100ms", "1ms", false), ("365d", "365d", true)] {
        let env = [("IDEMPOTENCY_LEASE", lease), ("IDEMPOTENCY_TTL", ttl)];
        let server = Server::payments(&env).await;
        let url = server.url("/payments");
        let first = client.post(&url, Some("k"), Some("alice"), PAYMENT).await;
        assert_eq!(first.status, StatusCode::CREATED, "{env:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let retry = client.post(&url, Some("k"), Some("alice"), PAYMENT).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{env:?}");
        assert_eq!(
            retry.replayed(),
            replayed,
            "{env:?}: replayed until the TTL ends"
        );
    }
}

/// The ledger's and the relay's own duration variables: an absurd value (one that used to
/// overflow the clock: `CLAIM_IDLE=18446744073709551615s` made the ledger panic at connect and
/// exit 101) or one longer than 365 days exits with status 2 naming the variable, before
/// anything connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_and_relay_durations_out_of_range_exit_with_the_variable() {
    const ABSURD: &str = "18446744073709551615s";
    let redis = idempotent_test_kit::backend::redis_url()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    // A NOTIFY_URL turns the relay's settings on; nothing is ever sent to it.
    let notify = ("NOTIFY_URL", "http://127.0.0.1:9/notify");
    let mut cases = Vec::new();
    for value in [ABSURD, "366d"] {
        cases.push(("ledger", "CLAIM_IDLE", value));
        for name in ["RELAY_BACKOFF", "RELAY_POLL", "RELAY_DELIVERY_TIMEOUT"] {
            cases.push(("ledger", name, value));
            cases.push(("relay", name, value));
        }
    }
    for (example, name, value) in cases {
        let stderr = support::refused_at_start(
            tokio::process::Command::new(support::example_binary(example))
                .env("LEDGER_SOURCE", &redis)
                .env("DATABASE_URL", "postgres://nobody@127.0.0.1:9/none")
                .env(notify.0, notify.1)
                .env(name, value),
            &format!("{example} with {name}={value}"),
        )
        .await
        .stderr;
        let expected = format!("{name}={value:?} is longer than 365d");
        assert!(
            stderr.contains(&expected),
            "{example} with {name}={value}: {stderr}"
        );
    }
    // At the end of the range, the settings are taken (the ledger then fails to reach the
    // database, later: not with status 2).
    let output = tokio::process::Command::new(support::example_binary("ledger"))
        .env("LEDGER_SOURCE", &redis)
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:9/none")
        .env("CLAIM_IDLE", "365d")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(60), output)
        .await
        .expect("the ledger exits when the database cannot be reached")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(output.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("CLAIM_IDLE"), "{stderr}");
}
