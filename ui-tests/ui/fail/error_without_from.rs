use idempotent_core::idempotent;

#[derive(Debug)]
struct Declined;

#[idempotent(key = id)]
async fn charge(id: u64) -> Result<u64, Declined> {
    Ok(id)
}

fn main() {}
