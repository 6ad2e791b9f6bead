use idempotent_core::{Error, idempotent};

const DAY: u64 = 86_400;

#[idempotent(key = id, ttl = DAY)]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
