use idempotent_core::{Error, idempotent};
use sqlx::{Postgres, Transaction};

#[idempotent(key = id, tx = txn)]
async fn charge(tx: &mut Transaction<'_, Postgres>, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

fn main() {}
