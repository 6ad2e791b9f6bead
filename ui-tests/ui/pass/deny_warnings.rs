//! The expansion raises no warning, with every argument in use.
#![deny(warnings)]
#![deny(missing_docs, unused_qualifications, unused_parens, unused_mut)]

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Error, Idempotency, Scope, idempotent};
use serde::{Deserialize, Serialize};

/// An error of this crate.
#[derive(Debug, Serialize, Deserialize)]
pub enum ChargeError {
    /// The idempotency runtime refused the call.
    Idempotency(String),
    /// The charge was declined.
    Declined,
}

impl From<Error> for ChargeError {
    fn from(error: Error) -> Self {
        ChargeError::Idempotency(error.to_string())
    }
}

/// A payment service.
pub struct Payments {
    idempotency: Idempotency,
    tenant: String,
}

impl Payments {
    /// Charges once per order.
    #[idempotent(
        key = order_id,
        ttl = 3600,
        lease = "30s",
        scope = Scope::new().tenant(&self.tenant),
        fingerprint = (amount, currency),
        name = "payments::charge",
        on_error = "store",
        wait = "500ms",
        runtime = &self.idempotency,
        crate = idempotent_core,
    )]
    pub async fn charge(
        &self,
        order_id: &str,
        amount: u64,
        currency: &str,
    ) -> Result<u64, ChargeError> {
        #![allow(clippy::needless_return)]
        if amount == 0 {
            return Err(ChargeError::Declined);
        }
        let mut total = amount;
        total += currency.len() as u64;
        Ok(total)
    }

    /// Refunds once per order, with the defaults.
    #[idempotent(key = order_id, in_flight = "reject")]
    pub async fn refund(&self, order_id: u64) -> Result<(), Error> {
        let _ = order_id;
        Ok(())
    }
}

fn main() {
    let payments = Payments {
        idempotency: Idempotency::new(MemoryStore::new()),
        tenant: "acme".into(),
    };
    drop(payments.charge("o-1", 10, "EUR"));
    drop(payments.refund(1));
}
