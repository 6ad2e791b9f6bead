use idempotent_core::{Error, idempotent};

#[idempotent(key = id, ttl = "1h", ttl = "2h")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
