//! Every duration form: milliseconds, seconds, minutes, hours, days, bare integer seconds, and
//! humantime's others (several spans, fractions, spelled-out units).

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

#[idempotent(key = id, ttl = "1h 30m", lease = "1.5s", wait = "250us")]
async fn spans(id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id, ttl = "2 days", lease = "45 seconds", wait = "1w")]
async fn spelled(id: u64) -> Result<(), Error> {
    Ok(())
}

fn main() {
    drop(spans(1));
    drop(spelled(1));
    drop(short(1));
    drop(long(1));
    drop(week(1));
}
