//! `#[step]` methods called from an `#[idempotent]` function: a retry of the operation gets
//! the saved results of the steps that ran, and runs only the rest.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Error, Idempotency, idempotent, step};

#[derive(Debug)]
enum AppError {
    Idempotency(#[allow(dead_code)] Error),
    ProviderDown,
}

impl From<Error> for AppError {
    fn from(error: Error) -> Self {
        AppError::Idempotency(error)
    }
}

struct Shop {
    idempotency: Idempotency,
    reserved: AtomicUsize,
    charged: AtomicUsize,
    /// Charges that fail before the provider is reached.
    failures: AtomicUsize,
}

impl Shop {
    #[step]
    async fn reserve(&self, sku: &str) -> String {
        let n = self.reserved.fetch_add(1, Ordering::SeqCst);
        format!("{sku}-{n}")
    }

    #[step(name = "charge")]
    async fn charge_card(&self, cents: u64) -> u64 {
        self.charged.fetch_add(1, Ordering::SeqCst);
        cents
    }

    #[idempotent(key = id, runtime = &self.idempotency)]
    async fn order(&self, id: &str) -> Result<(String, u64), AppError> {
        let reservation = self.reserve("tea").await?;
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            // The error is not kept: the key is released and the retry resumes.
            return Err(AppError::ProviderDown);
        }
        let charge = self.charge_card(1999).await?;
        Ok((reservation, charge))
    }
}

#[tokio::test]
async fn a_retry_resumes_after_the_steps_that_ran() {
    let shop = Shop {
        idempotency: Idempotency::new(MemoryStore::new()),
        reserved: AtomicUsize::new(0),
        charged: AtomicUsize::new(0),
        failures: AtomicUsize::new(2),
    };
    assert!(matches!(
        shop.order("o-1").await,
        Err(AppError::ProviderDown)
    ));
    assert!(matches!(
        shop.order("o-1").await,
        Err(AppError::ProviderDown)
    ));
    let (reservation, charge) = shop.order("o-1").await.unwrap();
    assert_eq!((reservation.as_str(), charge), ("tea-0", 1999));
    assert_eq!(shop.reserved.load(Ordering::SeqCst), 1, "reserved once");
    assert_eq!(shop.charged.load(Ordering::SeqCst), 1);
    // Another operation runs its own steps.
    assert_eq!(shop.order("o-2").await.unwrap().0, "tea-1");
    // Outside any idempotent call, a step just runs.
    assert_eq!(shop.reserve("mug").await.unwrap(), "mug-2");
    assert!(matches!(
        shop.order("o-1").await,
        Ok((ref r, 1999)) if r == "tea-0"
    ));
}
