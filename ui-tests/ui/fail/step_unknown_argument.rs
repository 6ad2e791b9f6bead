use idempotent_core::step;

#[step(key = "reserve")]
async fn reserve(sku: &str) -> String {
    sku.to_owned()
}

fn main() {}
