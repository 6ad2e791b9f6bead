use idempotent_core::{Error, idempotent};

#[idempotent(key = id, scope = tenant)]
async fn charge(tenant: &str, id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
