use idempotent_core::{Error, idempotent};
use sqlx::{Postgres, Transaction};

struct Receipt;

#[idempotent(key = id, tx = tx)]
async fn charge(tx: &mut Transaction<'_, Postgres>, id: u64) -> Result<Receipt, Error> {
    let _ = (tx, id);
    Ok(Receipt)
}

fn main() {}
