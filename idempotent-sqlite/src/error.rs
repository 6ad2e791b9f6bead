//! How SQLite failures map onto [`StoreError`]: what a retry can fix, what is full, what is
//! corrupt, and what needs an operator.

use idempotent_core::StoreError;

/// A SQLite failure, with what the store was doing when it happened.
#[derive(Debug, thiserror::Error)]
#[error("{doing}: {source}")]
pub(crate) struct Failed {
    doing: String,
    source: sqlx::Error,
}

// Primary result codes (the low byte of an extended code).
const SQLITE_NOMEM: i64 = 7;
const SQLITE_BUSY: i64 = 5;
const SQLITE_LOCKED: i64 = 6;
const SQLITE_READONLY: i64 = 8;
const SQLITE_IOERR: i64 = 10;
const SQLITE_CORRUPT: i64 = 11;
const SQLITE_FULL: i64 = 13;
const SQLITE_CANTOPEN: i64 = 14;
const SQLITE_PROTOCOL: i64 = 15;
const SQLITE_TOOBIG: i64 = 18;
const SQLITE_NOTADB: i64 = 26;

/// The primary result code of a SQLite error, if it is one.
fn primary_code(error: &sqlx::Error) -> Option<i64> {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|code| code.parse::<i64>().ok())
            .map(|code| code & 0xff),
        _ => None,
    }
}

/// Whether `error` is SQLite's "busy" or "locked": another connection holds the lock.
pub(crate) fn is_busy(error: &sqlx::Error) -> bool {
    matches!(primary_code(error), Some(SQLITE_BUSY | SQLITE_LOCKED))
}

/// `error` as the store reports it, saying what the store was `doing`:
///
/// - busy or locked past the busy timeout, an I/O error, out of memory, a file that cannot be
///   opened, a connection that could not be had in time: [`StoreError::Unavailable`] (a retry
///   may succeed);
/// - the disk or the database's size limit is full, or a value is longer than SQLite's length
///   limit: [`StoreError::Capacity`] (a completion refused so is recorded by the runtime as
///   "ran, not retained");
/// - a damaged file, or a file that is not a database, or a value of the wrong type:
///   [`StoreError::Corrupt`];
/// - a read-only database, and anything else: [`StoreError::Backend`] (an operator must act).
pub(crate) fn store_error(doing: impl Into<String>, error: sqlx::Error) -> StoreError {
    let code = primary_code(&error);
    let failed = || {
        Box::new(Failed {
            doing: doing.into(),
            source: error,
        })
    };
    match code {
        Some(SQLITE_FULL) => {
            tracing::warn!(error = %failed(), "the SQLite idempotency store is full");
            StoreError::Capacity {
                what: "sqlite database or disk full",
            }
        }
        Some(SQLITE_TOOBIG) => StoreError::Capacity {
            what: "value longer than the SQLite length limit",
        },
        Some(SQLITE_CORRUPT | SQLITE_NOTADB) => StoreError::Corrupt(failed()),
        Some(
            SQLITE_BUSY | SQLITE_LOCKED | SQLITE_IOERR | SQLITE_NOMEM | SQLITE_CANTOPEN
            | SQLITE_PROTOCOL,
        ) => StoreError::Unavailable(failed()),
        Some(SQLITE_READONLY) | Some(_) => StoreError::Backend(failed()),
        None => {
            let f = failed();
            match &f.source {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => StoreError::Unavailable(f),
                sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => StoreError::Corrupt(f),
                _ => StoreError::Backend(f),
            }
        }
    }
}

/// A record this store cannot interpret.
pub(crate) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("unexpected record data in the SQLite store: {what}").into())
}
