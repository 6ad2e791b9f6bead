// The work of a runtime whose store keeps no checkpoints gets a `KeyClaim`, which has no
// steps; a `ClaimHandle` (steps) comes only from a store that keeps checkpoints.
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{Call, Idempotency, KeyClaim};

async fn order() {
    let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let call = Call::new("order-1".parse().unwrap());
    let _ = keys
        .run(&call, async {
            let claim: KeyClaim = KeyClaim::current().unwrap();
            claim.step("reserve", async { 1u8 }).await
        })
        .await;
}

fn main() {
    let _ = order();
}
