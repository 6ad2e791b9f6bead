//! `#[idempotent]` on a message consumer: the broker delivers at least once (redeliveries,
//! concurrent duplicates, a retry after a failure), and every payment is applied exactly once.
//!
//! Run with `cargo run --example macro`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Defaults, Error, Idempotency, idempotent, set_default_runtime};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

/// What the broker delivers: a message id (the idempotency key), the delivery attempt, and the
/// payload.
#[derive(Debug, Clone)]
struct Delivery {
    message_id: String,
    attempt: u32,
    payment: Payment,
}

#[derive(Debug, Clone, Serialize)]
struct Payment {
    account: &'static str,
    cents: i64,
}

/// The recorded outcome of applying a message, replayed to every redelivery.
#[derive(Debug, Serialize, Deserialize)]
struct Applied {
    balance: i64,
    by_attempt: u32,
}

#[derive(Debug)]
enum ConsumerError {
    /// The ledger database was briefly unavailable; the broker redelivers.
    LedgerUnavailable,
    /// The idempotency runtime refused the delivery (in flight too long, key reused, ...).
    Idempotency(Error),
}

impl From<Error> for ConsumerError {
    fn from(error: Error) -> Self {
        ConsumerError::Idempotency(error)
    }
}

struct Consumer {
    balances: Mutex<BTreeMap<&'static str, i64>>,
    ledger_down_once: AtomicBool,
}

impl Consumer {
    /// Applies a payment once per message id. A redelivery replays the recorded outcome; a
    /// duplicate arriving while the first is running waits for it; a failure releases the
    /// message so the next delivery applies it; the same id with another payload is refused.
    #[idempotent(key = delivery.message_id, fingerprint = delivery.payment, wait = "5s")]
    async fn apply(&self, delivery: &Delivery) -> Result<Applied, ConsumerError> {
        tokio::time::sleep(Duration::from_millis(20)).await; // the ledger write
        if delivery.payment.account == "carol"
            && self.ledger_down_once.swap(false, Ordering::SeqCst)
        {
            return Err(ConsumerError::LedgerUnavailable);
        }
        let mut balances = self.balances.lock().await;
        let balance = balances.entry(delivery.payment.account).or_default();
        *balance += delivery.payment.cents;
        Ok(Applied {
            balance: *balance,
            by_attempt: delivery.attempt,
        })
    }
}

fn delivery(message_id: &str, attempt: u32, account: &'static str, cents: i64) -> Delivery {
    Delivery {
        message_id: message_id.into(),
        attempt,
        payment: Payment { account, cents },
    }
}

async fn handle(consumer: &Consumer, delivery: Delivery) {
    let id = &delivery.message_id;
    let attempt = delivery.attempt;
    match consumer.apply(&delivery).await {
        Ok(applied) if applied.by_attempt == attempt => {
            println!(
                "{id} attempt {attempt}: applied, balance {}",
                applied.balance
            )
        }
        Ok(applied) => println!(
            "{id} attempt {attempt}: duplicate, replayed the outcome of attempt {} (balance {})",
            applied.by_attempt, applied.balance
        ),
        Err(ConsumerError::LedgerUnavailable) => {
            println!("{id} attempt {attempt}: ledger unavailable, left for redelivery")
        }
        Err(ConsumerError::Idempotency(error)) => {
            println!("{id} attempt {attempt}: refused ({})", error.code())
        }
    }
}

#[tokio::main]
async fn main() {
    // Installed once at startup; every #[idempotent] function without `runtime = ...` uses it.
    // A service with several instances would use a shared store here.
    let runtime = Idempotency::builder(MemoryStore::new())
        .namespace("payments-consumer")
        .defaults(Defaults::new().ttl(Duration::from_secs(7 * 24 * 3600)))
        .build();
    set_default_runtime(runtime).expect("the default runtime is installed once");

    let consumer = Arc::new(Consumer {
        balances: Mutex::new(BTreeMap::new()),
        ledger_down_once: AtomicBool::new(true),
    });

    println!("-- deliveries, one at a time, with redeliveries");
    for delivery in [
        delivery("msg-1", 1, "alice", 500),
        delivery("msg-2", 1, "bob", 250),
        delivery("msg-1", 2, "alice", 500), // the broker did not see the ack
        delivery("msg-3", 1, "carol", 900), // fails: the ledger is down
        delivery("msg-3", 2, "carol", 900), // redelivered: applied now
        delivery("msg-2", 2, "bob", 250),
        delivery("msg-3", 3, "carol", 900),
        delivery("msg-2", 3, "bob", -250), // a producer bug: same id, other payload
    ] {
        handle(&consumer, delivery).await;
    }

    println!("-- five concurrent copies of one message");
    let mut copies = tokio::task::JoinSet::new();
    for attempt in 1..=5 {
        let consumer = Arc::clone(&consumer);
        copies.spawn(async move {
            handle(&consumer, delivery("msg-4", attempt, "alice", 100)).await;
        });
    }
    copies.join_all().await;

    let balances = consumer.balances.lock().await;
    println!("-- balances: {balances:?}");
    let expected = BTreeMap::from([("alice", 600), ("bob", 250), ("carol", 900)]);
    assert_eq!(*balances, expected, "every payment applied exactly once");
    println!("every payment was applied exactly once");
}
