use idempotent_core::{Error, Idempotency, idempotent};
use sqlx::PgConnection;

struct Ledger {
    idempotency: Idempotency,
}

impl Ledger {
    #[idempotent(key = id, tx = conn, runtime = &self.idempotency)]
    async fn post(&self, conn: &mut PgConnection, id: u64) -> Result<u64, Error> {
        let _ = conn;
        Ok(id)
    }
}

fn main() {}
