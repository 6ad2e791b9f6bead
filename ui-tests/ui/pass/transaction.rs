//! `tx = <parameter>`: the claim and the record are written with the function's transaction,
//! given as `&mut Transaction<'_, Postgres>` or `&mut PgConnection`; the expansion raises no
//! warning, and its future is `Send`, also for a result that is `Send` but not `Sync`.
#![deny(warnings)]

use idempotent_postgres::{PostgresStore, Transactional};
use idempotent_core::{Error, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

#[idempotent(key = order_id, tx = tx)]
async fn on_transaction(tx: &mut Transaction<'_, Postgres>, order_id: u64) -> Result<u64, Error> {
    sqlx::query("UPDATE accounts SET balance = balance + 1")
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Payload(e.into()))?;
    Ok(order_id)
}

#[idempotent(key = order_id, tx = conn, ttl = "1h", lease = "10s", wait = "2s")]
async fn on_connection(order_id: &str, conn: &mut PgConnection) -> Result<usize, Error> {
    sqlx::query("SELECT 1")
        .execute(conn)
        .await
        .map_err(|e| Error::Payload(e.into()))?;
    Ok(order_id.len())
}

/// `Send`, not `Sync`.
#[derive(Serialize, Deserialize)]
struct Counter(std::cell::Cell<u64>);

#[idempotent(key = id, tx = tx)]
async fn counted(tx: &mut Transaction<'_, Postgres>, id: u64) -> Result<Counter, Error> {
    sqlx::query("SELECT 1")
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Payload(e.into()))?;
    Ok(Counter(std::cell::Cell::new(id)))
}

/// The body need not use the transaction: the claim and the record still go through it.
#[idempotent(key = id, tx = tx, in_flight = "reject")]
async fn unused(tx: &mut Transaction<'_, Postgres>, id: u64) -> Result<(), Error> {
    let _ = id;
    Ok(())
}

#[derive(Debug, Serialize, Deserialize)]
enum Declined {
    Card,
    Refused(String),
}

impl From<Error> for Declined {
    fn from(error: Error) -> Self {
        Declined::Refused(error.code().as_str().into())
    }
}

struct Ledger {
    transactional: Transactional,
}

impl Ledger {
    #[idempotent(
        key = id,
        tx = tx,
        runtime = &self.transactional,
        fingerprint = amount,
        on_error = "store",
        name = "ledger.post",
    )]
    async fn post(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: String,
        amount: u64,
    ) -> Result<u64, Declined> {
        if amount == 0 {
            return Err(Declined::Card);
        }
        sqlx::query("SELECT $1")
            .bind(amount as i64)
            .execute(&mut **tx)
            .await
            .map_err(|e| Declined::Refused(e.to_string()))?;
        Ok(amount)
    }
}

fn spawnable<F: std::future::Future + Send + 'static>(_: F) {}

/// Every shape called with one transaction, in a future that can be spawned.
fn calls(pool: PgPool, ledger: Ledger) {
    spawnable(async move {
        let mut tx = pool.begin().await.unwrap();
        on_transaction(&mut tx, 1).await.unwrap();
        on_connection("k", &mut tx).await.unwrap();
        unused(&mut tx, 2).await.unwrap();
        ledger.post(&mut tx, "p-1".into(), 5).await.unwrap();
        counted(&mut tx, 3).await.unwrap();
        tx.commit().await.unwrap();
    });
}

fn main() {
    let _: fn(PgPool, Ledger) = calls;
    let _ = |store: PostgresStore| Ledger {
        transactional: Transactional::new(&store),
    };
}
