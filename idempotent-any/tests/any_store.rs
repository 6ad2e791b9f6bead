//! `AnyStore` against real servers (started by `scripts/test.sh`): `memory`, Redis, a Redis
//! Cluster, PostgreSQL and SQLite chosen by URL and by `IDEMPOTENCY_STORE`, each serving calls; the
//! PostgreSQL table and reaper it sets up; unsupported and (in a build without them)
//! feature-disabled schemes; and passwords, which no error shows.

use std::process::Command;

use idempotent_any::{AnyStore, AnyStoreError};
use idempotent_core::{Call, Idempotency, Store};
use idempotent_test_kit::names::unique;

/// A password that must never appear in an error.
const SECRET: &str = "s3cr3t-pw";

/// `error` and its sources, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Runs one call twice on `store`: the first runs, the second replays.
async fn serves_calls(store: AnyStore) {
    let idempotency = Idempotency::builder(store)
        .namespace(unique("any-store"))
        .build();
    let call = Call::new(unique("key").parse().unwrap());
    let first = idempotency.run(&call, async { 1u32 }).await.unwrap();
    let retry = idempotency.run(&call, async { 2u32 }).await.unwrap();
    assert!(!first.is_replayed());
    assert!(retry.is_replayed());
    assert_eq!(retry.into_inner(), 1);
}

#[tokio::test]
async fn memory_is_the_memory_store() {
    let store = AnyStore::connect("memory").await.unwrap();
    assert_eq!(store.name(), "memory");
    assert!(store.memory().is_some());
    assert!(store.keeps_records_in_process());
    serves_calls(store).await;
}

#[tokio::test]
async fn an_unsupported_scheme_is_refused_without_its_password() {
    let url = format!("mongodb://root:{SECRET}@127.0.0.1:27017/db");
    assert!(!AnyStore::supports(&url));
    let error = AnyStore::connect(&url).await.unwrap_err();
    assert!(
        matches!(error, AnyStoreError::Unsupported { .. }),
        "{error:?}"
    );
    let text = chain(&error);
    assert!(
        text.starts_with(
            "the store URL \"mongodb://root:***@127.0.0.1:27017/db\" is not supported"
        ),
        "{text}"
    );
    assert!(!text.contains(SECRET), "{text}");
    assert!(!format!("{error:?}").contains(SECRET));
    for url in ["", "Memory", "redis:/x", "http://127.0.0.1"] {
        assert!(
            matches!(
                AnyStore::connect(url).await,
                Err(AnyStoreError::Unsupported { .. })
            ),
            "{url:?}"
        );
    }
}

#[cfg(all(feature = "redis", feature = "postgres", feature = "sqlite"))]
#[test]
fn supports_the_schemes_of_this_build() {
    for url in [
        "memory",
        "redis://h:1",
        "rediss://h:1",
        "redis://h:1,redis://h:2",
        "postgres://u@h/db",
        "postgresql://u@h/db",
        "sqlite:///var/lib/app/idempotency.db",
        "sqlite://idempotency.db",
    ] {
        assert!(AnyStore::supports(url), "{url}");
    }
}

/// A build without `redis` or `postgres` (`cargo test -p idempotent-core --no-default-features
/// --features memory,test-util --test any_store`, a step of `scripts/test.sh`) refuses their
/// URLs, naming the feature.
#[cfg(not(all(feature = "redis", feature = "postgres", feature = "sqlite")))]
#[tokio::test]
async fn a_scheme_whose_feature_is_off_names_the_feature() {
    let mut checked = 0;
    for (url, on, feature) in [
        ("redis://127.0.0.1:1", cfg!(feature = "redis"), "redis"),
        (
            "postgres://u@127.0.0.1:1/db",
            cfg!(feature = "postgres"),
            "postgres",
        ),
        ("sqlite:///tmp/none.db", cfg!(feature = "sqlite"), "sqlite"),
    ] {
        if on {
            continue;
        }
        checked += 1;
        assert!(!AnyStore::supports(url));
        let error = AnyStore::connect(url).await.unwrap_err();
        assert!(
            matches!(error, AnyStoreError::FeatureDisabled { feature: f, .. } if f == feature),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .contains(&format!("no `{feature}` feature")),
            "{error}"
        );
    }
    assert!(checked > 0);
}

#[cfg(feature = "redis")]
mod redis {
    use std::time::Duration;

    use super::*;
    use idempotent_core::StoreError;
    use idempotent_core::conformance::fresh_key;
    use idempotent_core::{Claim, Fingerprint};
    use idempotent_test_kit::backend::{redis_cluster_urls, redis_url};

    #[tokio::test]
    async fn a_redis_url_is_the_redis_store() {
        let Some(url) = redis_url() else {
            return;
        };
        let store = AnyStore::connect(&url).await.unwrap();
        assert_eq!(store.name(), "redis");
        assert!(store.redis().is_some());
        assert!(!store.keeps_records_in_process());
        serves_calls(store).await;
    }

    #[tokio::test]
    async fn comma_separated_urls_are_a_redis_cluster() {
        let Some(urls) = redis_cluster_urls() else {
            return;
        };
        assert!(urls.contains(','), "{urls}");
        // The cluster has a replica per primary: claims acknowledged by one succeed.
        let store = AnyStore::builder(&urls)
            .replicas(1)
            .connect()
            .await
            .unwrap();
        assert_eq!(store.name(), "redis");
        for _ in 0..4 {
            serves_calls(store.clone()).await;
        }
    }

    #[tokio::test]
    async fn replicas_reach_the_redis_store() {
        let Some(url) = redis_url() else {
            return;
        };
        // One server, no replica: a claim that must be acknowledged by one is given back.
        let store = AnyStore::builder(&url).replicas(1).connect().await.unwrap();
        let claim = store
            .claim(
                &fresh_key(),
                &Fingerprint::from_bytes(b"replicas"),
                Duration::from_secs(5),
                Duration::from_secs(5),
            )
            .await;
        assert!(
            matches!(claim, Err(StoreError::Unavailable(_))),
            "{claim:?}"
        );
        let store = AnyStore::connect(&url).await.unwrap();
        let claim = store
            .claim(
                &fresh_key(),
                &Fingerprint::from_bytes(b"replicas"),
                Duration::from_secs(5),
                Duration::from_secs(5),
            )
            .await;
        assert!(matches!(claim, Ok(Claim::Claimed(_))), "{claim:?}");
    }

    #[tokio::test]
    async fn a_redis_error_shows_the_url_without_its_password() {
        let Some(url) = redis_url() else {
            return;
        };
        let host = url.trim_start_matches("redis://");
        // The test server has no password: AUTH with one fails. So does nothing listening.
        for url in [
            format!("redis://:{SECRET}@{host}"),
            format!("redis://app:{SECRET}@127.0.0.1:1"),
        ] {
            let error = AnyStore::connect(&url).await.unwrap_err();
            assert!(
                matches!(error, AnyStoreError::ConnectRedis { .. }),
                "{error:?}"
            );
            let text = chain(&error);
            assert!(
                text.starts_with("cannot connect to Redis at redis://"),
                "{text}"
            );
            assert!(text.contains(":***@"), "{text}");
            assert!(!text.contains(SECRET), "{text}");
            assert!(!format!("{error:?}").contains(SECRET));
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    /// A directory of its own, removed when dropped.
    fn directory() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary directory")
    }

    #[tokio::test]
    async fn a_sqlite_url_creates_the_file_and_serves_calls_across_handles() {
        let dir = directory();
        let path = dir.path().join("records.db");
        let url = format!("sqlite://{}", path.display());
        let store = AnyStore::connect(&url).await.unwrap();
        assert_eq!(store.name(), "sqlite");
        assert!(store.sqlite().is_some());
        assert!(path.exists(), "connect created the database file");
        // A second handle on the same file (another process would do the same) replays what
        // the first recorded.
        let again = AnyStore::connect(&url).await.unwrap();
        let namespace = unique("any-store");
        let call = Call::new(unique("key").parse().unwrap());
        let first = Idempotency::builder(store)
            .namespace(&namespace)
            .build()
            .run(&call, async { 1u32 })
            .await
            .unwrap();
        let retry = Idempotency::builder(again)
            .namespace(&namespace)
            .build()
            .run(&call, async { 2u32 })
            .await
            .unwrap();
        assert!(!first.is_replayed());
        assert!(retry.is_replayed());
        assert_eq!(retry.into_inner(), 1);
    }

    #[tokio::test]
    async fn an_empty_path_or_a_missing_directory_is_refused() {
        let store = AnyStore::connect("sqlite://").await.unwrap_err();
        assert!(
            matches!(store, AnyStoreError::Unsupported { .. }),
            "an empty path is no database: {store:?}"
        );
        let dir = directory();
        let url = format!(
            "sqlite://{}/a/missing/directory/records.db",
            dir.path().display()
        );
        let error = AnyStore::connect(&url).await.unwrap_err();
        assert!(
            matches!(error, AnyStoreError::OpenSqlite { .. }),
            "a missing directory is a clear error: {error:?}"
        );
        assert!(
            chain(&error).contains("cannot open the SQLite database"),
            "{error}"
        );
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::time::Duration;

    use super::*;
    use idempotent_core::Fingerprint;
    use idempotent_core::conformance::fresh_key;
    use idempotent_test_kit::backend::postgres_url;
    use idempotent_test_kit::postgres::Database;
    use sqlx::PgPool;

    /// The records table of a database of the test's own (the test kit's `Database`, dropped
    /// at the end): whether the table exists depends on this test alone.
    trait Records {
        async fn has_table(&self) -> bool;
        async fn add_old_row(&self, store: &impl Store) -> i64;
        async fn age_rows(&self) -> i64;
        async fn rows(&self) -> i64;
        async fn rows_on(&self, pool: &PgPool) -> i64;
    }

    impl Records for Database {
        async fn has_table(&self) -> bool {
            let pool = PgPool::connect(&self.url).await.unwrap();
            let table: Option<String> =
                sqlx::query_scalar("SELECT to_regclass('idempotent_records')::text")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            pool.close().await;
            table.is_some()
        }

        /// Adds a row that expired an hour ago, past any grace; returns the table's rows.
        async fn add_old_row(&self, store: &impl Store) -> i64 {
            store
                .claim(
                    &fresh_key(),
                    &Fingerprint::from_bytes(b"old"),
                    Duration::from_secs(60),
                    Duration::from_secs(60),
                )
                .await
                .unwrap();
            self.age_rows().await
        }

        /// Makes every row an hour old; returns how many there are.
        async fn age_rows(&self) -> i64 {
            let pool = PgPool::connect(&self.url).await.unwrap();
            sqlx::query(
                "UPDATE idempotent_records SET expires_at = now() - interval '1 hour', \
                 kept_until = now() - interval '1 hour'",
            )
            .execute(&pool)
            .await
            .unwrap();
            let rows = self.rows_on(&pool).await;
            pool.close().await;
            rows
        }

        async fn rows(&self) -> i64 {
            let pool = PgPool::connect(&self.url).await.unwrap();
            let rows = self.rows_on(&pool).await;
            pool.close().await;
            rows
        }

        async fn rows_on(&self, pool: &PgPool) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM idempotent_records")
                .fetch_one(pool)
                .await
                .unwrap()
        }
    }

    #[tokio::test]
    async fn a_postgres_url_creates_the_table_and_serves_calls() {
        let Some(database) = Database::create(&unique("any_store")).await else {
            return;
        };
        assert!(!database.has_table().await);
        let store = AnyStore::connect(&database.url).await.unwrap();
        assert_eq!(store.name(), "postgres");
        assert!(store.postgres().is_some());
        assert!(database.has_table().await, "connect migrated");
        serves_calls(store).await;
        let postgresql = database.url.replacen("postgres://", "postgresql://", 1);
        assert_eq!(
            AnyStore::connect(&postgresql).await.unwrap().name(),
            "postgres"
        );
        database.drop_database().await;
    }

    #[tokio::test]
    async fn without_migrate_the_table_is_left_to_the_deployment() {
        let Some(database) = Database::create(&unique("any_store")).await else {
            return;
        };
        let store = AnyStore::builder(&database.url)
            .migrate(false)
            .connect()
            .await
            .unwrap();
        assert!(!database.has_table().await);
        let call = Call::new("k".parse().unwrap());
        let idempotency = Idempotency::new(store);
        assert!(idempotency.run(&call, async { 1u32 }).await.is_err());
        database.drop_database().await;
    }

    #[tokio::test]
    async fn the_reaper_runs_while_the_store_lives_and_stops_with_it() {
        let Some(database) = Database::create(&unique("any_store")).await else {
            return;
        };
        let every = Duration::from_millis(100);
        let store = AnyStore::builder(&database.url)
            .reaper(Some(every))
            .connect()
            .await
            .unwrap();
        let clone = store.clone();
        drop(store);
        assert_eq!(database.add_old_row(&clone).await, 1);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while database.rows().await > 0 {
            assert!(tokio::time::Instant::now() < deadline, "never reaped");
            tokio::time::sleep(every).await;
        }
        // The last clone gone, so is the reaper: an old row stays.
        let witness = AnyStore::builder(&database.url)
            .reaper(None)
            .connect()
            .await
            .unwrap();
        drop(clone);
        assert_eq!(database.add_old_row(&witness).await, 1);
        tokio::time::sleep(every * 10).await;
        assert_eq!(
            database.rows().await,
            1,
            "reaped after the store was dropped"
        );
        drop(witness);
        database.drop_database().await;
    }

    #[tokio::test]
    async fn a_postgres_error_never_shows_the_password() {
        let Some(server) = postgres_url() else {
            return;
        };
        let address = server
            .trim_start_matches("postgres://")
            .split_once('@')
            .map_or(server.as_str(), |(_, address)| address)
            .to_owned();
        for url in [
            // The server answers: no such role.
            format!("postgres://no_such_role:{SECRET}@{address}"),
            // Nothing listens.
            format!("postgres://app:{SECRET}@127.0.0.1:1/app"),
            // Malformed.
            format!("postgresql://app:{SECRET}@127.0.0.1:port/app"),
            format!("postgres://127.0.0.1:1/app?password={SECRET}"),
        ] {
            let error = AnyStore::connect(&url).await.unwrap_err();
            assert!(
                matches!(error, AnyStoreError::ConnectPostgres { .. }),
                "{error:?}"
            );
            let text = chain(&error);
            assert!(
                text.starts_with("cannot connect to PostgreSQL (the store URL): "),
                "{text}"
            );
            assert!(!text.contains(SECRET), "{text}");
            assert!(!format!("{error:?}").contains(SECRET));
        }
    }
}

/// The name of the test that `from_env` cases run in a child process of this binary: the
/// environment is the process's, and changing it in a running test process is unsound.
const CHILD: &str = "from_env_in_a_child";
/// Set for the child, with the outcome printed after it.
const CHILD_VAR: &str = "ANY_STORE_CHILD";
const OUTCOME: &str = "any-store outcome: ";

/// When run as a child: `AnyStore::from_env()`, then one call on it; prints the store's name
/// and whether the call ran, or the error.
#[tokio::test]
async fn from_env_in_a_child() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    let outcome = match AnyStore::from_env().await {
        Ok(store) => {
            let name = store.name();
            let call = Call::new(unique("from-env").parse().unwrap());
            let ran = Idempotency::new(store).run(&call, async {}).await.is_ok();
            format!("{name} ran={ran}")
        }
        Err(error) => format!("error {}", chain(&error)),
    };
    println!("{OUTCOME}{outcome}");
}

/// What the child reports with `env` as its only `IDEMPOTENCY_*` variables.
fn from_env(env: &[(&str, &str)]) -> String {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([CHILD, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .env_remove("IDEMPOTENCY_STORE")
        .env_remove("IDEMPOTENCY_REDIS_REPLICAS")
        .env_remove("IDEMPOTENCY_CACHE");
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    stdout
        .lines()
        .find_map(|line| line.split_once(OUTCOME).map(|(_, outcome)| outcome))
        .unwrap_or_else(|| panic!("no outcome in {stdout}"))
        .to_owned()
}

#[test]
fn from_env_defaults_to_memory_and_names_the_variable() {
    assert_eq!(from_env(&[]), "memory ran=true");
    // Replicas are read for Redis only.
    assert_eq!(
        from_env(&[("IDEMPOTENCY_REDIS_REPLICAS", "lots")]),
        "memory ran=true"
    );
    let outcome = from_env(&[(
        "IDEMPOTENCY_STORE",
        &format!("mongodb://root:{SECRET}@127.0.0.1/db"),
    )]);
    assert!(
        outcome.starts_with(
            "error IDEMPOTENCY_STORE=\"mongodb://root:***@127.0.0.1/db\" is not supported; use"
        ),
        "{outcome}"
    );
    assert!(!outcome.contains(SECRET), "{outcome}");
}

#[cfg(feature = "redis")]
#[test]
fn from_env_reads_the_redis_replicas() {
    let Some(url) = idempotent_test_kit::backend::redis_url() else {
        return;
    };
    assert_eq!(from_env(&[("IDEMPOTENCY_STORE", &url)]), "redis ran=true");
    assert_eq!(
        from_env(&[
            ("IDEMPOTENCY_STORE", &url),
            ("IDEMPOTENCY_REDIS_REPLICAS", "lots")
        ]),
        "error IDEMPOTENCY_REDIS_REPLICAS=\"lots\" is not a number of replicas"
    );
    // One server, no replica: the call cannot be claimed.
    assert_eq!(
        from_env(&[
            ("IDEMPOTENCY_STORE", &url),
            ("IDEMPOTENCY_REDIS_REPLICAS", "1")
        ]),
        "redis ran=false"
    );
}

#[cfg(feature = "postgres")]
#[test]
fn from_env_names_the_variable_not_the_postgres_url() {
    let Some(server) = idempotent_test_kit::backend::postgres_url() else {
        return;
    };
    assert_eq!(
        from_env(&[("IDEMPOTENCY_STORE", &server)]),
        "postgres ran=true"
    );
    let outcome = from_env(&[(
        "IDEMPOTENCY_STORE",
        &format!("postgres://app:{SECRET}@127.0.0.1:1/app"),
    )]);
    assert!(
        outcome.starts_with("error cannot connect to PostgreSQL (IDEMPOTENCY_STORE): "),
        "{outcome}"
    );
    assert!(!outcome.contains(SECRET), "{outcome}");
}

/// A cache tier in front, by the builder and by `IDEMPOTENCY_CACHE`: `memory:N` is an in-process
/// tier that answers replays; a value that is not a tier is refused, naming its variable and
/// never showing a password.
#[cfg(feature = "cache")]
mod cache {
    use super::*;

    #[tokio::test]
    async fn a_tier_in_front_answers_replays() {
        let store = AnyStore::builder("memory")
            .cache("memory:5")
            .connect()
            .await
            .unwrap();
        let tier = store.cache().expect("a tier").clone();
        assert_eq!(tier.name(), "memory");
        serves_calls(store.clone()).await;
        assert_eq!(tier.entries(), Some(1), "the replay filled the tier");
        assert!(AnyStore::connect("memory").await.unwrap().cache().is_none());
    }

    #[tokio::test]
    async fn a_value_that_is_not_a_tier_is_refused() {
        for value in [
            "memory:0".to_owned(),
            "memory:many".to_owned(),
            "lru:5".to_owned(),
        ] {
            let error = AnyStore::builder("memory")
                .cache(value.as_str())
                .connect()
                .await
                .unwrap_err();
            assert!(
                matches!(error, AnyStoreError::InvalidCache { .. }),
                "{value}: {error:?}"
            );
            let text = chain(&error);
            assert!(text.contains("is not a cache tier"), "{text}");
            assert!(!text.contains(SECRET), "{text}");
        }
    }

    /// A malformed Redis tier URL is refused without its password; a Redis tier in front of
    /// the memory store is refused.
    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn a_redis_tier_needs_a_well_formed_url_and_a_shared_store() {
        let malformed = format!("redis://:{SECRET}@127.0.0.1:notaport");
        let error = idempotent_any::tier::connect(&malformed, "postgres://app@db/app")
            .await
            .unwrap_err();
        assert!(
            matches!(error, AnyStoreError::InvalidCache { .. }),
            "{error:?}"
        );
        let text = chain(&error);
        assert!(text.contains("is not a cache tier"), "{text}");
        assert!(!text.contains(SECRET), "{text}");
        let error = AnyStore::builder("memory")
            .cache("redis://127.0.0.1:1")
            .connect()
            .await
            .unwrap_err();
        assert!(
            matches!(error, AnyStoreError::RedisCacheOnMemory { .. }),
            "{error:?}"
        );
        #[cfg(feature = "sqlite")]
        {
            let dir = tempfile::tempdir().unwrap();
            let error = AnyStore::builder(format!("sqlite://{}/r.db", dir.path().display()))
                .cache("redis://127.0.0.1:1")
                .connect()
                .await
                .unwrap_err();
            assert!(
                matches!(error, AnyStoreError::RedisCacheOnSqlite { .. }),
                "{error:?}"
            );
            let memory_tier = AnyStore::builder(format!("sqlite://{}/m.db", dir.path().display()))
                .cache("memory:10")
                .connect()
                .await
                .expect("an in-process tier in front of SQLite");
            assert!(memory_tier.cache().is_some());
        }
        // Nothing listens there: the tier is made all the same, and connects later.
        let tier = idempotent_any::tier::connect("redis://127.0.0.1:1", "postgres://app@db/app")
            .await
            .expect("connecting does not wait for Redis");
        assert_eq!(tier.name(), "redis");
    }

    #[test]
    fn from_env_reads_the_cache_tier() {
        assert_eq!(
            from_env(&[("IDEMPOTENCY_CACHE", "memory:100")]),
            "memory ran=true"
        );
        assert_eq!(from_env(&[("IDEMPOTENCY_CACHE", "")]), "memory ran=true");
        let outcome = from_env(&[("IDEMPOTENCY_CACHE", "memory:x")]);
        assert!(
            outcome.starts_with("error IDEMPOTENCY_CACHE=\"memory:x\" is not a cache tier; use"),
            "{outcome}"
        );
    }
}
