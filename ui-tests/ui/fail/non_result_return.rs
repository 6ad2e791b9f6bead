use idempotent_core::idempotent;

#[idempotent(key = id)]
async fn charge(id: u64) -> u64 {
    id
}

fn main() {}
