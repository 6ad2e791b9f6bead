use idempotent_core::{Error, idempotent};

#[idempotent(key = id, ttl = "0s")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
