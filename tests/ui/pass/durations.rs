//! Every duration form: milliseconds, seconds, minutes, hours, days, bare integer seconds.

use idempotent_core::{Error, idempotent};

#[idempotent(key = id, ttl = "90s", lease = "500ms", wait = "15m")]
async fn short(id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id, ttl = "24h", lease = 30, wait = 2)]
async fn long(id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id, ttl = "7d", lease = "1m")]
async fn week(id: u64) -> Result<(), Error> {
    Ok(())
}

fn main() {
    drop(short(1));
    drop(long(1));
    drop(week(1));
}
