//! Reading rows back: every value is checked for its type and range, so a damaged row is
//! [`StoreError::Corrupt`], never a panic and never taken for something it is not.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::session::MAX_SEQ;
use idempotent_core::{Claim, Fingerprint, SessionKey, SessionMark, StorageKey, StoreError};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row as _, TypeInfo as _, ValueRef as _};

use crate::error::{corrupt, store_error};
use crate::sql::until;

/// The SQLite type of a column's value in `row`, or `None` for `NULL`.
fn kind(row: &SqliteRow, column: &str) -> Result<Option<String>, StoreError> {
    let raw = row
        .try_get_raw(column)
        .map_err(|e| store_error(format!("reading column {column}"), e))?;
    if raw.is_null() {
        return Ok(None);
    }
    Ok(Some(raw.type_info().name().to_owned()))
}

/// An `INTEGER` column (`None` for `NULL`); any other type is corrupt.
pub(crate) fn integer(row: &SqliteRow, column: &str) -> Result<Option<i64>, StoreError> {
    match kind(row, column)?.as_deref() {
        None => Ok(None),
        Some("INTEGER") => row
            .try_get::<i64, _>(column)
            .map(Some)
            .map_err(|e| store_error(format!("reading column {column}"), e)),
        Some(other) => Err(corrupt(format_args!("{column} is {other}, not an integer"))),
    }
}

/// A `BLOB` column (`None` for `NULL`); any other type is corrupt.
pub(crate) fn blob(row: &SqliteRow, column: &str) -> Result<Option<Vec<u8>>, StoreError> {
    match kind(row, column)?.as_deref() {
        None => Ok(None),
        Some("BLOB") => row
            .try_get::<Vec<u8>, _>(column)
            .map(Some)
            .map_err(|e| store_error(format!("reading column {column}"), e)),
        Some(other) => Err(corrupt(format_args!("{column} is {other}, not a blob"))),
    }
}

/// A `TEXT` column (`None` for `NULL`); any other type is corrupt.
pub(crate) fn text(row: &SqliteRow, column: &str) -> Result<Option<String>, StoreError> {
    match kind(row, column)?.as_deref() {
        None => Ok(None),
        Some("TEXT") => row
            .try_get::<String, _>(column)
            .map(Some)
            .map_err(|e| store_error(format!("reading column {column}"), e)),
        Some(other) => Err(corrupt(format_args!("{column} is {other}, not text"))),
    }
}

pub(crate) fn required<T>(value: Option<T>, column: &str) -> Result<T, StoreError> {
    value.ok_or_else(|| corrupt(format_args!("{column} is NULL")))
}

/// A token (or epoch) column: a positive integer.
pub(crate) fn token(row: &SqliteRow, column: &str) -> Result<u64, StoreError> {
    let value = required(integer(row, column)?, column)?;
    u64::try_from(value)
        .ok()
        .filter(|&t| t > 0)
        .ok_or_else(|| corrupt(format_args!("{column} {value} is not a positive number")))
}

pub(crate) fn fingerprint(row: &SqliteRow) -> Result<Fingerprint, StoreError> {
    let bytes = required(blob(row, "fingerprint")?, "fingerprint")?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map(Fingerprint::from_digest)
        .map_err(|_| corrupt(format_args!("fingerprint is {} bytes, not 32", bytes.len())))
}

/// A record as a claim sees it.
#[derive(Debug)]
pub(crate) enum Stored {
    /// Past its time (a completed record past its TTL, an abandoned claim past the TTL it was
    /// claimed with): as good as absent. Its token, if readable, so the next is above it.
    Expired { token: Option<u64> },
    /// In flight and still kept: its lease runs until `lease_until` (an abandoned claim once
    /// that passed).
    InFlight {
        fingerprint: Fingerprint,
        token: u64,
        lifetime: u64,
        lease_until: i64,
    },
    /// A live completed record.
    Completed {
        fingerprint: Fingerprint,
        payload: Bytes,
        expires_at: i64,
    },
}

impl Stored {
    /// Reads the row of the claim statement at `now`. A row whose times cannot be read is
    /// corrupt (nobody can tell whether it is live); one past its time is expired whatever
    /// else it holds; a live one must be whole.
    pub(crate) fn decode(row: &SqliteRow, now: i64) -> Result<Self, StoreError> {
        let expires_at = required(integer(row, "expires_at")?, "expires_at")?;
        let kept_until = required(integer(row, "kept_until")?, "kept_until")?;
        let expired = || Stored::Expired {
            token: token(row, "token").ok(),
        };
        if expires_at.max(kept_until) <= now {
            return Ok(expired());
        }
        let state = required(text(row, "state")?, "state")?;
        match state.as_str() {
            "in_flight" => {
                let token = token(row, "token")?;
                let lifetime = self::token(row, "lifetime")?;
                if lifetime > token {
                    return Err(corrupt(format_args!(
                        "lifetime {lifetime} begins after token {token}"
                    )));
                }
                Ok(Stored::InFlight {
                    fingerprint: fingerprint(row)?,
                    token,
                    lifetime,
                    lease_until: expires_at,
                })
            }
            "completed" if expires_at <= now => Ok(expired()),
            "completed" => {
                let payload = blob(row, "payload")?
                    .ok_or_else(|| corrupt("a completed record without a payload"))?;
                Ok(Stored::Completed {
                    fingerprint: fingerprint(row)?,
                    payload: Bytes::from(payload),
                    expires_at,
                })
            }
            other => Err(corrupt(format_args!(
                "unknown record state {other:?} at a request's key"
            ))),
        }
    }
}

/// What a claim (or with `resume`, a takeover only) does about what it found.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Tell the caller; change nothing.
    Report(Claim),
    /// A resume found nothing of its request to take over; change nothing.
    Nothing,
    /// A new lifetime, with a token above `floor`.
    Begin { floor: u64 },
    /// Take the abandoned claim over: its lifetime goes on.
    TakeOver { lifetime: u64, floor: u64 },
}

/// The claim's rules (see [`Store::claim`](idempotent_core::Store::claim) and
/// [`CheckpointStore::resume`](idempotent_core::CheckpointStore::resume)) applied to what the key holds at `now`.
pub(crate) fn decide(
    found: Option<Stored>,
    fingerprint: &Fingerprint,
    now: i64,
    resume: bool,
) -> Decision {
    match found {
        None => {
            if resume {
                Decision::Nothing
            } else {
                Decision::Begin { floor: 0 }
            }
        }
        Some(Stored::Expired { token }) => {
            if resume {
                Decision::Nothing
            } else {
                Decision::Begin {
                    floor: token.unwrap_or(0),
                }
            }
        }
        Some(Stored::Completed {
            fingerprint,
            payload,
            expires_at,
        }) => Decision::Report(Claim::Completed {
            fingerprint,
            payload,
            expires_in: until(now, expires_at),
        }),
        Some(Stored::InFlight {
            fingerprint: owner,
            lease_until,
            ..
        }) if lease_until > now => Decision::Report(Claim::InFlight {
            fingerprint: owner,
            retry_after: until(now, lease_until),
        }),
        Some(Stored::InFlight {
            fingerprint: owner,
            token,
            lifetime,
            ..
        }) if owner == *fingerprint => Decision::TakeOver {
            lifetime,
            floor: token,
        },
        // Abandoned by another request: still that request's key until it expires.
        Some(Stored::InFlight {
            fingerprint: owner, ..
        }) => {
            if resume {
                Decision::Nothing
            } else {
                Decision::Report(Claim::InFlight {
                    fingerprint: owner,
                    retry_after: Duration::ZERO,
                })
            }
        }
    }
}

/// A session's own record, as its gate reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Session {
    pub(crate) epoch: u64,
    /// The acknowledged mark.
    pub(crate) ack: u64,
    /// The highest sequence number admitted.
    pub(crate) high: u64,
}

impl Session {
    /// The live session in `row` at `now`, `None` if it expired; a live row that is not a
    /// valid session is corrupt.
    pub(crate) fn decode(row: &SqliteRow, now: i64) -> Result<Option<Self>, StoreError> {
        let expires_at = required(integer(row, "expires_at")?, "expires_at")?;
        if expires_at <= now {
            return Ok(None);
        }
        let invalid = || corrupt("the row at a session's key is not a valid session");
        if text(row, "state")?.as_deref() != Some("session") {
            return Err(invalid());
        }
        let number = |column: &str| -> Result<u64, StoreError> {
            integer(row, column)?
                .and_then(|n| u64::try_from(n).ok())
                .filter(|&n| n <= MAX_SEQ)
                .ok_or_else(invalid)
        };
        Ok(Some(Session {
            ack: number("token")?,
            high: number("lifetime")?,
            epoch: token(row, "epoch").map_err(|_| invalid())?,
        }))
    }

    pub(crate) fn mark(self) -> SessionMark {
        SessionMark {
            epoch: self.epoch,
            ack: self.ack,
        }
    }
}

/// The storage key whose [record bytes](StorageKey::record_bytes) are `bytes`: a key of its
/// own (32 bytes), a session's own record or a place in one (48).
pub(crate) fn storage_key(bytes: &[u8]) -> Option<StorageKey> {
    let digest = <[u8; 32]>::try_from(bytes.get(..32)?).ok()?;
    match bytes.len() {
        32 => Some(StorageKey::from_bytes(digest)),
        48 => {
            let number = |at: usize| {
                <[u8; 8]>::try_from(bytes.get(at..at + 8)?)
                    .ok()
                    .map(u64::from_be_bytes)
            };
            let session = SessionKey::from_bytes(digest);
            match (number(32)?, number(40)?) {
                (0, 0) => Some(session.record_key()),
                (epoch, seq) => Some(session.seq_key(epoch, seq)),
            }
        }
        _ => None,
    }
}

/// The record bytes of request `seq` of `session` in `epoch` (as
/// [`SessionKey::seq_key`]`(epoch, seq)` has them), for ranges of one epoch's records.
pub(crate) fn seq_bytes(session: &SessionKey, epoch: u64, seq: u64) -> Vec<u8> {
    session.seq_key(epoch, seq).record_bytes().as_ref().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_keys_round_trip_through_their_record_bytes() {
        let digest = [7; 32];
        let session = SessionKey::from_bytes(digest);
        for key in [
            StorageKey::from_bytes(digest),
            session.record_key(),
            session.seq_key(3, 9),
            session.seq_key(u64::MAX, 1),
        ] {
            assert_eq!(storage_key(key.record_bytes().as_ref()), Some(key));
        }
        for bad in [&[][..], &[1; 31], &[1; 33], &[1; 47], &[1; 49]] {
            assert_eq!(storage_key(bad), None);
        }
    }

    #[test]
    fn the_claim_rules() {
        let (mine, theirs) = (Fingerprint::from_bytes(b"a"), Fingerprint::from_bytes(b"b"));
        let in_flight = |lease_until| Stored::InFlight {
            fingerprint: mine,
            token: 5,
            lifetime: 3,
            lease_until,
        };
        assert!(matches!(
            decide(None, &mine, 10, false),
            Decision::Begin { floor: 0 }
        ));
        assert!(matches!(decide(None, &mine, 10, true), Decision::Nothing));
        assert!(matches!(
            decide(Some(Stored::Expired { token: Some(9) }), &mine, 10, false),
            Decision::Begin { floor: 9 }
        ));
        assert!(matches!(
            decide(Some(in_flight(20)), &theirs, 10, false),
            Decision::Report(Claim::InFlight { retry_after, .. }) if retry_after == Duration::from_millis(10)
        ));
        assert!(matches!(
            decide(Some(in_flight(10)), &mine, 10, true),
            Decision::TakeOver {
                lifetime: 3,
                floor: 5
            }
        ));
        assert!(matches!(
            decide(Some(in_flight(10)), &theirs, 10, false),
            Decision::Report(Claim::InFlight { retry_after: Duration::ZERO, fingerprint }) if fingerprint == mine
        ));
        assert!(matches!(
            decide(Some(in_flight(10)), &theirs, 10, true),
            Decision::Nothing
        ));
    }
}
