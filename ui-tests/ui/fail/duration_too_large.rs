use idempotent_core::{Error, idempotent};

#[idempotent(key = id, wait = "99999999999999999999d")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
