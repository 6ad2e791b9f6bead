//! A free `async fn` with every argument.

use idempotent_core::{Error, Scope, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
struct Charge<'a> {
    currency: &'a str,
    cents: u64,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    id: u64,
}

#[idempotent(
    key = order_id,
    ttl = "7d",
    lease = "45s",
    scope = Scope::new().tenant(tenant),
    fingerprint = Charge { currency, cents },
    name = "billing::charge",
    on_error = "release",
    wait = "5s",
    runtime = idempotent_core::default_runtime(),
    crate = ::idempotent_core,
)]
pub async fn charge(
    tenant: &str,
    order_id: u64,
    currency: &str,
    cents: u64,
) -> Result<Receipt, Error> {
    let _ = (currency, cents);
    Ok(Receipt { id: order_id })
}

#[derive(Serialize, Deserialize)]
pub enum RefundError {
    Idempotency(String),
    TooLate,
}

impl From<Error> for RefundError {
    fn from(error: Error) -> Self {
        RefundError::Idempotency(error.to_string())
    }
}

#[idempotent(key = order_id, in_flight = "reject", on_error = "store")]
pub async fn refund(order_id: String) -> Result<u64, RefundError> {
    let _ = order_id;
    Err(RefundError::TooLate)
}

fn main() {
    drop(charge("acme", 1, "EUR", 100));
    drop(refund("o-1".into()));
}
