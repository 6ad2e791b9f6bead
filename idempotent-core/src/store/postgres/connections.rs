//! The connections the store's own statements run on, kept apart from the sqlx pool.
//!
//! sqlx's pool checks a connection with a round trip (`Sync`, wait for `ReadyForQuery`) every
//! time one goes back to it, on a task it spawns for the purpose, and has no option to skip
//! it: for a store whose operations are one statement each, that doubles the round trips and
//! was most of the client's CPU (BENCHMARKS.md). These connections go back to their pool with
//! nothing sent. A statement whose future was dropped half way leaves nothing to clean up:
//! sqlx reads the unread replies of a connection before it sends the next statement.

use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleResult, TimeoutType};
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use super::store_error;
use crate::StoreError;

/// Opens connections with the options of the pool the store was given.
pub(super) struct Connector {
    options: Arc<PgConnectOptions>,
}

impl managed::Manager for Connector {
    type Type = PgConnection;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<PgConnection, sqlx::Error> {
        PgConnection::connect_with(&self.options).await
    }

    /// Nothing to check: a connection that failed was taken out of the pool (see
    /// [`Connections::discard_if_broken`]), and one broken since fails the one statement that
    /// next uses it.
    async fn recycle(&self, _: &mut PgConnection, _: &Metrics) -> RecycleResult<sqlx::Error> {
        Ok(())
    }
}

/// At most `max` connections, opened on first use and reused in turn.
#[derive(Clone)]
pub(super) struct Connections {
    pool: managed::Pool<Connector>,
    wait: Duration,
}

/// One connection, returned to the pool when dropped.
pub(super) type Connection = Object<Connector>;

impl Connections {
    /// Waits at most `wait` for a free connection, and as long again for a new one to open.
    pub(super) fn new(options: Arc<PgConnectOptions>, max: usize, wait: Duration) -> Self {
        let pool = managed::Pool::builder(Connector { options })
            .max_size(max.max(1))
            .wait_timeout(Some(wait))
            .create_timeout(Some(wait))
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .expect("a runtime is set, so building the pool cannot fail");
        Connections { pool, wait }
    }

    /// The most connections open at once.
    pub(super) fn max(&self) -> usize {
        self.pool.status().max_size
    }

    pub(super) async fn get(&self) -> Result<Connection, StoreError> {
        self.pool.get().await.map_err(|error| match error {
            PoolError::Backend(error) => store_error(error),
            PoolError::Timeout(TimeoutType::Wait) => StoreError::Unavailable(
                format!(
                    "no postgres connection free within {:?}: every one of the {} is busy",
                    self.wait,
                    self.max()
                )
                .into(),
            ),
            PoolError::Timeout(_) => StoreError::Unavailable(
                format!("could not connect to postgres within {:?}", self.wait).into(),
            ),
            other => StoreError::Unavailable(other.to_string().into()),
        })
    }

    /// Hands back `result` of a statement run on `connection`, closing the connection when
    /// the error may have left it unusable: a failure to reach the database or one this store
    /// does not recognise. After a refused token, a disk-full error or undecodable data the
    /// connection is in a known state and goes back to the pool; closing one that was fine
    /// costs only a reconnect.
    pub(super) fn settle<T>(
        connection: Connection,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if let Err(StoreError::Unavailable(_) | StoreError::Backend(_)) = &result {
            drop(Object::take(connection));
        }
        result
    }
}
