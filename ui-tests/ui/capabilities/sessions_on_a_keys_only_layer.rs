// A layer over a store of keys only does not read session headers, and cannot be told to.
use idempotent_core::Idempotency;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;

fn main() {
    let keys = Idempotency::keys_only(KeysOnlyStore::new(MemoryStore::new()));
    let _ = IdempotencyLayer::http(keys).sessions(true);
}
