// Listing abandoned operations (what a completer does) needs a store that keeps checkpoints.
use std::time::Duration;

use idempotent_core::Idempotency;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;

async fn list() {
    let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let _ = keys.abandoned(Duration::from_secs(60), 10, None).await;
}

fn main() {
    let _ = list();
}
