//! The sessions mode: the bytes a store holds for one client session of N requests, against
//! the bytes it holds for N requests with a key each.
//!
//! - **Traffic**: through the in-process runtime (`Idempotency` over the store, a namespace of
//!   its own per run), N requests in one session (`Call::in_session`), each answered with a
//!   small JSON receipt (the HTTP handler's fields, a fixed-width id: [`payload_bytes`] bytes),
//!   `in_flight` at a time (16 by default, within the window of 64; [`Acks`]): request `seq`
//!   goes out once the client holds every answer up to `seq - in_flight`, and acknowledges
//!   them (`ack = seq - in_flight`; `--ack lowest`: every answer it holds, the lowest
//!   unanswered number − 1). With the trailing ack the store ends up holding the last
//!   `in_flight` answers whatever order they came in; with `lowest` 1 to `in_flight` of them,
//!   as the last answers happened to arrive. Then N requests with a key each, `in_flight` at a
//!   time, into a fresh namespace. Every answer must be fresh (run once, not a replay), the
//!   keys all be held and the session hold its own record and the answers above its last
//!   `ack`, or the mode fails.
//! - **Memory**: a `MemoryStore` of its own per run (no sweep), so its accounting is the
//!   run's alone: `MemoryStore::stats()`, the bytes it charges against its byte bound, that
//!   is `RECORD_OVERHEAD` (256) per record plus each answer's payload; the session's own
//!   record is charged the overhead alone. An accounting, not resident memory (the memory
//!   mode measures that for keys).
//! - **Redis**: `MEMORY USAGE <key> SAMPLES 0` summed over the run's keys: for the session,
//!   the keys `SCAN MATCH idempotent:{<session hex>}*` finds (its hash tag: its own record and
//!   one per answer held); for keys, the Redis key of each of the N records. Redis counts the
//!   key, the value and its dictionary entry, not the entry in the expiry dictionary or the
//!   allocator's fragmentation. The keys are deleted after they are measured.
//! - **PostgreSQL**: a table of the store's own (`idempotent_bench_sessions`, emptied before
//!   each run, dropped at the end): `sum(pg_column_size(t.*))` over the session's rows (those
//!   whose `storage_key` begins with the session's 32-byte digest) or the N keys' rows; that
//!   is each live row's heap tuple (header and data; TOAST plays no part, the payloads are
//!   small), without its line pointer, its index entries, dead tuples or free space. The
//!   `+ indexes` figure adds an estimate per row: its 4-byte line pointer and one leaf entry in
//!   each of the table's three B-trees (the primary key on `storage_key`: 8-byte header plus
//!   the key with a 1-byte length, aligned to 8, plus its line pointer; the two `timestamptz`
//!   indexes: 16 + 4 each). `on disk` is `pg_total_relation_size` of the table as the run
//!   left it (heap, indexes, TOAST, free space and the dead tuples not yet vacuumed).

use std::collections::BTreeSet;
use std::future::Future;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idempotent_bench::table::thousands;
use idempotent_core::memory::MemoryStore;
use idempotent_core::session::{DEFAULT_SESSION_WINDOW, InSession};
use idempotent_core::{
    Call, CheckpointStore, Fingerprint, Idempotency, Key, SessionKey, SessionStore, StorageKey,
};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;

use crate::cli::{AckPolicy, Backends, Options};
use crate::fixture::REQUEST_BODY;
use crate::rows::StoreKind;

/// The PostgreSQL table of this mode, apart from the HTTP rows' table.
const TABLE: &str = "idempotent_bench_sessions";
/// The session's id.
const SESSION_ID: &str = "bench-session";
/// Redis commands per pipeline when measuring or deleting keys.
const REDIS_BATCH: usize = 1_000;
/// Bounds of the memory store: far above what a run holds.
const MEMORY_MAX_ENTRIES: usize = 50_000_000;
const MEMORY_MAX_BYTES: usize = 64 << 30;

/// A client's bookkeeping of one session: the numbers it sent, the answers it holds, and the
/// `ack` each request carries ([`AckPolicy`]). It keeps at most `in_flight` requests
/// unanswered past what it holds: request `seq` goes out once every answer up to
/// `seq - in_flight` is held, so no request is numbered past its `ack` plus the window as
/// long as `in_flight` is within the window.
#[derive(Debug, Clone)]
pub(crate) struct Acks {
    in_flight: u64,
    policy: AckPolicy,
    /// The highest number sent.
    sent: u64,
    /// Every answer up to this one is held.
    held: u64,
    /// Answers held above `held + 1` (the one missing).
    above: BTreeSet<u64>,
}

impl Acks {
    /// A client with `in_flight` requests out at most, in a session with `window` (at least
    /// `in_flight`, or the server would refuse requests as past the window).
    pub(crate) fn new(in_flight: u64, window: u64, policy: AckPolicy) -> Result<Acks, String> {
        if in_flight == 0 || in_flight > window {
            return Err(format!(
                "{in_flight} requests in flight do not fit a window of {window}"
            ));
        }
        Ok(Acks {
            in_flight,
            policy,
            sent: 0,
            held: 0,
            above: BTreeSet::new(),
        })
    }

    /// Every answer up to this number is held.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// The next request's `(seq, ack)`, or `None` until more answers are held.
    pub(crate) fn next(&mut self) -> Option<(u64, u64)> {
        let seq = self.sent + 1;
        if seq > self.held + self.in_flight {
            return None;
        }
        let ack = match self.policy {
            AckPolicy::Trailing => seq.saturating_sub(self.in_flight),
            AckPolicy::Lowest => self.held,
        };
        self.sent = seq;
        Some((seq, ack))
    }

    /// The answer to request `seq` arrived.
    pub(crate) fn answered(&mut self, seq: u64) {
        if seq <= self.held {
            return;
        }
        self.above.insert(seq);
        while self.above.remove(&(self.held + 1)) {
            self.held += 1;
        }
    }
}

/// Sends `requests` requests, numbered, acknowledged and let out as `acks` says:
/// `send(seq, ack)` makes request `seq`. Fails with the first failed request.
pub(crate) async fn drive<F, Fut>(requests: u64, acks: &mut Acks, mut send: F) -> Result<(), String>
where
    F: FnMut(u64, u64) -> Fut,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    let mut running = JoinSet::new();
    let mut sent = 0;
    loop {
        while sent < requests {
            let Some((seq, ack)) = acks.next() else { break };
            sent += 1;
            let request = send(seq, ack);
            running.spawn(async move { request.await.map(|()| seq) });
        }
        match running.join_next().await {
            Some(joined) => acks.answered(joined.map_err(|e| format!("request task: {e}"))??),
            None if sent < requests => {
                return Err(format!("stuck after {sent} requests: none may be sent"));
            }
            None => return Ok(()),
        }
    }
}

/// What the handler answers: the HTTP handler's receipt, with an id of fixed width.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    amount: u64,
    currency: String,
    customer: String,
    status: String,
}

fn receipt(n: u64) -> Receipt {
    Receipt {
        id: format!("pay_{n:012}"),
        amount: 1999,
        currency: "EUR".into(),
        customer: "cus_8f14e45f".into(),
        status: "captured".into(),
    }
}

/// The bytes of each answer as the runtime encodes it.
pub(crate) fn payload_bytes() -> u64 {
    serde_json::to_vec(&receipt(1)).map_or(0, |bytes| bytes.len() as u64)
}

/// What a store holds for one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Footprint {
    /// Records the store holds: the session's own and one per answer it keeps, or one per key.
    pub(crate) records: u64,
    /// Their bytes (see the module docs for each store's method).
    pub(crate) bytes: u64,
    /// PostgreSQL: `bytes` plus an estimate of each row's line pointer and index entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) with_indexes_bytes: Option<u64>,
    /// PostgreSQL: the table with its indexes and TOAST as the run left it
    /// (`pg_total_relation_size`), dead tuples and free space included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) on_disk_bytes: Option<u64>,
    /// PostgreSQL: the part of `on_disk_bytes` in indexes (`pg_indexes_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) indexes_on_disk_bytes: Option<u64>,
    /// PostgreSQL: the WAL the server wrote during the run (`pg_current_wal_lsn` before and
    /// after), the run's writes with their index updates and full-page images, and whatever
    /// autovacuum did meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) wal_bytes: Option<u64>,
    /// Seconds the requests took, in process.
    pub(crate) seconds: f64,
}

/// One store and request count: the session against the keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SessionRecord {
    pub(crate) store: String,
    pub(crate) requests: u64,
    pub(crate) in_flight: usize,
    pub(crate) window: u64,
    /// `trailing` or `lowest` ([`AckPolicy`]).
    pub(crate) ack: String,
    /// Bytes of each answer (the encoded receipt).
    pub(crate) payload_bytes: u64,
    /// The `ack` of the session's last request.
    pub(crate) last_ack: u64,
    pub(crate) session: Footprint,
    pub(crate) keys: Footprint,
}

/// A store under measurement, and how to read what it holds.
enum Backend {
    /// A new store per run.
    Memory,
    Redis {
        store: RedisStore,
        connection: redis::aio::MultiplexedConnection,
    },
    Postgres {
        store: PostgresStore,
        /// The WAL position when the run began (after its table was emptied).
        wal_from: String,
    },
}

impl Backend {
    async fn connect(
        kind: StoreKind,
        backends: &Backends,
        in_flight: usize,
    ) -> Result<Backend, String> {
        match kind {
            StoreKind::Redis => {
                let url = backends.redis_url.as_deref().ok_or("no Redis URL")?;
                if url.contains(',') {
                    return Err("the sessions mode measures one Redis server, not a cluster".into());
                }
                let store = RedisStore::connect(url)
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
                Ok(Backend::Postgres {
                    store,
                    wal_from: String::new(),
                })
            }
            StoreKind::Memory => Ok(Backend::Memory),
            StoreKind::None => Err("no store".into()),
        }
    }

    /// A runtime over the store in a namespace of its own, and the memory store when it is
    /// one (made for this run). PostgreSQL's table is emptied first.
    async fn runtime(&mut self, label: &str) -> Result<(Idempotency, Option<MemoryStore>), String> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let namespace = format!(
            "idempotent-bench-sessions-{}-{nanos}-{label}",
            std::process::id()
        );
        Ok(match self {
            Backend::Memory => {
                let store = MemoryStore::builder()
                    .max_entries(MEMORY_MAX_ENTRIES)
                    .max_bytes(MEMORY_MAX_BYTES)
                    .sweep_interval(None)
                    .build();
                (runtime(store.clone(), &namespace), Some(store))
            }
            Backend::Redis { store, .. } => (runtime(store.clone(), &namespace), None),
            Backend::Postgres { store, wal_from } => {
                sqlx::query(&format!("TRUNCATE {}", quoted(TABLE)))
                    .execute(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: TRUNCATE: {e}"))?;
                (*wal_from,) = sqlx::query_as("SELECT pg_current_wal_lsn()::text")
                    .fetch_one(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: pg_current_wal_lsn: {e}"))?;
                (runtime(store.clone(), &namespace), None)
            }
        })
    }

    /// What the store holds of `session` (then deleted from Redis).
    async fn session_footprint(
        &mut self,
        session: &SessionKey,
        memory: Option<&MemoryStore>,
    ) -> Result<Footprint, String> {
        let hex = StorageKey::from_bytes(*session.as_bytes()).to_hex();
        match self {
            Backend::Memory => memory_footprint(memory),
            Backend::Redis { store, connection } => {
                let prefix = store.redis_key(&session.record_key());
                // `PREFIX{hex}`: its own record; `PREFIX{hex}:<epoch>:<seq>`: its answers.
                let pattern = format!("{prefix}*");
                debug_assert!(prefix.contains(&format!("{{{hex}}}")));
                let keys = scan(connection, &pattern).await?;
                redis_footprint(connection, &keys).await
            }
            Backend::Postgres { store, wal_from } => {
                let sql = footprint_sql("substring(storage_key from 1 for 32) = $1");
                let row: PostgresRow = sqlx::query_as(&sql)
                    .bind(session.as_bytes().as_slice())
                    .bind(wal_from.as_str())
                    .fetch_one(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: the session's rows: {e}"))?;
                Ok(postgres_footprint(row))
            }
        }
    }

    /// What the store holds of the records `keys` (then deleted from Redis).
    async fn keys_footprint(
        &mut self,
        keys: &[StorageKey],
        memory: Option<&MemoryStore>,
    ) -> Result<Footprint, String> {
        match self {
            Backend::Memory => memory_footprint(memory),
            Backend::Redis { store, connection } => {
                let names: Vec<String> = keys.iter().map(|key| store.redis_key(key)).collect();
                redis_footprint(connection, &names).await
            }
            Backend::Postgres { store, wal_from } => {
                let sql = footprint_sql("storage_key = ANY($1)");
                let bytes: Vec<Vec<u8>> = keys
                    .iter()
                    .map(|key| key.record_bytes().as_ref().to_vec())
                    .collect();
                let row: PostgresRow = sqlx::query_as(&sql)
                    .bind(bytes)
                    .bind(wal_from.as_str())
                    .fetch_one(store.pool())
                    .await
                    .map_err(|e| format!("PostgreSQL: the keys' rows: {e}"))?;
                Ok(postgres_footprint(row))
            }
        }
    }

    /// Drops what the mode created: PostgreSQL's table and its sequence.
    async fn finish(self) -> Result<(), String> {
        if let Backend::Postgres { store, .. } = self {
            for statement in [
                format!("DROP TABLE IF EXISTS {}", quoted(TABLE)),
                format!(
                    "DROP SEQUENCE IF EXISTS {}",
                    quoted(&format!("{TABLE}_token_seq"))
                ),
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

/// Per PostgreSQL row: its line pointer, and its leaf entry (header, key, line pointer) in
/// the primary key and in the two `timestamptz` indexes.
const INDEX_ESTIMATE: &str = "pg_column_size(t.*) + 4 + ((8 + 1 + octet_length(storage_key) + 7) / 8) * 8 + 4 + 2 * (16 + 4)";

fn quoted(name: &str) -> String {
    format!("\"{name}\"")
}

fn runtime(store: impl SessionStore + CheckpointStore, namespace: &str) -> Idempotency {
    Idempotency::builder(store).namespace(namespace).build()
}

fn memory_footprint(memory: Option<&MemoryStore>) -> Result<Footprint, String> {
    let stats = memory.ok_or("no memory store")?.stats();
    Ok(Footprint {
        records: stats.records as u64,
        bytes: stats.bytes as u64,
        with_indexes_bytes: None,
        on_disk_bytes: None,
        indexes_on_disk_bytes: None,
        wal_bytes: None,
        seconds: 0.0,
    })
}

/// Rows, their bytes, with the index estimate, the table and its indexes on disk, and the
/// WAL written since the run began.
type PostgresRow = (i64, i64, i64, i64, i64, i64);

/// The statement that reads a [`PostgresRow`] over the rows `filter` selects (`$1`), with the
/// WAL position the run began at (`$2`).
fn footprint_sql(filter: &str) -> String {
    let table = quoted(TABLE);
    format!(
        "SELECT count(*)::int8, coalesce(sum(pg_column_size(t.*)), 0)::int8, \
         coalesce(sum({INDEX_ESTIMATE}), 0)::int8, pg_total_relation_size('{table}')::int8, \
         pg_indexes_size('{table}')::int8, \
         pg_wal_lsn_diff(pg_current_wal_lsn(), $2::pg_lsn)::int8 \
         FROM {table} AS t WHERE {filter}"
    )
}

fn postgres_footprint(
    (records, bytes, with_indexes, on_disk, indexes, wal): PostgresRow,
) -> Footprint {
    let unsigned = |n: i64| u64::try_from(n).unwrap_or(0);
    Footprint {
        records: unsigned(records),
        bytes: unsigned(bytes),
        with_indexes_bytes: Some(unsigned(with_indexes)),
        on_disk_bytes: Some(unsigned(on_disk)),
        indexes_on_disk_bytes: Some(unsigned(indexes)),
        wal_bytes: Some(unsigned(wal)),
        seconds: 0.0,
    }
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

/// `MEMORY USAGE … SAMPLES 0` summed over `keys` (those that exist), which are then deleted.
async fn redis_footprint(
    connection: &mut redis::aio::MultiplexedConnection,
    keys: &[String],
) -> Result<Footprint, String> {
    let (mut records, mut bytes) = (0, 0);
    for batch in keys.chunks(REDIS_BATCH) {
        let mut pipe = redis::pipe();
        for key in batch {
            pipe.cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .arg("SAMPLES")
                .arg(0);
        }
        let usages: Vec<Option<u64>> = pipe
            .query_async(connection)
            .await
            .map_err(|e| format!("Redis MEMORY USAGE: {e}"))?;
        for usage in usages.into_iter().flatten() {
            records += 1;
            bytes += usage;
        }
    }
    for batch in keys.chunks(REDIS_BATCH) {
        redis::cmd("UNLINK")
            .arg(batch)
            .exec_async(connection)
            .await
            .map_err(|e| format!("Redis UNLINK: {e}"))?;
    }
    Ok(Footprint {
        records,
        bytes,
        with_indexes_bytes: None,
        on_disk_bytes: None,
        indexes_on_disk_bytes: None,
        wal_bytes: None,
        seconds: 0.0,
    })
}

/// One request of the run on `idempotency`: it must run (not replay).
async fn pay<N>(idempotency: Idempotency, call: Call<N>, n: u64) -> Result<(), String>
where
    idempotent_core::capability::Full: idempotent_core::capability::Runs<N>,
{
    let outcome = idempotency
        .run(&call, async move { receipt(n) })
        .await
        .map_err(|e| format!("request {n}: {e}"))?;
    if outcome.is_replayed() {
        return Err(format!("request {n} was answered as a replay"));
    }
    Ok(())
}

/// N requests in one session, then N with a key each, on `backend`.
async fn measure(
    backend: &mut Backend,
    store: StoreKind,
    requests: u64,
    in_flight: usize,
    policy: AckPolicy,
) -> Result<SessionRecord, String> {
    let window = DEFAULT_SESSION_WINDOW;
    let fingerprint = Fingerprint::from_bytes(REQUEST_BODY);
    let id = Key::new(SESSION_ID).expect("a valid session id");

    let (idempotency, memory) = backend.runtime("session").await?;
    let mut acks = Acks::new(in_flight as u64, window, policy)?;
    let mut last_ack = 0;
    let started = Instant::now();
    drive(requests, &mut acks, |seq, ack| {
        last_ack = ack;
        let (idempotency, id) = (idempotency.clone(), id.clone());
        async move {
            let place = InSession::new(seq, ack).map_err(|e| e.to_string())?;
            let call = Call::in_session(id, place).fingerprint(fingerprint);
            pay(idempotency, call, seq).await
        }
    })
    .await
    .map_err(|e| format!("{} session: {e}", store.name()))?;
    let seconds = started.elapsed().as_secs_f64();
    if acks.held() != requests {
        return Err(format!(
            "{} session: {} of {requests} answers",
            store.name(),
            acks.held()
        ));
    }
    let session_key = idempotency.session_key(&Call::new(id.clone()));
    let session = Footprint {
        seconds,
        ..backend
            .session_footprint(&session_key, memory.as_ref())
            .await?
    };
    drop((idempotency, memory));

    let (idempotency, memory) = backend.runtime("keys").await?;
    let key = |n: u64| Key::new(format!("pay-{n}")).expect("a valid key");
    let mut all = Acks::new(in_flight as u64, in_flight as u64, AckPolicy::Lowest)?;
    let started = Instant::now();
    drive(requests, &mut all, |n, _| {
        let call = Call::new(key(n)).fingerprint(fingerprint);
        pay(idempotency.clone(), call, n)
    })
    .await
    .map_err(|e| format!("{} keys: {e}", store.name()))?;
    let seconds = started.elapsed().as_secs_f64();
    let storage_keys: Vec<StorageKey> = (1..=requests)
        .map(|n| idempotency.storage_key(&Call::new(key(n))))
        .collect();
    let keys = Footprint {
        seconds,
        ..backend
            .keys_footprint(&storage_keys, memory.as_ref())
            .await?
    };

    Ok(SessionRecord {
        store: store.name().to_owned(),
        requests,
        in_flight,
        window,
        ack: policy.name().to_owned(),
        payload_bytes: payload_bytes(),
        last_ack,
        session,
        keys,
    })
}

/// The stores the mode measures: memory, and Redis and PostgreSQL when their URL is known;
/// only those named in `only` when it names any.
pub(crate) fn stores(backends: &Backends, only: &[String]) -> Vec<StoreKind> {
    let known = [
        (StoreKind::Memory, true),
        (StoreKind::Redis, backends.redis_url.is_some()),
        (StoreKind::Postgres, backends.postgres_url.is_some()),
    ];
    let named = |store: StoreKind| only.iter().any(|item| item == store.name());
    let any_named = known.iter().any(|(store, _)| named(*store));
    known
        .into_iter()
        .filter(|(store, known)| *known && (!any_named || named(*store)))
        .map(|(store, _)| store)
        .collect()
}

/// Runs every store and request count.
pub(crate) fn run(options: &Options) -> Result<Vec<SessionRecord>, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.server_threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let stores = stores(&options.backends, &options.only);
    if stores.is_empty() {
        return Err("no store selected".into());
    }
    runtime.block_on(async {
        let mut records = Vec::new();
        for store in stores {
            let mut backend = Backend::connect(store, &options.backends, options.in_flight).await?;
            for &requests in &options.requests {
                let record = measure(
                    &mut backend,
                    store,
                    requests,
                    options.in_flight,
                    options.ack,
                )
                .await?;
                eprintln!(
                    "sessions: {:<8} {:>7} requests: session {} records {} bytes ({:.0} req/s), \
                     keys {} records {} bytes ({:.0} req/s)",
                    record.store,
                    record.requests,
                    record.session.records,
                    record.session.bytes,
                    rate(record.requests, record.session.seconds),
                    record.keys.records,
                    record.keys.bytes,
                    rate(record.requests, record.keys.seconds),
                );
                check(&record)?;
                records.push(record);
            }
            backend.finish().await?;
        }
        Ok(records)
    })
}

fn rate(requests: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        requests as f64 / seconds
    } else {
        0.0
    }
}

/// A run whose records are not what it made cannot be trusted: the keys must all be held, and
/// the session its own record and the answers above the last request's `ack`.
fn check(record: &SessionRecord) -> Result<(), String> {
    if record.keys.records != record.requests {
        return Err(format!(
            "{}: {} requests with a key each left {} records",
            record.store, record.requests, record.keys.records
        ));
    }
    let expected = record.requests.saturating_sub(record.last_ack) + 1;
    if record.session.records != expected {
        return Err(format!(
            "{}: a session of {} requests whose last acknowledged {} left {} records, not \
             {expected}",
            record.store, record.requests, record.last_ack, record.session.records
        ));
    }
    Ok(())
}

/// The records as a markdown table; PostgreSQL's other measures in a table of their own; and
/// per store, how far the session's bytes moved over the request counts.
pub(crate) fn table(records: &[SessionRecord]) -> String {
    let mut out = String::from(
        "| store | requests | session records | session bytes | key records | keys bytes | keys bytes/request | keys / session |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in records {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.store,
            thousands(r.requests),
            r.session.records,
            thousands(r.session.bytes),
            thousands(r.keys.records),
            thousands(r.keys.bytes),
            r.keys
                .bytes
                .checked_div(r.requests)
                .map_or("–".to_owned(), thousands),
            ratio(r.keys.bytes, r.session.bytes),
        ));
    }
    let postgres: Vec<&SessionRecord> = records
        .iter()
        .filter(|r| r.session.with_indexes_bytes.is_some())
        .collect();
    if !postgres.is_empty() {
        out.push_str(
            "\n| store | requests | session bytes | + indexes (est.) | on disk (of it indexes) | WAL/request | keys bytes | + indexes (est.) | on disk (of it indexes) | WAL/request | keys / session, + indexes |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let some = |n: Option<u64>| n.map_or("–".to_owned(), thousands);
        let disk = |f: &Footprint| {
            format!(
                "{} ({})",
                some(f.on_disk_bytes),
                some(f.indexes_on_disk_bytes)
            )
        };
        let wal = |f: &Footprint, requests: u64| {
            f.wal_bytes
                .and_then(|wal| wal.checked_div(requests))
                .map_or("–".to_owned(), thousands)
        };
        for r in postgres {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.store,
                thousands(r.requests),
                thousands(r.session.bytes),
                some(r.session.with_indexes_bytes),
                disk(&r.session),
                wal(&r.session, r.requests),
                thousands(r.keys.bytes),
                some(r.keys.with_indexes_bytes),
                disk(&r.keys),
                wal(&r.keys, r.requests),
                ratio(
                    r.keys.with_indexes_bytes.unwrap_or(0),
                    r.session.with_indexes_bytes.unwrap_or(0)
                ),
            ));
        }
    }
    out.push('\n');
    let mut stores: Vec<&str> = records.iter().map(|r| r.store.as_str()).collect();
    stores.dedup();
    for store in stores {
        let of_store: Vec<&SessionRecord> = records.iter().filter(|r| r.store == store).collect();
        let bytes = of_store.iter().map(|r| r.session.bytes);
        let (least, most) = (bytes.clone().min().unwrap_or(0), bytes.max().unwrap_or(0));
        let (first, last) = (of_store[0].requests, of_store[of_store.len() - 1].requests);
        let spread = match least {
            0 => "–".to_owned(),
            least => format!("{:.1} %", 100.0 * (most - least) as f64 / least as f64),
        };
        out.push_str(&format!(
            "{store}: the session holds {}–{} bytes from {} to {} requests (spread {spread}).\n",
            thousands(least),
            thousands(most),
            thousands(first),
            thousands(last),
        ));
    }
    out
}

fn ratio(keys: u64, session: u64) -> String {
    match session {
        0 => "–".to_owned(),
        session => match keys as f64 / session as f64 {
            ratio if ratio >= 100.0 => format!("{}x", thousands(ratio.round() as u64)),
            ratio => format!("{ratio:.1}x"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use AckPolicy::{Lowest, Trailing};

    #[test]
    fn one_in_flight_acknowledges_the_answer_before() {
        for policy in [Trailing, Lowest] {
            let mut acks = Acks::new(1, 64, policy).unwrap();
            for seq in 1..=100 {
                assert_eq!(acks.next(), Some((seq, seq - 1)));
                assert_eq!(acks.next(), None, "one at a time");
                acks.answered(seq);
            }
            assert_eq!(acks.held(), 100);
        }
    }

    #[test]
    fn trailing_acknowledges_in_flight_behind() {
        let mut acks = Acks::new(4, 64, Trailing).unwrap();
        for seq in 1..=4 {
            assert_eq!(acks.next(), Some((seq, 0)));
        }
        assert_eq!(acks.next(), None, "4 in flight");
        acks.answered(2);
        acks.answered(4);
        assert_eq!(acks.next(), None, "answer 1 is missing");
        acks.answered(1);
        assert_eq!(acks.held(), 2, "answer 3 is missing");
        assert_eq!(acks.next(), Some((5, 1)));
        assert_eq!(acks.next(), Some((6, 2)));
        assert_eq!(acks.next(), None);
        acks.answered(3);
        acks.answered(3);
        acks.answered(1);
        assert_eq!(acks.held(), 4, "an answer twice changes nothing");
        assert_eq!(acks.next(), Some((7, 3)));
        assert_eq!(acks.next(), Some((8, 4)));
        assert_eq!(acks.next(), None);
    }

    #[test]
    fn lowest_acknowledges_every_answer_held() {
        let mut acks = Acks::new(4, 64, Lowest).unwrap();
        for seq in 1..=4 {
            assert_eq!(acks.next(), Some((seq, 0)));
        }
        acks.answered(2);
        acks.answered(4);
        acks.answered(1);
        assert_eq!(acks.next(), Some((5, 2)), "answer 3 is missing");
        assert_eq!(acks.next(), Some((6, 2)));
        assert_eq!(acks.next(), None);
        acks.answered(3);
        assert_eq!(acks.next(), Some((7, 4)));
    }

    #[test]
    fn in_flight_must_fit_the_window() {
        assert!(Acks::new(64, 64, Trailing).is_ok());
        assert!(Acks::new(65, 64, Trailing).is_err());
        assert!(Acks::new(0, 64, Lowest).is_err());
        assert_eq!(AckPolicy::parse("trailing"), Some(Trailing));
        assert_eq!(AckPolicy::parse(Lowest.name()), Some(Lowest));
        assert_eq!(AckPolicy::parse("prompt"), None);
    }

    /// A client over a server that follows the gate's rules, with answers arriving in a
    /// scrambled order: no request is ever refused as acknowledged or past the window, every
    /// request is sent once, the server keeps at most `in_flight` answers, and with a
    /// trailing ack exactly the last `in_flight` at the end.
    #[test]
    fn a_scrambled_session_stays_within_the_gate() {
        let (window, in_flight, requests) = (64u64, 16u64, 5_000u64);
        for policy in [Trailing, Lowest] {
            let mut acks = Acks::new(in_flight, window, policy).unwrap();
            let mut pending: Vec<u64> = Vec::new();
            let (mut mark, mut sent, mut state) = (0u64, 0u64, 0x9e37_79b9_7f4a_7c15u64);
            let mut kept: BTreeSet<u64> = BTreeSet::new();
            while sent < requests || !pending.is_empty() {
                while let Some((seq, ack)) = (sent < requests).then(|| acks.next()).flatten() {
                    mark = mark.max(ack);
                    assert!(seq > mark, "seq {seq} at or below the mark {mark}");
                    assert!(seq <= mark + window, "seq {seq} past the window");
                    kept.retain(|&s| s > mark);
                    kept.insert(seq);
                    assert!(kept.len() as u64 <= in_flight, "{} kept", kept.len());
                    pending.push(seq);
                    sent += 1;
                }
                assert!(pending.len() as u64 <= in_flight);
                // xorshift: which pending request answers next.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let answered = pending.swap_remove((state % pending.len() as u64) as usize);
                acks.answered(answered);
            }
            assert_eq!(acks.held(), requests);
            if policy == Trailing {
                assert_eq!(mark, requests - in_flight);
                assert_eq!(kept.len() as u64, in_flight);
            }
        }
    }

    #[test]
    fn drive_sends_every_request_once_in_flight_at_most() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for policy in [Trailing, Lowest] {
            let sent = Arc::new(Mutex::new(Vec::new()));
            let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let mut acks = Acks::new(16, 64, policy).unwrap();
            runtime
                .block_on(drive(1_000, &mut acks, |seq, ack| {
                    sent.lock().unwrap().push((seq, ack));
                    let (running, most) = (Arc::clone(&running), Arc::clone(&most));
                    async move {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        // Answers arrive out of order: some numbers wait more turns.
                        for _ in 0..(seq % 7) {
                            tokio::task::yield_now().await;
                        }
                        running.fetch_sub(1, Ordering::SeqCst);
                        Ok(())
                    }
                }))
                .unwrap();
            assert!(most.load(Ordering::SeqCst) <= 16);
            let sent = sent.lock().unwrap();
            assert_eq!(sent.len(), 1_000);
            assert!(
                sent.iter()
                    .enumerate()
                    .all(|(i, (seq, _))| *seq == i as u64 + 1)
            );
            assert!(sent.iter().all(|(seq, ack)| ack < seq && seq - ack <= 16));
            assert!(
                sent.windows(2).all(|pair| pair[0].1 <= pair[1].1),
                "the ack never falls"
            );
            assert_eq!(acks.held(), 1_000);
            if policy == Trailing {
                assert!(sent.iter().all(|(seq, ack)| *ack == seq.saturating_sub(16)));
            }
        }

        let mut acks = Acks::new(4, 64, Trailing).unwrap();
        let failed = runtime.block_on(drive(10, &mut acks, |seq, _| async move {
            if seq == 3 {
                Err("no".to_owned())
            } else {
                Ok(())
            }
        }));
        assert_eq!(failed, Err("no".to_owned()));
    }

    #[test]
    fn the_payload_is_the_size_of_the_http_answers() {
        let bytes = payload_bytes();
        assert!((90..=110).contains(&bytes), "{bytes}");
        assert_eq!(
            serde_json::to_vec(&receipt(99_999)).unwrap().len() as u64,
            bytes,
            "the same size for every request"
        );
    }

    #[test]
    fn stores_follow_the_urls_and_only() {
        let backends = Backends {
            redis_url: Some("redis://x".into()),
            postgres_url: None,
            redis_replicas: 0,
        };
        let only =
            |items: &[&str]| -> Vec<String> { items.iter().map(|s| s.to_string()).collect() };
        assert_eq!(
            stores(&backends, &[]),
            [StoreKind::Memory, StoreKind::Redis]
        );
        assert_eq!(stores(&backends, &only(&["redis"])), [StoreKind::Redis]);
        assert_eq!(
            stores(&backends, &only(&["postgres"])),
            [],
            "PostgreSQL has no URL"
        );
        assert_eq!(
            stores(&backends, &only(&["session"])).len(),
            2,
            "not a store"
        );
    }

    fn record(store: &str, requests: u64, session: u64, keys: u64) -> SessionRecord {
        let footprint = |records, bytes| Footprint {
            records,
            bytes,
            with_indexes_bytes: (store == "postgres").then_some(bytes + 100 * records),
            on_disk_bytes: (store == "postgres").then_some(16_384),
            indexes_on_disk_bytes: (store == "postgres").then_some(8_192),
            wal_bytes: (store == "postgres").then_some(1_000 * records),
            seconds: 1.0,
        };
        SessionRecord {
            store: store.into(),
            requests,
            in_flight: 16,
            window: 64,
            ack: "trailing".into(),
            payload_bytes: 101,
            last_ack: requests - 16,
            session: footprint(17, session),
            keys: footprint(requests, keys),
        }
    }

    #[test]
    fn the_table_compares_and_checks() {
        let records = [
            record("memory", 100, 6_000, 35_700),
            record("memory", 100_000, 6_100, 35_700_000),
            record("postgres", 100, 4_000, 25_000),
        ];
        let table = table(&records);
        assert!(
            table.contains(
                "| memory | 100,000 | 17 | 6,100 | 100,000 | 35,700,000 | 357 | 5,852x |"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "| postgres | 100 | 4,000 | 5,700 | 16,384 (8,192) | 170 | 25,000 | 35,000 \
                 | 16,384 (8,192) | 1,000 | 6.1x |"
            ),
            "{table}"
        );
        assert!(
            table.contains("memory: the session holds 6,000–6,100 bytes from 100 to 100,000 requests (spread 1.7 %)."),
            "{table}"
        );
        assert!(check(&records[1]).is_ok());
        let mut lost = records[1].clone();
        lost.keys.records -= 1;
        assert!(check(&lost).is_err());
        let mut grown = records[1].clone();
        grown.session.records = 66;
        assert!(check(&grown).is_err());
    }
}
