//! How PostgreSQL failures map onto [`StoreError`]: what a retry can fix, what is full,
//! what is corrupt.

use idempotent_core::StoreError;

pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
    match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(Box::new(error)),
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // Disk full: nothing can be written until an operator makes room.
            Some("53100") => StoreError::Capacity {
                what: "postgres disk full",
            },
            // Connection failures (08), shutdown and crash recovery (57P01-57P03), too many
            // connections and out of memory (53), a statement or lock timeout, serialization
            // failures and deadlocks: all pass, so a retry can succeed.
            Some(code)
                if code.starts_with("08")
                    || code.starts_with("53")
                    || matches!(
                        code,
                        "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "40001" | "40P01"
                    ) =>
            {
                StoreError::Unavailable(Box::new(error))
            }
            _ => StoreError::Backend(Box::new(error)),
        },
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
            StoreError::Corrupt(Box::new(error))
        }
        _ => StoreError::Backend(Box::new(error)),
    }
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("unexpected record data from postgres: {what}").into())
}
