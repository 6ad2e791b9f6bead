//! An application installs its runtime once with `set_default_runtime`, and every
//! `#[idempotent]` function without `runtime = ...` uses it. (A test binary of its own: the
//! default runtime is process-wide.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, Defaults, Error, Idempotency, Scope, default_runtime, idempotent, set_default_runtime,
};

static RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = order_id)]
async fn charge(order_id: u64) -> Result<usize, Error> {
    Ok(RUNS.fetch_add(1, Ordering::SeqCst) + 1)
}

#[tokio::test]
async fn functions_use_the_installed_runtime() {
    let store = MemoryStore::new();
    let installed = Idempotency::builder(store.clone())
        .namespace("billing")
        .defaults(Defaults::new().ttl(Duration::from_secs(60)))
        .build();
    set_default_runtime(installed.clone()).unwrap();
    assert!(
        set_default_runtime(Idempotency::new(MemoryStore::new())).is_err(),
        "a second installation is refused"
    );

    assert_eq!(charge(42).await.unwrap(), 1);
    assert_eq!(charge(42).await.unwrap(), 1);
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);

    // The record is in the installed runtime's namespace, under the function's default name.
    let call = Call::new("42".parse().unwrap())
        .scope(Scope::new().operation(concat!(module_path!(), "::charge")));
    for runtime in [&installed, default_runtime()] {
        let replayed = runtime
            .run(&call, async { Ok::<usize, ()>(0) })
            .await
            .unwrap();
        assert!(replayed.is_replayed());
        assert_eq!(replayed.into_inner(), Ok(1));
    }
    // The same store under another namespace does not see it.
    let other_namespace = Idempotency::new(store);
    let fresh = other_namespace
        .run(&call, async { Ok::<usize, ()>(0) })
        .await
        .unwrap();
    assert!(!fresh.is_replayed());

    // The installed runtime's TTL (60 s) applies: after it, the body runs again.
    tokio::time::pause();
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(charge(42).await.unwrap(), 2);
}
