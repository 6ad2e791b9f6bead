use idempotent_core::{Error, idempotent};

#[idempotent(ttl = "1h")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
