//! The SQL text of the store's table (built once from its validated name), the locked
//! migration every PostgreSQL companion uses, and how durations and tokens are bound.

use std::time::Duration;

use sqlx::Executor as _;
use sqlx::postgres::{PgConnection, PgPool};

use super::error::store_error;
use super::table::{InvalidTableName, TableName};
use bytes::Bytes;
use sqlx::Row as _;
use sqlx::postgres::PgRow;

use super::error::corrupt;
use crate::{Claim, FencingToken, Fingerprint, StorageKey, StoreError, limits};

/// How often a claim is re-run when it lost a race it cannot see (see `claim_on`).
const CLAIM_ATTEMPTS: usize = 8;

/// Durations are bound as microseconds and capped at the longest TTL or lease (365 days), so
/// that `now + duration` is always a valid timestamp and no record outlives the ceilings in
/// [`limits`].
pub(super) const MAX_MICROS: i64 = {
    let max = if limits::MAX_TTL.as_micros() > limits::MAX_LEASE.as_micros() {
        limits::MAX_TTL.as_micros()
    } else {
        limits::MAX_LEASE.as_micros()
    };
    max as i64
};

/// The SQL of one table, built once per store from its validated name.
pub(crate) struct Sql {
    pub(crate) table: String,
    pub(crate) migrate: [String; 4],
    pub(crate) claim: String,
    pub(crate) complete: String,
    pub(crate) complete_in_transaction: String,
    pub(crate) release: String,
    pub(crate) release_in_transaction: String,
    pub(crate) renew: String,
    pub(crate) give_back: String,
    pub(crate) reap: String,
}

impl Sql {
    pub(crate) fn new(table: &str) -> Result<Self, InvalidTableName> {
        let table_name = TableName::parse(table)?;
        let name = table_name.name;
        let qualify = |part: &str| table_name.qualify(part);
        let t = table_name.quoted();
        let seq = qualify(&format!("{name}_token_seq"));
        let index = format!("\"{name}_expires_at_idx\"");
        let kept_index = format!("\"{name}_kept_until_idx\"");
        let kept_index_qualified = qualify(&format!("{name}_kept_until_idx"));
        let until = |param: &str| format!("clock_timestamp() + {param} * interval '1 microsecond'");
        let owned = "storage_key = $1 AND token = $2 AND state = 'in_flight'";
        let live = "expires_at > clock_timestamp()";
        // Until when a row is kept: the later of its lease or TTL and the TTL an abandoned
        // claim is kept for (`greatest` skips a NULL `kept_until`: rows written before it).
        let kept = "greatest(kept_until, expires_at)";
        Ok(Sql {
            table: table.to_owned(),
            migrate: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                     storage_key bytea PRIMARY KEY, \
                     state text NOT NULL, \
                     fingerprint bytea NOT NULL, \
                     token bigint NOT NULL, \
                     payload bytea, \
                     expires_at timestamptz NOT NULL)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)"),
                format!("CREATE SEQUENCE IF NOT EXISTS {seq}"),
                // The columns added in 0.3, checked first: `ALTER TABLE` and `CREATE INDEX`
                // lock the table even when there is nothing to do, and every instance
                // migrates at startup while others hold open transactions on the table.
                format!(
                    "DO $$ BEGIN \
                     IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{t}'::regclass \
                         AND attname = 'claimant' AND NOT attisdropped) THEN \
                         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS lifetime bigint, \
                         ADD COLUMN IF NOT EXISTS kept_until timestamptz, \
                         ADD COLUMN IF NOT EXISTS claimant bigint; \
                     END IF; \
                     IF to_regclass('{kept_index_qualified}') IS NULL THEN \
                         CREATE INDEX IF NOT EXISTS {kept_index} ON {t} (({kept})); \
                     END IF; \
                     END $$"
                ),
            ],
            claim: format!(
                "WITH live AS (\
                     SELECT state, fingerprint, payload, \
                     (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8 AS remaining_us \
                     FROM {t} WHERE storage_key = $1 AND {live}\
                 ), claimed AS (\
                     INSERT INTO {t} AS r (storage_key, state, fingerprint, token, lifetime, payload, \
                     expires_at, kept_until, claimant) \
                     SELECT $1, 'in_flight', $2, nextval('{seq}'), NULL, NULL, {lease}, {kept_for}, $5 \
                     WHERE NOT EXISTS (SELECT FROM live) \
                     ON CONFLICT (storage_key) DO UPDATE \
                     SET state = 'in_flight', fingerprint = excluded.fingerprint, \
                     token = greatest(nextval('{seq}'), r.token + 1), \
                     lifetime = CASE WHEN r.state = 'in_flight' AND r.fingerprint = excluded.fingerprint \
                         AND coalesce(r.kept_until, r.expires_at) > clock_timestamp() \
                         THEN coalesce(r.lifetime, r.token) END, \
                     payload = NULL, expires_at = {lease}, kept_until = {kept_for}, \
                     claimant = excluded.claimant \
                     WHERE r.expires_at <= clock_timestamp() \
                     RETURNING r.token, coalesce(r.lifetime, r.token) AS lifetime\
                 ) \
                 SELECT 'claimed'::text AS state, token, lifetime, NULL::bytea AS fingerprint, \
                 NULL::bytea AS payload, NULL::int8 AS remaining_us FROM claimed \
                 UNION ALL \
                 SELECT state, NULL, NULL, fingerprint, payload, remaining_us FROM live",
                lease = until("$3"),
                kept_for = until("greatest($3, $4)"),
            ),
            // The owner's completion repeated after the first one landed (its answer was
            // lost, or the runtime retries with the "not retained" record) changes nothing
            // and succeeds.
            complete: format!(
                "UPDATE {t} SET state = 'completed', \
                 payload = CASE WHEN state = 'in_flight' THEN $3 ELSE payload END, \
                 expires_at = CASE WHEN state = 'in_flight' THEN {ttl} ELSE expires_at END, \
                 kept_until = CASE WHEN state = 'in_flight' THEN {ttl} ELSE kept_until END, \
                 claimant = NULL \
                 WHERE storage_key = $1 AND token = $2 AND state IN ('in_flight', 'completed') \
                 AND {live}",
                ttl = until("$4"),
            ),
            // In the claimer's own transaction the row is locked until commit, so nobody can
            // take it over, however long the work took.
            complete_in_transaction: format!(
                "UPDATE {t} SET state = 'completed', payload = $3, expires_at = {ttl}, \
                 kept_until = {ttl}, claimant = NULL \
                 WHERE {owned}",
                ttl = until("$4"),
            ),
            release: format!(
                "UPDATE {t} SET expires_at = clock_timestamp() WHERE {owned} AND {live}"
            ),
            release_in_transaction: format!(
                "UPDATE {t} SET expires_at = clock_timestamp() WHERE {owned}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = {lease}, kept_until = greatest(kept_until, {lease}) \
                 WHERE {owned} AND {live}",
                lease = until("$3"),
            ),
            give_back: format!(
                "UPDATE {t} SET expires_at = clock_timestamp() \
                 WHERE storage_key = $1 AND claimant = $2 AND state = 'in_flight' AND {live}"
            ),
            // `statement_timestamp()`, not `clock_timestamp()`: a volatile function cannot be
            // an index condition, and the grace dwarfs the difference.
            reap: format!(
                "DELETE FROM {t} WHERE storage_key IN (\
                     SELECT storage_key FROM {t} \
                     WHERE {kept} < statement_timestamp() - $1 * interval '1 microsecond' \
                     LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
        })
    }

    /// The claim statement on `connection`, run again while it loses races it cannot see.
    /// `claimant` (see `Unanswered`) is written into the row it makes, if any.
    pub(crate) async fn claim_on(
        &self,
        connection: &mut PgConnection,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        claimant: Option<i64>,
    ) -> Result<Claim, StoreError> {
        for _ in 0..CLAIM_ATTEMPTS {
            let claim = sqlx::query(&self.claim)
                .bind(key.as_bytes().as_slice())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(micros(limits::clamp_lease(lease)))
                .bind(micros(limits::clamp_ttl(ttl)))
                .bind(claimant);
            let row = (&mut *connection)
                .fetch_optional(claim)
                .await
                .map_err(store_error)?;
            // No row: a concurrent claim committed a live record after this statement's
            // snapshot was taken. The next attempt's snapshot sees it.
            if let Some(row) = row {
                return decode_claim(&row);
            }
        }
        Err(StoreError::Backend(
            format!("claim lost {CLAIM_ATTEMPTS} races in a row; giving up").into(),
        ))
    }

    /// Runs a token-guarded update; one row changed means the caller held the claim.
    pub(crate) async fn guarded<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        connection: &mut PgConnection,
    ) -> Result<(), StoreError> {
        let changed = connection
            .execute(query)
            .await
            .map_err(store_error)?
            .rows_affected();
        if changed == 1 {
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }
}

/// Runs `statements` (`CREATE … IF NOT EXISTS`) in one transaction under an advisory lock
/// named after `table`: concurrent `CREATE TABLE IF NOT EXISTS` can fail in PostgreSQL's
/// catalog, so instances starting at once take turns.
pub(crate) async fn migrate(
    pool: &PgPool,
    table: &str,
    statements: &[String],
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let lock = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("idempotent-core migrate {table}"));
    (&mut *tx).execute(lock).await?;
    for statement in statements {
        (&mut *tx).execute(statement.as_str()).await?;
    }
    tx.commit().await
}

/// A duration bound as microseconds, at most [`MAX_MICROS`].
pub(crate) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).map_or(MAX_MICROS, |us| us.min(MAX_MICROS))
}

/// A token as stored: `bigint`, so above `i64::MAX` no row can hold it.
pub(crate) fn token_param(token: FencingToken) -> Option<i64> {
    i64::try_from(token.get()).ok()
}

pub(super) fn decode_claim(row: &PgRow) -> Result<Claim, StoreError> {
    let state: String = row.try_get("state").map_err(store_error)?;
    let fingerprint = || -> Result<Fingerprint, StoreError> {
        let bytes: Option<Vec<u8>> = row.try_get("fingerprint").map_err(store_error)?;
        let bytes = bytes.ok_or_else(|| corrupt("missing fingerprint"))?;
        <[u8; 32]>::try_from(bytes.as_slice())
            .map(Fingerprint::from_digest)
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))
    };
    match state.as_str() {
        "claimed" => {
            let number = |column: &str| -> Result<FencingToken, StoreError> {
                let value: Option<i64> = row.try_get(column).map_err(store_error)?;
                value
                    .and_then(|t| u64::try_from(t).ok())
                    .map(FencingToken::new)
                    .ok_or_else(|| corrupt(column))
            };
            let (token, lifetime) = (number("token")?, number("lifetime")?);
            Ok(if lifetime == token {
                Claim::Claimed(token)
            } else {
                Claim::TakenOver { token, lifetime }
            })
        }
        "in_flight" => {
            let remaining: Option<i64> = row.try_get("remaining_us").map_err(store_error)?;
            let remaining = remaining.ok_or_else(|| corrupt("lease"))?;
            Ok(Claim::InFlight {
                fingerprint: fingerprint()?,
                retry_after: Duration::from_micros(u64::try_from(remaining).unwrap_or(0)),
            })
        }
        "completed" => {
            let payload: Option<Vec<u8>> = row.try_get("payload").map_err(store_error)?;
            let payload = payload.ok_or_else(|| corrupt("completed record without a payload"))?;
            let remaining: Option<i64> = row.try_get("remaining_us").map_err(store_error)?;
            let remaining = remaining.ok_or_else(|| corrupt("expiry"))?;
            Ok(Claim::Completed {
                fingerprint: fingerprint()?,
                payload: Bytes::from(payload),
                expires_in: Duration::from_micros(u64::try_from(remaining).unwrap_or(0)),
            })
        }
        _ => Err(corrupt("unknown record state")),
    }
}
