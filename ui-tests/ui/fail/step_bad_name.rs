use idempotent_core::step;

#[step(name = "reserve stock")]
async fn reserve(sku: &str) -> String {
    sku.to_owned()
}

fn main() {}
