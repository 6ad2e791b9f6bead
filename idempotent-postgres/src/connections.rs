//! The connections the store's own statements run on, kept apart from the sqlx pool.
//!
//! sqlx's pool checks a connection with a round trip (`Sync`, wait for `ReadyForQuery`) every
//! time one goes back to it, on a task it spawns for the purpose, and has no option to skip
//! it: for a store whose operations are one statement each, that doubles the round trips and
//! was most of the client's CPU (BENCHMARKS.md). These connections go back to their pool with
//! nothing sent, but only when the statement's outcome was handed back
//! ([`Connections::settle`]). One whose statement's future was dropped half way (its caller
//! stopped waiting: the database did not answer in time) is closed instead: its reply may be
//! held up for as long as TCP's retransmission backoff after a network partition heals
//! (seconds), and every statement sent on it behind that reply would wait as long, so a pool
//! that kept it would go on refusing requests after the database is reachable again.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleResult, TimeoutType};
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use super::store_error;
use idempotent_core::StoreError;

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

    /// Nothing to check: a connection that failed, or whose statement was given up on, was
    /// taken out of the pool (see [`Connections::settle`] and [`Connection`]), and one broken
    /// since fails the one statement that next uses it.
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

/// One connection of the pool, for one statement (or a few in a row): handed back with
/// [`Connections::settle`], which returns it to the pool unless the statement failed in a way
/// that may have left it unusable. Dropped without that (its statement's future was dropped
/// half way: the caller stopped waiting for the database), it is closed rather than returned:
/// a reply that did not come may still be in flight, and on a link that stopped carrying
/// packets the next statement would wait behind it.
pub(super) struct Connection(Option<Object<Connector>>);

impl Deref for Connection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.0
            .as_ref()
            .expect("a connection is only emptied when it is settled or dropped")
    }
}

impl DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.0
            .as_mut()
            .expect("a connection is only emptied when it is settled or dropped")
    }
}

impl Drop for Connection {
    /// Not settled: closed, not returned to the pool (see [`Connection`]).
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

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

    /// A free connection of the pool, or a new one.
    pub(super) async fn get(&self) -> Result<Connection, StoreError> {
        let object = self.pool.get().await.map_err(|error| match error {
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
        })?;
        Ok(Connection(Some(object)))
    }

    /// Hands back `result` of a statement run on `connection`, closing the connection when
    /// the error may have left it unusable: a failure to reach the database or one this store
    /// does not recognise. After a refused token, a disk-full error or undecodable data the
    /// connection is in a known state and goes back to the pool; closing one that was fine
    /// costs only a reconnect.
    pub(super) fn settle<T>(
        mut connection: Connection,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if !matches!(
            &result,
            Err(StoreError::Unavailable(_) | StoreError::Backend(_))
        ) {
            // Returned to the pool; otherwise `connection`'s drop closes it.
            drop(connection.0.take());
        }
        result
    }
}
