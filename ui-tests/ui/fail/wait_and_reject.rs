use idempotent_core::{Error, idempotent};

#[idempotent(key = id, in_flight = "reject", wait = "5s")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
