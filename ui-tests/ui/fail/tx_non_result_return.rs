use idempotent_core::idempotent;
use sqlx::PgConnection;

#[idempotent(key = id, tx = conn)]
async fn charge(conn: &mut PgConnection, id: u64) -> Option<u64> {
    let _ = conn;
    Some(id)
}

fn main() {}
