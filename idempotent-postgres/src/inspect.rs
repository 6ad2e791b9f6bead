//! [`InspectStore`] for [`PostgresStore`]: a record by key, listings over the index of state
//! and age (`listing_idx`: the state in the "C" collation, `since`, `storage_key`) or of lease ends (`expires_at`), repairs in one
//! transaction with the row locked.

use std::time::Duration;

use bytes::Bytes;
use sqlx::Connection as _;
use sqlx::Executor as _;
use sqlx::Row as _;
use sqlx::postgres::PgRow;

use idempotent_core::inspect::{
    Cursor, InspectStore, KeyLabel, ListQuery, Listed, Page, RecordInfo, RecordState, Refusal,
    Repair, Repaired,
};
use idempotent_core::session::SessionState;
use idempotent_core::{FencingToken, Fingerprint, SessionKey, StorageKey, StoreError, limits};

use crate::PostgresStore;
use crate::connections::Connections;
use crate::error::{corrupt, store_error};
use crate::sql::micros;

fn duration_us(row: &PgRow, column: &str) -> Result<Duration, StoreError> {
    let value: Option<i64> = row.try_get(column).map_err(store_error)?;
    Ok(Duration::from_micros(
        value.and_then(|v| u64::try_from(v).ok()).unwrap_or(0),
    ))
}

/// A row of `INSPECTED` as what an operator reads.
fn record_info(row: &PgRow) -> Result<RecordInfo, StoreError> {
    let key: Vec<u8> = row.try_get("storage_key").map_err(store_error)?;
    let key = crate::steps::storage_key(&key)
        .ok_or_else(|| corrupt("storage key is not 32 or 48 bytes"))?;
    let state: String = row.try_get("state").map_err(store_error)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(store_error)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
        .map(Fingerprint::from_digest)
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let token: i64 = row.try_get("token").map_err(store_error)?;
    let token = u64::try_from(token)
        .map(FencingToken::new)
        .map_err(|_| corrupt("token is negative"))?;
    let label: Option<Vec<u8>> = row.try_get("label").map_err(store_error)?;
    let released: bool = row.try_get("released").map_err(store_error)?;
    let attempts: i32 = row.try_get("attempts").map_err(store_error)?;
    let payload: Option<Vec<u8>> = row.try_get("payload").map_err(store_error)?;
    let steps: Vec<u8> = row.try_get("steps").map_err(store_error)?;
    let request: Option<Vec<u8>> = row.try_get("request").map_err(store_error)?;
    let left = duration_us(row, "left_us")?;
    let kept = duration_us(row, "kept_us")?;
    let since = duration_us(row, "since_us")?;
    let (state, lease_left, expires_in, age) = match state.as_str() {
        "completed" => (RecordState::Completed, Duration::ZERO, left, since),
        "in_flight" => {
            // Released only once its lease ended: a row an older release took over keeps the
            // flag it does not know to clear, under a live lease.
            let state = if released && left.is_zero() {
                RecordState::Released
            } else {
                RecordState::InFlight
            };
            if left.is_zero() {
                // Abandoned: its age counts from the lease's end.
                let ended: Option<i64> = row.try_get("left_us").map_err(store_error)?;
                let ended = Duration::from_micros(ended.map_or(0, |v| v.unsigned_abs()));
                (state, Duration::ZERO, kept, ended)
            } else {
                (state, left, kept, since)
            }
        }
        other => return Err(corrupt(&format!("a record in state {other:?}"))),
    };
    Ok(RecordInfo {
        key,
        state,
        token,
        fingerprint,
        label: label.map(|label| KeyLabel::from_bytes(Bytes::from(label))),
        lease_left,
        expires_in,
        age,
        attempts: u32::try_from(attempts).unwrap_or(0),
        steps: Bytes::from(steps),
        request: request.map(Bytes::from),
        payload: if state == RecordState::Completed {
            payload.map(Bytes::from)
        } else {
            None
        },
    })
}

/// Whether `repair` applies to the locked `row` (`Ok(true)`: change it; `Ok(false)`: done
/// already, nothing to change), or why not. Reads only the token, the state and the lease, so
/// that a row damaged elsewhere (its fingerprint, its label) can still be forgotten.
fn decide(
    row: &PgRow,
    token: FencingToken,
    repair: &Repair,
    force: bool,
) -> Result<Result<bool, Refusal>, StoreError> {
    let state: String = row.try_get("state").map_err(store_error)?;
    let current: i64 = row.try_get("token").map_err(store_error)?;
    let released: bool = row.try_get("released").map_err(store_error)?;
    let left = duration_us(row, "left_us")?;
    let current = FencingToken::new(u64::try_from(current).unwrap_or(0));
    if current != token {
        return Ok(Err(Refusal::TokenMoved { now: current }));
    }
    let completed = state == "completed";
    let live = !completed && !left.is_zero();
    if live && !force {
        return Ok(Err(Refusal::LeaseLive { left }));
    }
    Ok(match repair {
        Repair::Release | Repair::GiveUp { .. } if completed => Err(Refusal::Completed),
        // Released, its lease ended: nothing to change.
        Repair::Release => Ok(!released || live),
        _ => Ok(true),
    })
}

/// A listing cursor: `microseconds since the epoch:hex storage key`.
fn parse_cursor(cursor: &Cursor) -> Result<(i64, Vec<u8>), StoreError> {
    let bad = || StoreError::Backend(format!("not a listing cursor: {:?}", cursor.0).into());
    let (stamp, key) = cursor.0.split_once(':').ok_or_else(bad)?;
    let stamp = stamp.parse().map_err(|_| bad())?;
    if !key.len().is_multiple_of(2) || key.len() > 256 {
        return Err(bad());
    }
    let key = (0..key.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(key.get(at..at + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| bad())?;
    Ok((stamp, key))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl InspectStore for PostgresStore {
    async fn inspect(&self, key: &StorageKey) -> Result<Option<RecordInfo>, StoreError> {
        let mut connection = self.connections.get().await?;
        let query = sqlx::query(&self.sql.inspect).bind(key.record_bytes().as_ref().to_vec());
        let result = connection
            .fetch_optional(query)
            .await
            .map_err(store_error)
            .and_then(|row| row.as_ref().map(record_info).transpose());
        Connections::settle(connection, result)
    }

    async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let statement = match query.state {
            Listed::InFlight => &self.sql.list[0],
            Listed::Abandoned => &self.sql.list[1],
            Listed::Released => &self.sql.list[2],
            Listed::Completed => &self.sql.list[3],
        };
        let (stamp, after) = match &query.after {
            Some(cursor) => {
                let (stamp, key) = parse_cursor(cursor)?;
                (Some(stamp), Some(key))
            }
            None => (None, None),
        };
        let limit = i64::try_from(query.limit.clamp(1, 10_000)).unwrap_or(10_000);
        let mut connection = self.connections.get().await?;
        let statement = sqlx::query(statement)
            .bind(micros(limits::clamp_ttl(query.older_than)))
            .bind(limit)
            .bind(stamp)
            .bind(after);
        let result = async {
            let rows = connection.fetch_all(statement).await.map_err(store_error)?;
            let mut records = Vec::with_capacity(rows.len());
            let mut last = None;
            for row in &rows {
                // A damaged row is left out, not the end of the listing: the cursor goes on
                // past it.
                match record_info(row) {
                    Ok(info) => records.push(info),
                    Err(why) => {
                        tracing::warn!(error = %why, "listing skipped a damaged record");
                    }
                }
                let stamp: i64 = row.try_get("stamp_us").map_err(store_error)?;
                let key: Vec<u8> = row.try_get("storage_key").map_err(store_error)?;
                last = Some((stamp, key));
            }
            let next = match last {
                Some((stamp, key)) if rows.len() as i64 == limit => {
                    Some(Cursor(format!("{stamp}:{}", hex(&key))))
                }
                _ => None,
            };
            Ok(Page { records, next })
        }
        .await;
        Connections::settle(connection, result)
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let record = key.record_bytes().as_ref().to_vec();
        let mut connection = self.connections.get().await?;
        let result = async {
            let mut tx = (*connection).begin().await.map_err(store_error)?;
            let row = (&mut *tx)
                .fetch_optional(sqlx::query(&self.sql.inspect_for_update).bind(&record))
                .await
                .map_err(store_error)?;
            let decision = match row {
                None => Err(Refusal::Absent),
                Some(row) => decide(&row, token, repair, force)?,
            };
            let statement = match decision {
                Err(refusal) => {
                    // Ended now, not when the connection is next used: the row stays locked
                    // until then, and its owner's renewal would wait on it.
                    tx.rollback().await.map_err(store_error)?;
                    return Ok(Repaired::Refused(refusal));
                }
                Ok(false) => None,
                Ok(true) => Some(match repair {
                    Repair::Release => sqlx::query(&self.sql.repair_release).bind(&record),
                    Repair::GiveUp { payload, ttl } => sqlx::query(&self.sql.repair_give_up)
                        .bind(&record)
                        .bind(payload.as_ref())
                        .bind(micros(limits::clamp_ttl(*ttl))),
                    Repair::Forget => sqlx::query(&self.sql.repair_forget).bind(&record),
                }),
            };
            if let Some(statement) = statement {
                (&mut *tx).execute(statement).await.map_err(store_error)?;
            }
            tx.commit().await.map_err(store_error)?;
            Ok(Repaired::Done)
        }
        .await;
        Connections::settle(connection, result)
    }

    async fn session_state(
        &self,
        session: &SessionKey,
    ) -> Result<Option<SessionState>, StoreError> {
        let mut connection = self.connections.get().await?;
        let query = sqlx::query(&self.sql.session_state)
            .bind(session.record_key().record_bytes().as_ref().to_vec());
        let result = async {
            let Some(row) = connection
                .fetch_optional(query)
                .await
                .map_err(store_error)?
            else {
                return Ok(None);
            };
            let state: String = row.try_get("state").map_err(store_error)?;
            let ack: i64 = row.try_get("token").map_err(store_error)?;
            let high: Option<i64> = row.try_get("lifetime").map_err(store_error)?;
            let epoch: Option<i64> = row.try_get("claimant").map_err(store_error)?;
            match (
                state.as_str(),
                u64::try_from(ack),
                high.map(u64::try_from),
                epoch,
            ) {
                ("session", Ok(ack), Some(Ok(high)), Some(epoch)) if epoch > 0 => {
                    Ok(Some(SessionState {
                        epoch: epoch as u64,
                        ack,
                        high,
                    }))
                }
                _ => Err(corrupt("the row at a session's key is not a valid session")),
            }
        }
        .await;
        Connections::settle(connection, result)
    }
}
