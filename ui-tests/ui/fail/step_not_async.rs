use idempotent_core::step;

#[step]
fn reserve(sku: &str) -> String {
    sku.to_owned()
}

fn main() {}
