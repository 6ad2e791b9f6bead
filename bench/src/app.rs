//! The server side: one trivial payments handler that counts its executions per key, and the
//! router of each row around it.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_core::postgres::PostgresStore;
use idempotent_core::redis::RedisStore;
use idempotent_tower::IdempotencyLayer;
use serde::{Deserialize, Serialize};

use crate::report::Executions;
use crate::rows::{Implementation, Row, StoreKind};

/// The path of the handler.
pub(crate) const PAYMENTS: &str = "/payments";
/// The path that opens a session (rows whose middleware needs one: axum-idempotent).
pub(crate) const SESSION: &str = "/session";
/// The name of the server's runtime threads.
pub(crate) const SERVER_THREAD: &str = "bench-server";
/// How long the handler works on a probe key, so that concurrent duplicates overlap it.
pub(crate) const PROBE_HOLD: Duration = Duration::from_millis(25);

/// Bounds of the memory store in the HTTP rows: far above what a fresh-key row creates, so
/// that no row measures a full store's 503s.
const MEMORY_MAX_ENTRIES: usize = 50_000_000;
const MEMORY_MAX_BYTES: usize = 64 << 30;

/// A key as the load generator makes it; the handler attributes executions by parsing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyId {
    /// The `index`-th key of load-generator connection `lane`: `c<lane>-<index>`.
    Load { lane: usize, index: usize },
    /// The `n`-th probe key, sent as concurrent duplicates: `p<n>`.
    Probe(usize),
}

impl KeyId {
    pub(crate) fn parse(key: &str) -> Option<KeyId> {
        if let Some(rest) = key.strip_prefix('c') {
            let (lane, index) = rest.split_once('-')?;
            return Some(KeyId::Load {
                lane: lane.parse().ok()?,
                index: index.parse().ok()?,
            });
        }
        key.strip_prefix('p')?.parse().ok().map(KeyId::Probe)
    }

    pub(crate) fn to_key(self) -> String {
        match self {
            KeyId::Load { lane, index } => format!("c{lane}-{index}"),
            KeyId::Probe(n) => format!("p{n}"),
        }
    }
}

/// Executions per key, counted by the handler.
pub(crate) struct Tally {
    lanes: Vec<Mutex<Vec<u32>>>,
    probes: Mutex<Vec<u32>>,
    unattributed: AtomicU64,
    next_id: AtomicU64,
}

impl Tally {
    pub(crate) fn new(lanes: usize) -> Self {
        Tally {
            lanes: (0..lanes).map(|_| Mutex::new(Vec::new())).collect(),
            probes: Mutex::new(Vec::new()),
            unattributed: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
        }
    }

    /// Counts one execution for `key`; returns a new receipt id.
    pub(crate) fn record(&self, key: Option<KeyId>) -> u64 {
        let bump = |counts: &Mutex<Vec<u32>>, index: usize| {
            let mut counts = counts.lock().unwrap();
            if counts.len() <= index {
                counts.resize(index + 1, 0);
            }
            counts[index] += 1;
        };
        match key {
            Some(KeyId::Load { lane, index }) if lane < self.lanes.len() => {
                bump(&self.lanes[lane], index)
            }
            Some(KeyId::Probe(n)) => bump(&self.probes, n),
            _ => {
                self.unattributed.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn executions(&self) -> Executions {
        Executions {
            lanes: self
                .lanes
                .iter()
                .map(|l| l.lock().unwrap().clone())
                .collect(),
            probes: self.probes.lock().unwrap().clone(),
            unattributed: self.unattributed.load(Ordering::Relaxed),
        }
    }
}

#[derive(Deserialize)]
struct Payment {
    amount: u64,
    currency: String,
    customer: String,
}

#[derive(Serialize)]
struct Receipt {
    id: u64,
    amount: u64,
    currency: String,
    customer: String,
    status: &'static str,
}

/// The request body every row sends.
pub(crate) const REQUEST_BODY: &[u8] =
    br#"{"amount":1999,"currency":"EUR","customer":"cus_8f14e45f"}"#;

/// The handler of every row: parse a small JSON body, count the execution, answer 201 with a
/// small JSON body.
async fn pay(
    State(tally): State<Arc<Tally>>,
    headers: HeaderMap,
    Json(payment): Json<Payment>,
) -> (StatusCode, Json<Receipt>) {
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .and_then(KeyId::parse);
    if let Some(KeyId::Probe(_)) = key {
        tokio::time::sleep(PROBE_HOLD).await;
    }
    let id = tally.record(key);
    let receipt = Receipt {
        id,
        amount: payment.amount,
        currency: payment.currency,
        customer: payment.customer,
        status: "captured",
    };
    (StatusCode::CREATED, Json(receipt))
}

/// The handler's route, without middleware.
pub(crate) fn payments() -> Router<Arc<Tally>> {
    Router::new().route(PAYMENTS, post(pay))
}

/// Where the shared stores are.
#[derive(Debug, Clone, Default)]
pub(crate) struct Backends {
    pub(crate) redis_url: Option<String>,
    pub(crate) postgres_url: Option<String>,
    /// Replicas that must acknowledge each claim and record on Redis
    /// (`RedisStoreBuilder::replicas`).
    pub(crate) redis_replicas: usize,
}

/// How often the PostgreSQL rows' reaper runs: often enough to work during a row.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// The runtime of an `idempotent-tower` row: its store, a namespace of its own (so that runs
/// against the same Redis or PostgreSQL never see each other's keys), default TTL and lease.
/// A prefilled memory row's store is filled here (`scale.rs`); the shared stores are filled
/// before the row. PostgreSQL rows run the reaper, as a deployment does.
async fn idempotency(row: Row, backends: &Backends) -> Result<Idempotency, String> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let namespace = format!("idempotent-bench-{}-{nanos}", std::process::id());
    let builder = match row.store {
        StoreKind::Memory => {
            let store = MemoryStore::builder()
                .max_entries(MEMORY_MAX_ENTRIES)
                .max_bytes(MEMORY_MAX_BYTES)
                .build();
            if row.prefilled > 0 {
                crate::scale::fill_memory(store.clone(), row.prefilled).await?;
            }
            Idempotency::builder(store)
        }
        StoreKind::Redis => {
            let url = backends.redis_url.as_deref().ok_or("no Redis URL")?;
            let redis = RedisStore::builder(url)
                .replicas(backends.redis_replicas)
                .connect()
                .await
                .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?;
            Idempotency::builder(redis)
        }
        StoreKind::Postgres => {
            let url = backends
                .postgres_url
                .as_deref()
                .ok_or("no PostgreSQL URL")?;
            let postgres = PostgresStore::connect(url)
                .await
                .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e}"))?;
            postgres
                .migrate()
                .await
                .map_err(|e| format!("cannot migrate PostgreSQL at {url}: {e}"))?;
            // Stopped with the row's runtime.
            postgres.spawn_reaper(REAP_EVERY);
            Idempotency::builder(postgres)
        }
        StoreKind::None => return Err("idempotent-tower needs a store".into()),
    };
    Ok(builder.namespace(namespace).build())
}

/// The router of `row`; called inside the server's runtime (stores spawn background tasks).
async fn router(row: Row, tally: Arc<Tally>, backends: &Backends) -> Result<Router, String> {
    let router = match row.implementation {
        Implementation::Bare => payments(),
        Implementation::Tower => {
            let idempotency = idempotency(row, backends).await?;
            // The load carries no credentials (the bare handler and the peers scope nothing):
            // one shared scope, as `allow_anonymous` documents.
            payments()
                .route_layer(IdempotencyLayer::new_for_http(idempotency).allow_anonymous(true))
        }
        #[cfg(idempotent_bench_peers)]
        Implementation::Idempotent2 => crate::peers::idempotent2()?,
        #[cfg(idempotent_bench_peers)]
        Implementation::AxumIdempotent => crate::peers::axum_idempotent(),
        #[cfg(not(idempotent_bench_peers))]
        Implementation::Idempotent2 | Implementation::AxumIdempotent => {
            return Err(format!(
                "{} is not compiled in: build with RUSTFLAGS=\"--cfg idempotent_bench_peers\" \
                 and --ignore-rust-version (scripts/bench.sh does)",
                row.implementation.name()
            ));
        }
    };
    Ok(router.with_state(tally))
}

/// A row's server on a loopback port, on a runtime of its own.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) tally: Arc<Tally>,
    runtime: tokio::runtime::Runtime,
}

impl Server {
    pub(crate) fn start(
        row: Row,
        lanes: usize,
        threads: usize,
        backends: &Backends,
    ) -> Result<Server, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(SERVER_THREAD)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the server runtime: {e}"))?;
        let tally = Arc::new(Tally::new(lanes));
        let (router, listener) = runtime.block_on(async {
            let router = router(row, Arc::clone(&tally), backends).await?;
            let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
            Ok::<_, String>((router, listener))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("no local address: {e}"))?;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        runtime.spawn(async move { axum::serve(listener, router).await });
        Ok(Server {
            addr,
            tally,
            runtime,
        })
    }

    /// Stops the server and everything its row spawned.
    pub(crate) fn stop(self) {
        self.runtime.shutdown_timeout(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for key in [
            KeyId::Load { lane: 0, index: 0 },
            KeyId::Load {
                lane: 63,
                index: 1_234_567,
            },
            KeyId::Probe(7),
        ] {
            assert_eq!(KeyId::parse(&key.to_key()), Some(key));
        }
        for bad in [
            "", "c", "c1", "c1-", "c-1", "cx-1", "p", "px", "x1-1", "\"c1-1\"",
        ] {
            assert_eq!(KeyId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tally_counts_per_key() {
        let tally = Tally::new(2);
        tally.record(Some(KeyId::Load { lane: 1, index: 2 }));
        tally.record(Some(KeyId::Load { lane: 1, index: 2 }));
        tally.record(Some(KeyId::Probe(0)));
        tally.record(Some(KeyId::Load { lane: 5, index: 0 }));
        let id = tally.record(None);
        assert_eq!(id, 5);
        let executions = tally.executions();
        assert_eq!(executions.lanes, vec![vec![], vec![0, 0, 2]]);
        assert_eq!(executions.probes, vec![1]);
        assert_eq!(executions.unattributed, 2);
    }
}
