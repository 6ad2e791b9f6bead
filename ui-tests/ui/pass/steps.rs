//! `#[step]` on methods and free functions, named after the function or explicitly, with and
//! without a return type, called from an `#[idempotent]` function.

use idempotent_core::{Error, idempotent, step};

struct Shop {
    sku: String,
}

impl Shop {
    #[step]
    async fn reserve(&self, quantity: u32) -> String {
        format!("{quantity} x {}", self.sku)
    }

    #[step(name = "charge.v2")]
    async fn charge(&self, cents: u64) -> Result<u64, String> {
        if cents == 0 {
            return Err("nothing to charge".to_owned());
        }
        Ok(cents)
    }
}

#[step]
async fn r#notify(to: String) {
    let _ = to;
}

#[idempotent(key = id)]
async fn order(shop: &Shop, id: u64) -> Result<(String, u64), Error> {
    let reservation: String = shop.reserve(2).await?;
    let charge = shop.charge(1999).await?.unwrap_or_default();
    let (): () = notify("alice".to_owned()).await?;
    Ok((reservation, charge + id))
}

fn main() {
    let _ = order;
}
