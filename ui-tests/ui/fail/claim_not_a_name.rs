use idempotent_core::{Error, idempotent};

#[idempotent(key = id, claim = "claim")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
