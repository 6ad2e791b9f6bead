//! What the runtime keeps on a record for an operator ([`idempotent_core::inspect`]): the key
//! in clear by default, only the scope parts with `keys_in_clear(false)`; a record is found by
//! the key a customer quotes either way.

use idempotent_core::inspect::{InspectStore, ListQuery, Listed, RecordState};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{Call, Idempotency, Key, Scope, StorageKey};

async fn run_one(keys_in_clear: bool) -> (MemoryStore, StorageKey) {
    let store = MemoryStore::new();
    let runtime = Idempotency::builder(store.clone())
        .namespace("billing")
        .keys_in_clear(keys_in_clear)
        .build();
    assert_eq!(runtime.keys_in_clear(), keys_in_clear);
    let key = Key::new("invoice 2026-11/17").unwrap();
    let scope = Scope::new().tenant("acme").principal("alice");
    let call = Call::new(key.clone()).scope(scope.clone());
    runtime.run(&call, async { 42 }).await.unwrap();
    // Found by deriving the storage key again from what the customer quotes.
    let storage_key = StorageKey::derive(b"billing", &scope, &key);
    assert_eq!(storage_key, runtime.storage_key(&call));
    (store, storage_key)
}

#[tokio::test]
async fn a_record_keeps_its_key_in_clear_by_default() {
    let (store, key) = run_one(true).await;
    let info = store.inspect(&key).await.unwrap().expect("a record");
    assert_eq!(info.state, RecordState::Completed);
    assert_eq!(info.attempts, 1);
    let label = info.label.expect("a label");
    assert_eq!(label.key(), Some("invoice 2026-11/17"));
    assert_eq!(label.scope_parts(), vec!["tenant", "principal"]);
    let listed = store
        .list(&ListQuery::new(Listed::Completed))
        .await
        .unwrap();
    assert_eq!(listed.records.len(), 1);
    assert_eq!(
        listed.records[0].label.as_ref().and_then(|l| l.key()),
        Some("invoice 2026-11/17")
    );
}

#[tokio::test]
async fn with_keys_in_clear_off_only_the_scope_parts_are_kept() {
    let (store, key) = run_one(false).await;
    let info = store
        .inspect(&key)
        .await
        .unwrap()
        .expect("found by its key");
    let label = info.label.expect("a label");
    assert_eq!(label.key(), None, "the key is not kept");
    assert_eq!(label.scope_parts(), vec!["tenant", "principal"]);
    assert!(
        !label
            .as_bytes()
            .windows(7)
            .any(|window| window == b"invoice"),
        "no byte of the key is stored"
    );
}
