use idempotent_core::idempotent;

#[derive(Debug)]
struct Declined;

type Charged = Result<u64, Declined>;

#[idempotent(key = id)]
async fn charge(id: u64) -> Charged {
    Ok(id)
}

fn main() {}
