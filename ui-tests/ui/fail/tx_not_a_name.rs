use idempotent_core::{Error, idempotent};
use sqlx::PgConnection;

#[idempotent(key = id, tx = "conn")]
async fn charge(conn: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = conn;
    Ok(id)
}

fn main() {}
