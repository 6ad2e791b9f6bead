//! Operations in steps, on real `payments` processes (`POST /orders`: reserve, charge,
//! receipt), on Redis, PostgreSQL and SQLite, and on memory where a restart is not needed: a process
//! that aborts after a step and is started again resumes the order at the next step when the
//! client retries; with nobody retrying, the completer finishes it; a hundred orders survive
//! five SIGKILLs with one effect per step each. And, in-process on both stores, a stale
//! owner's checkpoint is refused.
//!
//! Effects are counted across processes in the file `IDEMPOTENCY_EFFECTS_LOG` names (a line
//! `<step> <step key> <pid>` per effect, written before the step's checkpoint), and on
//! PostgreSQL the receipts in the outbox table (written in the transaction of the receipt's
//! checkpoint).

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::{Method, StatusCode};
use idempotent_any::AnyStore;
use idempotent_core::{Call, ClaimHandle, Defaults, Error, Idempotency, Key};
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::Database;
use support::{Answer, Client, Protocol, Server};

/// How long a test waits for something that should happen in a second or two; never an
/// assertion on speed, only a bound on a test that would otherwise hang.
const PATIENCE: Duration = Duration::from_secs(120);

/// The signal `std::process::abort` raises.
const SIGABRT: i32 = 6;

fn order_body(sku: &str, quantity: u64, amount: u64) -> String {
    format!(r#"{{"sku":"{sku}","quantity":{quantity},"amount":{amount},"currency":"EUR"}}"#)
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

fn expected_counts(
    orders: u64,
    reserved: u64,
    charged: u64,
    receipts: u64,
    runs: u64,
) -> BTreeMap<String, u64> {
    [
        ("orders", orders),
        ("reserved", reserved),
        ("charged", charged),
        ("receipts", receipts),
        ("runs", runs),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Checks a `201` order: exactly the documented fields, the request echoed, and ids that all
/// derive from the same operation. Returns the operation's part of the ids (24 hex digits).
fn check_order(answer: &Answer, body: &str) -> String {
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let json = answer.json();
    let fields: BTreeSet<&str> = json
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    let expected: BTreeSet<&str> = [
        "order_id",
        "reservation_id",
        "charge_id",
        "receipt_id",
        "sku",
        "quantity",
        "amount",
        "currency",
    ]
    .into_iter()
    .collect();
    assert_eq!(fields, expected);
    let request: serde_json::Value = serde_json::from_str(body).unwrap();
    for field in ["sku", "quantity", "amount", "currency"] {
        assert_eq!(json[field], request[field], "{field} is echoed");
    }
    let order_id = json["order_id"].as_str().expect("order_id");
    let operation = order_id
        .strip_prefix("ord_")
        .expect("ord_ prefix")
        .to_owned();
    assert_eq!(operation.len(), 24, "{order_id}");
    assert!(operation.bytes().all(|b| b.is_ascii_hexdigit()));
    for (field, prefix) in [
        ("reservation_id", "res"),
        ("charge_id", "ch"),
        ("receipt_id", "rcpt"),
    ] {
        assert_eq!(json[field], format!("{prefix}_{operation}"), "{field}");
    }
    operation
}

/// One line of the effects log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Effect {
    step: String,
    /// The operation key the step key begins with.
    operation: String,
    pid: u32,
}

fn effects(path: &Path) -> Vec<Effect> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            let mut words = line.split(' ');
            let (Some(step), Some(key), Some(pid), None) =
                (words.next(), words.next(), words.next(), words.next())
            else {
                panic!("malformed effects line {line:?}");
            };
            let (operation, suffix) = key.rsplit_once('.').expect("a step key");
            assert_eq!(suffix, step, "{line}");
            Effect {
                step: step.to_owned(),
                operation: operation.to_owned(),
                pid: pid.parse().expect("a pid"),
            }
        })
        .collect()
}

/// A fresh file for the effects log.
fn effects_log(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(unique(name));
    let _ = std::fs::remove_file(&path);
    path
}

/// Where the orders' records live.
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
    async fn redis() -> Option<Backend> {
        redis_url().map(Backend::Redis)
    }

    async fn postgres(name: &str) -> Option<Backend> {
        let name = format!("{name}_{}", std::process::id());
        Database::create(&name).await.map(Backend::Postgres)
    }

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

    /// Whether the receipt is an outbox row (PostgreSQL) rather than a line of the log.
    fn outbox(&self) -> bool {
        matches!(self, Backend::Postgres(_))
    }

    /// The outbox's rows by message key (on PostgreSQL; empty elsewhere).
    async fn receipts(&self) -> HashMap<String, i64> {
        let Backend::Postgres(database) = self else {
            return HashMap::new();
        };
        let pool = database.pool().await;
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT message_key, destination, count(*) FROM idempotent_outbox \
             GROUP BY message_key, destination",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        rows.into_iter()
            .map(|(key, destination, count)| {
                assert_eq!(destination, "receipts");
                (key, count)
            })
            .collect()
    }

    async fn finish(self) {
        if let Backend::Postgres(database) = self {
            database.drop_database().await;
        }
    }
}

/// Retries `key` (without `crash_after`) until it is answered with something other than
/// `409 in_flight`, `503` or no answer: the answer.
async fn retry_until_answered(client: &Client, base: &str, key: &str, body: &str) -> Answer {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match order(client, base, "", key, body).await {
            Ok(answer)
                if answer.status != StatusCode::CONFLICT
                    && answer.status != StatusCode::SERVICE_UNAVAILABLE =>
            {
                return answer;
            }
            Ok(_) | Err(_) => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "order {key} was not answered within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `key` with `?crash_after={step}` and waits for the process to abort, before it
/// answers. Returns the aborted process's pid.
async fn crash_after(
    client: &Client,
    mut server: Server,
    step: &str,
    key: &str,
    body: &str,
) -> u32 {
    let pid = server.pid();
    let sent = order(
        client,
        &server.url(""),
        &format!("?crash_after={step}"),
        key,
        body,
    )
    .await;
    assert!(
        sent.is_err(),
        "the process answered instead of aborting: {:?}",
        sent.map(|a| (a.status, a.body))
    );
    let status = tokio::time::timeout(PATIENCE, server.child.wait())
        .await
        .expect("the process exits")
        .unwrap();
    assert_eq!(status.signal(), Some(SIGABRT), "{status:?}");
    pid
}

/// The effects of the order whose operation key begins with `operation`, as (step, pid).
fn effects_of(all: &[Effect], operation: &str) -> Vec<(String, u32)> {
    all.iter()
        .filter(|e| e.operation.starts_with(operation))
        .map(|e| (e.step.clone(), e.pid))
        .collect()
}

/// The process aborts right after step `step`; started again on the same store with a short
/// lease, the client's retry resumes the order: the steps saved before the crash do not run
/// again, the others run once, and the answer names what the first process made.
async fn crash_after_a_step_then_retry(backend: &Backend, step: &str) {
    let log = effects_log("effects");
    let log_path = log.to_str().unwrap();
    let env = [
        ("IDEMPOTENCY_STORE", backend.url()),
        ("IDEMPOTENCY_LEASE", "1s"),
        ("IDEMPOTENCY_EFFECTS_LOG", log_path),
    ];
    let client = Client::new(Protocol::Http1);
    let key = unique("crash");
    let body = order_body("tea", 2, 1200);
    let first = Server::payments_logged(&env).await;
    let crashed = crash_after(&client, first, step, &key, &body).await;
    let before = effects(&log);
    let expected_before: Vec<_> = match step {
        "reserve" => vec!["reserve"],
        _ => vec!["reserve", "charge"],
    };
    assert_eq!(
        before.iter().map(|e| e.step.as_str()).collect::<Vec<_>>(),
        expected_before,
        "the first process's effects"
    );
    assert!(before.iter().all(|e| e.pid == crashed));
    let operation = before[0].operation.clone();

    let second = Server::payments_logged(&env).await;
    let answer = retry_until_answered(&client, &second.url(""), &key, &body).await;
    let ids = check_order(&answer, &body);
    assert!(!answer.replayed());
    assert!(
        operation.starts_with(&ids),
        "the answer names the first attempt's operation: {ids} against {operation}"
    );
    let (charged, receipts) = match step {
        "reserve" => (1, 1),
        _ => (0, 1),
    };
    assert_eq!(
        counts(&client, &second).await,
        expected_counts(1, 0, charged, receipts, 1),
        "after a crash after {step}"
    );

    // Each step's effect once, across both processes.
    let all = effects(&log);
    let mut steps: Vec<&str> = all.iter().map(|e| e.step.as_str()).collect();
    steps.sort_unstable();
    let mut expected = vec!["charge", "reserve"];
    if !backend.outbox() {
        expected.push("receipt");
    }
    expected.sort_unstable();
    assert_eq!(steps, expected, "{all:?}");
    assert!(all.iter().all(|e| e.operation == operation), "{all:?}");
    if backend.outbox() {
        let receipts = backend.receipts().await;
        assert_eq!(
            receipts.get(&format!("{operation}.receipt")),
            Some(&1),
            "{receipts:?}"
        );
        assert_eq!(receipts.len(), 1, "{receipts:?}");
    }

    // A further retry replays the answer byte for byte.
    let again = retry_until_answered(&client, &second.url(""), &key, &body).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, answer.body);
    assert_eq!(
        counts(&client, &second).await["runs"],
        1,
        "a replay runs nothing"
    );
    let _ = std::fs::remove_file(&log);
}

/// Nobody retries: the process aborts after the charge, and the completer of the process
/// started again finishes the order from its kept request (the receipt only); the client's
/// eventual retry gets that answer.
async fn the_completer_finishes_an_abandoned_order(backend: &Backend) {
    let log = effects_log("effects");
    let log_path = log.to_str().unwrap();
    let env = [
        ("IDEMPOTENCY_STORE", backend.url()),
        ("IDEMPOTENCY_LEASE", "1s"),
        ("IDEMPOTENCY_EFFECTS_LOG", log_path),
        ("IDEMPOTENCY_COMPLETER_AFTER", "1s"),
    ];
    let client = Client::new(Protocol::Http1);
    let key = unique("abandoned");
    let body = order_body("coffee", 3, 4500);
    let first = Server::payments_logged(&env).await;
    let crashed = crash_after(&client, first, "charge", &key, &body).await;
    let before = effects(&log);
    assert_eq!(before.len(), 2, "{before:?}");
    let operation = before[0].operation.clone();

    let second = Server::payments_logged(&env).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let now = counts(&client, &second).await;
        if now["receipts"] == 1 && now["runs"] == 1 {
            assert_eq!(now, expected_counts(1, 0, 0, 1, 1));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completer did not finish the order within {PATIENCE:?}: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = retry_until_answered(&client, &second.url(""), &key, &body).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.replayed(), "the completer's answer is replayed");
    let ids = check_order(&answer, &body);
    assert!(operation.starts_with(&ids));
    assert_eq!(counts(&client, &second).await["runs"], 1);

    let all = effects(&log);
    let reserve_and_charge: Vec<_> = all
        .iter()
        .filter(|e| e.step != "receipt")
        .map(|e| (e.step.as_str(), e.pid))
        .collect();
    assert_eq!(
        reserve_and_charge,
        [("reserve", crashed), ("charge", crashed)],
        "{all:?}"
    );
    if backend.outbox() {
        let receipts = backend.receipts().await;
        assert_eq!(receipts.len(), 1, "{receipts:?}");
        assert_eq!(receipts.get(&format!("{operation}.receipt")), Some(&1));
    } else {
        let second_pid = second.pid();
        assert_eq!(
            effects_of(&all, &ids)
                .into_iter()
                .filter(|(step, _)| step == "receipt")
                .collect::<Vec<_>>(),
            [("receipt".to_owned(), second_pid)]
        );
    }
    let _ = std::fs::remove_file(&log);
}

/// The process that serves the orders now, shared by the clients.
#[derive(Clone, Default)]
struct Current(Arc<Mutex<String>>);

impl Current {
    fn get(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, base: String) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = base;
    }
}

/// A hundred orders from eight clients that retry (on no answer, 409 and 503, with the same
/// key), while the process is SIGKILLed five times and started again: every order is
/// answered 201, and each step of each order made one effect.
async fn orders_survive_sigkills(backend: &Backend) {
    const ORDERS: usize = 100;
    const CLIENTS: usize = 8;
    const KILLS: usize = 5;
    let log = effects_log("effects");
    let log_path = log.to_str().unwrap().to_owned();
    let url = backend.url().to_owned();
    let env = [
        ("IDEMPOTENCY_STORE", url.as_str()),
        ("IDEMPOTENCY_LEASE", "2s"),
        ("IDEMPOTENCY_EFFECTS_LOG", log_path.as_str()),
    ];
    let run = unique("load");
    let orders: Arc<Vec<(String, String)>> = Arc::new(
        (0..ORDERS)
            .map(|i| {
                let body = order_body(&format!("sku-{i}"), 1 + i as u64 % 3, 100 + i as u64);
                (format!("{run}-{i}"), body)
            })
            .collect(),
    );
    let mut server = Server::payments_logged(&env).await;
    let current = Current::default();
    current.set(server.url(""));
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (orders, current, next, answered) = (
            Arc::clone(&orders),
            current.clone(),
            Arc::clone(&next),
            Arc::clone(&answered),
        );
        clients.spawn(async move {
            let mut answers = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((key, body)) = orders.get(i) else {
                    return answers;
                };
                let deadline = tokio::time::Instant::now() + PATIENCE;
                let answer = loop {
                    // A client of its own per attempt: no connection to a dead process is
                    // reused.
                    let client = Client::new(Protocol::Http1);
                    match order(&client, &current.get(), "", key, body).await {
                        Ok(answer)
                            if answer.status != StatusCode::CONFLICT
                                && answer.status != StatusCode::SERVICE_UNAVAILABLE =>
                        {
                            break answer;
                        }
                        Ok(_) | Err(_) => {}
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "order {key} was not answered within {PATIENCE:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                answered.fetch_add(1, Ordering::SeqCst);
                answers.push((i, answer));
            }
        });
    }

    // Kills spread over the run: after 10, 25, 40, 55 and 70 orders were answered.
    for kill in 0..KILLS {
        let threshold = 10 + 15 * kill;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while answered.load(Ordering::SeqCst) < threshold {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{threshold} orders were not answered within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.signal("KILL");
        let _ = server.child.wait().await;
        drop(server);
        server = Server::payments_logged(&env).await;
        current.set(server.url(""));
    }

    let mut answers: Vec<Option<Answer>> = (0..ORDERS).map(|_| None).collect();
    while let Some(done) = clients.join_next().await {
        for (i, answer) in done.expect("a client panicked") {
            assert!(answers[i].is_none(), "order {i} answered twice");
            answers[i] = Some(answer);
        }
    }
    let answers: Vec<Answer> = answers
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.unwrap_or_else(|| panic!("order {i} never answered")))
        .collect();

    // Every order answered 201, with its own ids.
    let mut operations = BTreeMap::new();
    for (i, answer) in answers.iter().enumerate() {
        let ids = check_order(answer, &orders[i].1);
        assert!(
            operations.insert(ids.clone(), i).is_none(),
            "two orders share {ids}"
        );
    }

    // Each step of each order: exactly one operation key, the one its answer names. A step
    // runs again only when a kill fell between its effect and its checkpoint, with the same
    // key (so a downstream that deduplicates by it makes one effect).
    let all = effects(&log);
    let mut steps_per_order: BTreeMap<&str, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for effect in &all {
        let ids = &effect.operation[..24];
        assert!(
            operations.contains_key(ids),
            "an effect of no answered order: {effect:?}"
        );
        steps_per_order
            .entry(ids)
            .or_default()
            .entry(effect.step.as_str())
            .or_default()
            .insert(effect.operation.as_str());
    }
    let mut expected_steps = vec!["charge", "reserve"];
    if !backend.outbox() {
        expected_steps.push("receipt");
    }
    expected_steps.sort_unstable();
    for ids in operations.keys() {
        let steps = steps_per_order
            .get(ids.as_str())
            .unwrap_or_else(|| panic!("no effects of order {ids}"));
        assert_eq!(
            steps.keys().copied().collect::<Vec<_>>(),
            expected_steps,
            "order {ids}"
        );
        let keys: BTreeSet<&&str> = steps.values().flatten().collect();
        assert_eq!(
            keys.len(),
            1,
            "order {ids} ran under one operation: {keys:?}"
        );
    }
    // A step runs again only in another process, after a kill between its effect and its
    // checkpoint: never twice in one process.
    let mut runs_per_process: BTreeMap<(&str, &str, u32), usize> = BTreeMap::new();
    for effect in &all {
        *runs_per_process
            .entry((effect.operation.as_str(), effect.step.as_str(), effect.pid))
            .or_default() += 1;
    }
    for (run, count) in &runs_per_process {
        assert_eq!(*count, 1, "{run:?} ran {count} times in one process");
    }
    let repeated = all.len() - ORDERS * expected_steps.len();
    assert!(
        repeated <= KILLS * CLIENTS,
        "{repeated} steps ran again: more than the kills can explain"
    );
    eprintln!(
        "{ORDERS} orders, {KILLS} kills: {} effects logged, {repeated} step(s) ran again after a kill",
        all.len()
    );

    // On PostgreSQL: one receipt row per order, committed with its checkpoint.
    if backend.outbox() {
        let receipts = backend.receipts().await;
        assert_eq!(receipts.len(), ORDERS, "one receipt per order");
        for (key, count) in &receipts {
            assert_eq!(*count, 1, "{key}");
            let operation = key.strip_suffix(".receipt").expect("a receipt step key");
            assert!(
                steps_per_order
                    .get(&operation[..24])
                    .is_some_and(|steps| steps["reserve"].contains(operation)),
                "receipt {key} of an order's operation"
            );
        }
    }

    // Every order replays its answer byte for byte, running nothing.
    let client = Client::new(Protocol::Http1);
    let runs = counts(&client, &server).await["runs"];
    for (i, (key, body)) in orders.iter().enumerate() {
        let again = retry_until_answered(&client, &server.url(""), key, body).await;
        assert!(again.replayed(), "order {i}");
        assert_eq!(again.body, answers[i].body, "order {i}");
    }
    assert_eq!(counts(&client, &server).await["runs"], runs);
    let _ = std::fs::remove_file(&log);
}

/// A stale owner's checkpoint is refused: a claim whose lease lapsed (its process frozen) and
/// that another owner took over fails its next step with [`Error::ClaimLost`], and the new
/// owner, which resumes from the checkpoints saved before, runs that step itself.
async fn a_stale_owners_checkpoint_is_refused(url: &str) {
    async fn runtime(url: &str) -> Idempotency {
        let store = AnyStore::builder(url).reaper(None).connect().await.unwrap();
        Idempotency::builder(store)
            .namespace("steps-e2e")
            .defaults(Defaults::new().lease(Duration::from_millis(500)))
            .build()
    }
    let key = unique("stale");
    let (reserved_tx, reserved_rx) = tokio::sync::oneshot::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (stale_tx, stale_rx) = tokio::sync::oneshot::channel::<Result<String, Error>>();

    // The first owner, on a runtime of one thread that it then blocks: nothing renews its
    // claim while it waits, as in a process frozen by a pause.
    let stale = {
        let (url, key) = (url.to_owned(), key.clone());
        std::thread::spawn(move || {
            let runtime_ = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime_.block_on(async move {
                let idempotency = runtime(&url).await;
                let call = Call::new(Key::new(key).unwrap());
                let _ = idempotency
                    .run(&call, async move {
                        let claim = ClaimHandle::current().expect("inside run");
                        let reserved: String = claim
                            .step("reserve", async { "reserved-by-first".to_owned() })
                            .await
                            .expect("the first owner's reserve");
                        assert_eq!(reserved, "reserved-by-first");
                        reserved_tx.send(()).unwrap();
                        // Blocks the runtime's only thread until the new owner holds the key.
                        go_rx.recv().unwrap();
                        let charged = claim
                            .step("charge", async { "charged-by-first".to_owned() })
                            .await;
                        let _ = stale_tx.send(charged);
                    })
                    .await;
            });
        })
    };

    reserved_rx.await.expect("the first owner reserved");
    let idempotency = runtime(url).await;
    let call = Call::new(Key::new(key.clone()).unwrap());
    let mut go = Some(go_tx);
    let mut stale_rx = Some(stale_rx);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let (reserved, charged, ran) = loop {
        let ran = Arc::new(Mutex::new(Vec::<&str>::new()));
        let work = {
            let ran = Arc::clone(&ran);
            let go = &mut go;
            let stale_rx = &mut stale_rx;
            async move {
                let claim = ClaimHandle::current().expect("inside run");
                // The key is ours now: let the first owner try its next step.
                go.take().expect("taken over once").send(()).unwrap();
                let stale = stale_rx
                    .take()
                    .expect("once")
                    .await
                    .expect("the first owner's step");
                assert!(
                    matches!(stale, Err(Error::ClaimLost)),
                    "the stale owner's step: {stale:?}"
                );
                let reserved: String = claim
                    .step("reserve", {
                        let ran = Arc::clone(&ran);
                        async move {
                            ran.lock().unwrap().push("reserve");
                            "reserved-by-second".to_owned()
                        }
                    })
                    .await
                    .expect("reserve");
                let charged: String = claim
                    .step("charge", {
                        let ran = Arc::clone(&ran);
                        async move {
                            ran.lock().unwrap().push("charge");
                            "charged-by-second".to_owned()
                        }
                    })
                    .await
                    .expect("charge");
                (reserved, charged)
            }
        };
        match idempotency.run(&call, work).await {
            Ok(outcome) => {
                assert!(!outcome.is_replayed(), "the second owner ran");
                let (reserved, charged) = outcome.into_inner();
                let ran = ran.lock().unwrap().clone();
                break (reserved, charged, ran);
            }
            Err(Error::InFlight { .. }) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the lapsed claim was not taken over within {PATIENCE:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("the second owner: {error:?}"),
        }
    };
    assert_eq!(
        reserved, "reserved-by-first",
        "restored from the first owner's checkpoint"
    );
    assert_eq!(
        charged, "charged-by-second",
        "the stale checkpoint was refused"
    );
    assert_eq!(ran, ["charge"], "the new owner ran only the charge");
    stale.join().expect("the first owner's thread");

    // The operation's answer is the new owner's.
    let replay = idempotency
        .run(&call, async { ("x".to_owned(), "y".to_owned()) })
        .await
        .unwrap();
    assert!(replay.is_replayed());
    assert_eq!(
        replay.into_inner(),
        (
            "reserved-by-first".to_owned(),
            "charged-by-second".to_owned()
        )
    );
}

// Memory: what needs no restart.

/// An uninterrupted order on memory: its answer, its counts, a byte-identical replay (which
/// `crash_after` does not crash: nothing runs), and the bodies and hooks it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_an_order_runs_each_step_once_and_replays() {
    let server = Server::payments_logged(&[]).await;
    let client = Client::new(Protocol::Http1);
    let base = server.url("");
    let body = order_body("tea", 2, 1200);
    let first = order(&client, &base, "", "order-1", &body).await.unwrap();
    check_order(&first, &body);
    assert!(!first.replayed());
    assert_eq!(
        counts(&client, &server).await,
        expected_counts(1, 1, 1, 1, 1)
    );
    for query in ["", "?crash_after=charge", "?crash_after=reserve"] {
        let again = order(&client, &base, query, "order-1", &body)
            .await
            .unwrap();
        assert_eq!(again.status, StatusCode::CREATED, "{query}");
        assert!(
            again.replayed(),
            "{query}: crash_after is not fingerprinted"
        );
        assert_eq!(again.body, first.body, "{query}");
    }
    // Another query parameter is part of the fingerprint.
    let other = order(&client, &base, "?note=1", "order-1", &body)
        .await
        .unwrap();
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem_code(), "fingerprint_mismatch");

    let bad_hook = order(&client, &base, "?crash_after=receipt", "order-2", &body)
        .await
        .unwrap();
    assert_eq!(bad_hook.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad_hook.json()["error"], "invalid_crash_after");
    for (bad, status) in [
        ("{", StatusCode::BAD_REQUEST),
        (
            r#"{"sku":"tea","quantity":0,"amount":1,"currency":"EUR"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            r#"{"sku":"tea","quantity":"2","amount":1,"currency":"EUR"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            r#"{"quantity":2,"amount":1,"currency":"EUR"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ] {
        let answer = order(&client, &base, "", &unique("bad"), bad)
            .await
            .unwrap();
        assert_eq!(answer.status, status, "{bad}");
    }
    let declined = order(&client, &base, "", "order-3", &order_body("tea", 1, 0))
        .await
        .unwrap();
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(declined.json()["error"], "card_declined");
    // The declined order reserved (the demo does not release it) and charged nothing.
    assert_eq!(
        counts(&client, &server).await,
        expected_counts(1, 2, 1, 1, 2)
    );
}

/// On memory, an order whose charge fails (a `500`, released) and that nobody retries is
/// resumed by the completer after the reservation, never reserving again; after its attempts
/// its last answer is recorded, and the client's retry gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_completer_resumes_a_released_order_and_gives_up() {
    let server = Server::payments_logged(&[("IDEMPOTENCY_COMPLETER_AFTER", "200ms")]).await;
    let client = Client::new(Protocol::Http1);
    let body = r#"{"sku":"tea","quantity":1,"amount":700,"currency":"err"}"#;
    let failed = order(&client, &server.url(""), "", "failing", body)
        .await
        .unwrap();
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let answer = loop {
        // The completer's default: 5 attempts, after the client's own.
        if counts(&client, &server).await["runs"] >= 6 {
            let answer = retry_until_answered(&client, &server.url(""), "failing", body).await;
            if answer.replayed() {
                break answer;
            }
            panic!(
                "the retry ran instead of replaying: {:?}",
                String::from_utf8_lossy(&answer.body)
            );
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completer did not give up within {PATIENCE:?}: {:?}",
            counts(&client, &server).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.json()["error"], "provider_unavailable");
    assert_eq!(
        counts(&client, &server).await,
        expected_counts(0, 1, 0, 0, 6),
        "one reservation however many runs"
    );
}

// Redis.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_crash_after_reserve_then_retry() {
    let Some(backend) = Backend::redis().await else {
        return;
    };
    crash_after_a_step_then_retry(&backend, "reserve").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_crash_after_charge_then_retry() {
    let Some(backend) = Backend::redis().await else {
        return;
    };
    crash_after_a_step_then_retry(&backend, "charge").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_the_completer_finishes_an_abandoned_order() {
    let Some(backend) = Backend::redis().await else {
        return;
    };
    the_completer_finishes_an_abandoned_order(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_orders_survive_sigkills() {
    let Some(backend) = Backend::redis().await else {
        return;
    };
    orders_survive_sigkills(&backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_stale_owners_checkpoint_is_refused() {
    let Some(url) = redis_url() else { return };
    a_stale_owners_checkpoint_is_refused(&url).await;
}

// PostgreSQL.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_after_reserve_then_retry() {
    let Some(backend) = Backend::postgres("steps_crash_reserve").await else {
        return;
    };
    crash_after_a_step_then_retry(&backend, "reserve").await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_after_charge_then_retry() {
    let Some(backend) = Backend::postgres("steps_crash_charge").await else {
        return;
    };
    crash_after_a_step_then_retry(&backend, "charge").await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_completer_finishes_an_abandoned_order() {
    let Some(backend) = Backend::postgres("steps_completer").await else {
        return;
    };
    the_completer_finishes_an_abandoned_order(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_orders_survive_sigkills() {
    let Some(backend) = Backend::postgres("steps_sigkills").await else {
        return;
    };
    orders_survive_sigkills(&backend).await;
    backend.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stale_owners_checkpoint_is_refused() {
    let Some(backend) = Backend::postgres("steps_stale").await else {
        return;
    };
    a_stale_owners_checkpoint_is_refused(backend.url()).await;
    backend.finish().await;
}

// SQLite: the embedded durable store, its file shared by the processes that follow each other.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_crash_after_reserve_then_retry() {
    crash_after_a_step_then_retry(&Backend::sqlite(), "reserve").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_crash_after_charge_then_retry() {
    crash_after_a_step_then_retry(&Backend::sqlite(), "charge").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_completer_finishes_an_abandoned_order() {
    the_completer_finishes_an_abandoned_order(&Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_orders_survive_sigkills() {
    orders_survive_sigkills(&Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_stale_owners_checkpoint_is_refused() {
    let backend = Backend::sqlite();
    a_stale_owners_checkpoint_is_refused(backend.url()).await;
}
