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

/// The suite runs the session and step checks of a store that has those traits (they reach
/// the store), and none of a store without them.
mod picked_by_traits {
    use std::sync::Mutex;

    use super::*;
    use idempotent_core::conformance::{
        CheckpointChecks as _, Faults, FaultyStore, KeysOnlyStore, NoCheckpointChecks as _,
        NoSessionChecks as _, Op, Probe, SessionChecks as _,
    };

    /// The faults handle of the store each harness set up last.
    static FULL: Mutex<Option<Faults>> = Mutex::new(None);
    static KEYS: Mutex<Option<Faults>> = Mutex::new(None);

    fn last(of: &Mutex<Option<Faults>>) -> Option<Faults> {
        of.lock().unwrap().clone()
    }

    struct Full(FaultyStore<MemoryStore>);
    struct Keys(KeysOnlyStore<FaultyStore<MemoryStore>>);

    impl Harness for Full {
        type Store = FaultyStore<MemoryStore>;
        async fn setup() -> Self {
            let store = FaultyStore::new(MemoryStore::new());
            *FULL.lock().unwrap() = Some(store.faults());
            Full(store)
        }
        fn store(&self) -> &Self::Store {
            &self.0
        }
        async fn advance(&self, by: Duration) {
            tokio::time::sleep(by).await;
        }
        fn time_unit(&self) -> Duration {
            Duration::from_millis(100)
        }
    }

    impl Harness for Keys {
        type Store = KeysOnlyStore<FaultyStore<MemoryStore>>;
        async fn setup() -> Self {
            let store = FaultyStore::new(MemoryStore::new());
            *KEYS.lock().unwrap() = Some(store.faults());
            Keys(KeysOnlyStore::new(store))
        }
        fn store(&self) -> &Self::Store {
            &self.0
        }
        async fn advance(&self, by: Duration) {
            tokio::time::sleep(by).await;
        }
        fn time_unit(&self) -> Duration {
            Duration::from_millis(100)
        }
    }

    // The borrow is what lets a store without the trait fall back to the `No…Checks` impl.
    #[allow(clippy::needless_borrow)]
    #[test]
    fn the_checks_follow_the_stores_traits() {
        (&Probe::<Full>::new()).sessions("session_starts_only_without_an_ack");
        let full = last(&FULL).expect("the full store was set up");
        assert!(full.calls(Op::OpenSession) > 0, "the session check ran");
        (&Probe::<Full>::new()).checkpoints("checkpoints_round_trip_in_order");
        let full = last(&FULL).expect("the full store was set up");
        assert!(full.calls(Op::SaveStep) > 0, "the step check ran");
        // A store of keys only: nothing is run (no harness is even set up).
        (&Probe::<Keys>::new()).sessions("session_starts_only_without_an_ack");
        (&Probe::<Keys>::new()).checkpoints("checkpoints_round_trip_in_order");
        assert!(last(&KEYS).is_none());
    }
}
