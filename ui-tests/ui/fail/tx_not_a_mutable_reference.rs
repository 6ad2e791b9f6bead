use idempotent_core::{Error, idempotent};
use sqlx::{Postgres, Transaction};

#[idempotent(key = id, tx = tx)]
async fn charge(tx: Transaction<'static, Postgres>, id: u64) -> Result<u64, Error> {
    tx.commit().await.map_err(|e| Error::Payload(e.into()))?;
    Ok(id)
}

fn main() {}
