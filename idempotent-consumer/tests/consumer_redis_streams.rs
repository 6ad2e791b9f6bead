//! The Redis Streams source against a real Redis (`IDEMPOTENT_TEST_REDIS_URL`): its duration
//! setting at its largest.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_consumer::redis_streams::RedisStreams;
use idempotent_consumer::{Consumer, Decode, Failure, Handler, Message, key};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Idempotency, Key};
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;

/// Keyed by the entry's `id` field; counts what it applies.
#[derive(Clone, Default)]
struct Counting {
    applied: Arc<AtomicUsize>,
}

impl Decode for Counting {
    type Input = String;

    fn decode(&self, message: &Message) -> Result<String, Failure> {
        message
            .field("id")
            .map(|id| String::from_utf8_lossy(id).into_owned())
            .ok_or_else(|| Failure::Malformed("no id".into()))
    }

    fn key(&self, _: &Message, id: &String) -> Result<Key, Failure> {
        key(id)
    }
}

impl Handler for Counting {
    type Output = ();

    async fn handle(&self, _: &String, _: &ClaimHandle) -> Result<(), Failure> {
        self.applied.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// `claim_idle(Duration::MAX)` ("never take entries back") used to overflow the clock at
/// connect (the first sweep's time) and panic; now it is taken as the longest claim idle
/// time, and the consumer applies what is sent, keeping entries in hand alive without
/// overflowing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_idle_of_duration_max_neither_panics_nor_stops_the_consumer() {
    let Some(url) = redis_url() else { return };
    let stream = unique("claim-idle-max");
    let source = RedisStreams::builder(&url, &stream, "group", "consumer")
        .claim_idle(Duration::MAX)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot start the Redis Streams source: {e}"));
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    for i in 0..10 {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("id")
            .arg(format!("e-{i}"))
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    let handler = Counting::default();
    let applied = Arc::clone(&handler.applied);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(Consumer::new(source).handler_timeout(Duration::MAX).run(
        Idempotency::new(MemoryStore::new()),
        handler,
        async move {
            let _ = stopped.await;
        },
    ));
    idempotent_test_kit::process::eventually("10 entries applied", Duration::from_secs(15), || {
        std::future::ready(applied.load(Ordering::SeqCst) == 10)
    })
    .await;
    stop.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(15), run)
        .await
        .expect("the consumer drains")
        .expect("the consumer does not panic");
    assert_eq!(report.applied, 10, "{report:?}");
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut redis)
        .await
        .unwrap();
}
