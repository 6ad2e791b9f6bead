//! The SQL text of one store (built once from its validated table prefix), and how times,
//! durations and tokens are bound.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_core::{FencingToken, RequestOwner};

/// The table prefix [`SqliteStore::open`](crate::SqliteStore::open) uses: the tables are
/// `idempotent_records` and `idempotent_tokens`.
pub const DEFAULT_TABLE_PREFIX: &str = "idempotent_";

/// The longest table prefix accepted.
pub(crate) const MAX_TABLE_PREFIX: usize = 48;

/// A table prefix that is not a lowercase identifier (or empty).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid table prefix {prefix:?}: expected nothing or a lowercase identifier \
     ([a-z_][a-z0-9_]*, at most 48 bytes), e.g. \"billing_\""
)]
pub struct InvalidTablePrefix {
    prefix: String,
}

/// Whether `prefix` is empty or a lowercase identifier, so that every name made from it is
/// one too (quoted anyway, so a reserved word is harmless).
fn is_prefix(prefix: &str) -> bool {
    let mut bytes = prefix.bytes();
    prefix.len() <= MAX_TABLE_PREFIX
        && match bytes.next() {
            None => true,
            Some(first) => {
                matches!(first, b'a'..=b'z' | b'_')
                    && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
            }
        }
}

/// The SQL of one store's tables. Every statement takes its values as parameters; table and
/// index names come from the validated prefix only.
#[derive(Debug)]
pub(crate) struct Sql {
    /// The records table, unquoted (`{prefix}records`).
    pub(crate) records: String,
    /// Creates the records table, with every column, if missing.
    pub(crate) create: String,
    /// The columns added since the first version, each with the statement that adds it to a
    /// table made before it (`ALTER TABLE … ADD COLUMN`).
    pub(crate) columns: Vec<(&'static str, String)>,
    /// `?1` the records table's name: its columns.
    pub(crate) table_columns: String,
    /// The indexes and the token counter, once every column is there.
    pub(crate) migrate: Vec<String>,
    /// `?1` now: the time in their state of the records of a table made before `since`.
    pub(crate) backfill_since: String,
    /// `?1` storage key: the columns a claim decides on.
    pub(crate) read_claim: String,
    /// `?1` storage key, `?2` fingerprint, `?3` token, `?4` lease end, `?5` kept until, `?6`
    /// label (or `NULL`), `?7` now: a new lifetime over whatever the key held.
    pub(crate) begin: String,
    /// `?1` storage key, `?2` token, `?3` lease end, `?4` kept until, `?5` now: a takeover,
    /// keeping the fingerprint, the lifetime, the checkpoints, the request and the label.
    pub(crate) take_over: String,
    /// `?1` the counter's value.
    pub(crate) read_counter: String,
    pub(crate) write_counter: String,
    /// `?1` key, `?2` token, `?3` now, `?4` payload, `?5` expiry.
    pub(crate) complete: String,
    /// `?1` key, `?2` token, `?3` now: the owner's completion landed already.
    pub(crate) completed_by: String,
    /// `?1` key, `?2` token, `?3` now.
    pub(crate) release: String,
    /// `?1` key, `?2` token, `?3` now, `?4` new lease end.
    pub(crate) renew: String,
    /// `?1` key, `?2` token, `?3` now, `?4` the entry.
    pub(crate) save_step: String,
    /// `?1` key, `?2` token, `?3` now.
    pub(crate) load_steps: String,
    /// `?1` key, `?2` token, `?3` now, `?4` the request.
    pub(crate) save_request: String,
    /// `?1` now, `?2` idle cut-off (lease ended at or before), `?3` limit.
    pub(crate) abandoned: String,
    /// As `abandoned`, `?4` the owner's bytes.
    pub(crate) abandoned_of: String,
    /// `?1` the session's own storage key.
    pub(crate) read_session: String,
    /// `?1` key, `?2` mark, `?3` highest admitted, `?4` epoch, `?5` until.
    pub(crate) write_session: String,
    /// `?1` after (exclusive), `?2` up to (inclusive): records of one session's epoch.
    pub(crate) drop_range: String,
    /// As `drop_range`, `?3` now, `?4` until.
    pub(crate) keep_range: String,
    /// `?1` now, `?2` batch.
    pub(crate) reap: String,
    /// `?1` storage key: every column an operator reads.
    pub(crate) inspect: String,
    /// The listings, one per [`Listed`]: `?1` now, `?2` age-stamp cut-off (at most), `?3` and
    /// `?4` the cursor's stamp and storage key (after them), `?5` limit. Oldest first by
    /// `stamp`, then storage key.
    pub(crate) list_in_flight: String,
    pub(crate) list_released: String,
    pub(crate) list_completed: String,
    pub(crate) list_abandoned: String,
    /// `?1` key, `?2` now: an operator's release (the lease ends now if it had not).
    pub(crate) repair_release: String,
    /// `?1` key, `?2` new token, `?3` payload, `?4` expiry, `?5` now: an operator's give-up.
    pub(crate) repair_give_up: String,
    /// `?1` key.
    pub(crate) repair_forget: String,
}

/// Which records a listing statement reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listed {
    InFlight,
    Released,
    Completed,
    Abandoned,
}

impl Sql {
    pub(crate) fn list(&self, listed: Listed) -> &str {
        match listed {
            Listed::InFlight => &self.list_in_flight,
            Listed::Released => &self.list_released,
            Listed::Completed => &self.list_completed,
            Listed::Abandoned => &self.list_abandoned,
        }
    }
}

impl Sql {
    pub(crate) fn new(prefix: &str) -> Result<Self, InvalidTablePrefix> {
        if !is_prefix(prefix) {
            return Err(InvalidTablePrefix {
                prefix: prefix.to_owned(),
            });
        }
        let records = format!("{prefix}records");
        let t = format!("\"{records}\"");
        let tokens = format!("\"{prefix}tokens\"");
        let kept_index = format!("\"{prefix}records_kept_until\"");
        let abandoned_index = format!("\"{prefix}records_abandoned\"");
        let listed_index = format!("\"{prefix}records_listed\"");
        let lapsed_index = format!("\"{prefix}records_lapsed\"");
        let owner = RequestOwner::LEN;
        // The guard of every operation of the owner: this key, this token, in flight, and the
        // lease not ended; and a row a claim can read (a time that is not an integer is no
        // lease, a damaged row is nobody's), so that garbage is never overwritten.
        let owned = "storage_key = ?1 AND token = ?2 AND state = 'in_flight' \
                     AND typeof(expires_at) = 'integer' AND expires_at > ?3 \
                     AND typeof(kept_until) = 'integer' \
                     AND typeof(lifetime) = 'integer' AND lifetime BETWEEN 1 AND token \
                     AND typeof(fingerprint) = 'blob' AND length(fingerprint) = 32";
        // In-flight records holding a request whose lease ended by `?2`, still kept at `?1`.
        let idle = "state = 'in_flight' AND request IS NOT NULL AND expires_at <= ?2 \
                    AND kept_until > ?1 AND length(storage_key) IN (32, 48)";
        let listed = "storage_key, fingerprint, request, expires_at";
        // The columns an operator reads (`InspectStore`), added since the first version: a
        // table made before them gets them at its next migration, its rows with no label, not
        // released, no count of claims (0) and no time in their state (set then: see
        // `migrate`).
        let added = [
            ("label", "label BLOB"),
            ("released", "released INTEGER NOT NULL DEFAULT 0"),
            ("attempts", "attempts INTEGER NOT NULL DEFAULT 0"),
            ("since", "since INTEGER"),
        ];
        // Live request records in a listing's order, with the columns `inspect` reads.
        let info = "storage_key, state, fingerprint, token, expires_at, kept_until, payload, \
                    steps, request, label, released, attempts, since";
        // One listing read on the `listed` index: request records of `state` (and `released`)
        // by `since`, then storage key, after the cursor, at most the cut-off old.
        let by_since = |state: &str, released: u8, live: &str| {
            format!(
                "SELECT {info}, since AS stamp FROM {t} INDEXED BY {listed_index} \
                 WHERE state = '{state}' AND released = {released} AND {live} \
                 AND typeof(since) = 'integer' AND since <= ?2 \
                 AND (since, storage_key) > (?3, ?4) AND typeof(storage_key) = 'blob' \
                 ORDER BY since, storage_key LIMIT ?5"
            )
        };
        let released_live = "expires_at <= ?1 AND kept_until > ?1";
        let list_released = by_since("in_flight", 1, released_live);
        // In flight with a lease that ended, not released: by the lease's end.
        let lapsed = format!(
            "SELECT {info}, expires_at AS stamp FROM {t} INDEXED BY {lapsed_index} \
             WHERE state = 'in_flight' AND released = 0 AND expires_at <= ?1 AND kept_until > ?1 \
             AND typeof(expires_at) = 'integer' AND expires_at <= ?2 \
             AND (expires_at, storage_key) > (?3, ?4) AND typeof(storage_key) = 'blob' \
             ORDER BY expires_at, storage_key LIMIT ?5"
        );
        Ok(Sql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 storage_key BLOB NOT NULL PRIMARY KEY, \
                 state TEXT NOT NULL, \
                 fingerprint BLOB NOT NULL, \
                 token INTEGER NOT NULL, \
                 lifetime INTEGER NOT NULL, \
                 epoch INTEGER, \
                 expires_at INTEGER NOT NULL, \
                 kept_until INTEGER NOT NULL, \
                 payload BLOB, \
                 steps BLOB, \
                 request BLOB, \
                 {})",
                added.map(|(_, column)| column).join(", ")
            ),
            columns: added
                .iter()
                .map(|&(name, column)| (name, format!("ALTER TABLE {t} ADD COLUMN {column}")))
                .collect(),
            table_columns: "SELECT name FROM pragma_table_info(?1)".to_owned(),
            backfill_since: format!(
                "UPDATE {t} SET since = ?1 WHERE since IS NULL AND state IN ('in_flight', 'completed')"
            ),
            migrate: vec![
                format!("CREATE INDEX IF NOT EXISTS {kept_index} ON {t} (kept_until)"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {abandoned_index} ON {t} \
                     (substr(request, 1, {owner}), expires_at) \
                     WHERE state = 'in_flight' AND request IS NOT NULL"
                ),
                // The listings: records by state and time in it, and lapsed leases by their end.
                format!(
                    "CREATE INDEX IF NOT EXISTS {listed_index} ON {t} \
                     (state, released, since, storage_key)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {lapsed_index} ON {t} (expires_at, storage_key) \
                     WHERE state = 'in_flight' AND released = 0"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {tokens} (\
                     name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL)"
                ),
                // Made once; a counter that went missing is made again above every number
                // the records still hold, so no token or epoch is handed out twice for them.
                format!(
                    "INSERT OR IGNORE INTO {tokens} (name, value) SELECT 'last', \
                     max(coalesce(max(CASE WHEN typeof(token) = 'integer' THEN token END), 0), \
                         coalesce(max(CASE WHEN typeof(epoch) = 'integer' THEN epoch END), 0)) \
                     FROM {t}"
                ),
            ],
            read_claim: format!(
                "SELECT state, fingerprint, token, lifetime, expires_at, kept_until, payload \
                 FROM {t} WHERE storage_key = ?1"
            ),
            begin: format!(
                "INSERT INTO {t} (storage_key, state, fingerprint, token, lifetime, epoch, \
                 expires_at, kept_until, payload, steps, request, label, released, attempts, \
                 since) \
                 VALUES (?1, 'in_flight', ?2, ?3, ?3, NULL, ?4, ?5, NULL, NULL, NULL, ?6, 0, 1, ?7) \
                 ON CONFLICT (storage_key) DO UPDATE SET state = excluded.state, \
                 fingerprint = excluded.fingerprint, token = excluded.token, \
                 lifetime = excluded.lifetime, epoch = NULL, expires_at = excluded.expires_at, \
                 kept_until = excluded.kept_until, payload = NULL, steps = NULL, request = NULL, \
                 label = excluded.label, released = 0, attempts = 1, since = excluded.since"
            ),
            // A record counted before (attempts 0: written before this store counted) stays
            // uncounted.
            take_over: format!(
                "UPDATE {t} SET token = ?2, expires_at = ?3, kept_until = ?4, released = 0, \
                 attempts = CASE WHEN typeof(attempts) = 'integer' \
                     AND attempts BETWEEN 1 AND 4294967294 THEN attempts + 1 ELSE 0 END, \
                 since = ?5 WHERE storage_key = ?1"
            ),
            read_counter: format!("SELECT value FROM {tokens} WHERE name = 'last'"),
            write_counter: format!("UPDATE {tokens} SET value = ?1 WHERE name = 'last'"),
            complete: format!(
                "UPDATE {t} SET state = 'completed', payload = ?4, expires_at = ?5, \
                 kept_until = ?5, steps = NULL, request = NULL, released = 0, since = ?3 \
                 WHERE {owned}"
            ),
            completed_by: format!(
                "SELECT 1 FROM {t} WHERE storage_key = ?1 AND token = ?2 \
                 AND state = 'completed' AND typeof(expires_at) = 'integer' AND expires_at > ?3"
            ),
            release: format!(
                "UPDATE {t} SET expires_at = ?3, released = 1, since = ?3 WHERE {owned}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = ?4, kept_until = max(kept_until, ?4) WHERE {owned}"
            ),
            // `||` makes text of its operands' bytes, unchanged; the cast makes them a blob
            // again, byte for byte.
            save_step: format!(
                "UPDATE {t} SET steps = CAST(coalesce(steps, x'') || ?4 AS BLOB) WHERE {owned}"
            ),
            load_steps: format!("SELECT steps FROM {t} WHERE {owned}"),
            save_request: format!("UPDATE {t} SET request = ?4 WHERE {owned}"),
            abandoned: format!(
                "SELECT {listed} FROM {t} WHERE {idle} AND length(request) < {owner} \
                 ORDER BY expires_at LIMIT ?3"
            ),
            // The owner's bytes compared as the index holds them, so only their rows are read.
            abandoned_of: format!(
                "SELECT {listed} FROM {t} WHERE {idle} AND substr(request, 1, {owner}) = ?4 \
                 ORDER BY expires_at LIMIT ?3"
            ),
            read_session: format!(
                "SELECT state, token, lifetime, epoch, expires_at FROM {t} WHERE storage_key = ?1"
            ),
            write_session: format!(
                "INSERT INTO {t} (storage_key, state, fingerprint, token, lifetime, epoch, \
                 expires_at, kept_until, payload, steps, request) \
                 VALUES (?1, 'session', x'', ?2, ?3, ?4, ?5, ?5, NULL, NULL, NULL) \
                 ON CONFLICT (storage_key) DO UPDATE SET state = excluded.state, \
                 fingerprint = excluded.fingerprint, token = excluded.token, \
                 lifetime = excluded.lifetime, epoch = excluded.epoch, \
                 expires_at = excluded.expires_at, kept_until = excluded.kept_until, \
                 payload = NULL, steps = NULL, request = NULL"
            ),
            drop_range: format!("DELETE FROM {t} WHERE storage_key > ?1 AND storage_key <= ?2"),
            keep_range: format!(
                "UPDATE {t} SET \
                 expires_at = CASE WHEN state = 'completed' AND expires_at > ?3 \
                     THEN max(expires_at, ?4) ELSE expires_at END, \
                 kept_until = CASE WHEN state = 'in_flight' OR expires_at > ?3 \
                     THEN max(kept_until, ?4) ELSE kept_until END \
                 WHERE storage_key > ?1 AND storage_key <= ?2 \
                 AND state IN ('in_flight', 'completed')"
            ),
            reap: format!(
                "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} \
                 WHERE kept_until <= ?1 AND expires_at <= ?1 LIMIT ?2)"
            ),
            inspect: format!("SELECT {info} FROM {t} WHERE storage_key = ?1"),
            list_in_flight: by_since("in_flight", 0, "expires_at > ?1"),
            list_completed: by_since("completed", 0, "expires_at > ?1"),
            // Released and lapsed records, each read in order on its index, merged: at most
            // twice the page's rows are read.
            list_abandoned: format!(
                "SELECT * FROM ({list_released}) UNION ALL SELECT * FROM ({lapsed}) \
                 ORDER BY stamp, storage_key LIMIT ?5"
            ),
            list_released,
            repair_release: format!(
                "UPDATE {t} SET expires_at = min(expires_at, ?2), released = 1, \
                 since = min(expires_at, ?2) \
                 WHERE storage_key = ?1"
            ),
            repair_give_up: format!(
                "UPDATE {t} SET state = 'completed', token = ?2, payload = ?3, expires_at = ?4, \
                 kept_until = ?4, steps = NULL, request = NULL, released = 0, since = ?5 \
                 WHERE storage_key = ?1"
            ),
            repair_forget: format!("DELETE FROM {t} WHERE storage_key = ?1"),
            records,
        })
    }
}

/// Milliseconds since the Unix epoch by this host's wall clock (zero before it).
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, millis)
}

/// A duration in whole milliseconds, at most `i64::MAX`.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// `now` plus `duration`, saturating.
pub(crate) fn after(now: i64, duration: Duration) -> i64 {
    now.saturating_add(millis(duration))
}

/// The time from `now` until `then` (zero if it passed).
pub(crate) fn until(now: i64, then: i64) -> Duration {
    Duration::from_millis(u64::try_from(then.saturating_sub(now)).unwrap_or(0))
}

/// A token as stored: `INTEGER` is signed 64 bits, so above `i64::MAX` no row can hold it.
pub(crate) fn token_param(token: FencingToken) -> Option<i64> {
    i64::try_from(token.get()).ok()
}

/// A parameter of a guarded statement after the key, the token and the time.
pub(crate) enum Param<'a> {
    Bytes(&'a [u8]),
    /// The time this long after the statement's `now`.
    From(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_empty_or_lowercase_identifiers() {
        for good in ["", "idempotent_", "_", "a", "billing_v2_", &"a".repeat(48)] {
            assert!(Sql::new(good).is_ok(), "{good:?} refused");
        }
        for bad in [
            "1a",
            "Upper_",
            "a-b",
            "a b",
            "x\"; DROP TABLE users; --",
            "a.b",
            "é",
            "a\0",
            &"a".repeat(49),
        ] {
            let error = Sql::new(bad).unwrap_err();
            assert!(
                error.to_string().contains("invalid table prefix"),
                "{error}"
            );
        }
    }

    #[test]
    fn names_are_quoted_and_prefixed() {
        let sql = Sql::new("billing_").unwrap();
        assert_eq!(sql.records, "billing_records");
        assert!(sql.create.contains("\"billing_records\""));
        assert!(
            sql.columns
                .iter()
                .all(|(_, add)| add.contains("\"billing_records\""))
        );
        assert!(
            sql.migrate
                .iter()
                .any(|m| m.contains("\"billing_records_listed\""))
        );
        assert!(sql.migrate[4].contains("\"billing_tokens\""));
        assert!(sql.read_counter.contains("\"billing_tokens\""));
        assert!(sql.reap.contains("FROM \"billing_records\""));
    }

    #[test]
    fn times_saturate() {
        assert_eq!(millis(Duration::MAX), i64::MAX);
        assert_eq!(after(i64::MAX - 1, Duration::from_secs(1)), i64::MAX);
        assert_eq!(until(10, 5), Duration::ZERO);
        assert_eq!(until(5, 10), Duration::from_millis(5));
        assert_eq!(token_param(FencingToken::new(u64::MAX)), None);
        assert_eq!(token_param(FencingToken::new(7)), Some(7));
    }
}
