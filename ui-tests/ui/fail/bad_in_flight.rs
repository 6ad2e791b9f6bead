use idempotent_core::{Error, idempotent};

#[idempotent(key = id, in_flight = "wait")]
async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
