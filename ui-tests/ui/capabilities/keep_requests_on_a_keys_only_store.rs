// Kept requests are checkpoints: a layer over a store of keys only has no `keep_requests`.
use idempotent_core::Idempotency;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;

fn main() {
    let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let _ = IdempotencyLayer::http(keys).keep_requests("1.0.0".parse().unwrap());
}
