//! A run: the system started on loopback and in network namespaces of its own, the workload
//! and the nemesis at once, then the faults healed, every operation finished and replayed, the
//! effects collected, and the history checked.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idempotent_test_kit::cluster::Cluster;
use idempotent_test_kit::names::restartable_port;
use idempotent_test_kit::netns::Netns;
use idempotent_test_kit::postgres::PrivatePostgres;
use idempotent_test_kit::redis::PrivateRedis;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::faults::{FaultKind, Planned, schedule};
use crate::history::{Event, Recorder};
use crate::system::{Proc, examples_dir};
use crate::workload::Workload;

/// The stores a run can put the `payments` instances' records in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreKind {
    /// A Redis of the run's own, in a network namespace.
    Redis,
    /// A PostgreSQL of the run's own, in a network namespace.
    Postgres,
    /// The Redis Cluster of the environment (`IDEMPOTENT_TEST_REDIS_CLUSTER_URLS`, which
    /// `scripts/services.sh` starts), one claim acknowledged by a replica.
    RedisCluster,
    /// A SQLite file both instances open: one host.
    Sqlite,
}

impl StoreKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            StoreKind::Redis => "redis",
            StoreKind::Postgres => "postgres",
            StoreKind::RedisCluster => "redis-cluster",
            StoreKind::Sqlite => "sqlite",
        }
    }
}

/// A run's settings (see `nemesis --help`).
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) store: StoreKind,
    pub(crate) seed: u64,
    pub(crate) duration: Duration,
    pub(crate) max_ops: u64,
    pub(crate) concurrent: usize,
    pub(crate) out: PathBuf,
    pub(crate) bin_dir: Option<PathBuf>,
}

/// The checker's bounds. An attempt: the claim's wait (`CLAIM_TIMEOUT`, 5 s), a step's
/// checkpoint and the completion each bounded by the store's 2 s timeout, with room for a
/// freeze that began mid-request. Finishing: a killed instance's claim lapses after its 2 s
/// lease; the client's pauses are at most 400 ms.
pub(crate) const ATTEMPT_BOUND: Duration = Duration::from_secs(15);
pub(crate) const FINISH_BOUND: Duration = Duration::from_secs(30);

/// The store whose faults the nemesis causes.
enum Store {
    Redis(PrivateRedis),
    Postgres(PrivatePostgres),
    Cluster(Cluster),
    /// Embedded in the instances: nothing of its own to fault.
    Sqlite,
}

struct System {
    store: Store,
    /// The store's namespace (Redis, PostgreSQL).
    store_netns: Option<Netns>,
    broker: Mutex<PrivateRedis>,
    broker_netns: Netns,
    /// On Redis, the ledger's PostgreSQL (not faulted): on PostgreSQL, the store is it.
    _ledger_server: Option<PrivatePostgres>,
    ledger_db: String,
    payments_db: Option<String>,
    instances: Vec<Mutex<Proc>>,
    consumers: Vec<Mutex<Proc>>,
    relay: Mutex<Proc>,
    /// One lock per target, so that two lanes never fault one target at once.
    targets: HashMap<String, Mutex<()>>,
}

/// Why a run could not be carried out (not an anomaly: the exit status is 3).
pub(crate) type Infra = String;

const STREAM: &str = "nemesis";

/// Runs the system under the schedule of `options.seed`; returns the history.
pub(crate) async fn run(options: &Options) -> Result<Vec<Event>, Infra> {
    std::fs::create_dir_all(&options.out).map_err(|e| format!("{}: {e}", options.out.display()))?;
    let recorder = Recorder::create(&options.out.join("history.jsonl"))
        .map_err(|e| format!("history.jsonl: {e}"))?;
    let planned = schedule(
        options.seed,
        options.duration,
        options.concurrent,
        options.store,
    );
    let system = Arc::new(start(options, &recorder).await?);

    // On PostgreSQL an order's receipt is an outbox row written with its checkpoint.
    let (logged_steps, outbox_steps): (Vec<String>, Vec<String>) = match options.store {
        StoreKind::Postgres => (
            vec!["reserve".into(), "charge".into()],
            vec!["receipt".into()],
        ),
        _ => (
            vec!["reserve".into(), "charge".into(), "receipt".into()],
            vec![],
        ),
    };
    recorder.record(Event::Run {
        seed: options.seed,
        store: options.store.name().to_owned(),
        duration_ms: millis(options.duration),
        attempt_bound_ms: millis(ATTEMPT_BOUND),
        finish_bound_ms: millis(FINISH_BOUND),
        logged_steps,
        outbox_steps,
    });
    let (_, required) = crate::faults::FaultKind::of(options.store);
    let missing: Vec<&str> = required
        .iter()
        .filter(|kind| !planned.iter().any(|p| p.kind == **kind))
        .map(|kind| kind.name())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "nemesis: warning: this run is too short for every kind of fault; it leaves out {}",
            missing.join(", ")
        );
    }
    eprintln!(
        "nemesis: seed {}, {} faults planned: {}",
        options.seed,
        planned.len(),
        planned
            .iter()
            .map(|p| format!("{}@{}s", p.kind, p.at_ms / 1000))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let mut targets = Vec::new();
    for instance in &system.instances {
        let instance = instance.lock().await;
        targets.push((instance.name.clone(), instance.url()));
    }
    let proxy = crate::proxy::Proxy::start(
        targets
            .iter()
            .map(|(_, url)| url.trim_start_matches("http://").to_owned())
            .collect(),
    )
    .await?;
    let workload = Arc::new(Workload::new(recorder.clone(), targets, options.seed));
    let broker_url = system.broker.lock().await.url();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..4 {
        clients.spawn(Arc::clone(&workload).order_client(options.max_ops));
    }
    for _ in 0..4 {
        clients.spawn(Arc::clone(&workload).payment_client(options.max_ops));
    }
    for client in 0..2 {
        clients.spawn(Arc::clone(&workload).session_client(client, options.max_ops));
    }
    clients.spawn(Arc::clone(&workload).producer(
        broker_url,
        STREAM.into(),
        Duration::from_millis(25),
        options.max_ops,
    ));
    // payments_client, the example, in batches through the load balancer: one batch with
    // keys and one in a session at a time.
    let bins = examples_dir(options.bin_dir.as_deref())?;
    for session in [false, true] {
        let (workload, recorder) = (Arc::clone(&workload), recorder.clone());
        let (program, url) = (bins.join("payments_client"), proxy.url.clone());
        let logs = options.out.clone();
        clients.spawn(async move {
            let mut batch = 0;
            while workload.sending() {
                let name = format!("payments_client-{}{batch}", if session { "s" } else { "k" });
                batch += 1;
                let event = client_batch(&program, &url, &name, session, &logs, &recorder).await;
                let failed = matches!(event, Event::Client { exit, .. } if exit != 0);
                recorder.record(event);
                if failed {
                    // The checker reports it; the next batch after a pause, not at once.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        });
    }

    // The nemesis: each lane's faults in turn, at their times.
    let began = Instant::now();
    let mut lanes = tokio::task::JoinSet::new();
    for lane in 0..options.concurrent.max(1) {
        let mine: Vec<Planned> = planned.iter().filter(|p| p.lane == lane).cloned().collect();
        let (system, recorder) = (Arc::clone(&system), recorder.clone());
        lanes.spawn(async move {
            for (n, fault) in mine.into_iter().enumerate() {
                tokio::time::sleep_until(began + Duration::from_millis(fault.at_ms)).await;
                let id = (lane as u64) << 32 | n as u64;
                inject(&system, &recorder, id, &fault).await?;
            }
            Ok::<(), Infra>(())
        });
    }
    tokio::time::sleep_until(began + options.duration).await;
    workload.stop_sending();
    while let Some(lane) = lanes.join_next().await {
        lane.map_err(|e| format!("a fault lane failed: {e}"))??;
    }
    let healed = recorder.now();
    recorder.record(Event::Healed { t: healed });
    workload.give_up_at(Instant::now() + FINISH_BOUND);
    while clients.join_next().await.is_some() {}
    drop(proxy);
    eprintln!(
        "nemesis: {} operations; faults healed at {} s; replaying the answers",
        workload.started(),
        healed / 1000
    );
    // The replays have a bound of their own, from now.
    workload.give_up_at(Instant::now() + FINISH_BOUND);
    Arc::clone(&workload).replay_all(8).await;

    collect(&system, options, &recorder).await?;
    recorder.record(Event::End { t: recorder.now() });
    recorder
        .flush()
        .map_err(|e| format!("history.jsonl: {e}"))?;
    if let Ok(system) = Arc::try_unwrap(system) {
        stop(system).await;
    }
    Ok(recorder.events())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn start(options: &Options, recorder: &Recorder) -> Result<System, Infra> {
    let bins = examples_dir(options.bin_dir.as_deref())?;
    for name in ["payments", "ledger", "relay", "payments_client"] {
        if !bins.join(name).exists() {
            return Err(format!(
                "{} is missing: build the examples (cargo build --examples) or pass --bin-dir",
                bins.join(name).display()
            ));
        }
    }
    let netns = || {
        Netns::create().ok_or_else(|| {
            "network namespaces need root and `ip` (iproute2); see RELIABILITY.md".to_owned()
        })
    };
    let mut store_netns = None;
    let mut ledger_server = None;
    let (store, store_url) = match options.store {
        StoreKind::Redis => {
            let netns = store_netns.insert(netns()?);
            let redis = PrivateRedis::start_in("nemesis-store", netns)
                .await
                .ok_or("redis-server is not installed")?;
            let url = redis.url();
            (Store::Redis(redis), url)
        }
        StoreKind::Postgres => {
            let netns = store_netns.insert(netns()?);
            let pg = PrivatePostgres::start_in(netns)
                .await
                .ok_or("PostgreSQL's server binaries are not installed")?;
            let url = pg.url();
            (Store::Postgres(pg), url)
        }
        StoreKind::RedisCluster => {
            let cluster = Cluster::from_env().ok_or(
                "--store redis-cluster needs IDEMPOTENT_TEST_REDIS_CLUSTER_URLS (a cluster \
                 of three primaries with a replica each, as scripts/services.sh starts)",
            )?;
            let url = cluster.urls().to_owned();
            (Store::Cluster(cluster), url)
        }
        StoreKind::Sqlite => {
            let url = format!("sqlite://{}", options.out.join("store.sqlite").display());
            (Store::Sqlite, url)
        }
    };
    // The ledger's PostgreSQL: the store on PostgreSQL, a server of its own (on loopback,
    // not faulted) otherwise.
    let pg_url = match &store {
        Store::Postgres(pg) => pg.url(),
        _ => {
            let pg = PrivatePostgres::start()
                .await
                .ok_or("PostgreSQL's server binaries are not installed")?;
            ledger_server.insert(pg).url()
        }
    };
    let broker_netns = netns()?;
    let broker = PrivateRedis::start_durable_in("nemesis-broker", &broker_netns)
        .await
        .ok_or("redis-server is not installed")?;
    let ledger_db = create_database(&pg_url, "ledger").await?;
    let payments_db = match options.store {
        StoreKind::Postgres => Some(store_url.clone()),
        _ => None,
    };
    let notifier = crate::notify::Notifier::start().await?;
    let notify_url = notifier.url.clone();
    NOTIFIER
        .set(notifier)
        .map_err(|_| "one run per process".to_owned())?;

    let logs = options.out.clone();
    let effects = options.out.join("effects.log");
    let _ = std::fs::remove_file(&effects);
    let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    let replicas = if options.store == StoreKind::RedisCluster {
        "1"
    } else {
        "0"
    };
    let mut instances = Vec::new();
    for n in 0..2 {
        let port = restartable_port().to_string();
        let effects = effects.display().to_string();
        let mut proc = Proc::new(
            &format!("payments-{n}"),
            bins.join("payments"),
            env(&[
                ("PORT", &port),
                ("IDEMPOTENCY_STORE", &store_url),
                ("IDEMPOTENCY_LEASE", "2s"),
                ("IDEMPOTENCY_COMPLETER_AFTER", "3s"),
                ("IDEMPOTENCY_EFFECTS_LOG", &effects),
                // On the Cluster, a claim and a record are acknowledged by a replica before
                // they count: a failover loses none.
                ("IDEMPOTENCY_REDIS_REPLICAS", replicas),
                ("RUST_LOG", "warn"),
            ]),
            "listening on ",
            &logs,
        );
        proc.port = Some(port);
        proc.start(recorder, Duration::from_secs(60)).await?;
        instances.push(Mutex::new(proc));
    }
    let broker_url = broker.url();
    let mut consumers = Vec::new();
    for n in 0..2 {
        let name = format!("ledger-{n}");
        let mut proc = Proc::new(
            &name,
            bins.join("ledger"),
            env(&[
                ("REDIS_URL", &broker_url),
                ("DATABASE_URL", &ledger_db),
                ("STREAM", STREAM),
                ("GROUP", "ledger"),
                ("CONSUMER", &name),
                ("CLAIM_IDLE", "2s"),
                ("MAX_DELIVERIES", "1000000"),
                ("NOTIFY_URL", &notify_url),
                ("RELAY", "0"),
                // A pause between the effect and the commit, as real work has: a consumer
                // killed mid-message is then killed inside its transaction, where acking
                // before the commit would lose the message.
                ("EFFECT_DELAY_MS", "100"),
                ("RUST_LOG", "warn"),
            ]),
            "consuming ",
            &logs,
        );
        proc.start(recorder, Duration::from_secs(60)).await?;
        consumers.push(Mutex::new(proc));
    }
    let mut relay = Proc::new(
        "relay",
        bins.join("relay"),
        env(&[
            ("DATABASE_URL", &ledger_db),
            ("NOTIFY_URL", &notify_url),
            ("RELAY_MAX_ATTEMPTS", "1000000"),
            ("RELAY_BACKOFF", "200ms"),
            ("RELAY_POLL", "200ms"),
            ("RELAY_DELIVERY_TIMEOUT", "5s"),
            ("RUST_LOG", "warn"),
        ]),
        "relaying to ",
        &logs,
    );
    relay.start(recorder, Duration::from_secs(60)).await?;
    let targets = [
        "payments-0",
        "payments-1",
        "ledger-0",
        "ledger-1",
        "relay",
        "store",
        "broker",
    ]
    .into_iter()
    .map(|t| (t.to_owned(), Mutex::new(())))
    .collect();
    Ok(System {
        store,
        store_netns,
        broker: Mutex::new(broker),
        broker_netns,
        _ledger_server: ledger_server,
        ledger_db,
        payments_db,
        instances,
        consumers,
        relay: Mutex::new(relay),
        targets,
    })
}

/// The receiver of the relay's deliveries, for the whole process.
static NOTIFIER: std::sync::OnceLock<crate::notify::Notifier> = std::sync::OnceLock::new();

/// Creates database `name` on the server of `url`; its URL.
async fn create_database(url: &str, name: &str) -> Result<String, Infra> {
    let admin = sqlx::PgPool::connect(url)
        .await
        .map_err(|e| format!("PostgreSQL at {url}: {e}"))?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .map_err(|e| format!("CREATE DATABASE {name}: {e}"))?;
    admin.close().await;
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    Ok(format!("{base}/{name}"))
}

/// Causes `fault`, holds it, ends it; the history gets its start and end.
async fn inject(
    system: &System,
    recorder: &Recorder,
    id: u64,
    fault: &Planned,
) -> Result<(), Infra> {
    let target = fault.kind.target(fault.which);
    let _held = match system.targets.get(&target) {
        Some(lock) => Some(lock.lock().await),
        None => None,
    };
    let hold = Duration::from_millis(fault.hold_ms);
    let start = |recorder: &Recorder| {
        recorder.record(Event::FaultStart {
            t: recorder.now(),
            fault: id,
            kind: fault.kind.name().into(),
            target: target.clone(),
        });
    };
    match fault.kind {
        FaultKind::KillInstance | FaultKind::KillConsumer | FaultKind::KillRelay => {
            let proc = match fault.kind {
                FaultKind::KillInstance => &system.instances[fault.which],
                FaultKind::KillConsumer => &system.consumers[fault.which],
                _ => &system.relay,
            };
            let mut proc = proc.lock().await;
            start(recorder);
            proc.kill().await;
            tokio::time::sleep(hold).await;
            proc.start(recorder, Duration::from_secs(60)).await?;
        }
        FaultKind::PauseInstance => {
            let instance = system.instances[fault.which].lock().await;
            let mut frozen = idempotent_test_kit::process::Frozen::new();
            start(recorder);
            if let Some(pid) = instance.pid() {
                frozen.stop(pid);
            }
            tokio::time::sleep(hold).await;
            frozen.thaw();
        }
        FaultKind::FreezeStore => {
            let frozen = match &system.store {
                Store::Redis(redis) => redis.freeze(),
                Store::Postgres(pg) => pg.freeze(),
                Store::Cluster(_) | Store::Sqlite => return Err(not_here(fault)),
            };
            start(recorder);
            tokio::time::sleep(hold).await;
            frozen.thaw();
        }
        FaultKind::PartitionStore | FaultKind::PartitionBroker => {
            let netns = match fault.kind {
                FaultKind::PartitionStore => system.store_netns.as_ref(),
                _ => Some(&system.broker_netns),
            };
            let netns = netns.ok_or_else(|| not_here(fault))?;
            start(recorder);
            netns.cut();
            tokio::time::sleep(hold).await;
            netns.heal();
        }
        FaultKind::FailoverStore => {
            let Store::Cluster(cluster) = &system.store else {
                return Err(not_here(fault));
            };
            let primaries = cluster.with_role("master").await;
            let primary = primaries[fault.which % primaries.len()];
            let replica = cluster.replica_of(primary).await;
            start(recorder);
            Cluster::failover_to(replica).await;
            cluster.wait_until_ok().await;
        }
        FaultKind::RestartBroker => {
            let mut broker = system.broker.lock().await;
            start(recorder);
            broker.restart().await;
        }
    }
    recorder.record(Event::FaultEnd {
        t: recorder.now(),
        fault: id,
    });
    Ok(())
}

fn not_here(fault: &Planned) -> Infra {
    format!("{} has no store of its own to fault here", fault.kind)
}

/// Waits until the ledger has applied and the receiver acted on every published posting (or
/// the finish bound passes), then records every effect: the steps' lines, the receipts'
/// outbox rows, the balances and the notifications.
async fn collect(system: &System, options: &Options, recorder: &Recorder) -> Result<(), Infra> {
    let ledger = sqlx::PgPool::connect(&system.ledger_db)
        .await
        .map_err(|e| format!("the ledger's database: {e}"))?;
    let published = recorder.count(|e| matches!(e, Event::Ok { status: 0, .. }));
    let notifier = NOTIFIER.get().ok_or("no notifier")?;
    // Caught up: every published posting applied and acted on, and the outbox delivered.
    // Then a settling time longer than a pending message's redelivery (CLAIM_IDLE, 2 s) and the
    // relay's poll, so that a late second apply or delivery lands before the effects are read.
    let deadline = Instant::now() + FINISH_BOUND;
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
            .fetch_one(&ledger)
            .await
            .map_err(|e| format!("the ledger's accounts: {e}"))?;
        let undelivered: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotent_outbox WHERE state <> 'delivered'")
                .fetch_one(&ledger)
                .await
                .map_err(|e| format!("the ledger's outbox: {e}"))?;
        let acted = notifier.acted().len();
        let caught_up = applied as usize >= published && acted >= published && undelivered == 0;
        if caught_up || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let effects = std::fs::read_to_string(options.out.join("effects.log")).unwrap_or_default();
    for line in effects.lines() {
        let mut words = line.split(' ');
        if let (Some(step), Some(key), Some(pid), None) =
            (words.next(), words.next(), words.next(), words.next())
        {
            let (key, pid) = (key.to_owned(), pid.parse().unwrap_or(0));
            recorder.record(match step {
                "payment" => Event::Charge { key, pid },
                _ => Event::Step {
                    step: step.to_owned(),
                    key,
                    pid,
                },
            });
        } else {
            return Err(format!("a malformed line in effects.log: {line:?}"));
        }
    }
    if let Some(db) = &system.payments_db {
        let payments = sqlx::PgPool::connect(db)
            .await
            .map_err(|e| format!("the payments' database: {e}"))?;
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT message_key, destination FROM idempotent_outbox")
                .fetch_all(&payments)
                .await
                .map_err(|e| format!("the receipts: {e}"))?;
        for (key, destination) in rows {
            let step = if destination == "receipts" {
                "receipt"
            } else {
                &destination
            };
            recorder.record(Event::OutboxStep {
                step: step.to_owned(),
                key,
            });
        }
    }
    let balances: Vec<(String, i64)> = sqlx::query_as("SELECT account, balance FROM accounts")
        .fetch_all(&ledger)
        .await
        .map_err(|e| format!("the ledger's accounts: {e}"))?;
    for (account, balance) in balances {
        recorder.record(Event::Balance { account, balance });
    }
    for (key, id) in notifier.acted() {
        recorder.record(Event::Notified { key, id });
    }
    ledger.close().await;
    Ok(())
}

/// A batch of 100 payments by `payments_client` through `url` (4 at a time; all in one session
/// with `session`), waited for up to 3 minutes; its summary line as an event.
async fn client_batch(
    program: &std::path::Path,
    url: &str,
    name: &str,
    session: bool,
    logs: &std::path::Path,
    recorder: &Recorder,
) -> Event {
    const SENT: u64 = 100;
    let mut command = tokio::process::Command::new(program);
    command
        .args([
            "--url",
            url,
            "--payments",
            &SENT.to_string(),
            "--concurrency",
            "4",
        ])
        .args(["--user", name])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    if session {
        command.arg("--session");
    }
    // One log for all the batches of a kind (`payments_client-k.log`, `-s.log`).
    let log = logs.join(format!(
        "payments_client-{}.log",
        if session { "s" } else { "k" }
    ));
    if let Ok(log) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        command.stderr(log);
    }
    let output = match command.spawn() {
        Ok(child) => tokio::time::timeout(Duration::from_secs(180), child.wait_with_output()).await,
        Err(error) => Ok(Err(error)),
    };
    let (exit, summary) = match output {
        Ok(Ok(output)) => {
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            let last = text.lines().last().unwrap_or_default().to_owned();
            (
                output.status.code().unwrap_or(-1),
                serde_json::from_str::<serde_json::Value>(&last).unwrap_or_default(),
            )
        }
        Ok(Err(_)) => (-1, serde_json::Value::Null),
        Err(_) => (-2, serde_json::Value::Null),
    };
    Event::Client {
        t: recorder.now(),
        name: name.to_owned(),
        exit,
        sent: SENT,
        succeeded: summary["succeeded"].as_u64().unwrap_or(0),
    }
}

async fn stop(system: System) {
    for proc in system.instances.iter().chain(&system.consumers) {
        proc.lock().await.stop().await;
    }
    system.relay.lock().await.stop().await;
    drop(system.store);
    drop(system.store_netns);
    drop(system.broker_netns);
}
