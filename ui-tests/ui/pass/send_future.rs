//! The future of an expanded function is `Send` (spawnable, usable as an axum handler) when the
//! body's is, and `'static` when the arguments are owned; a result that is `Send` but not `Sync`
//! is enough.

use std::cell::Cell;

use idempotent_core::{Error, idempotent};
use serde::{Deserialize, Serialize};

/// `Send`, not `Sync`.
#[derive(Serialize, Deserialize)]
struct Counter(Cell<u64>);

#[idempotent(key = id, wait = "1s")]
async fn owned(id: String, amount: u64) -> Result<u64, Error> {
    tokio::task::yield_now().await;
    Ok(amount + id.len() as u64)
}

#[idempotent(key = id)]
async fn borrowed(id: &str) -> Result<usize, Error> {
    tokio::task::yield_now().await;
    Ok(id.len())
}

#[idempotent(key = id)]
async fn counted(id: u64) -> Result<Counter, Error> {
    tokio::task::yield_now().await;
    Ok(Counter(Cell::new(id)))
}

fn spawnable<F: std::future::Future + Send + 'static>(_: F) {}
fn sendable<F: std::future::Future + Send>(_: F) {}

fn main() {
    spawnable(owned("k".into(), 1));
    sendable(borrowed("k"));
    spawnable(counted(1));
}
