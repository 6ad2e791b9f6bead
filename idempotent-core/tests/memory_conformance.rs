//! `MemoryStore` passes the store conformance suite, with a manual clock.

use std::time::Duration;

use idempotent_core::clock::ManualClock;
use idempotent_core::conformance::Harness;
use idempotent_core::memory::MemoryStore;

struct Memory {
    clock: ManualClock,
    store: MemoryStore,
}

impl Harness for Memory {
    type Store = MemoryStore;

    async fn setup() -> Self {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        Memory { clock, store }
    }

    fn store(&self) -> &MemoryStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    fn time_unit(&self) -> Duration {
        Duration::from_secs(10)
    }
}

idempotent_core::store_conformance_tests!(Memory);

/// The memory store seen as a store of keys only: the suite runs the key checks and says the
/// session and step checks do not apply (nothing to switch).
mod keys_only {
    use super::*;
    use idempotent_core::conformance::KeysOnlyStore;

    pub(super) struct KeysOnlyMemory {
        clock: ManualClock,
        store: KeysOnlyStore<MemoryStore>,
    }

    impl Harness for KeysOnlyMemory {
        type Store = KeysOnlyStore<MemoryStore>;

        async fn setup() -> Self {
            let clock = ManualClock::new();
            let store = KeysOnlyStore::new(MemoryStore::builder().clock(clock.clone()).build());
            KeysOnlyMemory { clock, store }
        }

        fn store(&self) -> &KeysOnlyStore<MemoryStore> {
            &self.store
        }

        async fn advance(&self, by: Duration) {
            self.clock.advance(by);
        }

        fn time_unit(&self) -> Duration {
            Duration::from_secs(10)
        }
    }

    idempotent_core::store_conformance_tests!(KeysOnlyMemory);
}
