// `Call::in_session` cannot be run by a runtime whose store keeps no sessions.
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;
use idempotent_core::session::InSession;
use idempotent_core::{Call, Idempotency};

async fn pay() {
    let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let call = Call::in_session("device-7".parse().unwrap(), InSession::new(1, 0).unwrap());
    let _ = keys.run(&call, async { 1u8 }).await;
}

fn main() {
    let _ = pay();
}
