//! `crate = path` names the core crate when it is renamed or re-exported.

extern crate idempotent_core as renamed;

mod framework {
    pub use idempotent_core as idempotency;
}

use renamed::{Error, idempotent};

#[idempotent(key = id, crate = renamed)]
async fn through_rename(id: u64) -> Result<u64, Error> {
    Ok(id)
}

#[idempotent(key = id, crate = crate::framework::idempotency)]
async fn through_reexport(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {
    drop(through_rename(1));
    drop(through_reexport(1));
}
