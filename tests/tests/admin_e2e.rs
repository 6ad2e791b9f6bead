//! `idempotent-admin` against the running `payments` example (issue 42): on SQLite, Redis and
//! PostgreSQL, a completed payment is found by the key a customer quotes; an order that died
//! after `charge` is in flight, then abandoned with its two saved steps once its lease ends,
//! and listed; a release is refused while the lease is live and done once it ended, and the
//! client's retry then finishes the order without charging again; a give-up makes retries
//! answer `500 operation_failed`; forgetting a completed payment makes the next payment with
//! its key run again (one more charge). Also: the exit status and message of bad arguments
//! and of a store that cannot be reached, and a client session read by `session`.
//!
//! The tool runs as a process, as an operator runs it: `target/<profile>/idempotent-admin`,
//! built by `cargo build --workspace --all-targets` (scripts/test.sh).

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use serde_json::Value;
use support::{Answer, Client, Protocol, Server};

/// A bound on waits for what should take a second or two; never an assertion on speed.
const PATIENCE: Duration = Duration::from_secs(120);
/// The signal `std::process::abort` raises.
const SIGABRT: i32 = 6;
/// The example's lease: long enough that a crashed order is still held when it is first
/// inspected, short enough to wait for.
const LEASE: &str = "6s";
/// The payments example's runtime namespace.
const NAMESPACE: &str = "payments-example";

enum Backend {
    Redis(String),
    Postgres(Database),
    Sqlite {
        _dir: tempfile::TempDir,
        url: String,
    },
}

impl Backend {
    fn sqlite() -> Backend {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("records.db").display());
        Backend::Sqlite { _dir: dir, url }
    }

    fn url(&self) -> &str {
        match self {
            Backend::Redis(url) | Backend::Sqlite { url, .. } => url,
            Backend::Postgres(database) => &database.url,
        }
    }

    async fn finish(self) {
        if let Backend::Postgres(database) = self {
            database.drop_database().await;
        }
    }
}

/// The admin tool's binary, next to this test's.
fn admin_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join("idempotent-admin");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p idempotent-admin` (scripts/test.sh builds every target)",
        path.display()
    );
    path
}

/// The tool's run: exit status, stdout, stderr.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// The one JSON object it printed.
    fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "not one JSON object ({e}): {:?} (stderr {:?})",
                self.stdout, self.stderr
            )
        })
    }

    /// One JSON object a line.
    fn lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON object a line"))
            .collect()
    }

    fn assert_code(&self, code: i32, what: &str) -> &Self {
        assert_eq!(
            self.code,
            Some(code),
            "{what}: stdout {:?}, stderr {:?}",
            self.stdout,
            self.stderr
        );
        assert!(
            !self.stderr.contains("panicked") && !self.stderr.contains("stack backtrace"),
            "{what}: a panic: {}",
            self.stderr
        );
        self
    }
}

/// Runs the tool on `store` with `args` (the namespace given).
async fn admin(store: &str, args: &[&str]) -> Ran {
    let mut command = tokio::process::Command::new(admin_binary());
    command
        .env_remove("IDEMPOTENCY_STORE")
        .env_remove("IDEMPOTENCY_NAMESPACE")
        .env("USER", "e2e-operator")
        .arg("--store")
        .arg(store)
        .arg("--namespace")
        .arg(NAMESPACE)
        .args(args);
    let Output {
        status,
        stdout,
        stderr,
    } = tokio::time::timeout(PATIENCE, command.output())
        .await
        .expect("the tool ends")
        .expect("the tool runs");
    Ran {
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

async fn inspect(store: &str, key: &str) -> Value {
    admin(store, &["inspect", "--key", key, "--principal", "alice"])
        .await
        .assert_code(0, "inspect")
        .json()
}

fn order_body() -> &'static str {
    r#"{"sku":"tea","quantity":2,"amount":1200,"currency":"EUR"}"#
}

/// `POST /orders{query}` as `alice` with `key`: `Err` when no answer came (the process died).
async fn order(client: &Client, base: &str, query: &str, key: &str) -> Result<Answer, String> {
    client
        .try_send(
            Method::POST,
            &format!("{base}/orders{query}"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer alice"),
                ("idempotency-key", key),
            ],
            order_body().to_owned(),
        )
        .await
}

/// The effects log's steps, in order.
fn effects(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| line.split(' ').next().unwrap_or_default().to_owned())
        .collect()
}

/// The example, keeping each order's request for a completer that waits an hour (so none
/// runs during the test) under the version `e2e-1`.
async fn start(backend: &Backend, log: &Path) -> Server {
    let env = [
        ("IDEMPOTENCY_STORE", backend.url()),
        ("IDEMPOTENCY_LEASE", LEASE),
        ("IDEMPOTENCY_EFFECTS_LOG", log.to_str().unwrap()),
        ("IDEMPOTENCY_COMPLETER_AFTER", "1h"),
        ("IDEMPOTENCY_APP_VERSION", "e2e-1"),
    ];
    Server::payments_logged(&env).await
}

/// Waits until `key`'s record is abandoned (its lease ended), and returns it.
async fn abandoned(store: &str, key: &str) -> Value {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let record = inspect(store, key).await;
        if record["abandoned"] == Value::Bool(true) {
            return record;
        }
        assert!(Instant::now() < deadline, "never abandoned: {record}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Starts an order that dies after `charge`; returns once the process is gone.
async fn crash_after_charge(client: &Client, server: &mut Server, key: &str) {
    let sent = order(client, &server.url(""), "?crash_after=charge", key).await;
    assert!(sent.is_err(), "the order answered instead of aborting");
    let status = tokio::time::timeout(PATIENCE, server.child.wait())
        .await
        .expect("the example exits")
        .unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(SIGABRT), "{status:?}");
}

async fn operate_the_payments_example(backend: &Backend) {
    let store = backend.url();
    let client = Client::new(Protocol::Http1);
    let log = std::env::temp_dir().join(unique("admin-effects"));
    let _ = std::fs::remove_file(&log);
    let mut server = start(backend, &log).await;

    // A completed payment, found by the key the customer quotes and its principal.
    let paid = unique("pay");
    let answer = client
        .post(
            &server.url("/payments"),
            Some(&paid),
            Some("alice"),
            r#"{"amount":500,"currency":"EUR"}"#,
        )
        .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let record = inspect(store, &paid).await;
    assert_eq!(record["state"], "completed", "{record}");
    assert_eq!(record["abandoned"], false);
    assert_eq!(record["key"], paid.as_str());
    assert_eq!(record["status"], 201);
    assert_eq!(record["attempts"], 1);
    assert_eq!(record["kept_request"], Value::Null);
    assert!(
        record.get("result").is_none(),
        "no body without --show-result"
    );
    assert!(record["expires_in_s"].as_f64().unwrap() > 3600.0);
    let shown = admin(
        store,
        &[
            "inspect",
            "--key",
            &paid,
            "--principal",
            "alice",
            "--show-result",
        ],
    )
    .await
    .assert_code(0, "inspect --show-result")
    .json();
    let body: Value = serde_json::from_str(shown["result"].as_str().expect("the body")).unwrap();
    assert_eq!(body, answer.json(), "the body as the client got it");
    // Another principal's key space does not hold it.
    let other = admin(store, &["inspect", "--key", &paid, "--principal", "bob"])
        .await
        .assert_code(0, "inspect as bob")
        .json();
    assert_eq!(other["state"], "absent");
    let listed = admin(
        store,
        &["list", "--state", "completed", "--limit", "100000"],
    )
    .await
    .assert_code(0, "list completed")
    .lines();
    assert!(
        listed.iter().any(|r| r["key"] == paid.as_str()),
        "list --state completed shows the key in clear"
    );

    // An order that died after `charge`: in flight while its lease lasts, a release refused.
    let order_key = unique("order");
    crash_after_charge(&client, &mut server, &order_key).await;
    let record = inspect(store, &order_key).await;
    assert_eq!(record["state"], "in_flight", "{record}");
    assert_eq!(record["abandoned"], false, "{record}");
    assert!(record["lease_left_s"].as_f64().unwrap() > 0.0);
    assert_eq!(record["steps"], serde_json::json!(["reserve", "charge"]));
    assert_eq!(
        record["kept_request"],
        serde_json::json!({"method": "POST", "uri": "/orders", "version": "e2e-1"}),
        "the kept request names the version that kept it"
    );
    let refused = admin(
        store,
        &[
            "release",
            "--key",
            &order_key,
            "--principal",
            "alice",
            "--reason",
            "e2e: too early",
        ],
    )
    .await;
    let refused = refused.assert_code(1, "release of a live claim").json();
    assert_eq!(refused["done"], false);
    assert!(
        refused["refused"].as_str().unwrap().contains("live lease"),
        "{refused}"
    );
    assert!(refused["lease_left_s"].as_f64().unwrap() > 0.0);
    assert!(
        refused["reason"] == "e2e: too early" && refused["operator"] == "e2e-operator",
        "{refused}"
    );

    // Once its lease ended: abandoned, with its two steps, and listed.
    let record = abandoned(store, &order_key).await;
    assert_eq!(record["state"], "in_flight");
    assert_eq!(record["steps"], serde_json::json!(["reserve", "charge"]));
    assert_eq!(record["lease_left_s"], 0.0);
    let listed = admin(
        store,
        &["list", "--state", "abandoned", "--limit", "100000"],
    )
    .await
    .assert_code(0, "list abandoned")
    .lines();
    let found = listed
        .iter()
        .find(|r| r["key"] == order_key.as_str())
        .unwrap_or_else(|| panic!("list --state abandoned misses {order_key}: {listed:?}"));
    assert_eq!(found["abandoned"], true);
    assert_eq!(found["scope_parts"], serde_json::json!(["principal"]));
    let table = admin(
        store,
        &[
            "--format",
            "table",
            "list",
            "--state",
            "abandoned",
            "--limit",
            "100000",
        ],
    )
    .await;
    table.assert_code(0, "list --format table");
    assert!(table.stdout.lines().next().unwrap().contains("state"));
    assert!(table.stdout.contains(&order_key));
    let running = admin(
        store,
        &["list", "--state", "in_flight", "--limit", "100000"],
    )
    .await
    .assert_code(0, "list in_flight")
    .lines();
    assert!(!running.iter().any(|r| r["key"] == order_key.as_str()));

    // Released: the client's retry finishes it from its steps, charging once.
    let released = admin(
        store,
        &[
            "release",
            "--key",
            &order_key,
            "--principal",
            "alice",
            "--reason",
            "e2e: stuck",
        ],
    )
    .await;
    assert!(
        released.stderr.contains("record repaired")
            && released.stderr.contains("e2e: stuck")
            && released.stderr.contains("e2e-operator"),
        "the repair is logged with who asked and why: {}",
        released.stderr
    );
    let released = released
        .assert_code(0, "release of an abandoned claim")
        .json();
    assert_eq!(released["done"], true);
    assert!(released["note"].as_str().unwrap().contains("runs again"));
    assert_eq!(inspect(store, &order_key).await["state"], "released");
    let mut server = start(backend, &log).await;
    let finished = order(&client, &server.url(""), "", &order_key)
        .await
        .expect("an answer");
    assert_eq!(finished.status, StatusCode::CREATED, "{:?}", finished.body);
    let record = inspect(store, &order_key).await;
    assert_eq!(record["state"], "completed");
    assert_eq!(record["status"], 201);
    assert_eq!(record["attempts"], 2, "{record}");
    let steps = effects(&log);
    assert_eq!(
        steps.iter().filter(|s| *s == "charge").count(),
        1,
        "charged once: {steps:?}"
    );

    // Given up: retries answer 500 operation_failed.
    let doomed = unique("doomed");
    crash_after_charge(&client, &mut server, &doomed).await;
    abandoned(store, &doomed).await;
    let given_up = admin(
        store,
        &[
            "give-up",
            "--key",
            &doomed,
            "--principal",
            "alice",
            "--reason",
            "e2e: refunded by hand",
        ],
    )
    .await
    .assert_code(0, "give-up")
    .json();
    assert_eq!(given_up["done"], true);
    let record = inspect(store, &doomed).await;
    assert_eq!(record["state"], "completed");
    assert_eq!(record["status"], 500);
    let server = start(backend, &log).await;
    let retry = order(&client, &server.url(""), "", &doomed)
        .await
        .expect("an answer");
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.problem_code(), "operation_failed");
    assert!(String::from_utf8_lossy(&retry.body).contains("e2e: refunded by hand"));

    // Forgotten: the next payment with the key runs again and charges again.
    let before = client.charges(&server).await;
    let answer = client
        .post(
            &server.url("/payments"),
            Some(&paid),
            Some("alice"),
            r#"{"amount":500,"currency":"EUR"}"#,
        )
        .await;
    assert!(answer.replayed(), "a completed payment replays");
    assert_eq!(client.charges(&server).await, before);
    let forgotten = admin(
        store,
        &[
            "forget",
            "--key",
            &paid,
            "--principal",
            "alice",
            "--reason",
            "e2e: customer asked",
        ],
    )
    .await
    .assert_code(0, "forget")
    .json();
    assert_eq!(forgotten["done"], true);
    assert!(forgotten["note"].as_str().unwrap().contains("run again"));
    assert_eq!(inspect(store, &paid).await["state"], "absent");
    let again = client
        .post(
            &server.url("/payments"),
            Some(&paid),
            Some("alice"),
            r#"{"amount":500,"currency":"EUR"}"#,
        )
        .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "a forgotten key runs as new");
    assert_eq!(client.charges(&server).await, before + 1, "one more charge");
    // A repair of a key with no record is refused.
    admin(
        store,
        &[
            "forget",
            "--key",
            &unique("never"),
            "--principal",
            "alice",
            "--reason",
            "e2e",
        ],
    )
    .await
    .assert_code(1, "forget of an absent key");
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_operate_the_payments_example() {
    let backend = Backend::sqlite();
    operate_the_payments_example(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_operate_the_payments_example() {
    let Some(url) = redis_url() else { return };
    let backend = Backend::Redis(url);
    operate_the_payments_example(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_operate_the_payments_example() {
    let Some(database) = Database::create(&unique("admin")).await else {
        return;
    };
    let backend = Backend::Postgres(database);
    operate_the_payments_example(&backend).await;
    backend.finish().await;
}

/// Bad arguments and a store that cannot be reached: exit 2, a message naming what, no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_an_unreachable_store_exit_2() {
    let sqlite = Backend::sqlite();
    let cases: &[(&str, &[&str], &str)] = &[
        (
            sqlite.url(),
            &["list", "--state", "stuck"],
            "in_flight, abandoned",
        ),
        (sqlite.url(), &["inspect"], "--key"),
        (
            sqlite.url(),
            &["inspect", "--key", " leading space"],
            "not a valid key",
        ),
        (
            sqlite.url(),
            &["list", "--state", "completed", "--older-than", "soon"],
            "soon",
        ),
        (sqlite.url(), &["release", "--key", "k"], "--reason"),
        ("nosuch://x", &["inspect", "--key", "k"], "nosuch://x"),
        ("memory", &["inspect", "--key", "k"], "memory"),
        (
            "postgres://nobody:secret@127.0.0.1:1/x",
            &["inspect", "--key", "k"],
            "127.0.0.1:1",
        ),
        ("redis://127.0.0.1:1", &["inspect", "--key", "k"], "store"),
    ];
    for (store, args, names) in cases {
        let ran = admin(store, args).await;
        ran.assert_code(2, &format!("{store} {args:?}"));
        assert!(
            ran.stderr.contains(names),
            "{store} {args:?}: the message names {names:?}: {}",
            ran.stderr
        );
        assert!(
            !ran.stderr.contains("secret"),
            "a password printed: {}",
            ran.stderr
        );
        assert!(ran.stdout.is_empty(), "{store} {args:?}: {}", ran.stdout);
    }
}

/// `session` reads a client session's epoch, mark and held numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_shows_the_mark_and_the_held_numbers() {
    use idempotent_core::session::InSession;
    use idempotent_core::{Call, Idempotency, Scope};
    let backend = Backend::sqlite();
    let store = idempotent_any::AnyStore::builder(backend.url())
        .reaper(None)
        .connect()
        .await
        .unwrap();
    let runtime = Idempotency::builder(store).namespace(NAMESPACE).build();
    let id = "device-7";
    for (seq, ack) in [(1, 0), (2, 0), (3, 1)] {
        let call = Call::in_session(id.parse().unwrap(), InSession::new(seq, ack).unwrap())
            .scope(Scope::new().principal("alice"));
        runtime.run(&call, async move { seq }).await.unwrap();
    }
    let shown = admin(
        backend.url(),
        &["session", "--id", id, "--principal", "alice"],
    )
    .await
    .assert_code(0, "session")
    .json();
    assert_eq!(shown["state"], "open", "{shown}");
    assert_eq!(shown["mark"], 1);
    assert_eq!(shown["high"], 3);
    assert_eq!(shown["held"], serde_json::json!([2, 3]));
    let absent = admin(backend.url(), &["session", "--id", id])
        .await
        .assert_code(0, "session, another scope")
        .json();
    assert_eq!(absent["state"], "absent");
}
