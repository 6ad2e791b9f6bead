// A runtime's capabilities must be the store's: keys and sessions over a store of keys only
// do not compile.
use idempotent_core::Idempotency;
use idempotent_core::capability::KeysAndSessions;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;

fn main() {
    let _ = Idempotency::<KeysAndSessions>::builder_for(KeysOnlyStore::new(MemoryStore::new()));
}
