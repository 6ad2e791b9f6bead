//! The write transaction: `BEGIN IMMEDIATE` on the writer's connection, then `COMMIT` or
//! `ROLLBACK`, issued by the store itself rather than through sqlx's `Transaction`.
//!
//! SQLite rolls some failed transactions back by itself (a full disk, an I/O error, out of
//! memory); sqlx's `Transaction` does not notice, keeps counting the transaction as open, and
//! from then on refuses to begin one on that connection. Here a failed `ROLLBACK` closes the
//! connection instead (the pool opens another), and so does a transaction dropped unfinished:
//! closing a SQLite connection rolls back whatever it left open.

use std::ops::{Deref, DerefMut};

use idempotent_core::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{Executor as _, Sqlite};

use crate::error::store_error;

/// A write transaction holding the database's write lock from its first statement.
pub(crate) struct Write {
    connection: PoolConnection<Sqlite>,
    /// Whether a transaction may be open on the connection.
    open: bool,
}

impl Write {
    /// Takes the writer's connection and the database's write lock, waiting for it at most the
    /// busy timeout.
    pub(crate) async fn begin(pool: &SqlitePool, doing: &str) -> Result<Self, StoreError> {
        let connection = pool.acquire().await.map_err(|e| store_error(doing, e))?;
        // Counted as open while `BEGIN` runs: dropped then, the connection is closed.
        let mut write = Write {
            connection,
            open: true,
        };
        match write.connection.execute("BEGIN IMMEDIATE").await {
            Ok(_) => Ok(write),
            Err(error) => {
                // A `BEGIN` that failed began nothing.
                write.open = false;
                Err(store_error(doing, error))
            }
        }
    }

    /// Commits if `result` is `Ok`, rolls back otherwise; returns `result`, or the commit's
    /// failure.
    pub(crate) async fn finish<T>(
        mut self,
        result: Result<T, StoreError>,
        doing: &str,
    ) -> Result<T, StoreError> {
        match result {
            Ok(value) => match self.connection.execute("COMMIT").await {
                Ok(_) => {
                    self.open = false;
                    Ok(value)
                }
                Err(error) => {
                    self.rollback().await;
                    Err(store_error(doing, error))
                }
            },
            Err(error) => {
                self.rollback().await;
                Err(error)
            }
        }
    }

    async fn rollback(&mut self) {
        // A failed `ROLLBACK` (SQLite rolled back already, or cannot) leaves `open` set, so
        // the connection is closed rather than reused.
        if self.connection.execute("ROLLBACK").await.is_ok() {
            self.open = false;
        }
    }
}

impl Drop for Write {
    fn drop(&mut self) {
        if self.open {
            self.connection.close_on_drop();
        }
    }
}

impl Deref for Write {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        &self.connection
    }
}

impl DerefMut for Write {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.connection
    }
}
