//! The steps mode: what a step of an operation costs (`ClaimHandle::step`: one checkpoint
//! written on the in-flight record, `CheckpointStore::save_step`), and what resuming an operation from
//! its checkpoints costs, on each store, in process.
//!
//! - **Operations**: through the in-process runtime (`Idempotency::run_with` over the store, a
//!   namespace of its own per round and operation kind), `in_flight` callers at once (16 by
//!   default, the sessions mode's), each running its next operation on a fresh key as soon as
//!   its last one returned:
//!   - `fresh`, with 0, 1, 3 and 8 steps: the work calls `step("step-<i>", …)` that many
//!     times, each step's value a 20-character string (22 bytes of JSON), then returns; the
//!     run completes. Every step must run and every outcome be fresh.
//!   - `atomic` (PostgreSQL), with 1, 3 and 8 steps: the same, each step through
//!     `PostgresStore::step_in_transaction`, whose transaction holds nothing but the step's
//!     checkpoint (`BEGIN`, the checkpoint's `UPDATE`, `COMMIT`): the cost of the atomic step
//!     itself, without an effect of its own.
//!   - `resume`: operations that ran 3 steps and were released (`Retain::Release`, untimed),
//!     run again: the claim takes the record over, the first step loads its checkpoints once
//!     (`CheckpointStore::load_steps`), the 3 steps return their saved values without running, the run
//!     completes. No step may run and every value must be the one saved.
//!   - `retry`: the same with operations released after no step: a takeover and a completion,
//!     the plain retry `resume` is compared with.
//!
//!   A round of `fresh`/`atomic` is a warm-up and a timed phase of the given durations. A
//!   round of `resume`/`retry` first prepares its released operations (as many as the round's
//!   `fresh` run with 3 steps, or 0, completed in the timed phase's length; between
//!   [`MIN_PREPARED`] and [`MAX_PREPARED`]), then runs the first warm-up's share of them
//!   untimed and the rest timed.
//! - **Measures**: operations per second of the timed phase, the median and p99 latency of one
//!   run (HDR histogram, microseconds), this process's CPU time per operation (its threads'
//!   user and system time: the runtime, the callers, the clients of the stores; not Redis or
//!   PostgreSQL) and the machine's busy share. Each row reports its median round by rate.
//! - **Store calls**: before the rounds, the same operations once more on the store wrapped in
//!   [`Counting`], which counts each `Store` method called: the calls per operation (of the
//!   timed run only, for `resume`/`retry`). On Redis each call is one `EVALSHA` and on
//!   PostgreSQL one statement (no replica acknowledgement, `--redis-replicas 0`). An `atomic`
//!   step needs a claim made over the `PostgresStore` itself, which the wrapper is not, and
//!   writes its checkpoint on the store's pool, outside the `Store` trait: its row shows the
//!   calls of a `fresh` operation of no step (its claim and completion) and, from the code,
//!   its steps' `BEGIN`, `UPDATE` and `COMMIT`.
//! - **Stores**: a new `MemoryStore` per round and operation kind (no sweep); Redis under a key
//!   prefix of its own ([`REDIS_PREFIX`]), whose keys are deleted before each round and at the
//!   end; PostgreSQL in a table of its own ([`TABLE`]), emptied before each round and dropped at
//!   the end.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idempotent_bench::{cpu, machine, table::thousands};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, CheckpointStore, Claim, ClaimHandle, FencingToken, Fingerprint, Idempotency, Key, Retain,
    SessionStore, StorageKey, Store, StoreError,
};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use serde::{Deserialize, Serialize};

use crate::cli::{Backends, Options};
use crate::fixture::REQUEST_BODY;
use crate::measure::{Latencies, round1};
use crate::rows::StoreKind;

/// The PostgreSQL table of this mode.
const TABLE: &str = "idempotent_bench_steps";
/// The Redis key prefix of this mode's records.
const REDIS_PREFIX: &str = "idempotent-bench-steps:";
/// Redis keys per `UNLINK`.
const REDIS_BATCH: usize = 1_000;
/// Steps per operation of the `fresh` rows, and of the `atomic` rows.
pub(crate) const FRESH_STEPS: [u32; 4] = [0, 1, 3, 8];
pub(crate) const ATOMIC_STEPS: [u32; 3] = [1, 3, 8];
/// Steps an operation of the `resume` rows made before it was released.
pub(crate) const RESUME_STEPS: u32 = 3;
/// Bounds of the released operations a `resume`/`retry` round prepares.
const MIN_PREPARED: u64 = 2_000;
const MAX_PREPARED: u64 = 300_000;
/// Operations of each kind run on the counting store.
const COUNTED: u64 = 256;
/// Bounds of the memory store: far above what a round holds.
const MEMORY_MAX_ENTRIES: usize = 50_000_000;
const MEMORY_MAX_BYTES: usize = 64 << 30;
/// The step names, in order.
const STEP_NAMES: [&str; 8] = [
    "step-1", "step-2", "step-3", "step-4", "step-5", "step-6", "step-7", "step-8",
];

/// What one row's operations are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A new operation making `steps` steps.
    Fresh(u32),
    /// A new operation making `steps` atomic steps (`PostgresStore::step_in_transaction`).
    Atomic(u32),
    /// An operation released after [`RESUME_STEPS`] steps, run again.
    Resume,
    /// An operation released after no step, run again.
    Retry,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Fresh(_) => "fresh",
            Kind::Atomic(_) => "atomic",
            Kind::Resume => "resume",
            Kind::Retry => "retry",
        }
    }

    /// Steps the operation makes (run or restored).
    pub(crate) fn steps(self) -> u32 {
        match self {
            Kind::Fresh(steps) | Kind::Atomic(steps) => steps,
            Kind::Resume => RESUME_STEPS,
            Kind::Retry => 0,
        }
    }

    /// Steps the prepared operation ran before it was released.
    fn prepared_steps(self) -> Option<u32> {
        match self {
            Kind::Resume => Some(RESUME_STEPS),
            Kind::Retry => Some(0),
            Kind::Fresh(_) | Kind::Atomic(_) => None,
        }
    }

    /// The kinds measured on `store`, in the order a round runs them (the `fresh` rows
    /// first: `resume` and `retry` size their rounds by them).
    pub(crate) fn all(store: StoreKind) -> Vec<Kind> {
        let mut kinds: Vec<Kind> = FRESH_STEPS.iter().map(|&n| Kind::Fresh(n)).collect();
        if store == StoreKind::Postgres {
            kinds.extend(ATOMIC_STEPS.iter().map(|&n| Kind::Atomic(n)));
        }
        kinds.extend([Kind::Retry, Kind::Resume]);
        kinds
    }
}

/// `Store` calls per operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Calls {
    pub(crate) claim: f64,
    pub(crate) complete: f64,
    pub(crate) release: f64,
    pub(crate) renew: f64,
    pub(crate) save_step: f64,
    pub(crate) load_steps: f64,
}

impl Calls {
    pub(crate) fn total(&self) -> f64 {
        self.claim + self.complete + self.release + self.renew + self.save_step + self.load_steps
    }

    /// `claim 1 + save_step 3 + complete 1 = 5`: the calls made, in the order an operation
    /// makes them, and their sum.
    pub(crate) fn describe(&self) -> String {
        let parts = [
            ("claim", self.claim),
            ("load_steps", self.load_steps),
            ("save_step", self.save_step),
            ("renew", self.renew),
            ("release", self.release),
            ("complete", self.complete),
        ];
        let made: Vec<String> = parts
            .iter()
            .filter(|(_, n)| *n > 0.0)
            .map(|(name, n)| format!("{name} {}", Self::number(*n)))
            .collect();
        format!("{} = {}", made.join(" + "), Self::number(self.total()))
    }

    fn number(n: f64) -> String {
        if (n - n.round()).abs() < 0.005 {
            format!("{}", n.round())
        } else {
            format!("{n:.2}")
        }
    }
}

/// One timed phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Round {
    pub(crate) operations: u64,
    pub(crate) seconds: f64,
    pub(crate) ops: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    /// This process's CPU time per operation, in microseconds.
    pub(crate) cpu_us_per_op: f64,
    /// The share of the machine's CPU time that was busy.
    pub(crate) machine_busy: f64,
}

/// One store and kind of operation: its median round, every round's rate, and the store calls
/// one operation makes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StepRecord {
    pub(crate) store: String,
    /// `fresh`, `atomic`, `resume` or `retry`.
    pub(crate) kind: String,
    /// Steps each operation makes (run, or restored for `resume`).
    pub(crate) steps: u32,
    pub(crate) in_flight: usize,
    /// Bytes of each step's value as JSON.
    pub(crate) value_bytes: u64,
    pub(crate) median: Round,
    pub(crate) rounds_ops: Vec<f64>,
    /// `Store` calls per operation; for `atomic` the claim and completion only.
    pub(crate) calls: Calls,
}

/// A store that counts the calls made to the one it wraps.
#[derive(Clone)]
pub(crate) struct Counting<S> {
    inner: S,
    counts: Arc<Counts>,
}

#[derive(Default)]
pub(crate) struct Counts {
    claim: AtomicU64,
    complete: AtomicU64,
    release: AtomicU64,
    renew: AtomicU64,
    save_step: AtomicU64,
    load_steps: AtomicU64,
}

impl Counts {
    fn take(&self) -> [u64; 6] {
        [
            &self.claim,
            &self.complete,
            &self.release,
            &self.renew,
            &self.save_step,
            &self.load_steps,
        ]
        .map(|count| count.swap(0, Ordering::Relaxed))
    }

    /// The calls counted since the last time, per one of `operations`.
    pub(crate) fn per(&self, operations: u64) -> Calls {
        let [claim, complete, release, renew, save_step, load_steps] = self.take();
        let per = |n: u64| n as f64 / operations.max(1) as f64;
        Calls {
            claim: per(claim),
            complete: per(complete),
            release: per(release),
            renew: per(renew),
            save_step: per(save_step),
            load_steps: per(load_steps),
        }
    }
}

impl<S: Store> Counting<S> {
    pub(crate) fn new(inner: S) -> (Counting<S>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let store = Counting {
            inner,
            counts: Arc::clone(&counts),
        };
        (store, counts)
    }
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl<S: Store> Store for Counting<S> {
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        count(&self.counts.claim);
        self.inner.claim(key, fingerprint, lease, ttl)
    }

    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        count(&self.counts.complete);
        self.inner.complete(key, token, payload, ttl)
    }

    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        count(&self.counts.release);
        self.inner.release(key, token)
    }

    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        count(&self.counts.renew);
        self.inner.renew(key, token, lease)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn keeps_records_in_process(&self) -> bool {
        self.inner.keeps_records_in_process()
    }

    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        self.inner.wait_for_change(key, max_wait)
    }
}

impl<S: SessionStore> SessionStore for Counting<S> {
    fn open_session(
        &self,
        session: &idempotent_core::SessionKey,
        request: idempotent_core::SessionRequest,
    ) -> impl Future<Output = Result<idempotent_core::SessionGate, StoreError>> + Send {
        self.inner.open_session(session, request)
    }

    fn session_mark(
        &self,
        session: &idempotent_core::SessionKey,
    ) -> impl Future<Output = Result<Option<idempotent_core::SessionMark>, StoreError>> + Send {
        self.inner.session_mark(session)
    }

    fn claim_in_session(
        &self,
        session: &idempotent_core::SessionKey,
        request: idempotent_core::SessionRequest,
        fingerprint: &idempotent_core::Fingerprint,
        lease: Duration,
        label: &idempotent_core::inspect::KeyLabel,
    ) -> impl Future<Output = Result<idempotent_core::SessionClaim, StoreError>> + Send {
        self.inner
            .claim_in_session(session, request, fingerprint, lease, label)
    }
}

impl<S: CheckpointStore> CheckpointStore for Counting<S> {
    fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        count(&self.counts.save_step);
        self.inner.save_step(key, token, entry)
    }

    fn load_steps(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<Bytes, StoreError>> + Send {
        count(&self.counts.load_steps);
        self.inner.load_steps(key, token)
    }

    fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send {
        self.inner.resume(key, fingerprint, lease, ttl)
    }

    fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.save_request(key, token, request)
    }

    fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&idempotent_core::RequestOwner>,
    ) -> impl Future<Output = Result<Vec<idempotent_core::steps::Abandoned>, StoreError>> + Send
    {
        self.inner.abandoned(idle, limit, owner)
    }
}

/// Step `step`'s value in operation `n`: 20 characters.
pub(crate) fn value(n: u64, step: u32) -> String {
    format!("v{step}_{:017}", n % 100_000_000_000_000_000)
}

/// The bytes of each step's value as JSON.
pub(crate) fn value_bytes() -> u64 {
    serde_json::to_vec(&value(1, 1)).map_or(0, |bytes| bytes.len() as u64)
}

/// How the work makes its steps.
#[derive(Clone)]
enum Stepper {
    /// `ClaimHandle::step`.
    Plain,
    /// `PostgresStore::step_in_transaction` on this store.
    Atomic(PostgresStore),
}

/// The work of operation `n`: `steps` steps, each checked to return its value; counts in `ran`
/// the steps that ran. Returns the number of steps, or what went wrong.
async fn work(stepper: &Stepper, n: u64, steps: u32, ran: &AtomicU64) -> Result<u32, String> {
    if steps == 0 {
        return Ok(0);
    }
    let claim = ClaimHandle::current().ok_or("no claim in the work")?;
    for step in 1..=steps {
        let name = STEP_NAMES[step as usize - 1];
        let got: String = match stepper {
            Stepper::Plain => claim
                .step(name, async {
                    ran.fetch_add(1, Ordering::Relaxed);
                    value(n, step)
                })
                .await
                .map_err(|e| format!("step {name}: {}", chain(&e)))?,
            Stepper::Atomic(store) => store
                .step_in_transaction(&claim, name, |tx| async move {
                    ran.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, std::convert::Infallible>((tx, value(n, step)))
                })
                .await
                .map_err(|e| format!("atomic step {name}: {}", chain(&e)))?,
        };
        if got != value(n, step) {
            return Err(format!("step {name} of operation {n} returned {got:?}"));
        }
    }
    Ok(steps)
}

/// Runs operation `n` with `steps` steps; `release` gives its claim up instead of completing.
/// It must run (not replay) and its work succeed.
async fn operation(
    idempotency: &Idempotency,
    stepper: &Stepper,
    n: u64,
    steps: u32,
    release: bool,
    ran: &AtomicU64,
) -> Result<(), String> {
    let key = Key::new(format!("op-{n}")).map_err(|e| e.to_string())?;
    let call = Call::new(key).fingerprint(Fingerprint::from_bytes(REQUEST_BODY));
    let outcome = idempotency
        .run_with(&call, work(stepper, n, steps, ran), |done| {
            if release || done.is_err() {
                Retain::Release
            } else {
                Retain::Keep
            }
        })
        .await
        .map_err(|e| format!("operation {n}: {}", chain(&e)))?;
    if outcome.is_replayed() {
        return Err(format!("operation {n} was answered as a replay"));
    }
    outcome.into_inner().map(|_| ())
}

/// An error with its sources: `a: b: c`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    out
}

/// When a phase stops.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// Operations numbered up to this one (excluded) have been started.
    Count(u64),
    /// This instant has passed.
    Deadline(Instant),
}

/// What a phase did.
struct Phase {
    operations: u64,
    elapsed: Duration,
    latencies: Latencies,
}

type Operation =
    Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// `callers` callers, each running `op(n)` on the next number from `first` until `until`.
async fn phase(callers: usize, first: u64, until: Until, op: Operation) -> Result<Phase, String> {
    let next = Arc::new(AtomicU64::new(first));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..callers {
        let (next, op) = (Arc::clone(&next), Arc::clone(&op));
        tasks.spawn(async move {
            let mut latencies = Latencies::new();
            let mut operations = 0u64;
            loop {
                if let Until::Deadline(deadline) = until
                    && Instant::now() >= deadline
                {
                    break;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                if let Until::Count(end) = until
                    && n >= end
                {
                    break;
                }
                let began = Instant::now();
                op(n).await?;
                latencies.record(began.elapsed());
                operations += 1;
            }
            Ok::<_, String>((operations, latencies))
        });
    }
    let mut all = Phase {
        operations: 0,
        elapsed: Duration::ZERO,
        latencies: Latencies::new(),
    };
    while let Some(joined) = tasks.join_next().await {
        let (operations, latencies) = joined.map_err(|e| format!("caller task: {e}"))??;
        all.operations += operations;
        all.latencies.merge(&latencies);
    }
    all.elapsed = started.elapsed();
    Ok(all)
}

/// A store under measurement.
enum Backend {
    /// A new store per round.
    Memory,
    Redis {
        store: RedisStore,
        connection: redis::aio::MultiplexedConnection,
    },
    Postgres {
        store: PostgresStore,
    },
}

impl Backend {
    async fn connect(
        kind: StoreKind,
        backends: &Backends,
        in_flight: usize,
    ) -> Result<Backend, String> {
        match kind {
            StoreKind::Memory => Ok(Backend::Memory),
            StoreKind::Redis => {
                let url = backends.redis_url.as_deref().ok_or("no Redis URL")?;
                if url.contains(',') {
                    return Err("the steps mode measures one Redis server, not a cluster".into());
                }
                let store = RedisStore::builder(url)
                    .key_prefix(REDIS_PREFIX)
                    .replicas(backends.redis_replicas)
                    .connect()
                    .await
                    .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?;
                let client = redis::Client::open(url).map_err(|e| format!("Redis: {e}"))?;
                let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
                let connection = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(|e| format!("Redis: {e}"))?;
                Ok(Backend::Redis { store, connection })
            }
            StoreKind::Postgres => {
                let url = backends
                    .postgres_url
                    .as_deref()
                    .ok_or("no PostgreSQL URL")?;
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(u32::try_from(in_flight).unwrap_or(64).min(64) + 2)
                    .connect(url)
                    .await
                    .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e}"))?;
                let store = PostgresStore::builder(pool)
                    .table(TABLE)
                    .build()
                    .map_err(|e| format!("PostgreSQL: {e}"))?;
                store
                    .migrate()
                    .await
                    .map_err(|e| format!("cannot migrate PostgreSQL at {url}: {e}"))?;
                Ok(Backend::Postgres { store })
            }
            StoreKind::None => Err("no store".into()),
        }
    }

    /// Empties what earlier rounds left: Redis's keys under the prefix, PostgreSQL's table.
    async fn empty(&mut self) -> Result<(), String> {
        match self {
            Backend::Memory => Ok(()),
            Backend::Redis { connection, .. } => {
                let keys = scan(connection, &format!("{REDIS_PREFIX}*")).await?;
                for batch in keys.chunks(REDIS_BATCH) {
                    redis::cmd("UNLINK")
                        .arg(batch)
                        .exec_async(connection)
                        .await
                        .map_err(|e| format!("Redis UNLINK: {e}"))?;
                }
                Ok(())
            }
            Backend::Postgres { store } => {
                sqlx::query(&format!("TRUNCATE \"{TABLE}\""))
                    .execute(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: TRUNCATE: {e}"))?;
                Ok(())
            }
        }
    }

    /// A runtime over the store (a new one for memory) in a namespace of its own, counting its
    /// calls when `counting`; and how its operations make their steps.
    fn runtime(
        &self,
        kind: Kind,
        label: &str,
        counting: bool,
    ) -> (Idempotency, Stepper, Option<Arc<Counts>>) {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let namespace = format!(
            "idempotent-bench-steps-{}-{nanos}-{label}",
            std::process::id()
        );
        fn build(
            store: impl SessionStore + CheckpointStore,
            namespace: &str,
            counting: bool,
        ) -> (Idempotency, Option<Arc<Counts>>) {
            if counting {
                let (store, counts) = Counting::new(store);
                (runtime(store, namespace), Some(counts))
            } else {
                (runtime(store, namespace), None)
            }
        }
        let (idempotency, counts) = match self {
            Backend::Memory => {
                let store = MemoryStore::builder()
                    .max_entries(MEMORY_MAX_ENTRIES)
                    .max_bytes(MEMORY_MAX_BYTES)
                    .sweep_interval(None)
                    .build();
                build(store, &namespace, counting)
            }
            Backend::Redis { store, .. } => build(store.clone(), &namespace, counting),
            Backend::Postgres { store } => build(store.clone(), &namespace, counting),
        };
        let stepper = match (kind, self) {
            (Kind::Atomic(_), Backend::Postgres { store }) => Stepper::Atomic(store.clone()),
            _ => Stepper::Plain,
        };
        (idempotency, stepper, counts)
    }

    /// Deletes what the mode created: Redis's keys, PostgreSQL's table and its sequence.
    async fn finish(mut self) -> Result<(), String> {
        self.empty().await?;
        if let Backend::Postgres { store } = self {
            for statement in [
                format!("DROP TABLE IF EXISTS \"{TABLE}\""),
                format!("DROP SEQUENCE IF EXISTS \"{TABLE}_token_seq\""),
            ] {
                sqlx::query(&statement)
                    .execute(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: {statement}: {e}"))?;
            }
            store.pool().close().await;
        }
        Ok(())
    }
}

fn runtime(store: impl SessionStore + CheckpointStore, namespace: &str) -> Idempotency {
    Idempotency::builder(store).namespace(namespace).build()
}

/// The names of the keys matching `pattern`.
async fn scan(
    connection: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Result<Vec<String>, String> {
    let mut found = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(connection)
            .await
            .map_err(|e| format!("Redis SCAN: {e}"))?;
        found.extend(keys);
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// The operation `n ↦ run n` of `kind` (the timed one: `resume`/`retry` run their prepared
/// operations again), counting the steps that ran in `ran`.
fn timed_operation(
    idempotency: &Idempotency,
    stepper: &Stepper,
    kind: Kind,
    ran: &Arc<AtomicU64>,
) -> Operation {
    let (idempotency, stepper, ran) = (idempotency.clone(), stepper.clone(), Arc::clone(ran));
    let steps = kind.steps();
    Arc::new(move |n| {
        let (idempotency, stepper, ran) = (idempotency.clone(), stepper.clone(), Arc::clone(&ran));
        Box::pin(async move { operation(&idempotency, &stepper, n, steps, false, &ran).await })
    })
}

/// Operations `0..count` of `kind`'s preparation: `steps` steps, then released.
async fn prepare(
    idempotency: &Idempotency,
    in_flight: usize,
    steps: u32,
    count: u64,
) -> Result<(), String> {
    let ran = Arc::new(AtomicU64::new(0));
    let (idempotency, stepper, counter) = (idempotency.clone(), Stepper::Plain, Arc::clone(&ran));
    let op: Operation = Arc::new(move |n| {
        let (idempotency, stepper, ran) =
            (idempotency.clone(), stepper.clone(), Arc::clone(&counter));
        Box::pin(async move { operation(&idempotency, &stepper, n, steps, true, &ran).await })
    });
    let done = phase(in_flight, 0, Until::Count(count), op).await?;
    let expected = count * u64::from(steps);
    if done.operations != count || ran.load(Ordering::Relaxed) != expected {
        return Err(format!(
            "preparing {count} released operations of {steps} steps ran {} operations and {} \
             steps",
            done.operations,
            ran.load(Ordering::Relaxed)
        ));
    }
    Ok(())
}

/// The steps that must have run in `operations` operations of `kind`.
fn expected_runs(kind: Kind, operations: u64) -> u64 {
    match kind {
        Kind::Fresh(steps) | Kind::Atomic(steps) => operations * u64::from(steps),
        Kind::Resume | Kind::Retry => 0,
    }
}

/// The store calls one operation of `kind` makes, counted on `COUNTED` operations.
async fn count_calls(backend: &mut Backend, kind: Kind, in_flight: usize) -> Result<Calls, String> {
    backend.empty().await?;
    let (idempotency, stepper, counts) = backend.runtime(kind, "count", true);
    let counts = counts.ok_or("no counts")?;
    if let Some(steps) = kind.prepared_steps() {
        prepare(&idempotency, in_flight, steps, COUNTED).await?;
    }
    counts.take();
    let ran = Arc::new(AtomicU64::new(0));
    let op = timed_operation(&idempotency, &stepper, kind, &ran);
    let done = phase(in_flight, 0, Until::Count(COUNTED), op).await?;
    if ran.load(Ordering::Relaxed) != expected_runs(kind, done.operations) {
        return Err(format!("{}: steps ran that should not have", kind.name()));
    }
    Ok(counts.per(done.operations))
}

/// One round of `kind` on `backend`; `prepared` released operations for `resume`/`retry`.
async fn round(
    backend: &mut Backend,
    kind: Kind,
    options: &Options,
    prepared: u64,
) -> Result<Round, String> {
    backend.empty().await?;
    let (idempotency, stepper, _) = backend.runtime(kind, kind.name(), false);
    let in_flight = options.in_flight;
    let ran = Arc::new(AtomicU64::new(0));
    let op = timed_operation(&idempotency, &stepper, kind, &ran);
    // The warm-up's operations, the first number of the timed phase's, and when it ends.
    let (warmed, timed_from, until) = match kind.prepared_steps() {
        Some(steps) => {
            prepare(&idempotency, in_flight, steps, prepared).await?;
            let share =
                options.warmup.as_secs_f64() / (options.warmup + options.measure).as_secs_f64();
            let warm = (prepared as f64 * share) as u64;
            let warmed = phase(in_flight, 0, Until::Count(warm), Arc::clone(&op)).await?;
            (warmed.operations, warm, Until::Count(prepared))
        }
        None => {
            let deadline = Instant::now() + options.warmup;
            let warmed = phase(in_flight, 0, Until::Deadline(deadline), Arc::clone(&op)).await?;
            // Fresh keys: a caller takes a number only when it runs it, so the warm-up used
            // exactly `0..warmed.operations`.
            let deadline = Instant::now() + options.measure;
            (
                warmed.operations,
                warmed.operations,
                Until::Deadline(deadline),
            )
        }
    };
    let (ticks, reading) = (cpu::process_ticks(), machine::Reading::now());
    let done = phase(in_flight, timed_from, until, op).await?;
    let cpu = cpu::ticks_to_duration(cpu::process_ticks().saturating_sub(ticks));
    let machine_busy = match (machine::Reading::now(), reading) {
        (Some(now), Some(then)) => now.utilization_since(then),
        _ => 0.0,
    };
    let operations = done.operations;
    let ran = ran.load(Ordering::Relaxed);
    let expected = expected_runs(kind, warmed + operations);
    if ran != expected {
        return Err(format!(
            "{} ({} steps): {ran} steps ran in {} operations, not {expected}",
            kind.name(),
            kind.steps(),
            warmed + operations
        ));
    }
    if operations == 0 {
        return Err(format!("{}: no operation in the timed phase", kind.name()));
    }
    let seconds = done.elapsed.as_secs_f64();
    Ok(Round {
        operations,
        seconds,
        ops: operations as f64 / seconds,
        p50_us: done.latencies.quantile_us(0.5),
        p99_us: done.latencies.quantile_us(0.99),
        cpu_us_per_op: round1(cpu.as_secs_f64() * 1e6 / operations as f64),
        machine_busy,
    })
}

/// The released operations a `resume`/`retry` round prepares: as many as the `fresh` row of
/// the same steps completed in `measure` (its rate in this round), within bounds.
fn prepared_for(fresh_ops: f64, measure: Duration) -> u64 {
    ((fresh_ops * measure.as_secs_f64()) as u64).clamp(MIN_PREPARED, MAX_PREPARED)
}

/// The round with the median rate (the lower of the two middle ones for an even count).
fn median(mut rounds: Vec<Round>) -> Option<Round> {
    rounds.sort_by(|a, b| a.ops.total_cmp(&b.ops));
    let middle = rounds.len().checked_sub(1)? / 2;
    Some(rounds.swap_remove(middle))
}

/// Every kind on one store: the calls counted, then `rounds` rounds of every kind in turn.
async fn measure(
    backend: &mut Backend,
    store: StoreKind,
    options: &Options,
) -> Result<Vec<StepRecord>, String> {
    let kinds = Kind::all(store);
    let mut calls = Vec::new();
    for &kind in &kinds {
        // An atomic step needs the claim of a runtime over the `PostgresStore` itself, not a
        // wrapper: its `Store` calls are those of a fresh operation of no step (it writes its
        // checkpoints on the pool, and a fresh claim has none to load).
        let counted = match kind {
            Kind::Atomic(_) => Kind::Fresh(0),
            kind => kind,
        };
        calls.push(count_calls(backend, counted, options.in_flight).await?);
    }
    let mut rounds: Vec<Vec<Round>> = vec![Vec::new(); kinds.len()];
    for number in 1..=options.rounds {
        let mut fresh = std::collections::BTreeMap::new();
        for (i, &kind) in kinds.iter().enumerate() {
            let prepared = kind.prepared_steps().map_or(0, |steps| {
                prepared_for(fresh.get(&steps).copied().unwrap_or(0.0), options.measure)
            });
            let result = round(backend, kind, options, prepared)
                .await
                .map_err(|e| format!("{} {}: {e}", store.name(), kind.name()))?;
            eprintln!(
                "steps: {:<8} round {number} {:<6} {} steps: {:>9.0} ops/s, p50 {} µs, p99 {} µs, \
                 {:.1} µs CPU/op, machine {:.0} % busy",
                store.name(),
                kind.name(),
                kind.steps(),
                result.ops,
                result.p50_us,
                result.p99_us,
                result.cpu_us_per_op,
                100.0 * result.machine_busy,
            );
            if let Kind::Fresh(steps) = kind {
                fresh.insert(steps, result.ops);
            }
            rounds[i].push(result);
        }
    }
    let mut records = Vec::new();
    for ((kind, rounds), calls) in kinds.into_iter().zip(rounds).zip(calls) {
        let rounds_ops = rounds.iter().map(|r| round1(r.ops)).collect();
        let median = median(rounds).ok_or("no round")?;
        records.push(StepRecord {
            store: store.name().to_owned(),
            kind: kind.name().to_owned(),
            steps: kind.steps(),
            in_flight: options.in_flight,
            value_bytes: value_bytes(),
            median,
            rounds_ops,
            calls,
        });
    }
    Ok(records)
}

/// Runs every selected store.
pub(crate) fn run(options: &Options) -> Result<Vec<StepRecord>, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.server_threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let stores = crate::sessions::stores(&options.backends, &options.only);
    if stores.is_empty() {
        return Err("no store selected".into());
    }
    runtime.block_on(async {
        let mut records = Vec::new();
        for store in stores {
            let mut backend = Backend::connect(store, &options.backends, options.in_flight).await?;
            let measured = measure(&mut backend, store, options).await;
            let finished = backend.finish().await;
            records.extend(measured?);
            finished?;
        }
        Ok(records)
    })
}

/// Writes the records as JSON to `path`.
pub(crate) fn write_json(path: &Path, records: &[StepRecord]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut json = serde_json::to_vec_pretty(records).map_err(std::io::Error::other)?;
    json.push(b'\n');
    std::fs::write(path, json)
}

/// The least-squares slope of `y` over `x`; `None` with fewer than two distinct `x`.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / n, sy / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, y) in points {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
    }
    (sxx > 0.0).then(|| sxy / sxx)
}

/// The records as a markdown table, then per store what one step adds and what resuming
/// costs.
pub(crate) fn table(records: &[StepRecord]) -> String {
    let mut out = String::from(
        "| store | operation | steps | ops/s [rounds] | p50 µs | p99 µs | CPU µs/op | store calls per operation |\n\
         |---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in records {
        let rounds: Vec<String> = r
            .rounds_ops
            .iter()
            .map(|ops| thousands(ops.round() as u64))
            .collect();
        let calls = match r.kind.as_str() {
            "atomic" => format!(
                "{} + {} × (BEGIN, UPDATE, COMMIT)",
                r.calls.describe(),
                r.steps
            ),
            _ => r.calls.describe(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} [{}] | {} | {} | {:.1} | {} |\n",
            r.store,
            r.kind,
            r.steps,
            thousands(r.median.ops.round() as u64),
            rounds.join(" / "),
            thousands(r.median.p50_us),
            thousands(r.median.p99_us),
            r.median.cpu_us_per_op,
            calls,
        ));
    }
    out.push('\n');
    let mut stores: Vec<&str> = records.iter().map(|r| r.store.as_str()).collect();
    stores.dedup();
    for store in stores {
        let of = |kind: &str| -> Vec<&StepRecord> {
            records
                .iter()
                .filter(|r| r.store == store && r.kind == kind)
                .collect()
        };
        for kind in ["fresh", "atomic"] {
            let rows = of(kind);
            if rows.len() < 2 {
                continue;
            }
            let points = |f: &dyn Fn(&StepRecord) -> f64| -> Vec<(f64, f64)> {
                rows.iter().map(|r| (f64::from(r.steps), f(r))).collect()
            };
            // A caller's time per operation at the measured rate: in_flight / ops.
            let per_caller = |r: &StepRecord| r.in_flight as f64 * 1e6 / r.median.ops;
            let (first, last) = (rows[0], rows[rows.len() - 1]);
            out.push_str(&format!(
                "{store} {kind}: one step adds {:.1} µs to the p50, {:.1} µs to a caller's time \
                 per operation at the measured rate, {:.1} µs of CPU in this process (slopes over \
                 {} steps); {} steps run at {:.2}x the rate of {}.\n",
                slope(&points(&|r| r.median.p50_us as f64)).unwrap_or(0.0),
                slope(&points(&per_caller)).unwrap_or(0.0),
                slope(&points(&|r| r.median.cpu_us_per_op)).unwrap_or(0.0),
                rows.iter()
                    .map(|r| r.steps.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                last.steps,
                last.median.ops / first.median.ops,
                first.steps,
            ));
        }
        let (resume, retry, fresh) = (of("resume"), of("retry"), of("fresh"));
        let fresh3 = fresh.iter().find(|r| r.steps == RESUME_STEPS);
        if let (Some(resume), Some(retry)) = (resume.first(), retry.first()) {
            out.push_str(&format!(
                "{store} resume: {:.2}x the rate of a plain retry, p50 {} against {} µs",
                resume.median.ops / retry.median.ops,
                thousands(resume.median.p50_us),
                thousands(retry.median.p50_us),
            ));
            if let Some(fresh3) = fresh3 {
                out.push_str(&format!(
                    "; {:.2}x the rate of a fresh run of the same {} steps (p50 {} µs)",
                    resume.median.ops / fresh3.median.ops,
                    RESUME_STEPS,
                    thousands(fresh3.median.p50_us),
                ));
            }
            out.push_str(".\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_twenty_characters() {
        assert_eq!(value(1, 1).len(), 20);
        assert_eq!(value(u64::MAX, 8).len(), 20);
        assert_ne!(value(7, 1), value(7, 2));
        assert_eq!(value_bytes(), 22, "a JSON string: the value and two quotes");
    }

    #[test]
    fn kinds_per_store() {
        let names = |store| -> Vec<(&str, u32)> {
            Kind::all(store)
                .into_iter()
                .map(|k| (k.name(), k.steps()))
                .collect()
        };
        assert_eq!(
            names(StoreKind::Memory),
            [
                ("fresh", 0),
                ("fresh", 1),
                ("fresh", 3),
                ("fresh", 8),
                ("retry", 0),
                ("resume", 3)
            ]
        );
        assert_eq!(names(StoreKind::Postgres).len(), 9, "and three atomic rows");
        assert_eq!(Kind::Resume.prepared_steps(), Some(3));
        assert_eq!(Kind::Fresh(3).prepared_steps(), None);
        assert_eq!(expected_runs(Kind::Fresh(3), 10), 30);
        assert_eq!(expected_runs(Kind::Resume, 10), 0);
    }

    #[test]
    fn helpers() {
        let calls = Calls {
            claim: 1.0,
            complete: 1.0,
            save_step: 3.0,
            ..Calls::default()
        };
        assert_eq!(calls.describe(), "claim 1 + save_step 3 + complete 1 = 5");
        let odd = Calls {
            renew: 0.25,
            ..calls
        };
        assert_eq!(
            odd.describe(),
            "claim 1 + save_step 3 + renew 0.25 + complete 1 = 5.25"
        );
        let line = [(0.0, 10.0), (1.0, 12.0), (3.0, 16.0), (8.0, 26.0)];
        assert!((slope(&line).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
        assert_eq!(prepared_for(10.0, Duration::from_secs(10)), MIN_PREPARED);
        assert_eq!(prepared_for(5_000.0, Duration::from_secs(10)), 50_000);
        assert_eq!(prepared_for(1e9, Duration::from_secs(10)), MAX_PREPARED);
        let round = |ops| Round {
            operations: 1,
            seconds: 1.0,
            ops,
            p50_us: 1,
            p99_us: 1,
            cpu_us_per_op: 1.0,
            machine_busy: 0.5,
        };
        let picked = median(vec![round(3.0), round(1.0), round(2.0)]).unwrap();
        assert_eq!(picked.ops, 2.0);
        assert!(median(Vec::new()).is_none());
    }

    /// The operations on the memory store: the calls each kind makes, and a short run of
    /// every row, whose checks (every step ran once in a fresh run, none in a resumed one)
    /// hold.
    #[test]
    fn the_memory_store_rows() {
        let args = [
            "steps",
            "--warmup",
            "0.05",
            "--duration",
            "0.1",
            "--rounds",
            "1",
            "--in-flight",
            "4",
            "--only",
            "memory",
        ];
        let options = crate::cli::parse(args.map(String::from), |_| None).unwrap();
        let records = run(&options).unwrap();
        let row = |kind: &str, steps: u32| {
            records
                .iter()
                .find(|r| r.kind == kind && r.steps == steps)
                .unwrap_or_else(|| panic!("no {kind} row of {steps} steps"))
        };
        assert_eq!(records.len(), 6);
        assert_eq!(row("fresh", 0).calls.describe(), "claim 1 + complete 1 = 2");
        assert_eq!(
            row("fresh", 8).calls.describe(),
            "claim 1 + save_step 8 + complete 1 = 10"
        );
        assert_eq!(
            row("resume", 3).calls.describe(),
            "claim 1 + load_steps 1 + complete 1 = 3"
        );
        assert_eq!(row("retry", 0).calls.describe(), "claim 1 + complete 1 = 2");
        assert!(records.iter().all(|r| r.median.operations > 0));
        assert!(records.iter().all(|r| r.rounds_ops.len() == 1));
        let table = table(&records);
        assert!(table.contains("| memory | resume | 3 |"), "{table}");
        assert!(table.contains("memory fresh: one step adds"), "{table}");
        assert!(table.contains("memory resume: "), "{table}");
    }
}
