use idempotent_core::idempotent;

#[idempotent(key = id)]
async fn charge(id: u64) -> Option<Vec<u64>> {
    Some(vec![id])
}

fn main() {}
