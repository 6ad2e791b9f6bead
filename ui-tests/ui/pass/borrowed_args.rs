//! Borrowed arguments: `&str`, slices, references to structs, explicit lifetimes, `impl Trait`
//! arguments and patterns.

use idempotent_core::{Error, idempotent};

struct Order {
    id: String,
    lines: Vec<u32>,
}

#[idempotent(key = id)]
async fn by_str(id: &str, lines: &[u32]) -> Result<u32, Error> {
    Ok(lines.iter().sum())
}

#[idempotent(key = order.id)]
async fn by_struct_ref<'o>(order: &'o Order, note: &'o mut String) -> Result<usize, Error> {
    note.push_str(&order.id);
    Ok(order.lines.len())
}

#[idempotent(key = id)]
async fn by_impl_trait(id: u64, lines: impl IntoIterator<Item = u32>) -> Result<u32, Error> {
    Ok(lines.into_iter().sum())
}

#[idempotent(key = id)]
async fn by_pattern((id, amount): (u64, u64), Order { lines, .. }: Order) -> Result<u64, Error> {
    Ok(amount + lines.len() as u64)
}

fn main() {
    let order = Order {
        id: "o-1".into(),
        lines: vec![1, 2],
    };
    let mut note = String::new();
    drop(by_str("o-1", &[1, 2]));
    drop(by_struct_ref(&order, &mut note));
    drop(by_impl_trait(1, vec![1, 2]));
    drop(by_pattern((1, 2), order));
}
