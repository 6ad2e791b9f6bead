//! `claim = name` binds the running claim in the body, with and without a transaction; the
//! expansion raises no warning.
#![deny(warnings)]

use idempotent_core::{ClaimHandle, Error, idempotent};
use sqlx::{Postgres, Transaction};

/// A downstream system that takes an idempotency key.
async fn provider_charge(idempotency_key: &str, cents: u64) -> u64 {
    cents + idempotency_key.len() as u64
}

#[idempotent(key = order_id, claim = claim)]
async fn charge(order_id: &str, cents: u64) -> Result<u64, Error> {
    let held: &ClaimHandle = &claim;
    held.check().await?;
    Ok(provider_charge(claim.operation_key().as_str(), cents).await)
}

#[idempotent(key = order_id, claim = running, wait = "1s")]
async fn token_of(order_id: u64) -> Result<u64, Error> {
    if running.is_lost() {
        return Err(Error::ClaimLost);
    }
    let _ = order_id;
    Ok(running.token().get())
}

#[idempotent(key = deposit_id, tx = tx, claim = claim)]
async fn deposit(tx: &mut Transaction<'_, Postgres>, deposit_id: &str) -> Result<i64, Error> {
    sqlx::query("UPDATE fences SET token = $1")
        .bind(claim.token().get() as i64)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::Payload(e.into()))?;
    let _ = deposit_id;
    Ok(1)
}

fn main() {
    drop(charge("o-1", 10));
    drop(token_of(1));
    let _ = deposit;
}
