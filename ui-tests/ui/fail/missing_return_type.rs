use idempotent_core::idempotent;

#[idempotent(key = id)]
async fn charge(id: u64) {
    let _ = id;
}

fn main() {}
