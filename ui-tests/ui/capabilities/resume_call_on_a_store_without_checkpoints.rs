// A completer's resume call (`Call::resume`) needs checkpoints: a runtime of keys and
// sessions does not take it.
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::memory::MemoryStore;
use idempotent_core::steps::Abandoned;
use idempotent_core::{Call, Fingerprint, Idempotency, StorageKey};

async fn resume() {
    let sessions = Idempotency::with_sessions(MemoryStore::new());
    let abandoned = Abandoned {
        key: StorageKey::from_bytes([7; 32]),
        fingerprint: Fingerprint::empty(),
        request: Bytes::new(),
        idle: Duration::ZERO,
    };
    let _ = sessions.run(&Call::resume(&abandoned), async { 1u8 }).await;
}

fn main() {
    let _ = resume();
}
