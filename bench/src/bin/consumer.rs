//! The consumer runtime's throughput on Redis Streams, NATS JetStream and RabbitMQ, against
//! each broker's own limit measured in the same run by the simplest correct consumer written
//! directly on the broker's client crate.
//!
//! Each row pre-publishes a backlog (`--messages`, default 20,000, postings like the `ledger`
//! example's: `id`, `account` among 1,000, `amount`) to a stream or queue of its own, then
//! consumes it and is timed from the consumer's start to the last acknowledgement. Rows, per
//! broker:
//!
//! - `bare`: the broker's own loop with a no-op handler, one message at a time: Redis
//!   `XREADGROUP … COUNT 32` then one `XACK` of the whole batch; NATS a durable pull consumer's
//!   `fetch` of 32, each message acknowledged; RabbitMQ `basic.consume` with prefetch 64, each
//!   delivery `basic.ack`ed (Redis reads on one connection and acknowledges on another: a
//!   blocking read holds up every later command on its connection);
//! - `bare-tasks`: the same loop handing each message to one of `--concurrency` (16) spawned
//!   tasks that acknowledge it one by one (Redis: one `XACK` per message): the runtime's shape,
//!   without decoding, claims or records;
//! - `runtime`: `Consumer::new(source).run(Idempotency::new(MemoryStore::new()), handler, …)`
//!   with a handler that decodes the posting and does nothing (a claim and a completion in the
//!   memory store per message); `runtime-dup`: the same with `--duplicates` (2,000) copies mixed
//!   in, each published at least 1,000 messages after its original;
//! - `bare-pg`: `bare-tasks` whose handler decodes the posting and runs `BEGIN; INSERT INTO
//!   accounts … ON CONFLICT DO UPDATE; COMMIT` before the ack: the effect without the runtime;
//! - `runtime-pg`: `Consumer::run_transactional` with that `INSERT` as the handler (the claim
//!   and the completion in the same transaction); `runtime-pg-dup`: with the duplicates.
//!
//! Each row reports messages per second over the whole backlog and between its 10th and 90th
//! percent (the tail shows in the difference), the p50, p99 and max from a message's receipt
//! to the broker's answer to its ack (the runtime's `idempotency.message.duration`, caught by a
//! recorder of its own; the bare loops time the same span), CPU per message of this process,
//! of each server (`--services`, which `scripts/bench_consumer.sh` sets) and of the whole
//! machine, context switches per message, and whether every posting was applied exactly once.
//! The consumer loops run on the main thread (in `#[tokio::main]`, as in the `ledger` example),
//! the handlers on the runtime's two worker threads.
//!
//! Diagnostics: `--paced RATE` publishes while the consumer runs and reports the latencies
//! (also from publication); `--receive-stats` counts the runtime's receive calls and their
//! sizes; `--bare-batch N` changes what the bare loops ask for at once; `--parts` times the
//! pieces the runtime adds per message, in process.
//!
//! ```sh
//! bash scripts/bench_consumer.sh            # starts the four servers, builds, runs
//! target/release/consumer --help
//! ```
//!
//! It prints one JSON object per row, then a table. The numbers are in BENCHMARKS.md.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use hdrhistogram::Histogram;
use idempotent_core::consumer::nats::JetStream;
use idempotent_core::consumer::rabbitmq::RabbitMq;
use idempotent_core::consumer::redis_streams::RedisStreams;
use idempotent_core::consumer::{
    Consumer, Decode, Failure, Fields, Handler, MESSAGE_DURATION, Message, Outcome, Received,
    Report, Source, SourceError, TxHandler, sql_failure,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::postgres::PostgresStore;
use idempotent_core::{Call, ClaimHandle, Execution, Fingerprint, Idempotency, Key, Retain};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use redis::Value;
use redis::aio::MultiplexedConnection;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::{Notify, Semaphore};

/// Distinct accounts the postings go to: few enough to be a real table, enough that 16
/// transactions at once rarely wait on one another's row.
const ACCOUNTS: usize = 1000;
/// A duplicate is published at least this many messages after its original, as a publisher's
/// retry or a redelivery would come: not while the original is still in hand.
const DUPLICATE_GAP: usize = 1000;
/// Messages a bare loop asks of the broker at once (the runtime's default batch).
const BATCH: usize = 32;
/// RabbitMQ's prefetch, in the bare loops and the runtime's source (its default).
const PREFETCH: u16 = 64;
/// How long a receive waits for a first message, everywhere.
const RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// The consumer group (Redis) and the durable consumer (NATS).
const GROUP: &str = "bench";
const ACCOUNTS_TABLE: &str = "consumer_bench_accounts";
const RECORDS_TABLE: &str = "consumer_bench_idempotency";

const USAGE: &str = "\
consumer: the consumer runtime's throughput on Redis Streams, NATS JetStream and RabbitMQ

  --redis-url URL      (or IDEMPOTENT_TEST_REDIS_URL; without one, no Redis rows)
  --nats-url URL       (or IDEMPOTENT_TEST_NATS_URL)
  --amqp-url URL       (or IDEMPOTENT_TEST_AMQP_URL)
  --postgres-url URL   (or IDEMPOTENT_TEST_POSTGRES_URL; without one, no PostgreSQL rows)
  --messages N         the backlog of every row (default 20000)
  --duplicates N       copies mixed into the -dup rows' backlog (default 2000)
  --concurrency N      handlers at once (default 16)
  --rounds N           rounds over every row; each row reports its median round (default 1)
  --only LIST          comma-separated brokers (redis, nats, rabbitmq) and rows (bare,
                       bare-tasks, runtime, runtime-dup, bare-pg, runtime-pg, runtime-pg-dup)
  --receive-stats      wrap the runtime's sources to count receive calls and their sizes
                       (the runtime rows only; a diagnostic, not the measured setup)
  --parts              measure the per-message pieces the runtime adds, in process, and exit
  --paced RATE         instead of a backlog, publish RATE messages a second for
                       --paced-seconds (default 4) while the consumer runs, and report the
                       latencies (from receipt and from publication to the ack's answer);
                       rows bare-tasks and runtime unless --only says otherwise
  --services LIST      redis=PID,nats=PID,rabbitmq=PGID,postgres=PID (or
                       CONSUMER_BENCH_SERVICES): also report each server's CPU time per
                       message (the process, its children and its process group)
  --bare-batch N       messages the bare loops ask for at once (default 32; a diagnostic)
  --out FILE           also write the rows as JSON to FILE
";

struct Options {
    redis: Option<String>,
    nats: Option<String>,
    amqp: Option<String>,
    postgres: Option<String>,
    messages: usize,
    duplicates: usize,
    concurrency: usize,
    rounds: usize,
    only: Vec<String>,
    receive_stats: bool,
    parts: bool,
    paced: Option<u64>,
    paced_seconds: u64,
    services: Option<String>,
    bare_batch: usize,
    out: Option<String>,
}

fn options() -> Result<Options, String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let mut options = Options {
        redis: env("IDEMPOTENT_TEST_REDIS_URL"),
        nats: env("IDEMPOTENT_TEST_NATS_URL"),
        amqp: env("IDEMPOTENT_TEST_AMQP_URL"),
        postgres: env("IDEMPOTENT_TEST_POSTGRES_URL"),
        messages: 20_000,
        duplicates: 2_000,
        concurrency: 16,
        rounds: 1,
        only: Vec::new(),
        receive_stats: false,
        parts: false,
        paced: None,
        paced_seconds: 4,
        services: env("CONSUMER_BENCH_SERVICES"),
        bare_batch: BATCH,
        out: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        let number = |text: String| -> Result<usize, String> {
            text.parse().map_err(|e| format!("{arg}: {e}"))
        };
        match arg.as_str() {
            "--redis-url" => options.redis = Some(value()?),
            "--nats-url" => options.nats = Some(value()?),
            "--amqp-url" => options.amqp = Some(value()?),
            "--postgres-url" => options.postgres = Some(value()?),
            "--messages" => options.messages = number(value()?)?.max(10),
            "--duplicates" => options.duplicates = number(value()?)?,
            "--concurrency" => options.concurrency = number(value()?)?.max(1),
            "--rounds" => options.rounds = number(value()?)?.max(1),
            "--only" => options.only = value()?.split(',').map(|s| s.trim().to_owned()).collect(),
            "--receive-stats" => options.receive_stats = true,
            "--parts" => options.parts = true,
            "--paced" => options.paced = Some((number(value()?)? as u64).max(1)),
            "--paced-seconds" => options.paced_seconds = (number(value()?)? as u64).max(1),
            "--out" => options.out = Some(value()?),
            "--services" => options.services = Some(value()?),
            "--bare-batch" => options.bare_batch = number(value()?)?.max(1),
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}\n\n{USAGE}")),
        }
    }
    Ok(options)
}

// ---------------------------------------------------------------------------------------------
// Rows

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Broker {
    Redis,
    Nats,
    RabbitMq,
}

impl Broker {
    const ALL: [Broker; 3] = [Broker::Redis, Broker::Nats, Broker::RabbitMq];

    fn name(self) -> &'static str {
        match self {
            Broker::Redis => "redis",
            Broker::Nats => "nats",
            Broker::RabbitMq => "rabbitmq",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    Bare,
    BareTasks,
    Runtime,
    RuntimeDup,
    BarePg,
    RuntimePg,
    RuntimePgDup,
}

impl Mode {
    const ALL: [Mode; 7] = [
        Mode::Bare,
        Mode::BareTasks,
        Mode::Runtime,
        Mode::RuntimeDup,
        Mode::BarePg,
        Mode::RuntimePg,
        Mode::RuntimePgDup,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::BareTasks => "bare-tasks",
            Mode::Runtime => "runtime",
            Mode::RuntimeDup => "runtime-dup",
            Mode::BarePg => "bare-pg",
            Mode::RuntimePg => "runtime-pg",
            Mode::RuntimePgDup => "runtime-pg-dup",
        }
    }

    fn duplicates(self) -> bool {
        matches!(self, Mode::RuntimeDup | Mode::RuntimePgDup)
    }

    fn postgres(self) -> bool {
        matches!(self, Mode::BarePg | Mode::RuntimePg | Mode::RuntimePgDup)
    }
}

/// One posting, as published.
#[derive(Debug, Clone)]
struct Posting {
    id: String,
    account: String,
    amount: i64,
    /// With `--paced`: when it was published, in microseconds since the Unix epoch.
    sent: Option<u64>,
}

impl Posting {
    /// The body NATS and RabbitMQ carry: a JSON object of three strings, as in `ledger`.
    fn body(&self) -> Vec<u8> {
        let mut body = serde_json::json!({
            "id": self.id,
            "account": self.account,
            "amount": self.amount.to_string(),
        });
        if let Some(sent) = self.sent {
            body["sent"] = sent.to_string().into();
        }
        serde_json::to_vec(&body).unwrap()
    }
}

/// Microseconds since the Unix epoch: a paced message's send time, compared on receipt.
fn now_micros() -> u64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

/// A row's backlog: `messages` distinct postings and `duplicates` copies of earlier ones,
/// spread evenly after the first [`DUPLICATE_GAP`], each at least that far behind its
/// original. Also the sum of the distinct amounts, what the accounts must add up to.
fn backlog(tag: &str, messages: usize, duplicates: usize) -> (Vec<Posting>, i64) {
    let gap = DUPLICATE_GAP.min(messages / 2);
    let originals: Vec<Posting> = (0..messages)
        .map(|n| Posting {
            id: format!("{tag}-{n}"),
            account: format!("acct-{}", n % ACCOUNTS),
            amount: (n % 97) as i64 + 1,
            sent: None,
        })
        .collect();
    let sum = originals.iter().map(|p| p.amount).sum();
    let mut out = Vec::with_capacity(messages + duplicates);
    let mut random: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut placed = 0;
    for (n, posting) in originals.iter().enumerate() {
        out.push(posting.clone());
        // Duplicates go after originals gap..messages, evenly.
        while placed < duplicates && n >= gap && gap + placed * (messages - gap) / duplicates <= n {
            random = random
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let of = (random >> 33) as usize % (n + 1 - gap);
            out.push(originals[of].clone());
            placed += 1;
        }
    }
    (out, sum)
}

// ---------------------------------------------------------------------------------------------
// Measuring

/// Receipt-to-answer durations of the current row, in microseconds.
static LATENCY: LazyLock<Mutex<Histogram<u64>>> =
    LazyLock::new(|| Mutex::new(Histogram::new_with_bounds(1, 120_000_000, 3).unwrap()));

fn record_latency(elapsed: Duration) {
    let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    let _ = LATENCY
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .record(micros.clamp(1, 120_000_000));
}

/// With `--paced`: from a message's publication to the broker's answer to its ack, in
/// microseconds (this process's clock on both sides).
static END_TO_END: LazyLock<Mutex<Histogram<u64>>> =
    LazyLock::new(|| Mutex::new(Histogram::new_with_bounds(1, 120_000_000, 3).unwrap()));

fn record_end_to_end(sent: Option<u64>) {
    if let Some(sent) = sent {
        let _ = END_TO_END
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(now_micros().saturating_sub(sent).clamp(1, 120_000_000));
    }
}

fn reset_histograms() {
    for histogram in [&LATENCY, &END_TO_END] {
        *histogram.lock().unwrap_or_else(PoisonError::into_inner) =
            Histogram::new_with_bounds(1, 120_000_000, 3).unwrap();
    }
}

/// A `metrics` recorder that keeps only the runtime's `idempotency.message.duration` (from a
/// message's receipt to the broker's answer), in [`LATENCY`]; every other metric is a no-op,
/// as with no recorder.
struct DurationRecorder;

struct DurationHistogram;

impl metrics::HistogramFn for DurationHistogram {
    fn record(&self, seconds: f64) {
        record_latency(Duration::from_secs_f64(seconds.max(0.0)));
    }
}

static DURATION_HISTOGRAM: LazyLock<Arc<DurationHistogram>> =
    LazyLock::new(|| Arc::new(DurationHistogram));

impl metrics::Recorder for DurationRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        if key.name() == MESSAGE_DURATION {
            metrics::Histogram::from_arc(Arc::clone(&DURATION_HISTOGRAM))
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// CPU counters: this process's user + system ticks, the machine's busy and total ticks.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    process: u64,
    busy: u64,
    total: u64,
    /// The servers' ticks, in the order of [`SERVICES`].
    services: [u64; 4],
    /// Context switches of this process's threads (voluntary and not).
    switches: u64,
}

/// Context switches of this process's live threads, from `/proc/self/task/*/status`.
fn context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|line| line.contains("ctxt_switches:"))
                .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// The servers whose CPU time is read (`--services`): the process with that id, its children
/// (PostgreSQL's backends) and the members of its process group (RabbitMQ's Erlang VM), by
/// service: Redis, NATS, RabbitMQ, PostgreSQL.
static SERVICES: std::sync::OnceLock<[Option<u32>; 4]> = std::sync::OnceLock::new();
const SERVICE_NAMES: [&str; 4] = ["redis", "nats", "rabbitmq", "postgres"];

/// `(pid, ppid, pgrp, utime + stime)` of every process.
fn processes() -> Vec<(u32, u32, u32, u64)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let fields: Vec<&str> = stat
                .get(stat.rfind(')')? + 1..)?
                .split_whitespace()
                .collect();
            let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
            Some((
                pid,
                u32::try_from(number(1)?).ok()?,
                u32::try_from(number(2)?).ok()?,
                number(11)? + number(12)?,
            ))
        })
        .collect()
}

/// Clock ticks per second of `/proc` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: u64 = 100;

impl Cpu {
    fn now() -> Cpu {
        let process = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let after = stat.get(stat.rfind(')')? + 1..)?;
                let mut fields = after.split_whitespace().skip(11);
                let user: u64 = fields.next()?.parse().ok()?;
                let system: u64 = fields.next()?.parse().ok()?;
                Some(user + system)
            })
            .unwrap_or(0);
        let (busy, total) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|stat| {
                let values: Vec<u64> = stat
                    .lines()
                    .next()?
                    .split_whitespace()
                    .skip(1)
                    .take(8)
                    .map(|v| v.parse().ok())
                    .collect::<Option<_>>()?;
                let total: u64 = values.iter().sum();
                Some((total - values.get(3)? - values.get(4)?, total))
            })
            .unwrap_or((0, 0));
        let mut services = [0; 4];
        if let Some(roots) = SERVICES.get() {
            for (pid, ppid, group, ticks) in processes() {
                for (i, root) in roots.iter().enumerate() {
                    if root.is_some_and(|r| r == pid || r == ppid || r == group) {
                        services[i] += ticks;
                    }
                }
            }
        }
        Cpu {
            process,
            busy,
            total,
            services,
            switches: context_switches(),
        }
    }
}

/// A row's progress: messages finished (acknowledged, or duplicates acknowledged), the times
/// it passed 10 %, 90 % and 100 %, and the CPU counters at the end.
struct Progress {
    total: u64,
    start: Instant,
    cpu_start: Cpu,
    done: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    marks: Mutex<[Option<Instant>; 3]>,
    cpu_end: Mutex<Option<Cpu>>,
    finished: Notify,
}

impl Progress {
    fn start(total: usize) -> Arc<Progress> {
        Arc::new(Progress {
            total: total as u64,
            cpu_start: Cpu::now(),
            start: Instant::now(),
            done: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            marks: Mutex::new([None; 3]),
            cpu_end: Mutex::new(None),
            finished: Notify::new(),
        })
    }

    fn finished_one(&self) {
        self.finished_many(1);
    }

    fn finished_many(&self, n: u64) {
        let before = self.done.fetch_add(n, Ordering::Relaxed);
        let after = before + n;
        let now = Instant::now();
        let mut marks = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, share) in [(0, 1), (1, 9)] {
            let at = self.total * share / 10;
            if before < at && after >= at {
                marks[i] = Some(now);
            }
        }
        if before < self.total && after >= self.total {
            marks[2] = Some(now);
            drop(marks);
            *self.cpu_end.lock().unwrap_or_else(PoisonError::into_inner) = Some(Cpu::now());
            self.finished.notify_one();
        }
    }

    /// The runtime's observer.
    fn outcome(&self, message: &Message, outcome: Outcome<'_>, paced: bool) {
        if paced {
            record_end_to_end(posting(message).ok().and_then(|p| p.sent));
        }
        match outcome {
            Outcome::Applied | Outcome::Duplicate => self.finished_one(),
            Outcome::Retried { .. } => {
                self.retried.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::DeadLettered { failure } => {
                eprintln!("consumer bench: a message was dead-lettered: {failure}");
                self.dead_lettered.fetch_add(1, Ordering::Relaxed);
                self.finished_one();
            }
            _ => {}
        }
    }

    async fn wait(&self) {
        self.finished.notified().await;
    }

    fn measured(&self) -> Measured {
        let marks = *self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        let end = marks[2].expect("the row finished");
        let cpu_end = self
            .cpu_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or_else(Cpu::now);
        let elapsed = end - self.start;
        let middle = match (marks[0], marks[1]) {
            (Some(a), Some(b)) if b > a => {
                (self.total * 9 / 10 - self.total / 10) as f64 / (b - a).as_secs_f64()
            }
            _ => f64::NAN,
        };
        let latency = LATENCY.lock().unwrap_or_else(PoisonError::into_inner);
        let ticks = |t: u64| t as f64 * 1e6 / TICKS_PER_SECOND as f64 / self.total as f64;
        let total_ticks = cpu_end.total.saturating_sub(self.cpu_start.total);
        Measured {
            messages: self.total,
            seconds: elapsed.as_secs_f64(),
            rate: self.total as f64 / elapsed.as_secs_f64(),
            rate_10_90: middle,
            p50_us: latency.value_at_quantile(0.5),
            p99_us: latency.value_at_quantile(0.99),
            max_us: latency.max(),
            end_to_end_us: {
                let e2e = END_TO_END.lock().unwrap_or_else(PoisonError::into_inner);
                (!e2e.is_empty()).then(|| {
                    (
                        e2e.value_at_quantile(0.5),
                        e2e.value_at_quantile(0.99),
                        e2e.max(),
                    )
                })
            },
            process_cpu_us: ticks(cpu_end.process.saturating_sub(self.cpu_start.process)),
            machine_cpu_us: ticks(cpu_end.busy.saturating_sub(self.cpu_start.busy)),
            switches_per_message: cpu_end.switches.saturating_sub(self.cpu_start.switches) as f64
                / self.total as f64,
            services_cpu_us: SERVICES.get().map(|_| {
                let mut out = [0.0; 4];
                for (i, value) in out.iter_mut().enumerate() {
                    *value = ticks(cpu_end.services[i].saturating_sub(self.cpu_start.services[i]));
                }
                out
            }),
            machine_busy: if total_ticks == 0 {
                0.0
            } else {
                cpu_end.busy.saturating_sub(self.cpu_start.busy) as f64 / total_ticks as f64
            },
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            effects: 0,
            correct: false,
            receives: None,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
struct Measured {
    messages: u64,
    seconds: f64,
    rate: f64,
    rate_10_90: f64,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    /// With `--paced`: p50, p99 and max from publication to the ack's answer.
    end_to_end_us: Option<(u64, u64, u64)>,
    process_cpu_us: f64,
    machine_cpu_us: f64,
    /// With `--services`: the CPU time of Redis, NATS, RabbitMQ and PostgreSQL per message.
    services_cpu_us: Option<[f64; 4]>,
    /// This process's context switches per message.
    switches_per_message: f64,
    machine_busy: f64,
    retried: u64,
    dead_lettered: u64,
    /// Handler runs (memory rows), or the postings the accounts add up to (PostgreSQL rows).
    effects: u64,
    correct: bool,
    /// With `--receive-stats`: receive calls and the messages they returned.
    receives: Option<(u64, u64)>,
}

// ---------------------------------------------------------------------------------------------
// The runtime's handlers

/// The posting a message carries, as the `ledger` example reads it.
fn posting(message: &Message) -> Result<Posting, Failure> {
    let fields = Fields::of(message)?;
    let amount = fields.text("amount")?;
    Ok(Posting {
        id: fields.text("id")?.to_owned(),
        account: fields.text("account")?.to_owned(),
        amount: amount
            .parse()
            .map_err(|_| Failure::Malformed(format!("amount {amount:?}")))?,
        sent: fields.text("sent").ok().and_then(|s| s.parse().ok()),
    })
}

/// The runtime rows' handler: the `ledger` example's decoding (key: the posting's id;
/// fingerprint: account and amount), and either nothing (counting its runs) or the account's
/// `INSERT … ON CONFLICT DO UPDATE` in the transaction.
#[derive(Clone, Default)]
struct Postings {
    runs: Arc<AtomicU64>,
}

impl Decode for Postings {
    type Input = Posting;

    fn decode(&self, message: &Message) -> Result<Posting, Failure> {
        posting(message)
    }

    fn key(&self, _: &Message, posting: &Posting) -> Result<Key, Failure> {
        Key::new(posting.id.as_str()).map_err(|e| Failure::Malformed(e.to_string()))
    }

    fn fingerprint(&self, _: &Message, posting: &Posting) -> Result<Fingerprint, Failure> {
        Fingerprint::of(&(&posting.account, posting.amount))
            .map_err(|e| Failure::Malformed(e.to_string()))
    }
}

impl Handler for Postings {
    type Output = ();

    async fn handle(&self, _: &Posting, _: &ClaimHandle) -> Result<(), Failure> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

const INSERT: &str = "INSERT INTO consumer_bench_accounts (account, balance) VALUES ($1, $2) \
     ON CONFLICT (account) DO UPDATE SET balance = consumer_bench_accounts.balance + EXCLUDED.balance \
     RETURNING balance";

impl TxHandler for Postings {
    type Output = i64;

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        posting: &Posting,
        _: &ClaimHandle,
    ) -> Result<i64, Failure> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        sqlx::query_scalar(INSERT)
            .bind(&posting.account)
            .bind(posting.amount)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| sql_failure("insert", &e))
    }
}

/// A source that counts its receive calls and what they returned (`--receive-stats`).
struct Counted<S> {
    inner: S,
    calls: Arc<AtomicU64>,
    messages: Arc<AtomicU64>,
}

impl<S: Source> Source for Counted<S> {
    type Delivery = S::Delivery;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<S::Delivery>>, SourceError> {
        let received = self.inner.receive(max).await;
        if let Ok(batch) = &received {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.messages
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
        received
    }

    async fn ack(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.inner.ack(delivery).await
    }

    async fn retry(&self, delivery: &S::Delivery, delay: Duration) -> Result<(), SourceError> {
        self.inner.retry(delivery, delay).await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &S::Delivery,
        reason: &str,
    ) -> Result<idempotent_core::consumer::DeadLettered, SourceError> {
        self.inner.dead_letter(message, delivery, reason).await
    }

    async fn keep_alive(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.inner.keep_alive(delivery).await
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        self.inner.keep_alive_every()
    }
}

/// The PostgreSQL side of a row: the pool and the store over the bench's own table.
#[derive(Clone)]
struct Postgres {
    pool: PgPool,
    store: PostgresStore,
}

/// Runs the runtime over `source` until `total` messages are finished.
async fn runtime_row<S: Source>(
    source: S,
    options: &Options,
    postgres: Option<&Postgres>,
    total: usize,
) -> (Measured, u64) {
    let handler = Postings::default();
    let runs = Arc::clone(&handler.runs);
    let counts = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let progress = Progress::start(total);
    let observer = Arc::clone(&progress);
    let stop = Arc::clone(&progress);
    let shutdown = async move { stop.wait().await };
    let report: Report = if options.receive_stats {
        let source = Counted {
            inner: source,
            calls: Arc::clone(&counts.0),
            messages: Arc::clone(&counts.1),
        };
        run_consumer(source, options, postgres, handler, observer, shutdown).await
    } else {
        run_consumer(source, options, postgres, handler, observer, shutdown).await
    };
    let mut measured = progress.measured();
    if report.source_errors > 0 {
        eprintln!(
            "consumer bench: {} broker operations failed",
            report.source_errors
        );
    }
    if options.receive_stats {
        measured.receives = Some((
            counts.0.load(Ordering::Relaxed),
            counts.1.load(Ordering::Relaxed),
        ));
    }
    (measured, runs.load(Ordering::Relaxed))
}

async fn run_consumer<S: Source>(
    source: S,
    options: &Options,
    postgres: Option<&Postgres>,
    handler: Postings,
    progress: Arc<Progress>,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let paced = options.paced.is_some();
    let consumer = Consumer::new(source)
        .concurrency(options.concurrency)
        .on_outcome(move |message, outcome| {
            progress.outcome(message, outcome, paced);
        });
    match postgres {
        None => {
            consumer
                .run(Idempotency::new(MemoryStore::new()), handler, shutdown)
                .await
        }
        Some(pg) => {
            consumer
                .run_transactional(
                    pg.pool.clone(),
                    pg.store.transactional().namespace("consumer-bench"),
                    handler,
                    shutdown,
                )
                .await
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The bare loops

/// A broker as the bare loops use it, directly on its client crate.
trait Bare: Send + Sync + 'static {
    type Item: Send + Sync + 'static;

    /// Up to `max` messages, waiting up to [`RECEIVE_WAIT`] for a first one.
    fn receive(&self, max: usize) -> impl Future<Output = Vec<Self::Item>> + Send;

    /// The posting an item carries (for the PostgreSQL effect).
    fn posting(item: &Self::Item) -> Posting;

    /// Acknowledges one message.
    fn ack(&self, item: &Self::Item) -> impl Future<Output = ()> + Send;

    /// Acknowledges a batch, handled one at a time (by default each message on its own).
    fn ack_all(&self, items: &[Self::Item]) -> impl Future<Output = ()> + Send {
        async move {
            for item in items {
                self.ack(item).await;
            }
        }
    }
}

/// The message-body form of a posting, as the bare loops decode it (typed, no runtime).
#[derive(serde::Deserialize)]
struct Body {
    id: String,
    account: String,
    amount: String,
    sent: Option<String>,
}

fn posting_of_body(body: &[u8]) -> Posting {
    let body: Body = serde_json::from_slice(body).expect("a posting");
    Posting {
        id: body.id,
        account: body.account,
        amount: body.amount.parse().expect("an amount"),
        sent: body.sent.and_then(|s| s.parse().ok()),
    }
}

/// `BEGIN; INSERT …; COMMIT`.
async fn apply(pool: &PgPool, posting: &Posting) {
    let mut tx = pool.begin().await.unwrap();
    let _: i64 = sqlx::query_scalar(INSERT)
        .bind(&posting.account)
        .bind(posting.amount)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Consumes `total` messages with the bare loop: one at a time, acknowledged per batch
/// (`concurrency` 1, no effect), or each on a spawned task, within `concurrency`, with the
/// effect, acknowledged on its own.
async fn bare_row<B: Bare>(
    broker: Arc<B>,
    total: usize,
    concurrency: usize,
    postgres: Option<PgPool>,
    paced: bool,
    batch: usize,
) -> Measured {
    let progress = Progress::start(total);
    if concurrency == 1 && postgres.is_none() {
        let mut done = 0;
        while done < total {
            let items = broker.receive(batch.min(total - done)).await;
            let received = Instant::now();
            for item in &items {
                std::hint::black_box(item);
            }
            broker.ack_all(&items).await;
            for item in &items {
                record_latency(received.elapsed());
                if paced {
                    record_end_to_end(B::posting(item).sent);
                }
            }
            done += items.len();
            progress.finished_many(items.len() as u64);
        }
    } else {
        let slots = Arc::new(Semaphore::new(concurrency));
        let mut received = 0;
        while received < total {
            let items = broker.receive(batch.min(total - received)).await;
            received += items.len();
            for item in items {
                let permit = Arc::clone(&slots).acquire_owned().await.unwrap();
                let (broker, progress, pool) =
                    (Arc::clone(&broker), Arc::clone(&progress), postgres.clone());
                tokio::spawn(async move {
                    let started = Instant::now();
                    if let Some(pool) = &pool {
                        apply(pool, &B::posting(&item)).await;
                    } else {
                        std::hint::black_box(&item);
                    }
                    broker.ack(&item).await;
                    record_latency(started.elapsed());
                    if paced {
                        record_end_to_end(B::posting(&item).sent);
                    }
                    progress.finished_one();
                    drop(permit);
                });
            }
        }
    }
    progress.wait().await;
    progress.measured()
}

// Redis Streams ------------------------------------------------------------------------------

struct RedisEntry {
    id: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

struct BareRedis {
    /// For `XREADGROUP`: a blocking read holds up every later command on its connection.
    reader: MultiplexedConnection,
    /// For `XACK`.
    acker: MultiplexedConnection,
    stream: String,
}

fn redis_entries(reply: Value) -> Vec<RedisEntry> {
    let per_stream = match reply {
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut pair) if pair.len() == 2 => Some(pair.remove(1)),
                _ => None,
            })
            .collect(),
        Value::Map(streams) => streams.into_iter().map(|(_, e)| e).collect(),
        _ => Vec::new(),
    };
    let mut out = Vec::new();
    for entries in per_stream {
        let Value::Array(entries) = entries else {
            continue;
        };
        for entry in entries {
            let Value::Array(mut pair) = entry else {
                continue;
            };
            let (Some(fields), Some(Value::BulkString(id))) = (pair.pop(), pair.pop()) else {
                continue;
            };
            let fields = match fields {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|pair| match pair {
                        [Value::BulkString(n), Value::BulkString(v)] => {
                            Some((n.clone(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                Value::Map(pairs) => pairs
                    .into_iter()
                    .filter_map(|pair| match pair {
                        (Value::BulkString(n), Value::BulkString(v)) => Some((n, v)),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            out.push(RedisEntry {
                id: String::from_utf8(id).unwrap(),
                fields,
            });
        }
    }
    out
}

impl Bare for BareRedis {
    type Item = RedisEntry;

    async fn receive(&self, max: usize) -> Vec<RedisEntry> {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("bare")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(RECEIVE_WAIT.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.reader.clone())
            .await
            .unwrap();
        redis_entries(reply)
    }

    fn posting(item: &RedisEntry) -> Posting {
        let field = |name: &str| {
            let (_, value) = item.fields.iter().find(|(n, _)| n == name.as_bytes())?;
            Some(std::str::from_utf8(value).unwrap().to_owned())
        };
        Posting {
            id: field("id").expect("an id"),
            account: field("account").expect("an account"),
            amount: field("amount").expect("an amount").parse().unwrap(),
            sent: field("sent").and_then(|s| s.parse().ok()),
        }
    }

    async fn ack(&self, item: &RedisEntry) {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&item.id)
            .query_async(&mut self.acker.clone())
            .await
            .unwrap();
    }

    async fn ack_all(&self, items: &[RedisEntry]) {
        if items.is_empty() {
            return;
        }
        let ids: Vec<&str> = items.iter().map(|e| e.id.as_str()).collect();
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&ids)
            .query_async(&mut self.acker.clone())
            .await
            .unwrap();
    }
}

async fn redis_connection(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Per-command call counts from `INFO commandstats`.
async fn redis_calls(url: &str) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut redis_connection(url).await)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

// NATS JetStream -----------------------------------------------------------------------------

struct BareNats {
    consumer: PullConsumer,
}

impl Bare for BareNats {
    type Item = jetstream::Message;

    async fn receive(&self, max: usize) -> Vec<jetstream::Message> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(max)
            .expires(RECEIVE_WAIT)
            .messages()
            .await
            .unwrap();
        let mut out = Vec::with_capacity(max);
        while let Some(message) = batch.next().await {
            out.push(message.unwrap());
        }
        out
    }

    fn posting(item: &jetstream::Message) -> Posting {
        posting_of_body(&item.message.payload)
    }

    async fn ack(&self, item: &jetstream::Message) {
        item.ack().await.unwrap();
    }
}

fn nats_stream_config(stream: &str) -> stream::Config {
    // As the runtime's source creates it: it uses an existing stream as it is.
    stream::Config {
        name: stream.to_owned(),
        subjects: vec![format!("{stream}.entries"), format!("{stream}.dead")],
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

// RabbitMQ -----------------------------------------------------------------------------------

async fn amqp_connection(url: &str) -> Connection {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    Connection::connect(url, properties).await.unwrap()
}

/// Declares `queue` as the runtime's source does: durable, `{"x-queue-type": "quorum"}`.
async fn declare_quorum(channel: &Channel, queue: &str) {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .unwrap();
}

struct BareRabbit {
    _connection: Connection,
    channel: Channel,
    consumer: tokio::sync::Mutex<lapin::Consumer>,
}

impl Bare for BareRabbit {
    type Item = lapin::message::Delivery;

    async fn receive(&self, max: usize) -> Vec<lapin::message::Delivery> {
        let mut consumer = self.consumer.lock().await;
        let mut out = Vec::with_capacity(max);
        let Ok(first) = tokio::time::timeout(RECEIVE_WAIT, consumer.next()).await else {
            return out;
        };
        let mut next = Some(first);
        while let Some(Some(delivery)) = next.take() {
            out.push(delivery.unwrap());
            if out.len() >= max {
                break;
            }
            next = consumer.next().now_or_never();
        }
        out
    }

    fn posting(item: &lapin::message::Delivery) -> Posting {
        posting_of_body(&item.data)
    }

    async fn ack(&self, item: &lapin::message::Delivery) {
        self.channel
            .basic_ack(item.delivery_tag, BasicAckOptions::default())
            .await
            .unwrap();
    }
}

async fn delete_rabbit(url: &str, queue: &str) {
    let connection = amqp_connection(url).await;
    let channel = connection.create_channel().await.unwrap();
    for name in [queue.to_owned(), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(&name, QueueDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "deleted").await;
}

// Publishing -------------------------------------------------------------------------------

/// A publisher on a row's stream or queue, which it creates (NATS: as the runtime's source
/// would; RabbitMQ: declared as the source declares it).
enum Publisher {
    Redis(MultiplexedConnection),
    Nats(jetstream::Context),
    RabbitMq(Box<(Connection, Channel)>),
}

impl Publisher {
    async fn open(broker: Broker, url: &str, name: &str) -> Publisher {
        match broker {
            Broker::Redis => Publisher::Redis(redis_connection(url).await),
            Broker::Nats => {
                let context = jetstream::new(async_nats::connect(url).await.unwrap());
                context
                    .get_or_create_stream(nats_stream_config(name))
                    .await
                    .unwrap();
                Publisher::Nats(context)
            }
            Broker::RabbitMq => {
                let connection = amqp_connection(url).await;
                let channel = connection.create_channel().await.unwrap();
                declare_quorum(&channel, name).await;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                Publisher::RabbitMq(Box::new((connection, channel)))
            }
        }
    }

    /// Publishes `postings` to `name` in order, in chunks of 1,000 whose acknowledgements
    /// (Redis replies, JetStream acks, publisher confirms) are awaited before the next.
    async fn publish(&mut self, name: &str, postings: &[Posting]) {
        for chunk in postings.chunks(1000) {
            match self {
                Publisher::Redis(connection) => {
                    let mut pipe = redis::pipe();
                    for p in chunk {
                        let command = pipe
                            .cmd("XADD")
                            .arg(name)
                            .arg("*")
                            .arg("id")
                            .arg(&p.id)
                            .arg("account")
                            .arg(&p.account)
                            .arg("amount")
                            .arg(p.amount);
                        if let Some(sent) = p.sent {
                            command.arg("sent").arg(sent);
                        }
                        command.ignore();
                    }
                    let () = pipe.query_async(connection).await.unwrap();
                }
                Publisher::Nats(context) => {
                    let subject = format!("{name}.entries");
                    let mut acks = Vec::with_capacity(chunk.len());
                    for p in chunk {
                        acks.push(
                            context
                                .publish(subject.clone(), Bytes::from(p.body()))
                                .await
                                .unwrap(),
                        );
                    }
                    for ack in acks {
                        ack.await.unwrap();
                    }
                }
                Publisher::RabbitMq(link) => {
                    let channel = &link.1;
                    let mut confirms = Vec::with_capacity(chunk.len());
                    for p in chunk {
                        let properties = BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into());
                        confirms.push(
                            channel
                                .basic_publish(
                                    "",
                                    name,
                                    BasicPublishOptions::default(),
                                    &p.body(),
                                    properties,
                                )
                                .await
                                .unwrap(),
                        );
                    }
                    for confirm in confirms {
                        assert!(matches!(confirm.await.unwrap(), Confirmation::Ack(None)));
                    }
                }
            }
        }
    }

    /// Publishes `postings` one at a time, `rate` a second, each stamped with its send time,
    /// starting after `delay` (the consumer connects meanwhile).
    async fn paced(mut self, name: String, postings: Vec<Posting>, rate: u64, delay: Duration) {
        let start = tokio::time::Instant::now() + delay;
        for (n, mut posting) in postings.into_iter().enumerate() {
            tokio::time::sleep_until(start + Duration::from_secs_f64(n as f64 / rate as f64)).await;
            posting.sent = Some(now_micros());
            self.publish(&name, std::slice::from_ref(&posting)).await;
        }
        self.close().await;
    }

    async fn close(self) {
        if let Publisher::RabbitMq(link) = self {
            let _ = link.0.close(200, "published").await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One row

async fn row(
    broker: Broker,
    mode: Mode,
    round: usize,
    options: &Options,
    postgres: Option<&Postgres>,
) -> Option<Measured> {
    let url = match broker {
        Broker::Redis => options.redis.clone()?,
        Broker::Nats => options.nats.clone()?,
        Broker::RabbitMq => options.amqp.clone()?,
    };
    let postgres = match mode.postgres() {
        true => Some(postgres?),
        false => None,
    };
    let name = format!(
        "consumer_bench_{}_{}_{round}_{}",
        broker.name(),
        mode.name().replace('-', "_"),
        std::process::id()
    );
    let duplicates = if mode.duplicates() {
        options.duplicates
    } else {
        0
    };
    // Paced: the messages are published while the consumer runs, `rate` a second.
    let paced = options.paced;
    let messages = match paced {
        Some(rate) => (rate * options.paced_seconds) as usize,
        None => options.messages,
    };
    let (postings, sum) = backlog(&name, messages, duplicates);
    let total = postings.len();
    if let Some(pg) = postgres {
        sqlx::query(&format!("TRUNCATE {ACCOUNTS_TABLE}, {RECORDS_TABLE}"))
            .execute(&pg.pool)
            .await
            .unwrap();
    }
    let mut publisher = Publisher::open(broker, &url, &name).await;
    let publishing = match paced {
        None => {
            let started = Instant::now();
            publisher.publish(&name, &postings).await;
            publisher.close().await;
            eprintln!(
                "    published {total} messages in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            // Whatever the broker does right after a burst of writes (RabbitMQ's quorum
            // queue log, Redis's AOF) is not the consumer's.
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
        Some(rate) => Some(tokio::spawn(publisher.paced(
            name.clone(),
            postings,
            rate,
            Duration::from_millis(500),
        ))),
    };
    let paced = paced.is_some();
    reset_histograms();
    let calls_before = match broker {
        Broker::Redis => Some(redis_calls(&url).await),
        _ => None,
    };
    let concurrency = match mode {
        Mode::Bare => 1,
        _ => options.concurrency,
    };
    let pool = postgres.map(|pg| pg.pool.clone());
    let is_runtime = matches!(
        mode,
        Mode::Runtime | Mode::RuntimeDup | Mode::RuntimePg | Mode::RuntimePgDup
    );
    let (mut measured, runs) = match (broker, is_runtime) {
        (Broker::Redis, false) => {
            let reader = redis_connection(&url).await;
            let _: () = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&name)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut reader.clone())
                .await
                .unwrap();
            let broker = BareRedis {
                reader,
                acker: redis_connection(&url).await,
                stream: name.clone(),
            };
            (
                bare_row(
                    Arc::new(broker),
                    total,
                    concurrency,
                    pool,
                    paced,
                    options.bare_batch,
                )
                .await,
                0,
            )
        }
        (Broker::Redis, true) => {
            let source = RedisStreams::builder(url.as_str(), name.as_str(), GROUP, "runtime")
                .connect()
                .await
                .unwrap();
            runtime_row(source, options, postgres, total).await
        }
        (Broker::Nats, false) => {
            let context = jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
            let stream = context.get_stream(&name).await.unwrap();
            let consumer: PullConsumer = stream
                .get_or_create_consumer(
                    GROUP,
                    pull::Config {
                        durable_name: Some(GROUP.to_owned()),
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        filter_subject: format!("{name}.entries"),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let broker = BareNats { consumer };
            (
                bare_row(
                    Arc::new(broker),
                    total,
                    concurrency,
                    pool,
                    paced,
                    options.bare_batch,
                )
                .await,
                0,
            )
        }
        (Broker::Nats, true) => {
            let source = JetStream::builder(url.as_str(), name.as_str(), GROUP)
                .connect()
                .await
                .unwrap();
            runtime_row(source, options, postgres, total).await
        }
        (Broker::RabbitMq, false) => {
            let connection = amqp_connection(&url).await;
            let channel = connection.create_channel().await.unwrap();
            channel
                .basic_qos(PREFETCH, BasicQosOptions::default())
                .await
                .unwrap();
            let consumer = channel
                .basic_consume(
                    &name,
                    "bare",
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let broker = BareRabbit {
                _connection: connection,
                channel,
                consumer: tokio::sync::Mutex::new(consumer),
            };
            (
                bare_row(
                    Arc::new(broker),
                    total,
                    concurrency,
                    pool,
                    paced,
                    options.bare_batch,
                )
                .await,
                0,
            )
        }
        (Broker::RabbitMq, true) => {
            let source = RabbitMq::builder(url.as_str(), name.as_str())
                .prefetch(PREFETCH)
                .connect()
                .await
                .unwrap();
            runtime_row(source, options, postgres, total).await
        }
    };
    if let Some(publishing) = publishing {
        publishing.await.unwrap();
    }
    // Exactly once: memory rows count the handler's runs; PostgreSQL rows add the balances up.
    measured.effects = match postgres {
        Some(pg) => {
            let (rows, balance): (i64, i64) = sqlx::query_as(&format!(
                "SELECT count(*), coalesce(sum(balance), 0)::bigint FROM {ACCOUNTS_TABLE}"
            ))
            .fetch_one(&pg.pool)
            .await
            .unwrap();
            measured.correct = balance == sum && rows as usize == ACCOUNTS.min(messages);
            if !measured.correct {
                eprintln!(
                    "consumer bench: {} {}: the balances add up to {balance}, not {sum}",
                    broker.name(),
                    mode.name()
                );
            }
            // The postings applied, if each was applied at most once.
            if measured.correct { messages as u64 } else { 0 }
        }
        None if is_runtime => {
            measured.correct = runs == messages as u64;
            runs
        }
        None => {
            measured.correct = measured.messages == messages as u64;
            measured.messages
        }
    };
    measured.correct &= measured.retried == 0 && measured.dead_lettered == 0;
    if let Some(before) = calls_before {
        let after = redis_calls(&url).await;
        let per_message = |command: &str| {
            (after.get(command).copied().unwrap_or(0) - before.get(command).copied().unwrap_or(0))
                as f64
                / total as f64
        };
        eprintln!(
            "    redis commands per message: xreadgroup {:.3}, xack {:.3}, xautoclaim {:.4}, all {:.3}",
            per_message("xreadgroup"),
            per_message("xack"),
            per_message("xautoclaim"),
            after
                .values()
                .sum::<u64>()
                .saturating_sub(before.values().sum::<u64>()) as f64
                / total as f64
        );
    }
    // The stream or queue, cleared away (the consumers above are gone).
    match broker {
        Broker::Redis => {
            let _: redis::RedisResult<i64> = redis::cmd("DEL")
                .arg(&name)
                .arg(format!("{name}:dead"))
                .query_async(&mut redis_connection(&url).await)
                .await;
        }
        Broker::Nats => {
            let context = jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
            let _ = context.delete_stream(&name).await;
        }
        Broker::RabbitMq => delete_rabbit(&url, &name).await,
    }
    Some(measured)
}

// ---------------------------------------------------------------------------------------------
// The pieces, in process (`--parts`)

/// Nanoseconds per iteration of `f`, over `n` iterations after `n / 10` of warm-up.
async fn per_iteration<F, Fut>(n: usize, mut f: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = ()>,
{
    for i in 0..n / 10 {
        f(i).await;
    }
    let start = Instant::now();
    for i in 0..n {
        f(n + i).await;
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

async fn parts() {
    const N: usize = 100_000;
    let postings: Vec<Posting> = backlog("parts", N * 2, 0).0;
    let json: Vec<Message> = postings
        .iter()
        .enumerate()
        .map(|(n, p)| Message::new(n.to_string(), p.body()))
        .collect();
    let fields: Vec<Message> = postings
        .iter()
        .enumerate()
        .map(|(n, p)| {
            Message::new(n.to_string(), Bytes::new())
                .with_field("id", p.id.clone())
                .with_field("account", p.account.clone())
                .with_field("amount", p.amount.to_string())
        })
        .collect();
    let decoder = Postings::default();
    let prepare = |message: &Message| {
        let input = decoder.decode(message).unwrap();
        let key = decoder.key(message, &input).unwrap();
        let fingerprint = decoder.fingerprint(message, &input).unwrap();
        (input, Call::new(key).fingerprint(fingerprint))
    };
    let mut rows = Vec::new();
    rows.push((
        "decode + key + fingerprint (JSON body, NATS/RabbitMQ)",
        per_iteration(N, |i| {
            let _ = std::hint::black_box(prepare(&json[i]));
            async {}
        })
        .await,
    ));
    rows.push((
        "decode + key + fingerprint (Redis fields)",
        per_iteration(N, |i| {
            let _ = std::hint::black_box(prepare(&fields[i]));
            async {}
        })
        .await,
    ));
    let calls: Vec<Call> = json.iter().map(|m| prepare(m).1).collect();
    let idempotency = Idempotency::new(MemoryStore::new());
    rows.push((
        "Idempotency::execute, fresh key, memory store (claim + completion)",
        per_iteration(N, |i| {
            let (idempotency, call) = (&idempotency, &calls[i]);
            async move {
                let execution = idempotency
                    .execute(
                        call,
                        async { Ok::<(), Failure>(()) },
                        |_| Retain::Keep,
                        |result| {
                            serde_json::to_vec(&result.as_ref().ok())
                                .ok()
                                .map(Bytes::from)
                        },
                    )
                    .await
                    .unwrap();
                assert!(matches!(execution, Execution::Fresh(Ok(()))));
            }
        })
        .await,
    ));
    rows.push((
        "tokio::spawn of a no-op task, awaited",
        per_iteration(N, |_| async {
            tokio::spawn(async {}).await.unwrap();
        })
        .await,
    ));
    let slots = Arc::new(Semaphore::new(16));
    rows.push((
        "Semaphore::acquire_owned + release",
        per_iteration(N, |_| {
            let slots = Arc::clone(&slots);
            async move {
                drop(slots.acquire_owned().await.unwrap());
            }
        })
        .await,
    ));
    rows.push((
        "keep-alive interval made and dropped (Redis, NATS)",
        per_iteration(N, |_| async {
            let every = Duration::from_secs(10);
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tokio::select! {
                biased;
                () = async {} => {}
                _ = ticks.tick() => {}
            }
        })
        .await,
    ));
    for (name, ns) in rows {
        println!(
            "{}",
            serde_json::json!({"part": name, "ns_per_message": ns.round()})
        );
    }
}

// ---------------------------------------------------------------------------------------------

fn selected(options: &Options, broker: Broker, mode: Mode) -> bool {
    let brokers: Vec<&String> = options
        .only
        .iter()
        .filter(|o| Broker::ALL.iter().any(|b| b.name() == o.as_str()))
        .collect();
    let modes: Vec<&String> = options
        .only
        .iter()
        .filter(|o| Mode::ALL.iter().any(|m| m.name() == o.as_str()))
        .collect();
    let mode_selected = match (modes.is_empty(), options.paced) {
        (false, _) => modes.iter().any(|m| *m == mode.name()),
        (true, Some(_)) => matches!(mode, Mode::BareTasks | Mode::Runtime),
        (true, None) => true,
    };
    (brokers.is_empty() || brokers.iter().any(|b| *b == broker.name())) && mode_selected
}

async fn connect_postgres(url: &str, concurrency: usize) -> Postgres {
    let pool = PgPoolOptions::new()
        .max_connections(concurrency as u32 + 4)
        .connect(url)
        .await
        .expect("connect to PostgreSQL");
    let store = PostgresStore::builder(pool.clone())
        .table(RECORDS_TABLE)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {ACCOUNTS_TABLE} (account text PRIMARY KEY, balance bigint NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    Postgres { pool, store }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = match options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("consumer bench: {message}");
            std::process::exit(2);
        }
    };
    if options.parts {
        // On a worker thread, where the runtime's tasks run (the main thread is no worker).
        tokio::spawn(parts()).await.unwrap();
        return;
    }
    metrics::set_global_recorder(DurationRecorder).expect("no other recorder");
    if let Some(list) = &options.services {
        let mut roots = [None; 4];
        for item in list.split(',').filter(|i| !i.is_empty()) {
            let parsed = item.split_once('=').and_then(|(name, pid)| {
                let i = SERVICE_NAMES.iter().position(|n| *n == name)?;
                Some((i, pid.trim().parse().ok()?))
            });
            match parsed {
                Some((i, pid)) => roots[i] = Some(pid),
                None => {
                    eprintln!("consumer bench: --services: cannot read {item:?}");
                    std::process::exit(2);
                }
            }
        }
        let _ = SERVICES.set(roots);
    }
    let postgres = match &options.postgres {
        Some(url) => Some(connect_postgres(url, options.concurrency).await),
        None => None,
    };
    let mut results: BTreeMap<(Broker, Mode), Vec<Measured>> = BTreeMap::new();
    for round in 0..options.rounds {
        for broker in Broker::ALL {
            for mode in Mode::ALL {
                if !selected(&options, broker, mode) {
                    continue;
                }
                eprintln!(
                    "==> round {}/{}: {} {}",
                    round + 1,
                    options.rounds,
                    broker.name(),
                    mode.name()
                );
                let Some(measured) = row(broker, mode, round, &options, postgres.as_ref()).await
                else {
                    continue;
                };
                let json = serde_json::json!({
                    "broker": broker.name(),
                    "row": mode.name(),
                    "round": round + 1,
                    "concurrency": if mode == Mode::Bare { 1 } else { options.concurrency },
                    "batch": if matches!(mode, Mode::Bare | Mode::BareTasks | Mode::BarePg) {
                        options.bare_batch
                    } else {
                        idempotent_core::consumer::DEFAULT_BATCH
                    },
                    "paced": options.paced,
                    "result": measured,
                });
                println!("{json}");
                results.entry((broker, mode)).or_default().push(measured);
            }
        }
    }
    print_table(&results);
    if let Some(path) = &options.out {
        let rows: Vec<_> = results
            .iter()
            .map(|((broker, mode), runs)| {
                serde_json::json!({"broker": broker.name(), "row": mode.name(), "runs": runs})
            })
            .collect();
        std::fs::write(path, serde_json::to_vec_pretty(&rows).unwrap()).unwrap();
    }
    if results.values().flatten().any(|m| !m.correct) {
        eprintln!("consumer bench: some rows were not exactly once (see `correct`)");
        std::process::exit(1);
    }
}

fn print_table(results: &BTreeMap<(Broker, Mode), Vec<Measured>>) {
    println!();
    println!(
        "| broker | row | messages | msgs/s | vs | msgs/s 10–90 % | p50 µs | p99 µs | max µs | end-to-end p50 / p99 / max µs | CPU µs/msg: consumer | broker | PostgreSQL | machine | machine busy | context switches/msg | correct |"
    );
    println!(
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"
    );
    let median = |runs: &[Measured]| -> Measured {
        let mut sorted = runs.to_vec();
        sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        sorted[sorted.len() / 2].clone()
    };
    for ((broker, mode), runs) in results {
        let m = median(runs);
        // The runtime against the bare loop of the same shape: 16 tasks, one ack each.
        let reference = match mode {
            Mode::Runtime | Mode::RuntimeDup => Some(Mode::BareTasks),
            Mode::RuntimePg | Mode::RuntimePgDup => Some(Mode::BarePg),
            _ => None,
        };
        let versus = reference
            .and_then(|r| Some((r, median(results.get(&(*broker, r))?))))
            .map_or(String::from("–"), |(r, b)| {
                format!("{:.0} % of {}", 100.0 * m.rate / b.rate, r.name())
            });
        let end_to_end = m
            .end_to_end_us
            .map_or(String::from("–"), |(p50, p99, max)| {
                format!(
                    "{} / {} / {}",
                    thousands(p50 as f64),
                    thousands(p99 as f64),
                    thousands(max as f64)
                )
            });
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {:.0} % | {:.2} | {} |",
            broker.name(),
            mode.name(),
            m.messages,
            thousands(m.rate),
            versus,
            thousands(m.rate_10_90),
            thousands(m.p50_us as f64),
            thousands(m.p99_us as f64),
            thousands(m.max_us as f64),
            end_to_end,
            m.process_cpu_us,
            m.services_cpu_us.map_or(String::from("–"), |cpu| format!(
                "{:.1}",
                cpu[*broker as usize]
            )),
            m.services_cpu_us
                .map_or(String::from("–"), |cpu| format!("{:.1}", cpu[3])),
            m.machine_cpu_us,
            100.0 * m.machine_busy,
            m.switches_per_message,
            if m.correct { "yes" } else { "**no**" },
        );
        if let Some((calls, messages)) = m.receives {
            println!(
                "|   | (receive calls: {calls}, {:.2} messages each) | | | | | | | | | | | | | | | |",
                messages as f64 / calls.max(1) as f64
            );
        }
    }
}

fn thousands(value: f64) -> String {
    if !value.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.0}", value);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlogs_hold_each_posting_once_and_late_copies() {
        let (postings, sum) = backlog("t", 20_000, 2_000);
        assert_eq!(postings.len(), 22_000);
        let mut first = std::collections::HashMap::new();
        let mut copies = 0;
        for (position, posting) in postings.iter().enumerate() {
            match first.get(&posting.id) {
                None => {
                    first.insert(posting.id.clone(), (position, posting.amount));
                }
                Some(&(original, amount)) => {
                    copies += 1;
                    assert_eq!(amount, posting.amount, "a copy has its original's content");
                    assert!(position - original >= DUPLICATE_GAP, "copy too close");
                }
            }
        }
        assert_eq!((first.len(), copies), (20_000, 2_000));
        assert_eq!(first.values().map(|(_, amount)| amount).sum::<i64>(), sum);
        assert_eq!(backlog("t", 10, 0).0.len(), 10);
    }

    #[test]
    fn numbers_get_thousands_separators() {
        assert_eq!(thousands(1_234_567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(f64::NAN), "–");
    }
}
