//! The server of a row: the payments handler behind the row's middleware and store, on a
//! loopback port and a runtime of its own.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::serve::ListenerExt;
use idempotent_cache::Cached;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{CheckpointStore, Idempotency, IdempotencyBuilder, SessionStore};
use idempotent_postgres::PostgresStore;
use idempotent_redis::RedisStore;
use idempotent_tower::IdempotencyLayer;

use crate::cache::RowTier;
use crate::cli::Backends;
use crate::fixture::{Tally, payments};
use crate::floor::{FloorLayer, MemoryLedger, StoreLedger};
use crate::rows::{Cache, Implementation, Row, StoreKind};

/// The name of the server's runtime threads.
pub(crate) const SERVER_THREAD: &str = "bench-server";

/// Bounds of the memory store in the HTTP rows: far above what a fresh-key row creates, so
/// that no row measures a full store's 503s.
const MEMORY_MAX_ENTRIES: usize = 50_000_000;
const MEMORY_MAX_BYTES: usize = 64 << 30;

/// How often the PostgreSQL rows' reaper runs: often enough to work during a row.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// The runtime of an `idempotent-tower` row: its store (behind the row's cache tier, if it
/// has one: `Cached::new(store, tier)`), a namespace of its own (so that runs against the
/// same Redis or PostgreSQL never see each other's keys), default TTL and lease. A prefilled
/// memory row's store is filled here (`scale.rs`); the shared stores are filled before the
/// row. PostgreSQL rows run the reaper, as a deployment does. The in-process tier holds
/// `cache_entries` records.
async fn idempotency(
    row: Row,
    backends: &Backends,
    cache_entries: u64,
) -> Result<(Idempotency, Option<Arc<RowTier>>), String> {
    let tier = match row.cache {
        Cache::None => None,
        cache => Some(Arc::new(
            RowTier::create(cache, cache_entries, backends).await?,
        )),
    };
    let namespace = namespace();
    let builder = match row.store {
        StoreKind::Memory => {
            let store = MemoryStore::builder()
                .max_entries(MEMORY_MAX_ENTRIES)
                .max_bytes(MEMORY_MAX_BYTES)
                .build();
            if row.prefilled > 0 {
                crate::scale::fill_memory(store.clone(), row.prefilled).await?;
            }
            cached(store, tier.as_deref())
        }
        StoreKind::Redis => cached(redis(backends).await?, tier.as_deref()),
        StoreKind::Postgres => cached(postgres(backends).await?, tier.as_deref()),
        StoreKind::None => return Err("idempotent-tower needs a store".into()),
    };
    Ok((builder.namespace(namespace).build(), tier))
}

/// A namespace of the row's own, so that runs against the same Redis or PostgreSQL never see
/// each other's keys.
fn namespace() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("idempotent-bench-{}-{nanos}", std::process::id())
}

/// The Redis store of a row.
async fn redis(backends: &Backends) -> Result<RedisStore, String> {
    let url = backends.redis_url.as_deref().ok_or("no Redis URL")?;
    RedisStore::builder(url)
        .replicas(backends.redis_replicas)
        .connect()
        .await
        .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))
}

/// The PostgreSQL store of a row, migrated, its reaper running (stopped with the row's
/// runtime).
async fn postgres(backends: &Backends) -> Result<PostgresStore, String> {
    let url = backends
        .postgres_url
        .as_deref()
        .ok_or("no PostgreSQL URL")?;
    let postgres = migrated_postgres(url).await?;
    postgres.spawn_reaper(REAP_EVERY);
    Ok(postgres)
}

/// The PostgreSQL store at `url` on its default table, connected and migrated: what the rows,
/// the prefills and the limit rows share.
pub(crate) async fn migrated_postgres(url: &str) -> Result<PostgresStore, String> {
    let postgres = PostgresStore::connect(url)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e}"))?;
    postgres
        .migrate()
        .await
        .map_err(|e| format!("cannot migrate PostgreSQL at {url}: {e}"))?;
    Ok(postgres)
}

/// The floor's router on the row's store (`floor.rs`).
async fn floor(row: Row, backends: &Backends) -> Result<Router<Arc<Tally>>, String> {
    let namespace = namespace();
    Ok(match row.store {
        StoreKind::Memory => {
            payments().route_layer(FloorLayer::new(MemoryLedger::new(), &namespace))
        }
        StoreKind::Redis => payments().route_layer(FloorLayer::new(
            StoreLedger::new(redis(backends).await?),
            &namespace,
        )),
        StoreKind::Postgres => payments().route_layer(FloorLayer::new(
            StoreLedger::new(postgres(backends).await?),
            &namespace,
        )),
        StoreKind::None => return Err("the floor needs a store".into()),
    })
}

/// The builder of a runtime over `store`, behind `tier` when there is one.
fn cached<S: SessionStore + CheckpointStore>(
    store: S,
    tier: Option<&RowTier>,
) -> IdempotencyBuilder {
    match tier {
        Some(tier) => Idempotency::builder(Cached::new(store, tier.tier.clone())),
        None => Idempotency::builder(store),
    }
}

/// The router of `row`, and its cache tier; called inside the server's runtime (stores spawn
/// background tasks).
async fn router(
    row: Row,
    tally: Arc<Tally>,
    backends: &Backends,
    cache_entries: u64,
) -> Result<(Router, Option<Arc<RowTier>>), String> {
    let mut tier = None;
    let router = match row.implementation {
        Implementation::Bare => payments(),
        Implementation::Floor => floor(row, backends).await?,
        Implementation::Tower => {
            let (idempotency, cache) = idempotency(row, backends, cache_entries).await?;
            tier = cache;
            // The load carries no credentials (the bare handler and the peers scope nothing):
            // one shared scope, as `allow_anonymous` documents.
            payments().route_layer(IdempotencyLayer::http(idempotency).allow_anonymous(true))
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
    Ok((router.with_state(tally), tier))
}

/// A row's server on a loopback port, on a runtime of its own.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) tally: Arc<Tally>,
    /// The row's cache tier, if it has one.
    pub(crate) cache: Option<Arc<RowTier>>,
    runtime: tokio::runtime::Runtime,
}

impl Server {
    /// `cache_entries`: the size of the in-process cache tier of a row that has one.
    pub(crate) fn start(
        row: Row,
        lanes: usize,
        threads: usize,
        backends: &Backends,
        cache_entries: u64,
    ) -> Result<Server, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(SERVER_THREAD)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the server runtime: {e}"))?;
        let tally = Arc::new(Tally::new(lanes));
        let (router, cache, listener) = runtime.block_on(async {
            let (router, cache) = router(row, Arc::clone(&tally), backends, cache_entries).await?;
            let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
            Ok::<_, String>((router, cache, listener))
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
            cache,
            runtime,
        })
    }

    /// Stops the server and everything its row spawned.
    pub(crate) fn stop(self) {
        self.runtime.shutdown_timeout(Duration::from_secs(2));
    }
}
