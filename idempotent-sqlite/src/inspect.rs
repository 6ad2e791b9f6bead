//! [`InspectStore`] for [`SqliteStore`]: a record read by its key, listings in pages on the
//! `listed` and `lapsed` indexes, repairs as one write transaction each, and a session's state.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::inspect::{
    Cursor, InspectStore, KeyLabel, ListQuery, Listed, Page, RecordInfo, RecordState, Refusal,
    Repair, Repaired,
};
use idempotent_core::session::SessionState;
use idempotent_core::{FencingToken, SessionKey, StorageKey, StoreError, limits};
use sqlx::Executor as _;
use sqlx::sqlite::{SqliteConnection, SqliteRow};

use crate::error::{corrupt, store_error};
use crate::row::{self, Session};
use crate::sql::{self, after, millis, now_ms, until};
use crate::store::{Inner, SqliteStore};

/// The most records one page of a listing holds, whatever its query's limit.
pub(crate) const MAX_PAGE: usize = 1000;

/// What an operator sees of the row read by the `inspect` statement (or a listing) under `key`
/// at `now`: `None` when it is past its time, or not a request's record (a session's own).
/// A live row this store cannot read is corrupt; its label, which only helps an operator
/// recognise it, reads as none when it is not a blob.
pub(crate) fn record_info(
    row: &SqliteRow,
    key: StorageKey,
    now: i64,
) -> Result<Option<RecordInfo>, StoreError> {
    let expires_at = row::required(row::integer(row, "expires_at")?, "expires_at")?;
    let kept_until = row::required(row::integer(row, "kept_until")?, "kept_until")?;
    if expires_at.max(kept_until) <= now {
        return Ok(None);
    }
    let state = row::required(row::text(row, "state")?, "state")?;
    let in_flight = match state.as_str() {
        "in_flight" => true,
        "completed" if expires_at <= now => return Ok(None),
        "completed" => false,
        "session" => return Ok(None),
        other => {
            return Err(corrupt(format_args!(
                "unknown record state {other:?} at a request's key"
            )));
        }
    };
    let token = FencingToken::new(row::token(row, "token")?);
    let fingerprint = row::fingerprint(row)?;
    let label = row::blob(row, "label")
        .ok()
        .flatten()
        .map(|bytes| KeyLabel::from_bytes(Bytes::from(bytes)));
    let released = match row::integer(row, "released")? {
        None | Some(0) => false,
        Some(1) => true,
        Some(other) => return Err(corrupt(format_args!("released is {other}, not 0 or 1"))),
    };
    let attempts = match row::integer(row, "attempts")? {
        None => 0,
        Some(n) => u32::try_from(n)
            .map_err(|_| corrupt(format_args!("attempts {n} is not a count of claims")))?,
    };
    let since = row::integer(row, "since")?;
    let lease_live = in_flight && expires_at > now;
    // A live lease is never released (a row claimed again by a process of an earlier version
    // keeps the flag it had).
    let released = in_flight && released && !lease_live;
    let lapsed = in_flight && !lease_live && !released;
    // When it entered its state: what a listing orders by.
    let stamp = if lapsed || (released && since.is_none()) {
        Some(expires_at)
    } else {
        since
    };
    let (steps, request, payload) = if in_flight {
        (
            row::blob(row, "steps")?
                .map(Bytes::from)
                .unwrap_or_default(),
            row::blob(row, "request")?.map(Bytes::from),
            None,
        )
    } else {
        let payload = row::blob(row, "payload")?
            .ok_or_else(|| corrupt("a completed record without a payload"))?;
        (Bytes::new(), None, Some(Bytes::from(payload)))
    };
    Ok(Some(RecordInfo {
        key,
        state: if !in_flight {
            RecordState::Completed
        } else if released {
            RecordState::Released
        } else {
            RecordState::InFlight
        },
        token,
        fingerprint,
        label,
        lease_left: if lease_live {
            until(now, expires_at)
        } else {
            Duration::ZERO
        },
        expires_in: if in_flight {
            until(now, expires_at.max(kept_until))
        } else {
            until(now, expires_at)
        },
        age: stamp.map_or(Duration::ZERO, |stamp| until(stamp, now)),
        attempts,
        steps,
        request,
        payload,
    }))
}

/// A listing cursor: the last record's age stamp (ms) and storage key bytes in hex.
fn cursor(stamp: i64, key: &[u8]) -> Cursor {
    let mut text = format!("{stamp}:");
    for byte in key {
        text.push_str(&format!("{byte:02x}"));
    }
    Cursor(text)
}

fn parse_cursor(cursor: &str) -> Result<(i64, Vec<u8>), StoreError> {
    let bad = || StoreError::Backend(format!("not a SQLite listing cursor: {cursor:?}").into());
    let (stamp, key) = cursor.split_once(':').ok_or_else(bad)?;
    let stamp = stamp.parse::<i64>().map_err(|_| bad())?;
    if key.len() % 2 != 0 || key.len() > 2 * 48 || !key.is_ascii() {
        return Err(bad());
    }
    let key = (0..key.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&key[at..at + 2], 16).map_err(|_| bad()))
        .collect::<Result<Vec<u8>, _>>()?;
    Ok((stamp, key))
}

impl Inner {
    pub(crate) async fn inspect(&self, key: &StorageKey) -> Result<Option<RecordInfo>, StoreError> {
        let doing = "inspecting a record";
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.inspect).bind(record.as_ref());
        let mut reader = self.reader(doing).await?;
        let row = reader
            .fetch_optional(query)
            .await
            .map_err(|e| store_error(doing, e))?;
        let now = now_ms();
        Ok(row
            .map(|row| record_info(&row, *key, now))
            .transpose()?
            .flatten())
    }

    /// One read of at most a page and one row more (to know whether more follow), on the index
    /// of its state. A row that cannot be read is skipped with a warning, not the page: the
    /// cursor still goes past it.
    pub(crate) async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let doing = "listing records";
        let (after_stamp, after_key) = match &query.after {
            None => (i64::MIN, Vec::new()),
            Some(cursor) => parse_cursor(&cursor.0)?,
        };
        let limit = query.limit.clamp(1, MAX_PAGE);
        let listed = match query.state {
            Listed::InFlight => sql::Listed::InFlight,
            Listed::Abandoned => sql::Listed::Abandoned,
            Listed::Released => sql::Listed::Released,
            Listed::Completed => sql::Listed::Completed,
        };
        let now = now_ms();
        let statement = sqlx::query(self.sql.list(listed))
            .bind(now)
            .bind(now.saturating_sub(millis(query.older_than)))
            .bind(after_stamp)
            .bind(after_key)
            .bind(limit as i64 + 1);
        let mut reader = self.reader(doing).await?;
        let mut rows = reader
            .fetch_all(statement)
            .await
            .map_err(|e| store_error(doing, e))?;
        drop(reader);
        let next = if rows.len() > limit {
            rows.truncate(limit);
            let last = rows.last().ok_or_else(|| corrupt("an empty page"))?;
            let stamp = row::required(row::integer(last, "stamp")?, "stamp")?;
            let key = row::required(row::blob(last, "storage_key")?, "storage_key")?;
            Some(cursor(stamp, &key))
        } else {
            None
        };
        let records = rows
            .iter()
            .filter_map(|row| {
                let read = row::blob(row, "storage_key").and_then(|key| {
                    let key = key
                        .as_deref()
                        .and_then(row::storage_key)
                        .ok_or_else(|| corrupt("storage key is not 32 or 48 bytes"))?;
                    record_info(row, key, now)
                });
                match read {
                    Ok(info) => info,
                    Err(error) => {
                        tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "a listed record cannot be read; skipped"
                        );
                        None
                    }
                }
            })
            .filter(|info| query.state.matches(info) && info.age >= query.older_than)
            .collect();
        Ok(Page { records, next })
    }

    /// The repair's checks and change in one write transaction.
    pub(crate) async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let doing = "repairing a record";
        let mut tx = self.begin(doing).await?;
        let repaired = self
            .repair_under_lock(&mut tx, key, token, repair, force)
            .await;
        let repaired = tx.finish(repaired, doing).await?;
        if repaired == Repaired::Done {
            self.changed.notify_waiters();
        }
        Ok(repaired)
    }

    async fn repair_under_lock(
        &self,
        tx: &mut SqliteConnection,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let doing = "repairing a record";
        let record = key.record_bytes();
        let record = record.as_ref();
        // The time is read once the write lock is held.
        let now = now_ms();
        let row = tx
            .fetch_optional(sqlx::query(&self.sql.inspect).bind(record))
            .await
            .map_err(|e| store_error(doing, e))?;
        let Some(info) = row
            .map(|row| record_info(&row, *key, now))
            .transpose()?
            .flatten()
        else {
            return Ok(Repaired::Refused(Refusal::Absent));
        };
        if info.token != token {
            return Ok(Repaired::Refused(Refusal::TokenMoved { now: info.token }));
        }
        if !info.lease_left.is_zero() && !force {
            return Ok(Repaired::Refused(Refusal::LeaseLive {
                left: info.lease_left,
            }));
        }
        let change = match (repair, info.state) {
            (Repair::Forget, _) => sqlx::query(&self.sql.repair_forget).bind(record),
            (Repair::Release | Repair::GiveUp { .. }, RecordState::Completed) => {
                return Ok(Repaired::Refused(Refusal::Completed));
            }
            (Repair::Release, RecordState::Released) => return Ok(Repaired::Done),
            (Repair::Release, RecordState::InFlight) => {
                sqlx::query(&self.sql.repair_release).bind(record).bind(now)
            }
            (Repair::GiveUp { payload, ttl }, _) => {
                // Above every token before, as a claim's.
                let new = self.next_token(tx, token.get()).await?;
                sqlx::query(&self.sql.repair_give_up)
                    .bind(record)
                    .bind(new.get() as i64)
                    .bind(payload.as_ref())
                    .bind(after(now, limits::clamp_ttl(*ttl)))
                    .bind(now)
            }
        };
        tx.execute(change)
            .await
            .map_err(|e| store_error(doing, e))?;
        Ok(Repaired::Done)
    }

    pub(crate) async fn session_state(
        &self,
        session: &SessionKey,
    ) -> Result<Option<SessionState>, StoreError> {
        let doing = "reading a session";
        let record = session.record_key().record_bytes();
        let query = sqlx::query(&self.sql.read_session).bind(record.as_ref());
        let mut reader = self.reader(doing).await?;
        let row = reader
            .fetch_optional(query)
            .await
            .map_err(|e| store_error(doing, e))?;
        let now = now_ms();
        Ok(row
            .map(|row| Session::decode(&row, now))
            .transpose()?
            .flatten()
            .map(|session| SessionState {
                epoch: session.epoch,
                ack: session.ack,
                high: session.high,
            }))
    }
}

/// Reads run on the read connections; a repair is one `BEGIN IMMEDIATE` transaction, so its
/// checks and its change are one step for every process on the file.
///
/// [`list`](InspectStore::list) reads one page (and one row more) in order on an index:
/// in-flight, released and completed records on `{prefix}records_listed`
/// (`state, released, since, storage_key`), abandoned ones by merging the released records
/// from that index with the lapsed leases from `{prefix}records_lapsed` (`expires_at,
/// storage_key` of the in-flight rows not released): oldest first, by the time each entered
/// its state (a lapsed lease: its end), then storage key. The cursor is that time and key; a
/// page holds at most 1000 records.
impl InspectStore for SqliteStore {
    async fn inspect(&self, key: &StorageKey) -> Result<Option<RecordInfo>, StoreError> {
        let key = *key;
        self.spawned(move |inner| async move { inner.inspect(&key).await })
            .await
    }

    async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let query = query.clone();
        self.spawned(move |inner| async move { inner.list(&query).await })
            .await
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let (key, repair) = (*key, repair.clone());
        self.spawned(move |inner| async move { inner.repair(&key, token, &repair, force).await })
            .await
    }

    async fn session_state(
        &self,
        session: &SessionKey,
    ) -> Result<Option<SessionState>, StoreError> {
        let session = *session;
        self.spawned(move |inner| async move { inner.session_state(&session).await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_an_error() {
        let key = [0xab; 48];
        let Cursor(text) = cursor(-5, &key);
        assert_eq!(parse_cursor(&text).unwrap(), (-5, key.to_vec()));
        assert_eq!(parse_cursor("7:").unwrap(), (7, Vec::new()));
        for bad in [
            "",
            "7",
            "x:00",
            "7:0",
            "7:zz",
            "7:é0",
            "99999999999999999999:00",
            &format!("1:{}", "00".repeat(49)),
        ] {
            match parse_cursor(bad) {
                Err(StoreError::Backend(error)) => {
                    assert!(error.to_string().contains("listing cursor"), "{error}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    /// The plan of each listing: a range of its index, read in the index's order (an abandoned
    /// listing sorts only the at most one page each of its two reads yield, to merge them).
    #[tokio::test]
    async fn listings_read_their_index_in_order() {
        use sqlx::{Connection as _, Row as _};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.db");
        SqliteStore::builder(&path)
            .reap_every(None)
            .build()
            .await
            .unwrap();
        let sql = crate::sql::Sql::new(crate::DEFAULT_TABLE_PREFIX).unwrap();
        let mut connection = sqlx::SqliteConnection::connect_with(
            &sqlx::sqlite::SqliteConnectOptions::new().filename(&path),
        )
        .await
        .unwrap();
        for listed in [
            sql::Listed::InFlight,
            sql::Listed::Released,
            sql::Listed::Completed,
            sql::Listed::Abandoned,
        ] {
            let query = sqlx::query(format!("EXPLAIN QUERY PLAN {}", sql.list(listed)).leak())
                .bind(0_i64)
                .bind(0_i64)
                .bind(i64::MIN)
                .bind(Vec::<u8>::new())
                .bind(10_i64);
            let plan: Vec<String> = connection
                .fetch_all(query)
                .await
                .unwrap()
                .iter()
                .map(|row| row.get::<String, _>("detail"))
                .collect();
            let searches: Vec<&String> = plan.iter().filter(|d| d.starts_with("SEARCH")).collect();
            let indexes: &[&str] = if listed == sql::Listed::Abandoned {
                &["idempotent_records_listed", "idempotent_records_lapsed"]
            } else {
                &["idempotent_records_listed"]
            };
            assert_eq!(searches.len(), indexes.len(), "{listed:?}: {plan:?}");
            for (search, index) in searches.iter().zip(indexes) {
                assert!(
                    search.contains(&format!("USING INDEX {index} (")) && search.contains(">"),
                    "{listed:?}: a range of {index} expected: {plan:?}"
                );
            }
            // An abandoned listing merges its two reads, each sorted again as a page's rows.
            let sorts = plan.iter().filter(|d| d.contains("TEMP B-TREE")).count();
            let merged = if listed == sql::Listed::Abandoned {
                2
            } else {
                0
            };
            assert_eq!(sorts, merged, "{listed:?}: {plan:?}");
        }
    }
}
