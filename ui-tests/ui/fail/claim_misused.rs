use idempotent_core::{Error, idempotent};

#[idempotent(key = id, claim = claim)]
async fn charge(id: u64) -> Result<u64, Error> {
    let token: u64 = claim.token();
    Ok(id + token)
}

fn main() {}
