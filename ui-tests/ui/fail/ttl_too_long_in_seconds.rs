use idempotent_core::{Error, idempotent};

// One second more than `limits::MAX_TTL`, written as integer seconds.
#[idempotent(key = id, ttl = 31_536_001)]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
