//! What the PostgreSQL crate's test suites share: a call on a key, work that counts its runs,
//! and the outbox's fixture ([`outbox`]). Servers, ports and names come from the test kit
//! (`idempotent_test_kit`).

#![allow(dead_code, unreachable_pub)]

pub mod outbox;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::{Call, Key};

/// A call on the key `key`.
pub fn call(key: &str) -> Call {
    Call::new(Key::new(key).unwrap())
}

/// Work that counts its run in `runs` when it begins, then takes `delay`, and returns the count
/// it saw. A run stopped during its delay (its call dropped, its claim lost) still counts: a
/// test that asserts one run means one run began.
pub fn slow(runs: &Arc<AtomicUsize>, delay: Duration) -> impl Future<Output = usize> + use<> {
    let runs = Arc::clone(runs);
    async move {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        n
    }
}

/// Work that counts its run in `runs` and finishes at once: [`slow`] without a delay.
pub fn counted(runs: &Arc<AtomicUsize>) -> impl Future<Output = usize> + use<> {
    slow(runs, Duration::ZERO)
}
