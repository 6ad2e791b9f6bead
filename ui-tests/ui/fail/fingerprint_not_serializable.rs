use idempotent_core::{Error, idempotent};

struct Order {
    id: u64,
}

#[idempotent(key = order.id, fingerprint = order)]
async fn charge(order: &Order) -> Result<u64, Error> {
    Ok(order.id)
}

fn main() {}
