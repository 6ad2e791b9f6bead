//! [`AnyStore`]: one of the family's stores, chosen by a URL (or `IDEMPOTENCY_STORE`) when the
//! service starts: `memory`, `redis://…`, `postgres://…` or `sqlite://PATH`, optionally behind a
//! cache tier (`IDEMPOTENCY_CACHE`). It sits above the store crates, which know nothing of it.
//! See [`AnyStore`] for the URLs, what is done for you and the errors.

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

#[cfg(feature = "memory")]
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    CheckpointStore, Claim, FencingToken, Fingerprint, SessionStore, StorageKey, Store, StoreError,
};
#[cfg(feature = "postgres")]
use idempotent_postgres::PostgresStore;
#[cfg(feature = "redis")]
use idempotent_redis::RedisStore;

/// The variable [`AnyStore::from_env`] reads the store's URL from.
const STORE_VAR: &str = "IDEMPOTENCY_STORE";
/// The variable [`AnyStore::from_env`] reads the cache tier from.
const CACHE_VAR: &str = "IDEMPOTENCY_CACHE";
/// The variable [`AnyStore::from_env`] reads the Redis replica count from.
const REPLICAS_VAR: &str = "IDEMPOTENCY_REDIS_REPLICAS";
/// How often a PostgreSQL or SQLite store's expired rows are reaped unless told otherwise.
const REAP_EVERY: Duration = Duration::from_secs(60);

/// `MemoryStore`, `RedisStore`, `PostgresStore` or `SqliteStore`, as a URL says:
/// for a service that lets its deployment pick the store. Each is there with its feature
/// (`memory`, `redis`, `postgres`); every [`Store`] call goes to the chosen store.
///
/// | URL | store |
/// |---|---|
/// | `memory` | `MemoryStore::new()`: one process, the default bounds |
/// | `redis://HOST:PORT[/DB]` (`rediss://`) | `RedisStore`: one server |
/// | `redis://HOST1:PORT1,redis://HOST2:PORT2,…` | `RedisStore`: a Redis Cluster, any of its nodes |
/// | `postgres://USER[:PASSWORD]@HOST[:PORT]/DB` (`postgresql://`) | `PostgresStore` with its default table |
/// | `sqlite://PATH` (`sqlite:///abs/path.db`, `sqlite://rel/path.db`) | `SqliteStore`: one file (created if missing), shared by the processes of one host |
///
/// [`from_env`](Self::from_env) reads the URL from `IDEMPOTENCY_STORE` (default `memory`),
/// on Redis the replicas that must acknowledge every claim and record from
/// `IDEMPOTENCY_REDIS_REPLICAS` (default 0), and the cache tier in front of the store from
/// `IDEMPOTENCY_CACHE` (unset: none), the names every example service reads.
///
/// # A cache tier in front
///
/// [`cache`](AnyStoreBuilder::cache) (or `IDEMPOTENCY_CACHE`) puts a
/// [`CacheTier`](idempotent_cache::CacheTier) in front of the store (feature `cache`), as
/// [`Cached`](idempotent_cache::Cached) does:
///
/// | value | tier |
/// |---|---|
/// | `memory:N` | in this process, at most `N` finished records (and 64 MiB of them) |
/// | `redis://HOST:PORT[/DB]` (several, comma-separated: a Redis Cluster's nodes) | in a Redis every instance shares, in front of the store (PostgreSQL, say) |
///
/// The PostgreSQL transactional mode of a runtime over it is
/// `Transactional::of(&runtime, store.postgres()?)`, with `.tier(store.cache()?.clone())` to
/// answer duplicates from the tier too.
///
/// # What is done for you
///
/// A store chosen at deployment must work without code that knows which one it is, so
/// [`connect`](AnyStoreBuilder::connect) does on PostgreSQL what every service needs there:
///
/// - **The table is created** (`PostgresStore::migrate`) before the store is returned. It is
///   idempotent and safe from every instance at once. Turn it off with
///   [`migrate(false)`](AnyStoreBuilder::migrate) when the service's role may not create
///   tables and a deployment step migrates instead.
/// - **Expired rows are reaped** every minute (`PostgresStore::spawn_reaper`), by a task that
///   lives as long as the store does: it stops when the last clone of this `AnyStore` (and so
///   the runtime built on it) is dropped. Change the period, or turn it off when another
///   process reaps, with [`reaper`](AnyStoreBuilder::reaper).
///
/// Redis expires records itself and the memory store sweeps its own, so neither needs a step.
/// Everything else is each store's default (key prefix, table name, timeouts, pool size,
/// memory bounds); a service that sets those builds its store directly.
///
/// # Errors
///
/// An [`AnyStoreError`] names the variable (or "the store URL") and never prints a password:
/// a URL shown in a message has its password replaced by `***`, and a PostgreSQL URL is not
/// shown at all.
///
/// ```no_run
/// use idempotent_any::AnyStore;
/// use idempotent_core::{Idempotency};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// // IDEMPOTENCY_STORE=postgres://app@db:5432/app, say; `memory` when unset.
/// let store = AnyStore::from_env().await?;
/// let idempotency = Idempotency::builder(store).namespace("billing").build();
/// # let _ = idempotency;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct AnyStore {
    backend: Backend,
    #[cfg(feature = "cache")]
    cache: Option<idempotent_cache::CacheTier>,
    /// Stops the PostgreSQL reaper when the last clone is dropped.
    _reaper: Option<Arc<Reaper>>,
}

#[derive(Debug, Clone)]
enum Backend {
    #[cfg(feature = "memory")]
    Memory(MemoryStore),
    #[cfg(feature = "redis")]
    Redis(RedisStore),
    #[cfg(feature = "postgres")]
    Postgres(PostgresStore),
    #[cfg(feature = "sqlite")]
    Sqlite(idempotent_sqlite::SqliteStore),
}

/// The reaper task, aborted when dropped.
#[derive(Debug)]
struct Reaper(tokio::task::JoinHandle<()>);

impl Drop for Reaper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The stores a URL can name, by scheme.
#[derive(Clone, Copy)]
enum Kind {
    Memory,
    Redis,
    Postgres,
    Sqlite,
}

impl Kind {
    fn of(url: &str) -> Option<Kind> {
        if url == "memory" {
            Some(Kind::Memory)
        } else if url.starts_with("redis://") || url.starts_with("rediss://") {
            Some(Kind::Redis)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Kind::Postgres)
        } else if url.starts_with("sqlite://") {
            Some(Kind::Sqlite)
        } else {
            None
        }
    }

    fn built(self) -> bool {
        match self {
            Kind::Memory => cfg!(feature = "memory"),
            Kind::Redis => cfg!(feature = "redis"),
            Kind::Postgres => cfg!(feature = "postgres"),
            Kind::Sqlite => cfg!(feature = "sqlite"),
        }
    }

    /// The store's name and the feature that brings it.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Kind::Memory => ("the memory store", "memory"),
            Kind::Redis => ("Redis", "redis"),
            Kind::Postgres => ("PostgreSQL", "postgres"),
            Kind::Sqlite => ("SQLite", "sqlite"),
        }
    }
}

impl AnyStore {
    /// Configures a store on `url` (see the table above).
    pub fn builder(url: impl Into<String>) -> AnyStoreBuilder {
        AnyStoreBuilder {
            url: url.into(),
            variable: None,
            replicas: 0,
            migrate: true,
            reaper: Some(REAP_EVERY),
            cache: None,
        }
    }

    /// Connects to the store `url` names, with the defaults above:
    /// `AnyStore::builder(url).connect()`.
    pub async fn connect(url: &str) -> Result<AnyStore, AnyStoreError> {
        AnyStore::builder(url).connect().await
    }

    /// Connects to the store `IDEMPOTENCY_STORE` names (default `memory`), on Redis with
    /// `IDEMPOTENCY_REDIS_REPLICAS` replicas (default 0): `AnyStoreBuilder::from_env()?.connect()`.
    pub async fn from_env() -> Result<AnyStore, AnyStoreError> {
        AnyStoreBuilder::from_env()?.connect().await
    }

    /// Whether `url` names a store this build has (its scheme is known and its feature on).
    pub fn supports(url: &str) -> bool {
        Kind::of(url).is_some_and(Kind::built)
    }

    /// The memory store, if `memory` chose it.
    #[cfg(feature = "memory")]
    #[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
    pub fn memory(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(store) => Some(store),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The Redis store, if a `redis://` URL chose it.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis(&self) -> Option<&RedisStore> {
        match &self.backend {
            Backend::Redis(store) => Some(store),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The SQLite store, if a `sqlite://` URL chose it.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn sqlite(&self) -> Option<&idempotent_sqlite::SqliteStore> {
        match &self.backend {
            Backend::Sqlite(store) => Some(store),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The PostgreSQL store, if a `postgres://` URL chose it (its pool, say). A runtime on this
    /// `AnyStore` has the transactional mode of a runtime on that store.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn postgres(&self) -> Option<&PostgresStore> {
        match &self.backend {
            Backend::Postgres(store) => Some(store),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The cache tier in front of the store, if one was configured.
    #[cfg(feature = "cache")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
    pub fn cache(&self) -> Option<&idempotent_cache::CacheTier> {
        self.cache.as_ref()
    }
}

/// Configures an [`AnyStore`]. Created by [`AnyStore::builder`] or
/// [`AnyStoreBuilder::from_env`]; each setting applies only to the store it names.
#[derive(Clone)]
#[must_use]
pub struct AnyStoreBuilder {
    url: String,
    /// The environment variable `url` came from, named in errors.
    variable: Option<&'static str>,
    replicas: usize,
    migrate: bool,
    reaper: Option<Duration>,
    /// The cache tier's value (`memory:N`, `redis://…`), and the variable it came from.
    cache: Option<(String, Option<&'static str>)>,
}

impl fmt::Debug for AnyStoreBuilder {
    /// Shows the URL without its password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyStoreBuilder")
            .field("url", &redacted(&self.url))
            .field("replicas", &self.replicas)
            .field("migrate", &self.migrate)
            .field("reaper", &self.reaper)
            .finish()
    }
}

impl AnyStoreBuilder {
    /// A builder on the URL in `IDEMPOTENCY_STORE` (default `memory`), with
    /// [`replicas`](Self::replicas) from `IDEMPOTENCY_REDIS_REPLICAS` (default 0) when the URL
    /// is a Redis one. Fails with [`AnyStoreError::InvalidReplicas`] when that is not a number.
    /// Errors of its [`connect`](Self::connect) name `IDEMPOTENCY_STORE`.
    pub fn from_env() -> Result<Self, AnyStoreError> {
        let url = std::env::var(STORE_VAR).unwrap_or_else(|_| "memory".to_owned());
        // Read only for Redis, so a value meant for it does not stop a service on another store.
        let replicas = match std::env::var(REPLICAS_VAR) {
            Ok(value) if matches!(Kind::of(&url), Some(Kind::Redis)) => value
                .parse()
                .map_err(|_| AnyStoreError::InvalidReplicas { value })?,
            _ => 0,
        };
        let mut builder = AnyStore::builder(url).replicas(replicas);
        builder.variable = Some(STORE_VAR);
        if let Ok(cache) = std::env::var(CACHE_VAR)
            && !cache.is_empty()
        {
            builder.cache = Some((cache, Some(CACHE_VAR)));
        }
        Ok(builder)
    }

    /// On Redis, the replicas that must acknowledge every claim and record
    /// (`RedisStoreBuilder::replicas`, which says what it costs); default 0.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// On PostgreSQL and SQLite, whether [`connect`](Self::connect) creates the tables if they
    /// do not exist; default `true`.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// A cache tier in front of the store: `memory:N` (in this process, `N` finished records)
    /// or a Redis URL (see [`AnyStore`]); checked and connected by
    /// [`connect`](Self::connect). Needs the feature `cache` (and `redis` for a Redis tier).
    pub fn cache(mut self, tier: impl Into<String>) -> Self {
        self.cache = Some((tier.into(), None));
        self
    }

    /// On PostgreSQL and SQLite, how often expired rows are reaped while the store lives;
    /// `None`: never (another process reaps). Default every minute.
    pub fn reaper(mut self, every: Option<Duration>) -> Self {
        self.reaper = every;
        self
    }

    /// Connects to the store the URL names, and on PostgreSQL and SQLite creates the tables and
    /// starts the reaper (see [`AnyStore`]). Requires a tokio runtime.
    pub async fn connect(self) -> Result<AnyStore, AnyStoreError> {
        let Some(kind) = Kind::of(&self.url) else {
            return Err(AnyStoreError::Unsupported {
                url: redacted(&self.url),
                variable: self.variable,
            });
        };
        if !kind.built() {
            let (store, feature) = kind.names();
            return Err(AnyStoreError::FeatureDisabled {
                store,
                feature,
                variable: self.variable,
            });
        }
        let (backend, reaper) = match kind {
            #[cfg(feature = "memory")]
            Kind::Memory => (Backend::Memory(MemoryStore::new()), None),
            #[cfg(feature = "redis")]
            Kind::Redis => {
                let store = RedisStore::builder(self.url.as_str())
                    .replicas(self.replicas)
                    .connect()
                    .await
                    .map_err(|source| AnyStoreError::ConnectRedis {
                        url: redacted(&self.url),
                        source,
                    })?;
                (Backend::Redis(store), None)
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres => {
                let store = PostgresStore::connect(&self.url).await.map_err(|source| {
                    AnyStoreError::ConnectPostgres {
                        variable: self.variable,
                        source,
                    }
                })?;
                if self.migrate {
                    store
                        .migrate()
                        .await
                        .map_err(|source| AnyStoreError::Migrate { source })?;
                }
                let reaper = self
                    .reaper
                    .map(|every| Arc::new(Reaper(store.spawn_reaper(every))));
                (Backend::Postgres(store), reaper)
            }
            #[cfg(feature = "sqlite")]
            Kind::Sqlite => {
                let path = self.url.strip_prefix("sqlite://").unwrap_or_default();
                if path.is_empty() {
                    return Err(AnyStoreError::Unsupported {
                        url: self.url.clone(),
                        variable: self.variable,
                    });
                }
                // The store reaps its own expired rows, on a task that ends with it.
                let store = idempotent_sqlite::SqliteStore::builder(std::path::Path::new(path))
                    .migrate(self.migrate)
                    .reap_every(self.reaper)
                    .build()
                    .await
                    .map_err(|source| AnyStoreError::OpenSqlite {
                        path: path.to_owned(),
                        source,
                    })?;
                (Backend::Sqlite(store), None)
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("a store this build has not is refused above"),
        };
        // Settings of the stores this build has not are unused.
        let _ = (self.replicas, self.migrate, self.reaper);
        #[cfg(feature = "cache")]
        let cache = match &self.cache {
            Some((value, variable)) => Some(tier::named(value, *variable, &self.url).await?),
            None => None,
        };
        #[cfg(not(feature = "cache"))]
        if let Some((_, variable)) = self.cache {
            return Err(AnyStoreError::FeatureDisabled {
                store: "a cache tier",
                feature: "cache",
                variable,
            });
        }
        Ok(AnyStore {
            backend,
            #[cfg(feature = "cache")]
            cache,
            _reaper: reaper,
        })
    }
}

/// The tier `value` names (`memory:N`, a Redis URL), as `IDEMPOTENCY_CACHE` holds it, in front
/// of the store `store` names: see [`connect`](tier::connect).
#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub mod tier {
    use super::{AnyStoreError, CACHE_VAR, Kind, redacted};
    use idempotent_cache::CacheTier;

    /// The tier `value` names, in front of the store `store` names (its URL): `memory:N` (in
    /// this process, at most `N` finished records and
    /// [`DEFAULT_MEMORY_BYTES`](idempotent_cache::DEFAULT_MEMORY_BYTES) of them) or a Redis URL
    /// (one server, or a Redis Cluster's nodes comma-separated; with the defaults of
    /// `RedisCacheBuilder`): what `IDEMPOTENCY_CACHE` holds. A Redis URL needs the feature
    /// `redis`.
    ///
    /// A Redis tier's keys carry a digest of `store` (its password left out), so stores that
    /// share one Redis tier never answer for each other. A Redis tier in front of the memory
    /// store is refused ([`AnyStoreError::RedisCacheOnMemory`]): it would outlive the records
    /// it stands for.
    pub async fn connect(value: &str, store: &str) -> Result<CacheTier, AnyStoreError> {
        named(value, None, store).await
    }

    /// The tier `IDEMPOTENCY_CACHE` names in front of the store `store` names (see
    /// [`connect`]), or `None` when it is unset or empty. Errors name the
    /// variable.
    pub async fn from_env(store: &str) -> Result<Option<CacheTier>, AnyStoreError> {
        match std::env::var(CACHE_VAR) {
            Ok(value) if !value.is_empty() => named(&value, Some(CACHE_VAR), store).await.map(Some),
            _ => Ok(None),
        }
    }

    pub(crate) async fn named(
        value: &str,
        variable: Option<&'static str>,
        store: &str,
    ) -> Result<CacheTier, AnyStoreError> {
        #[cfg(not(feature = "redis"))]
        let _ = store;
        let invalid = || AnyStoreError::InvalidCache {
            value: redacted(value),
            variable,
        };
        if let Some(entries) = value.strip_prefix("memory:") {
            let entries: u64 = entries.parse().map_err(|_| invalid())?;
            if entries == 0 {
                return Err(invalid());
            }
            return Ok(CacheTier::memory(entries));
        }
        match Kind::of(value) {
            #[cfg(feature = "redis")]
            Some(Kind::Redis) => {
                if matches!(Kind::of(store), Some(Kind::Memory)) {
                    return Err(AnyStoreError::RedisCacheOnMemory { variable });
                }
                if matches!(Kind::of(store), Some(Kind::Sqlite)) {
                    return Err(AnyStoreError::RedisCacheOnSqlite { variable });
                }
                let digest = blake3::hash(redacted(store).as_bytes()).to_hex();
                // Connecting does not wait for Redis: it fails only on a malformed URL.
                idempotent_redis::RedisCacheBuilder::new(value)
                    .key_prefix(format!(
                        "{}{}:",
                        idempotent_redis::DEFAULT_CACHE_PREFIX,
                        &digest[..16]
                    ))
                    .connect()
                    .await
                    .map_err(|_| invalid())
            }
            #[cfg(not(feature = "redis"))]
            Some(Kind::Redis) => Err(AnyStoreError::FeatureDisabled {
                store: "a Redis cache tier",
                feature: "redis",
                variable,
            }),
            _ => Err(invalid()),
        }
    }
}

/// Why an [`AnyStore`] could not be made. No message holds a password (see [`AnyStore`]);
/// [`source`](std::error::Error::source) gives the store's own error where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnyStoreError {
    /// The URL names no store of the library.
    #[error(
        "{} is not supported; use `memory`, `redis://HOST:PORT[/DB]` (comma-separated URLs \
         for a Redis Cluster), `postgres://USER@HOST:PORT/DB` or `sqlite://PATH`",
        Named(*.variable, url)
    )]
    Unsupported {
        /// The URL, its password replaced by `***`.
        url: String,
        /// The environment variable it came from, if any.
        variable: Option<&'static str>,
    },

    /// The URL names a store this build leaves out.
    #[error(
        "{} names {store}, but this build of idempotent-any has no `{feature}` feature",
        Origin(*.variable)
    )]
    FeatureDisabled {
        /// The store: `the memory store`, `Redis`, `PostgreSQL` or `SQLite`.
        store: &'static str,
        /// The feature of `idempotent-any` that brings it.
        feature: &'static str,
        /// The environment variable the URL came from, if any.
        variable: Option<&'static str>,
    },

    /// `IDEMPOTENCY_REDIS_REPLICAS` is not a number.
    #[error("IDEMPOTENCY_REDIS_REPLICAS={value:?} is not a number of replicas")]
    InvalidReplicas {
        /// The variable's value.
        value: String,
    },

    /// The cache tier's value is neither `memory:N` (`N` ≥ 1) nor a well-formed Redis URL.
    #[error(
        "{} is not a cache tier; use `memory:N` (N finished records in this process) or \
         a well-formed `redis://HOST:PORT[/DB]`",
        Named(*.variable, value)
    )]
    InvalidCache {
        /// The value, its password replaced by `***`.
        value: String,
        /// The environment variable it came from, if any.
        variable: Option<&'static str>,
    },

    /// A Redis cache tier was asked for in front of the memory store, whose records live and
    /// die with the process: the tier would go on answering for records the store forgot.
    #[error(
        "{}: a Redis cache tier in front of the memory store would outlive its records; use \
         `memory:N`, or a Redis or PostgreSQL store",
        Origin(*.variable)
    )]
    RedisCacheOnMemory {
        /// The environment variable the tier came from, if any.
        variable: Option<&'static str>,
    },

    /// A Redis cache tier was asked for in front of a SQLite store: the store is one host's
    /// file, named by a path that another host (or another working directory, or a file made
    /// again) would name the same, so a shared tier could answer for records the file does not
    /// hold. An in-process tier (`memory:N`) serves one host as well.
    #[error(
        "{}: a Redis cache tier in front of a SQLite store could answer for another file's \
         records; use `memory:N`",
        Origin(*.variable)
    )]
    RedisCacheOnSqlite {
        /// The environment variable the tier came from, if any.
        variable: Option<&'static str>,
    },

    /// Redis could not be reached, or the URL is malformed.
    #[error("cannot connect to Redis at {url}")]
    ConnectRedis {
        /// The URL, its password replaced by `***`.
        url: String,
        /// What the store reported.
        source: StoreError,
    },

    /// PostgreSQL could not be reached, or the URL is malformed. The URL is not shown.
    #[error("cannot connect to PostgreSQL ({})", Origin(*.variable))]
    ConnectPostgres {
        /// The environment variable the URL came from, if any.
        variable: Option<&'static str>,
        /// What the store reported.
        source: StoreError,
    },

    /// The SQLite database could not be opened or created at `path` (a missing directory, a
    /// file that is not a database, no permission), or its tables could not be created.
    #[error("cannot open the SQLite database {path:?}")]
    OpenSqlite {
        /// The database file's path.
        path: String,
        /// What the store reported.
        source: StoreError,
    },

    /// The PostgreSQL table could not be created (see [`AnyStoreBuilder::migrate`]).
    #[error("cannot create the idempotency table in PostgreSQL")]
    Migrate {
        /// What the store reported.
        source: StoreError,
    },
}

/// Where a URL came from, in a message: its variable, or "the store URL".
struct Origin(Option<&'static str>);

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.unwrap_or("the store URL"))
    }
}

/// A (redacted) URL with where it came from: `VAR="url"` or `the store URL "url"`.
struct Named<'a>(Option<&'static str>, &'a str);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(variable) => write!(f, "{variable}={:?}", self.1),
            None => write!(f, "the store URL {:?}", self.1),
        }
    }
}

/// `url` (or several, comma-separated) with every password replaced by `***`: the one in
/// each URL's user information (`scheme://user:PASSWORD@host`) and the value of any query
/// parameter whose name ends in `password`.
fn redacted(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    while let Some(start) = rest.find("://") {
        let (head, after) = rest.split_at(start + 3);
        out.push_str(head);
        // The user information ends at the last `@` before the path, query or fragment; a
        // password may hold `,` or `@` unescaped, so neither ends it.
        let authority_end = after.find(['/', '?', '#']).unwrap_or(after.len());
        rest = match after[..authority_end].rfind('@') {
            Some(at) => {
                let user_info = &after[..at];
                match user_info.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str(user_info),
                }
                &after[at..]
            }
            None => after,
        };
    }
    out.push_str(rest);
    redact_query_passwords(&out)
}

/// `url` with the value of every query parameter whose name ends in `password` replaced.
fn redact_query_passwords(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    while let Some(at) = rest.find(['?', '&']) {
        let (head, parameter) = rest.split_at(at + 1);
        out.push_str(head);
        let end = parameter.find(['&', '#', ',']).unwrap_or(parameter.len());
        match parameter[..end].split_once('=') {
            Some((name, _)) if name.to_ascii_lowercase().ends_with("password") => {
                out.push_str(name);
                out.push_str("=***");
            }
            _ => out.push_str(&parameter[..end]),
        }
        rest = &parameter[end..];
    }
    out.push_str(rest);
    out
}

/// Runs `$body` with `$store` bound to whichever store `$self` holds.
macro_rules! each {
    ($self:ident, |$store:ident| $body:expr) => {
        match $self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(ref $store) => $body,
            #[cfg(feature = "redis")]
            Backend::Redis(ref $store) => $body,
            #[cfg(feature = "postgres")]
            Backend::Postgres(ref $store) => $body,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(ref $store) => $body,
        }
    };
}

impl Store for AnyStore {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        #[cfg(feature = "cache")]
        if let Some(tier) = &self.cache {
            return each!(self, |store| tier
                .claim_through(store, key, fingerprint, lease, ttl)
                .await);
        }
        each!(self, |store| store
            .claim(key, fingerprint, lease, ttl)
            .await)
    }

    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        #[cfg(feature = "cache")]
        if let Some(tier) = &self.cache {
            return each!(self, |store| tier
                .claim_labelled_through(store, key, fingerprint, terms, label)
                .await);
        }
        each!(self, |store| store
            .claim_labelled(key, fingerprint, terms, label)
            .await)
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        each!(self, |store| store.complete(key, token, payload, ttl).await)
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        each!(self, |store| store.release(key, token).await)
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        each!(self, |store| store.renew(key, token, lease).await)
    }

    /// The chosen store's name (`memory`, `redis`, `postgres`), so its metrics are labelled
    /// as if it were used directly.
    fn name(&self) -> &'static str {
        each!(self, |store| store.name())
    }

    fn keeps_records_in_process(&self) -> bool {
        each!(self, |store| store.keeps_records_in_process())
    }

    /// The chosen store's (the memory store answers it, the others do not), unless a cache
    /// tier is in front: claims then go through the tier, and so does every replay.
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        #[cfg(feature = "cache")]
        if self.cache.is_some() {
            return None;
        }
        each!(self, |store| store.completed_in_process(key))
    }

    /// The chosen store's, so that an atomic step finds its claim's records.
    fn location(&self) -> Option<String> {
        each!(self, |store| store.location())
    }

    async fn wait_for_change(&self, key: &StorageKey, max_wait: Duration) {
        each!(self, |store| store.wait_for_change(key, max_wait).await)
    }
}

impl SessionStore for AnyStore {
    async fn open_session(
        &self,
        session: &idempotent_core::SessionKey,
        request: idempotent_core::SessionRequest,
    ) -> Result<idempotent_core::SessionGate, StoreError> {
        each!(self, |store| store.open_session(session, request).await)
    }

    async fn session_mark(
        &self,
        session: &idempotent_core::SessionKey,
    ) -> Result<Option<idempotent_core::SessionMark>, StoreError> {
        each!(self, |store| store.session_mark(session).await)
    }

    /// The chosen store's: its gate and claim in one step where it makes them so.
    async fn claim_in_session(
        &self,
        session: &idempotent_core::SessionKey,
        request: idempotent_core::SessionRequest,
        fingerprint: &idempotent_core::Fingerprint,
        lease: Duration,
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<idempotent_core::SessionClaim, StoreError> {
        each!(self, |store| store
            .claim_in_session(session, request, fingerprint, lease, label)
            .await)
    }
}

impl CheckpointStore for AnyStore {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &idempotent_core::Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<idempotent_core::Claim>, StoreError> {
        each!(self, |store| store
            .resume(key, fingerprint, lease, ttl)
            .await)
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: idempotent_core::FencingToken,
        entry: bytes::Bytes,
    ) -> Result<(), StoreError> {
        each!(self, |store| store.save_step(key, token, entry).await)
    }

    async fn load_steps(
        &self,
        key: &StorageKey,
        token: idempotent_core::FencingToken,
    ) -> Result<bytes::Bytes, StoreError> {
        each!(self, |store| store.load_steps(key, token).await)
    }

    async fn save_request(
        &self,
        key: &StorageKey,
        token: idempotent_core::FencingToken,
        request: bytes::Bytes,
    ) -> Result<(), StoreError> {
        each!(self, |store| store.save_request(key, token, request).await)
    }

    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&idempotent_core::RequestOwner>,
    ) -> Result<Vec<idempotent_core::steps::Abandoned>, StoreError> {
        each!(self, |store| store.abandoned(idle, limit, owner).await)
    }
}

/// The chosen store's. A repair changes the store, not a cache tier in front (see
/// `idempotent-cache`'s `Cached`): a tier's copy of a completed record is replayed until it
/// expires.
impl idempotent_core::inspect::InspectStore for AnyStore {
    async fn inspect(
        &self,
        key: &StorageKey,
    ) -> Result<Option<idempotent_core::inspect::RecordInfo>, StoreError> {
        each!(self, |store| store.inspect(key).await)
    }

    async fn list(
        &self,
        query: &idempotent_core::inspect::ListQuery,
    ) -> Result<idempotent_core::inspect::Page, StoreError> {
        each!(self, |store| store.list(query).await)
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &idempotent_core::inspect::Repair,
        force: bool,
    ) -> Result<idempotent_core::inspect::Repaired, StoreError> {
        each!(self, |store| store.repair(key, token, repair, force).await)
    }

    async fn session_state(
        &self,
        session: &idempotent_core::SessionKey,
    ) -> Result<Option<idempotent_core::session::SessionState>, StoreError> {
        each!(self, |store| store.session_state(session).await)
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_redacted_and_the_rest_kept() {
        for (url, expected) in [
            ("memory", "memory"),
            ("redis://127.0.0.1:6379/2", "redis://127.0.0.1:6379/2"),
            ("redis://:hunter2@h:1", "redis://:***@h:1"),
            ("redis://app@h:1", "redis://app@h:1"),
            (
                "postgres://app:hunter2@db:5432/app?sslmode=disable",
                "postgres://app:***@db:5432/app?sslmode=disable",
            ),
            ("postgres://app:p@ss,w@db/app", "postgres://app:***@db/app"),
            (
                "redis://u:a@h1:1,redis://h2:2,redis://:b@h3:3",
                "redis://u:***@h1:1,redis://h2:2,redis://:***@h3:3",
            ),
            (
                "postgres://db/app?user=app&password=hunter2&sslmode=require",
                "postgres://db/app?user=app&password=***&sslmode=require",
            ),
            (
                "postgres://db/app?sslPassword=hunter2",
                "postgres://db/app?sslPassword=***",
            ),
            ("mongodb://root:hunter2@x", "mongodb://root:***@x"),
        ] {
            assert_eq!(redacted(url), expected, "{url}");
        }
    }
}
