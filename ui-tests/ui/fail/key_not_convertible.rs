use idempotent_core::{Error, idempotent};

struct OrderId(u64);

#[idempotent(key = order)]
async fn charge(order: OrderId) -> Result<u64, Error> {
    Ok(order.0)
}

fn main() {}
