//! The core runtime on the embedded in-memory store: a payment charged once, however often it is
//! retried, and a concurrent duplicate refused while the first is still running.
//!
//! Run with `cargo run --example quickstart`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Call, Defaults, Error, Fingerprint, Idempotency, Scope};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq)]
struct Charge {
    amount: u64,
    currency: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    charge_id: u64,
    amount: u64,
    currency: String,
}

/// The effect to protect: a call to a payment provider that must happen once.
struct Provider {
    charges: AtomicU64,
}

impl Provider {
    async fn charge(&self, charge: &Charge) -> Receipt {
        tokio::time::sleep(Duration::from_millis(200)).await; // a slow network call
        let id = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        Receipt {
            charge_id: id,
            amount: charge.amount,
            currency: charge.currency.clone(),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let idempotency = Idempotency::builder(MemoryStore::new())
        .namespace("quickstart")
        .defaults(Defaults::new().ttl(Duration::from_secs(24 * 60 * 60)))
        .build();
    let provider = Arc::new(Provider {
        charges: AtomicU64::new(0),
    });

    let charge = Charge {
        amount: 1999,
        currency: "EUR".into(),
    };
    // The client picks the key once per intended payment and reuses it on every retry.
    let call = Call::new("order-8472-payment".parse()?)
        .scope(Scope::new().principal("alice"))
        .fingerprint(Fingerprint::of(&charge)?);

    // A client that times out and retries at once: the duplicate arrives while the first
    // attempt is still running, and is refused with a retry hint instead of charging twice.
    let first = {
        let (idempotency, provider, call, charge) = (
            idempotency.clone(),
            provider.clone(),
            call.clone(),
            charge.clone(),
        );
        tokio::spawn(async move {
            idempotency
                .run(&call, async move { provider.charge(&charge).await })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    match idempotency.run(&call, provider.charge(&charge)).await {
        Err(Error::InFlight { retry_after }) => println!(
            "concurrent duplicate refused: still in flight, retry after {:.1}s",
            retry_after.as_secs_f64()
        ),
        other => panic!("expected the duplicate to be refused, got {other:?}"),
    }
    let receipt = first.await.expect("first attempt panicked")?;
    println!(
        "first attempt:  fresh={} {:?}",
        !receipt.is_replayed(),
        receipt.get()
    );

    // Later retries replay the recorded receipt.
    for attempt in 2..=4 {
        let retry = idempotency.run(&call, provider.charge(&charge)).await?;
        println!(
            "retry {attempt}:        replayed={} {:?}",
            retry.is_replayed(),
            retry.get()
        );
    }

    // The same key with a different amount is a client bug, not a new payment.
    let tampered = Charge {
        amount: 1,
        ..charge.clone()
    };
    let mismatch = call.clone().fingerprint(Fingerprint::of(&tampered)?);
    match idempotency.run(&mismatch, provider.charge(&tampered)).await {
        Err(error @ Error::FingerprintMismatch) => println!("different payload, same key: {error}"),
        other => panic!("expected a mismatch, got {other:?}"),
    }

    // Another customer using the same key string is a different payment.
    let bob = call.clone().scope(Scope::new().principal("bob"));
    let bobs = idempotency.run(&bob, provider.charge(&charge)).await?;
    println!(
        "bob, same key:  fresh={} {:?}",
        !bobs.is_replayed(),
        bobs.get()
    );

    let total = provider.charges.load(Ordering::SeqCst);
    println!("provider charged {total} times for 7 requests");
    assert_eq!(total, 2, "one charge for alice, one for bob");
    Ok(())
}
