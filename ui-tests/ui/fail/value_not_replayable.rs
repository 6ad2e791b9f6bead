use idempotent_core::{Error, idempotent};

struct Receipt;

#[idempotent(key = id)]
async fn charge(id: u64) -> Result<Receipt, Error> {
    let _ = id;
    Ok(Receipt)
}

fn main() {}
