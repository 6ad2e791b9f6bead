use idempotent_core::{Error, idempotent};

#[idempotent(key = id, tx = log)]
async fn charge(log: &mut Vec<String>, id: u64) -> Result<u64, Error> {
    log.push(id.to_string());
    Ok(id)
}

fn main() {}
