// A store that implements only `Store` is not a full runtime's store: the error says to use
// `Idempotency::keys_only`.
use idempotent_core::Idempotency;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;

fn main() {
    let _ = Idempotency::new(KeysOnlyStore::new(MemoryStore::new()));
}
