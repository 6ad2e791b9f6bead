use idempotent_core::{Error, idempotent};

#[idempotent(key = id)]
async fn charge(id: u64) -> Result<impl serde::Serialize, Error> {
    Ok(id)
}

fn main() {}
