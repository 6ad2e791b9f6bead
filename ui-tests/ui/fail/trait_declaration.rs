use idempotent_core::{Error, idempotent};

trait Charger {
    #[idempotent(key = id)]
    async fn charge(&self, id: u64) -> Result<u64, Error>;
}

fn main() {}
