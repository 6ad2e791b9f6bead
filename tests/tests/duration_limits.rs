//! The attribute's duration ranges are the runtime's: the ends of the ranges that
//! `#[idempotent]` checks at compile time (through `idempotent_core::limits`, see
//! `ui/fail/*_too_*.rs`) run and replay, and the longest `wait` the attribute can write, which
//! used to panic on `Instant + max`, gets the replay.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Error, Idempotency, idempotent};
use tokio::sync::Semaphore;

struct App {
    idempotency: Idempotency,
    runs: AtomicUsize,
    release: Semaphore,
}

impl App {
    fn new() -> Arc<Self> {
        Arc::new(App {
            idempotency: Idempotency::new(MemoryStore::new()),
            runs: AtomicUsize::new(0),
            release: Semaphore::new(0),
        })
    }

    fn ran(&self) -> usize {
        self.runs.fetch_add(1, Ordering::SeqCst) + 1
    }

    #[idempotent(key = key, ttl = "1ms", lease = "100ms", runtime = &self.idempotency)]
    async fn shortest(&self, key: &str) -> Result<usize, Error> {
        Ok(self.ran())
    }

    #[idempotent(key = key, ttl = "365d", lease = "8760h", runtime = &self.idempotency)]
    async fn longest(&self, key: &str) -> Result<usize, Error> {
        Ok(self.ran())
    }

    /// Runs until released.
    #[idempotent(key = key, name = "held", runtime = &self.idempotency)]
    async fn held(&self, key: &str) -> Result<usize, Error> {
        let _permit = self.release.acquire().await;
        Ok(self.ran())
    }

    /// Waits as long as the attribute can write (`Duration::MAX`), for a call of `held`.
    #[idempotent(
        key = key,
        name = "held",
        wait = "18446744073709551615s 999999999ns",
        runtime = &self.idempotency
    )]
    async fn patient(&self, key: &str) -> Result<usize, Error> {
        Ok(self.ran())
    }
}

/// The ends of the ranges compile (`ui/pass/duration_bounds.rs`) and the runtime takes them.
#[tokio::test]
async fn durations_at_both_ends_run_and_replay() {
    let app = App::new();
    assert_eq!(app.longest("a").await.unwrap(), 1);
    assert_eq!(app.longest("a").await.unwrap(), 1, "replayed for a year");
    assert_eq!(app.shortest("b").await.unwrap(), 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(app.shortest("b").await.unwrap(), 3, "forgotten after 1 ms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_wait_gets_the_replay() {
    let app = App::new();
    let owner = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.held("k").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.patient("k").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "the duplicate waits for the owner");
    app.release.add_permits(1);
    assert_eq!(owner.await.unwrap().unwrap(), 1);
    let replayed = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the duplicate waits for the owner, not forever")
        .expect("the duplicate does not panic")
        .unwrap();
    assert_eq!(replayed, 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}
