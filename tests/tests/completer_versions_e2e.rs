//! A deploy: the completer of one release never finishes an operation another release kept
//! (issue 42, part 4). On real `payments` processes sharing a store: version A aborts after an
//! order's charge; version B, with a completer, runs long past the completer's delay and
//! leaves the order alone (nothing runs, the record stays abandoned, its kept request names
//! A); version A started again finishes it, without charging again. On SQLite (a file, no
//! server), Redis and PostgreSQL.
//!
//! Effects are counted across processes in the file `IDEMPOTENCY_EFFECTS_LOG` names (a line
//! `<step> <step key> <pid>` per effect, written before the step's checkpoint).

mod support;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{Method, StatusCode};
use idempotent_any::AnyStore;
use idempotent_core::Idempotency;
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use idempotent_tower::{CodeVersion, KeptRequest};
use support::{Answer, Client, Protocol, Server};

/// A bound on waits for what should take a second or two; never an assertion on speed.
const PATIENCE: Duration = Duration::from_secs(120);
/// The signal `std::process::abort` raises.
const SIGABRT: i32 = 6;
/// How long an order waits for its client before a completer takes it (a pass every quarter
/// of it).
const COMPLETER_AFTER: &str = "300ms";
/// How long version B runs with the order abandoned: its lease (1 s) and the completer's
/// delay many times over, some twenty passes.
const B_RUNS: Duration = Duration::from_secs(6);

/// Where the records live.
enum Backend {
    Redis(String),
    Postgres(Database),
    /// A SQLite file in a directory of its own (removed with it), as a `sqlite://` URL.
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

fn order_body() -> String {
    r#"{"sku":"tea","quantity":2,"amount":1200,"currency":"EUR"}"#.to_owned()
}

/// `POST /orders{query}` as `alice` with `key`: `Err` when no answer came (the process died).
async fn order(
    client: &Client,
    base: &str,
    query: &str,
    key: &str,
    body: &str,
) -> Result<Answer, String> {
    client
        .try_send(
            Method::POST,
            &format!("{base}/orders{query}"),
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer alice"),
                ("idempotency-key", key),
            ],
            body.to_owned(),
        )
        .await
}

/// `GET /orders/count` of `server`.
async fn counts(client: &Client, server: &Server) -> BTreeMap<String, u64> {
    let answer = client.get(&server.url("/orders/count")).await;
    assert_eq!(answer.status, StatusCode::OK);
    answer
        .json()
        .as_object()
        .expect("an object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().expect("a count")))
        .collect()
}

fn nothing_counted() -> BTreeMap<String, u64> {
    ["orders", "reserved", "charged", "receipts", "runs"]
        .into_iter()
        .map(|k| (k.to_owned(), 0))
        .collect()
}

/// The effects log's lines as (step, pid).
fn effects(path: &Path) -> Vec<(String, u32)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            let words: Vec<&str> = line.split(' ').collect();
            let [step, _key, pid] = words[..] else {
                panic!("malformed effects line {line:?}");
            };
            (step.to_owned(), pid.parse().expect("a pid"))
        })
        .collect()
}

fn effects_log() -> PathBuf {
    let path = std::env::temp_dir().join(unique("versions-effects"));
    let _ = std::fs::remove_file(&path);
    path
}

/// The example's runtime (its namespace), in this process, over the same store.
async fn runtime(url: &str) -> Idempotency {
    let store = AnyStore::builder(url).reaper(None).connect().await.unwrap();
    Idempotency::builder(store)
        .namespace("payments-example")
        .build()
}

/// The abandoned orders `version` kept: their kept requests, read back.
async fn abandoned_of(runtime: &Idempotency, version: &str) -> Vec<KeptRequest> {
    let version = CodeVersion::new(version).unwrap();
    let owner = KeptRequest::owner_for(runtime, Some(&version));
    runtime
        .abandoned(Duration::ZERO, 10, Some(&owner))
        .await
        .unwrap()
        .iter()
        .map(|abandoned| KeptRequest::decode(&abandoned.request).unwrap())
        .collect()
}

async fn another_versions_completer_leaves_the_order_alone(backend: &Backend) {
    let log = effects_log();
    let log_path = log.to_str().unwrap();
    // Versions of this run's own: on a store other runs share (Redis, say), an order another
    // run left is never this run's.
    let (version_a, version_b) = (unique("A"), unique("B"));
    let env = |version: &str| {
        [
            ("IDEMPOTENCY_STORE", backend.url().to_owned()),
            ("IDEMPOTENCY_LEASE", "1s".to_owned()),
            ("IDEMPOTENCY_EFFECTS_LOG", log_path.to_owned()),
            ("IDEMPOTENCY_COMPLETER_AFTER", COMPLETER_AFTER.to_owned()),
            ("IDEMPOTENCY_APP_VERSION", version.to_owned()),
        ]
    };
    let client = Client::new(Protocol::Http1);
    let key = unique("deployed");
    let body = order_body();

    // Version A aborts right after the charge: the order is abandoned, kept by A.
    let start = |version: &str| {
        let env = env(version);
        async move {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            Server::payments_logged(&env).await
        }
    };
    let mut a = start(&version_a).await;
    let crashed = a.pid();
    let sent = order(&client, &a.url(""), "?crash_after=charge", &key, &body).await;
    assert!(sent.is_err(), "A answered instead of aborting");
    let status = tokio::time::timeout(PATIENCE, a.child.wait())
        .await
        .expect("A exits")
        .unwrap();
    assert_eq!(status.signal(), Some(SIGABRT), "{status:?}");
    let crash_effects = vec![
        ("reserve".to_owned(), crashed),
        ("charge".to_owned(), crashed),
    ];
    assert_eq!(effects(&log), crash_effects);

    // Version B, with its completer, long past the lease and the completer's delay.
    let b = start(&version_b).await;
    tokio::time::sleep(B_RUNS).await;
    assert_eq!(
        counts(&client, &b).await,
        nothing_counted(),
        "B ran nothing"
    );
    assert_eq!(effects(&log), crash_effects, "no step ran again");
    // Still abandoned, and kept by A: what an operator's inspection shows.
    let runtime = runtime(backend.url()).await;
    let kept = abandoned_of(&runtime, &version_a).await;
    assert_eq!(kept.len(), 1, "the order is still abandoned");
    assert_eq!(
        kept[0].version().map(CodeVersion::as_str),
        Some(version_a.as_str())
    );
    assert_eq!(kept[0].uri().path(), "/orders");
    assert_eq!(kept[0].body().as_ref(), body.as_bytes());
    assert!(abandoned_of(&runtime, &version_b).await.is_empty());
    drop(b);

    // Version A again: its completer finishes the order from its checkpoints.
    let a = start(&version_a).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let now = counts(&client, &a).await;
        if now["receipts"] == 1 {
            assert_eq!((now["runs"], now["reserved"], now["charged"]), (1, 0, 0));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "A's completer did not finish the order within {PATIENCE:?}: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The completer's last step counts the receipt just before its answer is recorded: until
    // then the key is in flight (409), as a client's retry would find it.
    let answer = loop {
        let answer = order(&client, &a.url(""), "", &key, &body).await.unwrap();
        if answer.status != StatusCode::CONFLICT {
            break answer;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the order stayed in flight after its receipt for {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.replayed(), "the completer's answer is replayed");
    let mut expected = crash_effects;
    // On PostgreSQL the receipt is a row of the outbox, committed with its checkpoint, not a
    // line of the log.
    if !matches!(backend, Backend::Postgres(_)) {
        expected.push(("receipt".to_owned(), a.pid()));
    }
    assert_eq!(effects(&log), expected, "each step once: charged once");
    assert!(abandoned_of(&runtime, &version_a).await.is_empty());
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_another_versions_completer_leaves_the_order_alone() {
    let backend = Backend::sqlite();
    another_versions_completer_leaves_the_order_alone(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_another_versions_completer_leaves_the_order_alone() {
    let Some(url) = redis_url() else { return };
    let backend = Backend::Redis(url);
    another_versions_completer_leaves_the_order_alone(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_another_versions_completer_leaves_the_order_alone() {
    let name = format!("completer_versions_{}", std::process::id());
    let Some(database) = Database::create(&name).await else {
        return;
    };
    let backend = Backend::Postgres(database);
    another_versions_completer_leaves_the_order_alone(&backend).await;
    backend.finish().await;
}

/// A bad `IDEMPOTENCY_APP_VERSION` stops the server at start, naming the variable.
#[tokio::test]
async fn a_bad_app_version_exits_2_naming_the_variable() {
    for bad in ["", "1.4 beta", "9".repeat(65).as_str()] {
        let stderr = support::refused_at_start(
            tokio::process::Command::new(support::example_binary("payments"))
                .env("PORT", "0")
                .env("IDEMPOTENCY_APP_VERSION", bad),
            &format!("IDEMPOTENCY_APP_VERSION={bad:?}"),
        )
        .await
        .stderr;
        assert!(
            stderr.contains("IDEMPOTENCY_APP_VERSION"),
            "{bad:?}: {stderr}"
        );
    }
}
