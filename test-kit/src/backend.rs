//! The test environment's servers, each named by an environment variable that
//! `scripts/services.sh` sets, and the rule for a server that is missing: a test says loudly
//! that it did not run and passes, except where backend tests are required
//! (`IDEMPOTENT_REQUIRE_BACKENDS=1`, as `scripts/test.sh` sets, or `CI`), where it fails.

use std::io::Write as _;

/// The URL of the shared `redis-server`.
pub const REDIS_URL: &str = "IDEMPOTENT_TEST_REDIS_URL";
/// The URLs of the Redis Cluster's nodes (three primaries, three replicas), comma-separated.
pub const REDIS_CLUSTER_URLS: &str = "IDEMPOTENT_TEST_REDIS_CLUSTER_URLS";
/// The Redis Cluster's directory: `PORT/redis.pid` and `PORT/start.sh` for each node.
pub const REDIS_CLUSTER_DIR: &str = "IDEMPOTENT_TEST_REDIS_CLUSTER_DIR";
/// The URL of the shared PostgreSQL server's `postgres` database.
pub const POSTGRES_URL: &str = "IDEMPOTENT_TEST_POSTGRES_URL";
/// The directory of PostgreSQL's server binaries (`initdb`, `pg_ctl`).
pub const PG_BIN: &str = "IDEMPOTENT_TEST_PG_BIN";
/// The URL of the shared `nats-server -js`.
pub const NATS_URL: &str = "IDEMPOTENT_TEST_NATS_URL";
/// The URL of the shared RabbitMQ node.
pub const AMQP_URL: &str = "IDEMPOTENT_TEST_AMQP_URL";
/// A `rabbitmqctl` command for the shared RabbitMQ node, split on spaces.
pub const RABBITMQCTL: &str = "IDEMPOTENT_TEST_RABBITMQCTL";
/// The URL of the shared Kafka-protocol broker (`kafka://127.0.0.1:PORT`).
pub const KAFKA_URL: &str = "IDEMPOTENT_TEST_KAFKA_URL";
/// The Kafka-protocol broker's binary (`nisshi`), for tests that start brokers of their own.
pub const NISSHI: &str = "IDEMPOTENT_TEST_NISSHI";
/// Set (not `0`) where backend tests must run: a missing server is then a failure.
pub const REQUIRE_BACKENDS: &str = "IDEMPOTENT_REQUIRE_BACKENDS";

/// Whether backend tests must run here: `IDEMPOTENT_REQUIRE_BACKENDS` set and not `0`, or `CI`
/// set and not `false`.
pub fn required() -> bool {
    std::env::var_os(REQUIRE_BACKENDS).is_some_and(|v| v != "0")
        || std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false")
}

/// The URL in the environment variable `var` (one of this module's constants), or `None` when
/// it is unset or empty: then the test says so loudly and returns, or fails where backend
/// tests are required.
pub fn backend_url(var: &str) -> Option<String> {
    if let Ok(url) = std::env::var(var)
        && !url.is_empty()
    {
        return Some(url);
    }
    missing(
        &format!("{var} is not set"),
        "run `bash scripts/test.sh`, which starts the servers, or set it to a server's URL",
    );
    None
}

/// `found`, or `None` when the program `what` is not installed: then the test says so loudly
/// and returns, or fails where backend tests are required.
pub fn installed<T>(what: &str, found: Option<T>) -> Option<T> {
    if found.is_none() {
        missing(
            &format!("{what} is missing"),
            "install it (scripts/test.sh installs the Debian packages)",
        );
    }
    found
}

/// The one place the rule is applied: a failure where backend tests are required, a notice
/// otherwise.
fn missing(what: &str, how: &str) {
    assert!(
        !required(),
        "{what} but backend tests are required here; {how}"
    );
    // Written to the stderr handle rather than with `eprintln!`, which the test harness
    // captures and hides for passing tests: a test that did not run must not look green.
    let _ = writeln!(
        std::io::stderr(),
        "\n*** NOT RUN: {what}, so this test did not talk to a real server; {how}. ***\n"
    );
}

/// The shared `redis-server`'s URL (see [`backend_url`]).
pub fn redis_url() -> Option<String> {
    backend_url(REDIS_URL)
}

/// The shared PostgreSQL server's URL (see [`backend_url`]).
pub fn postgres_url() -> Option<String> {
    backend_url(POSTGRES_URL)
}

/// The Redis Cluster's node URLs, comma-separated (see [`backend_url`]).
pub fn redis_cluster_urls() -> Option<String> {
    backend_url(REDIS_CLUSTER_URLS)
}

/// The shared NATS server's URL (see [`backend_url`]).
pub fn nats_url() -> Option<String> {
    backend_url(NATS_URL)
}

/// The shared Kafka-protocol broker's URL, `kafka://127.0.0.1:PORT` (see [`backend_url`]).
pub fn kafka_url() -> Option<String> {
    backend_url(KAFKA_URL)
}

/// The shared RabbitMQ node's URL (see [`backend_url`]).
pub fn amqp_url() -> Option<String> {
    backend_url(AMQP_URL)
}
