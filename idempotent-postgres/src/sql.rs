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
use idempotent_core::session::SessionError;
use idempotent_core::{
    Claim, FencingToken, Fingerprint, RecordBytes, RequestOwner, SessionClaim, SessionGate,
    SessionKey, SessionRequest, StorageKey, StoreError, limits,
};

/// How often a claim is re-run when it lost a race it cannot see (see `claim_on`).
const CLAIM_ATTEMPTS: usize = 8;

/// The largest `seq` or `ack` the session gate binds.
const MAX_SEQ_PARAM: i64 = idempotent_core::session::MAX_SEQ as i64;

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
    pub(crate) migrate: [String; 9],
    pub(crate) claim: String,
    /// [`CheckpointStore::resume`](idempotent_core::CheckpointStore::resume): the claim's takeover, and nothing else.
    pub(crate) resume: String,
    pub(crate) complete: String,
    pub(crate) complete_in_transaction: String,
    pub(crate) release: String,
    pub(crate) release_in_transaction: String,
    pub(crate) renew: String,
    pub(crate) give_back: String,
    /// [`SessionStore::claim_in_session`](idempotent_core::SessionStore::claim_in_session): one
    /// call of the function `migrate` creates (see [`session_claim_function`]).
    pub(crate) session_claim: String,
    /// The same call's common case as one plain statement, tried first (see
    /// [`session_claim_common`]): no row when it does not apply, and the function runs.
    pub(crate) session_claim_common: String,
    /// The give-back of a session claim whose caller stopped waiting: `$1` the session's own
    /// storage key, `$2` the claimant, `$3` the request's `seq`; its record is found through the
    /// session's epoch.
    pub(crate) give_back_in_session: String,
    pub(crate) reap: String,
    pub(crate) open_session: String,
    pub(crate) session_mark: String,
    pub(crate) save_step: String,
    pub(crate) load_steps: String,
    pub(crate) save_request: String,
    /// [`CheckpointStore::abandoned`](idempotent_core::CheckpointStore::abandoned) of requests that name no owner.
    pub(crate) abandoned: String,
    /// [`CheckpointStore::abandoned`](idempotent_core::CheckpointStore::abandoned) of one owner's requests (`$3`).
    pub(crate) abandoned_of: String,
    /// [`InspectStore`](idempotent_core::inspect::InspectStore): one record, and its row locked for a repair.
    pub(crate) inspect: String,
    pub(crate) inspect_for_update: String,
    /// The listings, by [`Listed`](idempotent_core::inspect::Listed): in flight, abandoned, released, completed.
    pub(crate) list: [String; 4],
    pub(crate) repair_release: String,
    pub(crate) repair_give_up: String,
    pub(crate) repair_forget: String,
    pub(crate) session_state: String,
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
        let abandoned_index = format!("\"{name}_abandoned_idx\"");
        let abandoned_index_qualified = qualify(&format!("{name}_abandoned_idx"));
        let owner_index = format!("\"{name}_owner_idx\"");
        let owner_index_qualified = qualify(&format!("{name}_owner_idx"));
        let listing_index = format!("\"{name}_listing_idx\"");
        let listing_index_qualified = qualify(&format!("{name}_listing_idx"));
        // The listing index of earlier 0.4 builds, keyed on `state` as the column is: see
        // `LISTED_STATE`.
        let state_index_qualified = qualify(&format!("{name}_state_since_idx"));
        // Whose a saved request is (`RequestOwner`): its first bytes, indexed as they are, so
        // rows written before the index are listed by owner too.
        let owner = format!("substring(request from 1 for {})", RequestOwner::LEN);
        let until = |param: &str| format!("clock_timestamp() + {param} * interval '1 microsecond'");
        let owned = "storage_key = $1 AND token = $2 AND state = 'in_flight'";
        let live = "expires_at > clock_timestamp()";
        // A session's row is live until the end of its idle time (`idle_until`, exact), its
        // `expires_at` (rewritten once per half idle time) for rows written before 0.4.
        let session_live = SESSION_LIVE;
        // Until when a row is kept: the later of its lease or TTL and the TTL an abandoned
        // claim is kept for (`greatest` skips a NULL `kept_until`: rows written before it).
        let kept = "greatest(kept_until, expires_at)";
        // An abandoned claim (its lease ended, or released) of a request other than
        // `fingerprint`'s, still kept; columns of `row` (a prefix: `r.` or none).
        let pinned = |row: &str, fingerprint: &str| {
            format!(
                "{row}state = 'in_flight' AND {row}fingerprint <> {fingerprint} \
                 AND coalesce({row}kept_until, {row}expires_at) > clock_timestamp()"
            )
        };
        let claim = format!(
            "WITH live AS (\
                 SELECT state, fingerprint, payload, \
                 greatest((EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8, 0) AS remaining_us \
                 FROM {t} WHERE storage_key = $1 AND ({live} OR {pinned})\
             ), claimed AS (\
                 INSERT INTO {t} AS r (storage_key, state, fingerprint, token, lifetime, payload, \
                 expires_at, kept_until, claimant, label, released, attempts, since) \
                 SELECT $1, 'in_flight', $2, nextval('{seq}'), NULL, NULL, {lease}, {kept_for}, $5, \
                 $6, false, 1, clock_timestamp() \
                 WHERE NOT EXISTS (SELECT FROM live) \
                 ON CONFLICT (storage_key) DO UPDATE \
                 SET state = 'in_flight', fingerprint = excluded.fingerprint, \
                 token = greatest(nextval('{seq}'), r.token + 1), \
                 (lifetime, steps, request) = (\
                     SELECT coalesce(r.lifetime, r.token), r.steps, r.request \
                     WHERE r.state = 'in_flight' AND r.fingerprint = excluded.fingerprint \
                     AND coalesce(r.kept_until, r.expires_at) > clock_timestamp()), \
                 label = CASE WHEN {continued} THEN r.label ELSE excluded.label END, \
                 attempts = CASE WHEN {continued} THEN least(r.attempts, 2147483646) + 1 ELSE 1 END, \
                 payload = NULL, expires_at = {lease}, kept_until = {kept_for}, \
                 claimant = excluded.claimant, released = false, since = clock_timestamp() \
                 WHERE r.expires_at <= clock_timestamp() AND NOT ({pinned_r}) \
                 RETURNING r.token, coalesce(r.lifetime, r.token) AS lifetime\
             ) \
             SELECT 'claimed'::text AS state, token, lifetime, NULL::bytea AS fingerprint, \
             NULL::bytea AS payload, NULL::int8 AS remaining_us FROM claimed \
             UNION ALL \
             SELECT state, NULL, NULL, fingerprint, payload, remaining_us FROM live",
            lease = until("$3"),
            kept_for = until("greatest($3, $4)"),
            pinned = pinned("", "$2"),
            pinned_r = pinned("r.", "excluded.fingerprint"),
            continued = "r.state = 'in_flight' AND r.fingerprint = excluded.fingerprint \
                 AND coalesce(r.kept_until, r.expires_at) > clock_timestamp()",
        );
        let session_fn = qualify(&format!("{name}_session_claim"));
        let session_claim_common = session_claim_common(&t, &claim);
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
                // The columns of checkpoints and saved requests, and the index of the
                // completer's query (`abandoned`): checked first, like the ones above.
                format!(
                    "DO $$ BEGIN \
                     IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{t}'::regclass \
                         AND attname = 'request' AND NOT attisdropped) THEN \
                         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS steps bytea, \
                         ADD COLUMN IF NOT EXISTS request bytea; \
                     END IF; \
                     IF to_regclass('{abandoned_index_qualified}') IS NULL THEN \
                         CREATE INDEX IF NOT EXISTS {abandoned_index} ON {t} (expires_at) \
                         WHERE state = 'in_flight' AND request IS NOT NULL; \
                     END IF; \
                     END $$"
                ),
                // The index of one owner's saved requests (`abandoned_of`), checked first
                // like the ones above.
                format!(
                    "DO $$ BEGIN \
                     IF to_regclass('{owner_index_qualified}') IS NULL THEN \
                         CREATE INDEX IF NOT EXISTS {owner_index} ON {t} (({owner}), expires_at) \
                         WHERE state = 'in_flight' AND request IS NOT NULL; \
                     END IF; \
                     END $$"
                ),
                // What an operator reads (0.4): the key's label, whether it was released, the
                // count of claims and when the record entered its state; the index of the
                // listings by state and age, keyed on `LISTED_STATE` (an index on `state` as
                // it is, made by earlier 0.4 builds, is dropped). Checked first, like the
                // ones above.
                format!(
                    "DO $$ BEGIN \
                     IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{t}'::regclass \
                         AND attname = 'since' AND NOT attisdropped) THEN \
                         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS label bytea, \
                         ADD COLUMN IF NOT EXISTS released boolean, \
                         ADD COLUMN IF NOT EXISTS attempts integer, \
                         ADD COLUMN IF NOT EXISTS since timestamptz; \
                     END IF; \
                     IF to_regclass('{listing_index_qualified}') IS NULL THEN \
                         CREATE INDEX IF NOT EXISTS {listing_index} \
                             ON {t} (({LISTED_STATE}), since, storage_key); \
                     END IF; \
                     IF to_regclass('{state_index_qualified}') IS NOT NULL THEN \
                         DROP INDEX IF EXISTS {state_index_qualified}; \
                     END IF; \
                     END $$"
                ),
                // The exact end of a session's idle time (0.4), so that its row's indexed
                // `expires_at` is rewritten once per half idle time rather than by every
                // request. Checked first, like the ones above.
                format!(
                    "DO $$ BEGIN \
                     IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{t}'::regclass \
                         AND attname = 'idle_until' AND NOT attisdropped) THEN \
                         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS idle_until timestamptz; \
                     END IF; \
                     END $$"
                ),
                // The session claim (0.4): replaced on every migrate, so it is always the
                // gate and claim of this version.
                session_claim_function(&session_fn, &open_session(&t, &seq), &claim),
            ],
            // A row is reported (`live`) while its lease or TTL lasts, and so is an abandoned
            // claim of another request while it is kept (`pinned`, nobody holding its lease):
            // the key is that request's for the record's whole life. The update refuses such a
            // row too, so a claim whose snapshot missed it runs again and reports it.
            claim,
            // The claim's takeover of an abandoned claim of the same request, and nothing else:
            // no row when the key holds no such record (absent, expired, another request's).
            resume: format!(
                "WITH live AS (\
                     SELECT state, fingerprint, payload, \
                     (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8 AS remaining_us \
                     FROM {t} WHERE storage_key = $1 AND {live}\
                 ), taken AS (\
                     UPDATE {t} AS r SET token = greatest(nextval('{seq}'), r.token + 1), \
                     lifetime = coalesce(r.lifetime, r.token), \
                     expires_at = {lease}, kept_until = {kept_for}, claimant = $5, \
                     attempts = least(r.attempts, 2147483646) + 1, released = false, since = clock_timestamp() \
                     WHERE r.storage_key = $1 AND r.state = 'in_flight' AND r.fingerprint = $2 \
                     AND r.expires_at <= clock_timestamp() \
                     AND coalesce(r.kept_until, r.expires_at) > clock_timestamp() \
                     AND NOT EXISTS (SELECT FROM live) \
                     RETURNING r.token, r.lifetime\
                 ) \
                 SELECT 'claimed'::text AS state, token, lifetime, NULL::bytea AS fingerprint, \
                 NULL::bytea AS payload, NULL::int8 AS remaining_us FROM taken \
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
                 since = CASE WHEN state = 'in_flight' THEN clock_timestamp() ELSE since END, \
                 claimant = NULL, steps = NULL, request = NULL, released = false \
                 WHERE storage_key = $1 AND token = $2 AND state IN ('in_flight', 'completed') \
                 AND {live}",
                ttl = until("$4"),
            ),
            // In the claimer's own transaction the row is locked until commit, so nobody can
            // take it over, however long the work took.
            complete_in_transaction: format!(
                "UPDATE {t} SET state = 'completed', payload = $3, expires_at = {ttl}, \
                 kept_until = {ttl}, claimant = NULL, steps = NULL, request = NULL, \
                 since = clock_timestamp(), released = false \
                 WHERE {owned}",
                ttl = until("$4"),
            ),
            release: format!(
                "UPDATE {t} SET expires_at = clock_timestamp(), released = true \
                 WHERE {owned} AND {live}"
            ),
            release_in_transaction: format!(
                "UPDATE {t} SET expires_at = clock_timestamp(), released = true WHERE {owned}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = {lease}, kept_until = greatest(kept_until, {lease}) \
                 WHERE {owned} AND {live}",
                lease = until("$3"),
            ),
            give_back: format!(
                "UPDATE {t} SET expires_at = clock_timestamp(), released = true \
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
            open_session: open_session(&t, &seq),
            session_claim_common,
            session_claim: format!(
                "SELECT o_gate AS gate, o_epoch AS epoch, o_mark AS mark, o_state AS state, \
                 o_token AS token, o_lifetime AS lifetime, o_fingerprint AS fingerprint, \
                 o_payload AS payload, o_remaining_us AS remaining_us \
                 FROM {session_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9)"
            ),
            give_back_in_session: format!(
                "UPDATE {t} SET expires_at = clock_timestamp(), released = true \
                 WHERE storage_key = substring($1 from 1 for 32) || int8send((\
                     SELECT claimant FROM {t} WHERE storage_key = $1 AND state = 'session')) \
                     || int8send($3) \
                 AND claimant = $2 AND state = 'in_flight' AND {live}"
            ),
            session_mark: format!(
                "SELECT state, token, claimant FROM {t} \
                 WHERE storage_key = $1 AND {session_live}"
            ),
            save_step: format!(
                "UPDATE {t} SET steps = coalesce(steps, ''::bytea) || $3 WHERE {owned} AND {live}"
            ),
            load_steps: format!(
                "SELECT coalesce(steps, ''::bytea) AS steps FROM {t} WHERE {owned} AND {live}"
            ),
            save_request: format!("UPDATE {t} SET request = $3 WHERE {owned} AND {live}"),
            // `statement_timestamp()`, like `reap`, so that the lease bound is an index
            // condition; kept as a takeover keeps it (see `claim`).
            abandoned: format!(
                "SELECT storage_key, fingerprint, request, \
                 (EXTRACT(EPOCH FROM statement_timestamp() - expires_at) * 1000000)::int8 AS idle_us \
                 FROM {t} \
                 WHERE state = 'in_flight' AND request IS NOT NULL \
                 AND expires_at <= statement_timestamp() - $1 * interval '1 microsecond' \
                 AND coalesce(kept_until, expires_at) > statement_timestamp() \
                 AND octet_length(storage_key) IN (32, 48) \
                 AND octet_length(request) < {len} \
                 ORDER BY expires_at LIMIT $2",
                len = RequestOwner::LEN,
            ),
            abandoned_of: format!(
                "SELECT storage_key, fingerprint, request, \
                 (EXTRACT(EPOCH FROM statement_timestamp() - expires_at) * 1000000)::int8 AS idle_us \
                 FROM {t} \
                 WHERE state = 'in_flight' AND request IS NOT NULL AND {owner} = $3 \
                 AND expires_at <= statement_timestamp() - $1 * interval '1 microsecond' \
                 AND coalesce(kept_until, expires_at) > statement_timestamp() \
                 AND octet_length(storage_key) IN (32, 48) \
                 ORDER BY expires_at LIMIT $2"
            ),
            inspect: inspect(&t, ""),
            inspect_for_update: inspect(&t, " FOR UPDATE"),
            list: [
                list(
                    &t,
                    &format!("{LISTED_STATE} = 'in_flight' AND expires_at > clock_timestamp()"),
                    "since",
                ),
                list(
                    &t,
                    "state = 'in_flight' AND expires_at <= clock_timestamp()",
                    "expires_at",
                ),
                list(
                    &t,
                    "state = 'in_flight' AND expires_at <= clock_timestamp() AND released",
                    "expires_at",
                ),
                list(
                    &t,
                    &format!("{LISTED_STATE} = 'completed' AND expires_at > clock_timestamp()"),
                    "since",
                ),
            ],
            repair_release: format!(
                "UPDATE {t} SET expires_at = least(expires_at, clock_timestamp()), \
                 released = true, claimant = NULL WHERE storage_key = $1"
            ),
            repair_give_up: format!(
                "UPDATE {t} SET state = 'completed', token = greatest(nextval('{seq}'), token + 1), \
                 payload = $2, expires_at = {ttl}, kept_until = {ttl}, since = clock_timestamp(), \
                 steps = NULL, request = NULL, claimant = NULL, released = false \
                 WHERE storage_key = $1",
                ttl = until("$3"),
            ),
            repair_forget: format!("DELETE FROM {t} WHERE storage_key = $1"),
            session_state: format!(
                "SELECT state, token, lifetime, claimant FROM {t} \
                 WHERE storage_key = $1 AND {session_live}"
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
        label: Option<&[u8]>,
    ) -> Result<Claim, StoreError> {
        let record = key.record_bytes();
        for _ in 0..CLAIM_ATTEMPTS {
            let claim = sqlx::query(&self.claim)
                .bind(record.as_ref())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(micros(limits::clamp_lease(lease)))
                .bind(micros(limits::clamp_ttl(ttl)))
                .bind(claimant)
                .bind(label);
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

    /// The resume statement on `connection`: `None` when it found nothing of the request to
    /// take over.
    pub(crate) async fn resume_on(
        &self,
        connection: &mut PgConnection,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        claimant: Option<i64>,
    ) -> Result<Option<Claim>, StoreError> {
        let record = key.record_bytes();
        // No row: nothing to take over, or a concurrent resume or claim took the record after
        // this statement's snapshot was taken; the second attempt's snapshot sees its lease.
        for _ in 0..2 {
            let resume = sqlx::query(&self.resume)
                .bind(record.as_ref())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(micros(limits::clamp_lease(lease)))
                .bind(micros(limits::clamp_ttl(ttl)))
                .bind(claimant);
            let row = (&mut *connection)
                .fetch_optional(resume)
                .await
                .map_err(store_error)?;
            if let Some(row) = row {
                return decode_claim(&row).map(Some);
            }
        }
        Ok(None)
    }

    /// The session gate statement on `connection` (see [`open_session`]), run again while it
    /// answers `retry`: it met a session started after its snapshot was taken, which the next
    /// attempt's snapshot sees.
    pub(crate) async fn open_session_on(
        &self,
        connection: &mut PgConnection,
        params: &SessionParams,
    ) -> Result<SessionGate, StoreError> {
        for _ in 0..CLAIM_ATTEMPTS {
            let query = sqlx::query(&self.open_session)
                .bind(params.record.as_ref())
                .bind(params.seq)
                .bind(params.ack)
                .bind(params.window)
                .bind(params.idle);
            let row = (&mut *connection)
                .fetch_one(query)
                .await
                .map_err(store_error)?;
            if let Some(gate) = decode_gate(&row)? {
                return Ok(gate);
            }
        }
        Err(StoreError::Backend(
            format!("session gate lost {CLAIM_ATTEMPTS} races in a row; giving up").into(),
        ))
    }

    /// A session request on `connection`: the common case's statement
    /// ([`session_claim_common`]), and when it answers nothing, the session claim function
    /// ([`session_claim_function`]).
    pub(crate) async fn claim_in_session_on(
        &self,
        connection: &mut PgConnection,
        params: &SessionParams,
        fingerprint: &Fingerprint,
        lease: Duration,
        claimant: i64,
        label: &[u8],
    ) -> Result<SessionClaim, StoreError> {
        let query = |sql| {
            sqlx::query(sql)
                .bind(params.record.as_ref())
                .bind(params.seq)
                .bind(params.ack)
                .bind(params.window)
                .bind(params.idle)
                .bind(fingerprint.as_bytes().as_slice())
                .bind(micros(limits::clamp_lease(lease)))
                .bind(claimant)
                .bind(label)
        };
        // The common case first, as one statement; every other case (a new, expired, corrupt
        // or older release's session, a refusal, answers left above the mark) is the
        // function's.
        let row = match (&mut *connection)
            .fetch_optional(query(&self.session_claim_common))
            .await
        {
            Ok(Some(row)) => Ok(row),
            Ok(None) => {
                (&mut *connection)
                    .fetch_one(query(&self.session_claim))
                    .await
            }
            Err(error) => Err(error),
        };
        let row = match row {
            Ok(row) => row,
            // A table migrated by an older release: no `idle_until` column (42703), or no
            // session claim function (42883).
            Err(sqlx::Error::Database(error))
                if matches!(error.code().as_deref(), Some("42703" | "42883")) =>
            {
                return Err(StoreError::Backend(
                    format!(
                        "the session claim of table {} needs what migrate creates ({error}): \
                         run PostgresStore::migrate",
                        self.table
                    )
                    .into(),
                ));
            }
            Err(error) => return Err(store_error(error)),
        };
        let gate: Option<String> = row.try_get("gate").map_err(store_error)?;
        match gate.as_deref() {
            Some("open") => {
                let epoch: Option<i64> = row.try_get("epoch").map_err(store_error)?;
                let epoch = epoch
                    .and_then(|n| u64::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| corrupt("session epoch"))?;
                Ok(SessionClaim::Admitted {
                    epoch,
                    claim: decode_claim(&row)?,
                })
            }
            Some("lost") => Err(StoreError::Backend(
                format!("claim lost {CLAIM_ATTEMPTS} races in a row; giving up").into(),
            )),
            _ => match decode_gate(&row)? {
                Some(SessionGate::Open { .. }) => {
                    Err(corrupt("a session gate opened without a claim"))
                }
                Some(refused) => Ok(SessionClaim::Refused(refused)),
                None => Err(StoreError::Backend(
                    format!("session gate lost {CLAIM_ATTEMPTS} races in a row; giving up").into(),
                )),
            },
        }
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

/// The session gate ([`SessionStore::open_session`](idempotent_core::SessionStore::open_session)) on table `t` with
/// token sequence `seq`, as one statement: `$1` the session's own storage key (its record
/// bytes), `$2` the request's `seq`, `$3` its `ack`, `$4` the window, `$5` the idle time in
/// microseconds. It answers one row: `gate` (`open`, `acknowledged`, `window_full`,
/// `expired`, `corrupt`, or `retry`: run it again), `epoch` and `mark`.
///
/// The session is a row of the table at its own key: `state = 'session'`, `token` its
/// acknowledged mark, `lifetime` the highest `seq` admitted, `claimant` its epoch,
/// `idle_until` the exact end of its idle time, an empty `fingerprint`, an empty `payload`
/// (which says 0.4 wrote it last: an older release writes NULL there, and the exact end in
/// `expires_at`, which is then read instead) and no `kept_until`. Its `expires_at` (indexed, for the reaper) is at least `idle_until`: set to one
/// and a half idle times from now whenever it has less than the idle time left, so it is
/// rewritten once per half idle time rather than by every request, and an update that leaves
/// it (and every other indexed column) alone can stay on its page (a HOT update, no index
/// entries). The reaper deletes the row once `expires_at` passed, like any row; the session
/// is live until `idle_until` (a row written before 0.4, without it, until `expires_at`). Its requests' rows are at
/// `digest ‖ epoch ‖ seq` (big-endian), so one epoch's requests are a range of the primary key.
///
/// Step by step:
///
/// - `locked` reads the session's row `FOR UPDATE`: the gate holds its lock from there to the
///   end of the transaction, so the steps of one session never interleave, and a gate that
///   waited for the lock reads the row as the one before it left it (`FOR UPDATE` follows a
///   row's updates under `READ COMMITTED`).
/// - `known` and `step` apply the rules of `SessionState::gate` to it: a live row that is not
///   a valid session is corrupt (nothing is written); no live row and `ack > 0` is expired
///   (nothing is written); no live row and `ack = 0` starts a session with an epoch drawn
///   from the token sequence, so no epoch of any session is ever drawn twice.
/// - `saved` writes the session's new state: an update of the locked row, or the insert of a
///   new one. If there was no row to lock but a concurrent gate inserted one after this
///   statement's snapshot, the insert meets that row unlocked: `saved` then writes nothing
///   and the statement answers `retry`, to be run again with a snapshot that sees the row.
/// - `dropped` deletes the requests' rows the mark now covers (`old mark + 1 ..= min(mark,
///   high)`) and `kept` keeps the ones above it (`mark + 1 ..= high`) at least the idle time
///   from now: a completed row's `expires_at`, an in-flight row's `kept_until` (how long an
///   abandoned claim is kept to be taken over). A row with less than the idle time left gets
///   one and a half, so each is rewritten once per half idle time at most rather than on every
///   request (an update of an indexed column leaves a dead row behind). Both are ranges of the primary key, at most
///   the window long, and follow `saved` (they read its output), under the session's lock.
fn open_session(t: &str, seq: &str) -> String {
    let max = idempotent_core::session::MAX_SEQ;
    let max_us = MAX_MICROS;
    format!(
        "WITH locked AS (\
             SELECT state, token, lifetime, claimant, expires_at, idle_until, payload FROM {t} \
             WHERE storage_key = $1 FOR UPDATE\
         ), known AS (\
             SELECT l.state IS NOT NULL AS present, \
             coalesce(CASE WHEN l.payload IS NOT NULL THEN coalesce(l.idle_until, l.expires_at) \
                 ELSE l.expires_at END > clock_timestamp(), false) AS live, \
             coalesce(l.state = 'session' AND l.token BETWEEN 0 AND {max} \
                 AND l.lifetime BETWEEN 0 AND {max} AND l.claimant > 0, false) AS valid, \
             l.token AS mark, l.lifetime AS high, l.claimant AS epoch, \
             clock_timestamp() + $5 * interval '1 microsecond' AS until, \
             clock_timestamp() + least($5 * 3 / 2, {max_us}) * interval '1 microsecond' AS longer \
             FROM (SELECT) AS one LEFT JOIN locked AS l ON true\
         ), step AS (\
             SELECT present, until, longer, \
             CASE WHEN live THEN epoch ELSE nextval('{seq}') END AS epoch, \
             CASE WHEN live THEN mark ELSE 0 END AS old_mark, \
             CASE WHEN live THEN high ELSE 0 END AS old_high, \
             greatest(CASE WHEN live THEN mark ELSE 0 END, $3) AS mark \
             FROM known WHERE CASE WHEN live THEN valid ELSE $3 = 0 END\
         ), decided AS (\
             SELECT *, CASE WHEN $2 <= mark THEN 'acknowledged' \
                 WHEN $2 > mark + $4 THEN 'window_full' ELSE 'open' END AS gate \
             FROM step\
         ), saved AS (\
             INSERT INTO {t} AS r (storage_key, state, fingerprint, token, lifetime, payload, \
             expires_at, kept_until, claimant, idle_until) \
             SELECT $1, 'session', ''::bytea, mark, \
             CASE WHEN gate = 'open' THEN greatest(old_high, $2) ELSE old_high END, \
             ''::bytea, longer, NULL, epoch, until FROM decided \
             ON CONFLICT (storage_key) DO UPDATE \
             SET state = excluded.state, fingerprint = excluded.fingerprint, \
             token = excluded.token, lifetime = excluded.lifetime, payload = excluded.payload, \
             expires_at = CASE WHEN r.state = 'session' AND r.expires_at >= excluded.idle_until \
                 THEN r.expires_at ELSE excluded.expires_at END, \
             kept_until = NULL, claimant = excluded.claimant, idle_until = excluded.idle_until \
             WHERE (SELECT present FROM decided) \
             RETURNING 1\
         ), ranges AS (\
             SELECT p || int8send(old_mark) AS drop_after, \
             p || int8send(least(mark, old_high)) AS drop_to, \
             p || int8send(mark) AS keep_after, p || int8send(old_high) AS keep_to, until, longer \
             FROM (SELECT substring($1 from 1 for 32) || int8send(epoch) AS p, * FROM decided) AS d \
             WHERE EXISTS (SELECT FROM saved)\
         ), dropped AS (\
             DELETE FROM {t} \
             WHERE storage_key > (SELECT drop_after FROM ranges) \
             AND storage_key <= (SELECT drop_to FROM ranges)\
         ), kept AS (\
             UPDATE {t} SET \
             expires_at = CASE WHEN state = 'completed' \
                 THEN greatest(expires_at, (SELECT longer FROM ranges)) ELSE expires_at END, \
             kept_until = greatest(kept_until, (SELECT longer FROM ranges)) \
             WHERE storage_key > (SELECT keep_after FROM ranges) \
             AND storage_key <= (SELECT keep_to FROM ranges) \
             AND ((state = 'in_flight' AND coalesce(kept_until, expires_at) < (SELECT until FROM ranges)) \
                 OR (state = 'completed' AND expires_at > clock_timestamp() \
                     AND expires_at < (SELECT until FROM ranges)))\
         ) \
         SELECT CASE WHEN k.live AND NOT k.valid THEN 'corrupt' \
             WHEN d.gate IS NULL THEN 'expired' \
             WHEN NOT EXISTS (SELECT FROM saved) THEN 'retry' \
             ELSE d.gate END AS gate, \
         d.epoch, d.mark \
         FROM known AS k LEFT JOIN decided AS d ON true"
    )
}

/// The function `name` (created by `migrate`) that makes
/// [`SessionStore::claim_in_session`](idempotent_core::SessionStore::claim_in_session) one call
/// and one transaction: the session gate statement `gate` ([`open_session`], its parameters
/// the function's `$1` to `$5`), then, when it admits the request, the claim statement `claim`
/// of the request's row `digest ‖ epoch ‖ seq`, with `$6` the fingerprint, `$7` the lease,
/// the idle time `$5` as its TTL, `$8` the claimant and `$9` the label. Each statement runs
/// again while it loses a race it cannot see (`retry`, or no row), as the store runs them on
/// their own; each run takes a new snapshot (`READ COMMITTED`).
///
/// The gate locks the session's row (`FOR UPDATE`) until the call's transaction ends, after the
/// claim: no other request of the session passes its gate in between, so no `ack` can drop the
/// request's answer between the gate and the claim, and no check of the mark follows.
///
/// It answers one row: `o_gate` and the gate's `o_epoch` and `o_mark`, and when admitted
/// (`open`) the claim's columns (`o_state` and the rest, as the claim statement answers them);
/// `lost` when the claim lost every race.
fn session_claim_function(name: &str, gate: &str, claim: &str) -> String {
    let (gate, from) = gate
        .rsplit_once(" FROM known AS k LEFT JOIN decided AS d ON true")
        .expect("the gate statement ends with its answer");
    assert!(from.is_empty(), "the gate's answer is its last clause");
    // The claim's parameters, as the function's.
    let claim = renumber(claim, |n| match n {
        1 => "v_key".to_owned(),
        n => session_claim_parameter(n),
    });
    let admitted = "'open'::text, v_gate.epoch, v_gate.mark,";
    let claim = claim
        .replacen(
            "SELECT 'claimed'::text AS state,",
            &format!("SELECT {admitted} 'claimed'::text AS state,"),
            1,
        )
        .replacen(
            "SELECT state, NULL, NULL, fingerprint, payload, remaining_us FROM live",
            &format!(
                "SELECT {admitted} state, NULL, NULL, fingerprint, payload, remaining_us FROM live"
            ),
            1,
        );
    assert_eq!(
        claim.matches(admitted).count(),
        2,
        "the claim's two answers"
    );
    let nothing = "NULL::text, NULL::int8, NULL::int8, NULL::bytea, NULL::bytea, NULL::int8";
    format!(
        "CREATE OR REPLACE FUNCTION {name}(bytea, int8, int8, int8, int8, bytea, int8, int8, bytea) \
         RETURNS TABLE (o_gate text, o_epoch int8, o_mark int8, o_state text, o_token int8, \
         o_lifetime int8, o_fingerprint bytea, o_payload bytea, o_remaining_us int8) \
         LANGUAGE plpgsql VOLATILE AS $fn$\n\
         #variable_conflict use_column\n\
         DECLARE v_gate record; v_key bytea;\n\
         BEGIN\n\
         FOR attempt IN 1..{CLAIM_ATTEMPTS} LOOP\n\
         {gate} INTO v_gate FROM known AS k LEFT JOIN decided AS d ON true;\n\
         EXIT WHEN v_gate.gate IS DISTINCT FROM 'retry';\n\
         END LOOP;\n\
         IF v_gate.gate IS DISTINCT FROM 'open' THEN\n\
         RETURN QUERY SELECT v_gate.gate, v_gate.epoch, v_gate.mark, {nothing};\n\
         RETURN;\n\
         END IF;\n\
         v_key := substring($1 from 1 for 32) || int8send(v_gate.epoch) || int8send($2);\n\
         FOR attempt IN 1..{CLAIM_ATTEMPTS} LOOP\n\
         RETURN QUERY {claim};\n\
         IF FOUND THEN RETURN; END IF;\n\
         END LOOP;\n\
         RETURN QUERY SELECT 'lost'::text, v_gate.epoch, v_gate.mark, {nothing};\n\
         END\n\
         $fn$"
    )
}

/// The session claim function's common case as one plain statement, tried before the function
/// (the function's parameters, `$1` to `$9`): a live session written by 0.4 (an empty, not NULL,
/// `payload`) that is a valid session, admits the request (`ack < seq <= mark + window`, the
/// mark being the greater of the stored one and `ack`), and whose answers above the new mark
/// are none (its highest number admitted is at most the new mark: the client acknowledged
/// everything it was answered, as a client sending one request at a time does). It answers the
/// function's row for such a request (`open`, the epoch, the mark and the claim's columns), and
/// no row for any other case, or when the request's row is somehow there already (below): then
/// the function runs, and decides every other case as it always has.
///
/// It writes what the function's gate writes in that case, no more: the session's row gets the
/// new mark, the request's `seq` as its highest number, and the end of its idle time
/// (`idle_until`, exact; `expires_at` moved on only when less than the idle time is left, as the
/// gate does), and the answers the mark now covers (`old mark + 1 ..= old high`) are deleted.
/// The locking is the gate's: `o` reads the session's row `FOR UPDATE` (a statement that waited
/// for the lock reads the row as the one before it left it, its conditions checked again on
/// that version), and the update and the delete follow under that lock. The claim is the
/// claim statement's insert of the request's row `digest ‖ epoch ‖ seq` (`claimed`, answered as
/// the claim statement answers a new row: `claimed`, its token as its lifetime), which cannot be
/// there yet: the request's number is above every number the session admitted in its epoch
/// (the highest only grows, an epoch is never drawn twice), and a number is admitted before its
/// row is claimed. If a row is there anyway (a sequence reset, a restore, a row made by hand),
/// nothing is inserted and it answers none, its gate's writes made; the function then decides
/// the request from the row. Its gate finds the request already the session's highest, so it
/// writes only a new end of the idle time, and counts the row among the answers above the mark
/// that it keeps alive (it may take over an abandoned claim there whose keeping had run out,
/// where it would otherwise have claimed it anew). Leaving out the claim statement's read of a
/// live row and its takeover (`ON CONFLICT DO UPDATE`) is what makes this statement cheap.
///
/// One statement rather than the function's two inside PL/pgSQL: PostgreSQL spends most of a
/// session request's time starting the executor for each statement's plan (BENCHMARKS.md,
/// "issue 43, eighth part").
fn session_claim_common(t: &str, claim: &str) -> String {
    let max = idempotent_core::session::MAX_SEQ;
    let max_us = MAX_MICROS;
    // The claim statement's insert of a new row, with the session's parameters (as the
    // function's) and the request's key from `s`: a row already there is not the common case,
    // and the function decides it.
    let (_, insert) = claim
        .split_once("claimed AS (")
        .expect("the claim statement's insert");
    let (insert, _) = insert
        .split_once(" WHERE NOT EXISTS (SELECT FROM live)")
        .expect("the claim statement inserts only when no row is live");
    assert!(insert.starts_with("INSERT INTO "), "{insert}");
    let insert = renumber(insert, |n| match n {
        1 => "s.p || int8send($2)".to_owned(),
        n => session_claim_parameter(n),
    });
    format!(
        "WITH o AS (\
             SELECT token, lifetime, claimant, \
             clock_timestamp() + $5 * interval '1 microsecond' AS until FROM {t} \
             WHERE storage_key = $1 AND state = 'session' AND payload IS NOT NULL \
             AND coalesce(idle_until, expires_at) > clock_timestamp() \
             AND CASE WHEN token BETWEEN 0 AND {max} AND lifetime BETWEEN 0 AND {max} \
                 AND claimant > 0 \
                 THEN $2 > greatest(token, $3) AND $2 <= greatest(token, $3) + $4 \
                 AND lifetime <= greatest(token, $3) \
                 ELSE false END \
             FOR UPDATE\
         ), s AS (\
             UPDATE {t} AS n SET token = greatest(o.token, $3), lifetime = $2, \
             idle_until = o.until, \
             expires_at = CASE WHEN n.expires_at >= o.until THEN n.expires_at \
                 ELSE clock_timestamp() + least($5 * 3 / 2, {max_us}) * interval '1 microsecond' END \
             FROM o WHERE n.storage_key = $1 \
             RETURNING substring($1 from 1 for 32) || int8send(o.claimant) AS p, \
             o.token AS old_mark, o.lifetime AS old_high, o.claimant AS epoch, n.token AS mark\
         ), d AS (\
             DELETE FROM {t} \
             WHERE storage_key > (SELECT p || int8send(old_mark) FROM s) \
             AND storage_key <= (SELECT p || int8send(old_high) FROM s)\
         ), claimed AS (\
             {insert} FROM s ON CONFLICT (storage_key) DO NOTHING RETURNING token\
         ) \
         SELECT 'open'::text AS gate, s.epoch, s.mark, 'claimed'::text AS state, c.token, \
         c.token AS lifetime, NULL::bytea AS fingerprint, NULL::bytea AS payload, \
         NULL::int8 AS remaining_us FROM claimed AS c, s"
    )
}

/// The session claim's parameter (the function's `$5` to `$9`) that stands for the claim
/// statement's parameter `$n` (2 to 6: fingerprint, lease, TTL, claimant, label); its key,
/// `$1`, is the caller's.
fn session_claim_parameter(n: usize) -> String {
    match n {
        2 => "$6",
        3 => "$7",
        4 => "$5",
        5 => "$8",
        6 => "$9",
        other => panic!("the claim statement has no parameter ${other}"),
    }
    .to_owned()
}

/// `sql` with each parameter `$n` replaced by `to(n)`.
fn renumber(sql: &str, to: impl Fn(usize) -> String) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        if digits == 0 {
            out.push('$');
        } else {
            let n = rest[at + 1..at + 1 + digits]
                .parse()
                .expect("a parameter's number");
            out.push_str(&to(n));
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// Whether a session's row (unprefixed columns) is live: until the exact end of its idle time
/// (`idle_until`) when 0.4 wrote it last (its `payload` is then empty, not NULL), or until its
/// `expires_at` when an older release did (it writes the exact end there, and NULL in
/// `payload`), so instances of both agree during a rolling upgrade.
const SESSION_LIVE: &str = "CASE WHEN payload IS NOT NULL THEN coalesce(idle_until, expires_at) \
     ELSE expires_at END > clock_timestamp()";

/// The state as the listing index keys it: in the "C" collation, not the column's own, so that
/// only the listings (which compare it so) can use that index. The statements of one key
/// (`storage_key = $1 AND state = 'in_flight'`) must find their row through the primary key:
/// a `state` index tempts PostgreSQL's planner to take the `in_flight` range of it instead,
/// which its statistics say is nearly empty (a claim is in flight briefly) but which holds an
/// entry left by every claim since the last vacuum; with such an index, a consumer's completion
/// took 0.74 ms instead of 0.10 (BENCHMARKS.md, "0.4: a key's statements on the primary key").
pub(crate) const LISTED_STATE: &str = "state COLLATE \"C\"";

/// The columns an operator reads of a record (see `inspect::record_info`).
const INSPECTED: &str = "storage_key, state, fingerprint, token, label, \
     coalesce(released, false) AS released, coalesce(attempts, 0) AS attempts, payload, \
     coalesce(steps, ''::bytea) AS steps, request, \
     (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8 AS left_us, \
     (EXTRACT(EPOCH FROM greatest(kept_until, expires_at) - clock_timestamp()) * 1000000)::int8 AS kept_us, \
     (EXTRACT(EPOCH FROM clock_timestamp() - coalesce(since, clock_timestamp())) * 1000000)::int8 AS since_us";

/// One live record (`$1`): in flight while its lease or its TTL lasts, completed while it has
/// not expired.
fn inspect(t: &str, lock: &str) -> String {
    format!(
        "SELECT {INSPECTED} FROM {t} WHERE storage_key = $1 \
         AND state IN ('in_flight', 'completed') \
         AND greatest(kept_until, expires_at) > clock_timestamp(){lock}"
    )
}

/// A page of the records `filter` keeps, at least `$1` microseconds old by `stamp` (`since`,
/// or the lease's end for abandoned ones), after the cursor (`$3` microseconds since the epoch
/// and `$4` the storage key; `$3` NULL: from the start), oldest first, `$2` of them: an index
/// range (`listing_idx`: `LISTED_STATE, since, storage_key`; or `expires_at`).
fn list(t: &str, filter: &str, stamp: &str) -> String {
    format!(
        "SELECT {INSPECTED}, (EXTRACT(EPOCH FROM {stamp}) * 1000000)::int8 AS stamp_us FROM {t} \
         WHERE {filter} AND {stamp} IS NOT NULL \
         AND greatest(kept_until, expires_at) > clock_timestamp() \
         AND {stamp} <= statement_timestamp() - $1 * interval '1 microsecond' \
         AND ($3::int8 IS NULL OR ({stamp}, storage_key) > \
             (timestamptz 'epoch' + $3::int8 * interval '1 microsecond', $4::bytea)) \
         ORDER BY {stamp}, storage_key LIMIT $2"
    )
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

/// What the session gate statement binds: the session's own storage key, then `seq`, `ack`,
/// the window and the idle time in microseconds.
pub(crate) struct SessionParams {
    record: RecordBytes,
    seq: i64,
    ack: i64,
    window: i64,
    idle: i64,
}

impl SessionParams {
    /// The request's `seq`, as bound.
    pub(crate) fn seq(&self) -> i64 {
        self.seq
    }

    /// Refuses a `seq` or `ack` above [`MAX_SEQ`](idempotent_core::session::MAX_SEQ), which the runtime
    /// never sends; a window that large admits the same requests as any larger one.
    pub(crate) fn new(session: &SessionKey, request: SessionRequest) -> Result<Self, StoreError> {
        let number = |value: u64, error: fn(u64) -> SessionError| {
            i64::try_from(value)
                .ok()
                .filter(|&n| n <= MAX_SEQ_PARAM)
                .ok_or_else(|| StoreError::Backend(Box::new(error(value))))
        };
        Ok(SessionParams {
            record: session.record_key().record_bytes(),
            seq: number(request.seq, SessionError::SeqOutOfRange)?,
            ack: number(request.ack, SessionError::AckOutOfRange)?,
            window: i64::try_from(request.window).map_or(MAX_SEQ_PARAM, |w| w.min(MAX_SEQ_PARAM)),
            idle: micros(limits::clamp_ttl(request.idle)),
        })
    }
}

/// The session gate's answer, or `None` for `retry`.
fn decode_gate(row: &PgRow) -> Result<Option<SessionGate>, StoreError> {
    let gate: Option<String> = row.try_get("gate").map_err(store_error)?;
    let number = |column: &str| -> Result<u64, StoreError> {
        let value: Option<i64> = row.try_get(column).map_err(store_error)?;
        value
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| corrupt(&format!("session {column}")))
    };
    Ok(Some(match gate.as_deref() {
        Some("open") => match number("epoch")? {
            0 => return Err(corrupt("session epoch")),
            epoch => SessionGate::Open { epoch },
        },
        Some("acknowledged") => SessionGate::Acknowledged {
            ack: number("mark")?,
        },
        Some("window_full") => SessionGate::WindowFull {
            ack: number("mark")?,
        },
        Some("expired") => SessionGate::Expired,
        Some("retry") => return Ok(None),
        Some("corrupt") => return Err(corrupt("a session row that is not a valid session")),
        _ => return Err(corrupt("unknown session gate")),
    }))
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
