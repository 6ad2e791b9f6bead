//! The prefilled rows: the `idempotent-tower` rows again with a million or ten million records
//! already in the store, to show that throughput does not fall as the store grows.
//!
//! Every prefilled record is a completed `201` response of the payments handler, stored under
//! the key `prefill-<i>` in a namespace of its own ([`NAMESPACE`]), with the anonymous scope the
//! rows use. How it gets there depends on the store:
//!
//! - **memory**: through the real `IdempotencyLayer` (the memory mode's path), into the row's
//!   own store, before each round of the row: a memory store lives as long as its row.
//! - **Redis and PostgreSQL**: one record goes through the layer; the others are copies of its
//!   stored fields (state, fingerprint, token, payload) under their own storage keys, written
//!   in bulk: Redis hashes through pipelines, PostgreSQL rows through `INSERT ... SELECT FROM
//!   unnest(...)` batches. The shared stores keep them for the rest of the run, so a larger
//!   count only adds the difference. A prefilled key is then replayed through the layer to
//!   check the copies are records the store reads back.
//!
//! On PostgreSQL, 100,000 rows of each fill expire during the rows after it (spread over ten
//! minutes), so the reaper, which every PostgreSQL row runs, deletes rows while the rows are
//! measured. A fill ends with what the store would otherwise do in the background during the
//! first rows: PostgreSQL's `VACUUM (ANALYZE)` and `CHECKPOINT`, and Redis's rewrite of its
//! append-only file (`BGREWRITEAOF`, waited for).

use std::time::Instant;

use http::StatusCode;
use http_body_util::BodyExt;
use idempotent_core::{CheckpointStore, Idempotency, Key, Scope, SessionStore, StorageKey};
use idempotent_postgres::DEFAULT_TABLE;
use idempotent_redis::RedisStore;
use idempotent_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::cli::Backends;
use crate::fixture::{payment_request, response_body, stand_in};
use crate::report::FillRecord;

/// The namespace of every prefilled record: apart from the rows' own namespaces.
pub(crate) const NAMESPACE: &str = "idempotent-bench-prefill";
/// Records written per Redis pipeline or PostgreSQL statement.
const BATCH: u64 = 5_000;
/// PostgreSQL rows of each fill that expire during the rows after it, whatever the count: the
/// reaper then deletes at the same rate (about 170 rows a second) with 1M or 10M records, as
/// in a steady state where records expire as fast as new ones come.
const EXPIRING_PER_FILL: u64 = 100_000;
/// Over how many seconds the expiring rows' expiries are spread.
const EXPIRY_SPREAD_SECONDS: u64 = 600;
/// The TTL of the other prefilled records: the layer's default.
const TTL_MS: u64 = 24 * 3600 * 1000;

fn prefill_key(i: u64) -> String {
    format!("prefill-{i}")
}

/// Sends `prefill-<i>` for every `i` in `range` through the layer on `idempotency` and checks
/// each answer: `201` when `fresh`, otherwise a replay.
async fn through_layer(
    idempotency: Idempotency,
    range: std::ops::Range<u64>,
    fresh: bool,
) -> Result<(), String> {
    let service = IdempotencyLayer::http(idempotency)
        .allow_anonymous(true)
        .layer(stand_in());
    for i in range {
        let Ok(response) = service
            .clone()
            .oneshot(payment_request(prefill_key(i)))
            .await;
        let replayed = response.headers().contains_key("idempotent-replayed");
        if response.status() != StatusCode::CREATED || replayed == fresh {
            return Err(format!(
                "prefill key {i}: the layer answered {} ({}a replay)",
                response.status(),
                if replayed { "" } else { "not " }
            ));
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("prefill key {i}: body: {e}"))?
            .to_bytes();
        if body != response_body() {
            return Err(format!("prefill key {i}: not the handler's body"));
        }
    }
    Ok(())
}

/// Fills the memory store of a row (behind `idempotency`'s store, in [`NAMESPACE`]) with
/// `records` records through the layer.
pub(crate) async fn fill_memory(
    store: idempotent_core::memory::MemoryStore,
    records: u64,
) -> Result<(), String> {
    let started = Instant::now();
    through_layer(prefill_runtime(store), 0..records, true).await?;
    eprintln!(
        "prefill: {records} records through the layer into the memory store in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn prefill_runtime(store: impl SessionStore + CheckpointStore) -> Idempotency {
    Idempotency::builder(store).namespace(NAMESPACE).build()
}

/// The storage key of prefilled record `i`.
fn storage_key(i: u64) -> StorageKey {
    let key = Key::new(prefill_key(i)).expect("prefill keys are valid");
    StorageKey::derive(NAMESPACE.as_bytes(), &Scope::new(), &key)
}

/// The prefilled records of the shared stores, kept across the run.
pub(crate) struct Shared {
    backends: Backends,
    redis: u64,
    postgres: u64,
}

impl Shared {
    pub(crate) fn new(backends: &Backends) -> Shared {
        Shared {
            backends: backends.clone(),
            redis: 0,
            postgres: 0,
        }
    }

    /// Tops the Redis store up to `records` prefilled records.
    pub(crate) async fn redis(&mut self, records: u64) -> Result<FillRecord, String> {
        let url = self.backends.redis_url.as_deref().ok_or("no Redis URL")?;
        let store = RedisStore::connect(url)
            .await
            .map_err(|e| format!("Redis: {e}"))?;
        let client = redis::Client::open(url).map_err(|e| format!("Redis: {e}"))?;
        // No response timeout: a pipeline of thousands of writes may wait behind Redis's own
        // work (a rewrite of its append-only file forks a copy of gigabytes).
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        let mut connection = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| format!("Redis: {e}"))?;
        let started = Instant::now();
        if self.redis < records {
            // The template: record `self.redis`, through the layer; copies after it.
            through_layer(
                prefill_runtime(store.clone()),
                self.redis..self.redis + 1,
                true,
            )
            .await?;
            let template: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL")
                .arg(store.redis_key(&storage_key(self.redis)))
                .query_async(&mut connection)
                .await
                .map_err(|e| format!("Redis HGETALL: {e}"))?;
            if template.is_empty() {
                return Err("Redis: the template record is not where the store keeps it".into());
            }
            let mut next = self.redis + 1;
            let mut pending = tokio::task::JoinSet::new();
            while next < records {
                let end = (next + BATCH).min(records);
                let mut pipe = redis::pipe();
                for i in next..end {
                    let key = store.redis_key(&storage_key(i));
                    pipe.cmd("HSET").arg(&key);
                    for (field, value) in &template {
                        pipe.arg(field).arg(value.as_slice());
                    }
                    pipe.ignore();
                    pipe.cmd("PEXPIRE").arg(&key).arg(TTL_MS).ignore();
                }
                let mut connection = connection.clone();
                pending.spawn(async move { pipe.exec_async(&mut connection).await });
                while pending.len() >= 4 {
                    join_one(&mut pending).await?;
                }
                next = end;
            }
            while !pending.is_empty() {
                join_one(&mut pending).await?;
            }
            through_layer(prefill_runtime(store), records - 1..records, false).await?;
            self.redis = records;
            // The fill grows the append-only file enough for Redis to rewrite it, in a child
            // process that would share the CPUs with the rows: rewrite now and wait. Redis may
            // have started a rewrite of its own during the fill, and refuses a second one
            // meanwhile: wait for it first.
            crate::background::rewrite(&mut connection).await?;
        }
        let fill_seconds = started.elapsed().as_secs_f64();
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut connection)
            .await
            .map_err(|e| format!("Redis INFO: {e}"))?;
        let entries: u64 = redis::cmd("DBSIZE")
            .query_async(&mut connection)
            .await
            .map_err(|e| format!("Redis DBSIZE: {e}"))?;
        Ok(FillRecord {
            store: "redis".into(),
            records,
            fill_seconds,
            store_bytes: crate::background::info_field(&info, "used_memory").unwrap_or(0),
            index_bytes: None,
            entries,
        })
    }

    /// Tops the PostgreSQL table up to `records` prefilled rows.
    pub(crate) async fn postgres(&mut self, records: u64) -> Result<FillRecord, String> {
        let url = self
            .backends
            .postgres_url
            .as_deref()
            .ok_or("no PostgreSQL URL")?;
        let store = crate::app::migrated_postgres(url).await?;
        let pool = store.pool().clone();
        let table = format!("\"{DEFAULT_TABLE}\"");
        let sequence = format!("\"{DEFAULT_TABLE}_token_seq\"");
        let started = Instant::now();
        if self.postgres < records {
            through_layer(
                prefill_runtime(store.clone()),
                self.postgres..self.postgres + 1,
                true,
            )
            .await?;
            let (fingerprint, payload): (Vec<u8>, Vec<u8>) = sqlx::query_as(&format!(
                "SELECT fingerprint, payload FROM {table} WHERE storage_key = $1"
            ))
            .bind(storage_key(self.postgres).as_bytes().as_slice())
            .fetch_one(&pool)
            .await
            .map_err(|e| format!("PostgreSQL: the template record: {e}"))?;
            let insert = format!(
                "INSERT INTO {table} (storage_key, state, fingerprint, token, payload, expires_at) \
                 SELECT k, 'completed', $2, nextval('{sequence}'), $3, \
                 CASE WHEN n < $5 \
                 THEN clock_timestamp() + (n % {EXPIRY_SPREAD_SECONDS}) * interval '1 second' \
                 ELSE clock_timestamp() + interval '24 hours' END \
                 FROM unnest($1::bytea[], $4::int8[]) AS u(k, n) \
                 ON CONFLICT (storage_key) DO NOTHING"
            );
            let mut next = self.postgres + 1;
            let expiring_end = (next + EXPIRING_PER_FILL) as i64;
            while next < records {
                let end = (next + BATCH).min(records);
                let keys: Vec<Vec<u8>> = (next..end)
                    .map(|i| storage_key(i).as_bytes().to_vec())
                    .collect();
                let numbers: Vec<i64> = (next..end).map(|i| i as i64).collect();
                sqlx::query(&insert)
                    .bind(keys)
                    .bind(fingerprint.as_slice())
                    .bind(payload.as_slice())
                    .bind(numbers)
                    .bind(expiring_end)
                    .execute(&pool)
                    .await
                    .map_err(|e| format!("PostgreSQL: prefill insert: {e}"))?;
                next = end;
            }
            // What autovacuum and the checkpointer would otherwise do during the rows.
            for statement in [format!("VACUUM (ANALYZE) {table}"), "CHECKPOINT".to_owned()] {
                sqlx::query(&statement)
                    .execute(&pool)
                    .await
                    .map_err(|e| format!("PostgreSQL: {statement}: {e}"))?;
            }
            // The last record of a fill larger than its expiring share is live for a day.
            if records - self.postgres > EXPIRING_PER_FILL + 1 {
                through_layer(prefill_runtime(store), records - 1..records, false).await?;
            }
            self.postgres = records;
        }
        let fill_seconds = started.elapsed().as_secs_f64();
        let (store_bytes, index_bytes, entries): (i64, i64, i64) = sqlx::query_as(&format!(
            "SELECT pg_total_relation_size('{table}'), pg_indexes_size('{table}'), \
             (SELECT count(*) FROM {table})"
        ))
        .fetch_one(&pool)
        .await
        .map_err(|e| format!("PostgreSQL: sizes: {e}"))?;
        Ok(FillRecord {
            store: "postgres".into(),
            records,
            fill_seconds,
            store_bytes: store_bytes.max(0) as u64,
            index_bytes: Some(index_bytes.max(0) as u64),
            entries: entries.max(0) as u64,
        })
    }
}

async fn join_one(
    pending: &mut tokio::task::JoinSet<redis::RedisResult<()>>,
) -> Result<(), String> {
    match pending.join_next().await {
        Some(Ok(Ok(()))) | None => Ok(()),
        Some(Ok(Err(e))) => Err(format!("Redis prefill pipeline: {e}")),
        Some(Err(e)) => Err(format!("Redis prefill task: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_keys_are_distinct_storage_keys() {
        assert_ne!(storage_key(0), storage_key(1));
        assert_eq!(storage_key(7), storage_key(7));
    }

    /// The memory fill puts exactly the records asked for, each replayed afterwards.
    #[test]
    fn memory_fill_records_replay() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = idempotent_core::memory::MemoryStore::new();
            fill_memory(store.clone(), 50).await.unwrap();
            assert_eq!(store.stats().records, 50);
            through_layer(prefill_runtime(store), 0..50, false)
                .await
                .unwrap();
        });
    }
}
