//! Durations at both ends of their ranges: the shortest and longest TTL and lease, and the
//! longest wait the attribute can write (`Duration::MAX`).

use idempotent_core::{Error, idempotent};

#[idempotent(key = id, ttl = "1ms", lease = "100ms")]
async fn shortest(id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id, ttl = "365d", lease = "8760h", wait = "18446744073709551615s 999999999ns")]
async fn longest(id: u64) -> Result<(), Error> {
    Ok(())
}

fn main() {
    drop(shortest(1));
    drop(longest(1));
}
