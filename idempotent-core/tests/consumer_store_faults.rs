//! The consumer runtime over stores that fail in ways only a store can: a record the store
//! reports as corrupt (a real Redis, its hash damaged), and a completion the store refuses
//! to write (`FaultyStore`).

#![cfg(all(
    feature = "consumer",
    feature = "memory",
    feature = "redis",
    feature = "test-util"
))]

mod support;

use std::time::Duration;

use idempotent_core::Idempotency;
use idempotent_core::consumer::Failure;
use idempotent_core::redis::RedisStore;
use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::names::unique;
use support::probe::*;
use support::source::*;

/// Sets the `s` (state) field of every record hash under `prefix` to a state no version of
/// the store writes; how many were damaged.
async fn damage_records(url: &str, prefix: &str) -> usize {
    let client = redis::Client::open(url).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut damaged = 0;
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap();
        let has_state: bool = kind == "hash"
            && redis::cmd("HEXISTS")
                .arg(&key)
                .arg("s")
                .query_async(&mut redis)
                .await
                .unwrap();
        if has_state {
            let _: () = redis::cmd("HSET")
                .arg(&key)
                .arg("s")
                .arg("x")
                .query_async(&mut redis)
                .await
                .unwrap();
            damaged += 1;
        }
    }
    damaged
}

/// A record the store reports as corrupt (Redis answers `'?'` for a state it does not know)
/// is met again by every delivery: the message is dead-lettered at its first delivery, with
/// the store's reason, not retried for ever as a transient failure (as it used to be).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_meeting_a_record_the_store_calls_corrupt_is_dead_lettered_at_once() {
    let Some(url) = redis_url() else { return };
    let prefix = format!("{}:", unique("consumer-corrupt"));
    let store = RedisStore::builder(url.as_str())
        .key_prefix(prefix.as_str())
        .connect()
        .await
        .unwrap();
    let source = TestSource::new();
    let probe = Probe::default();
    let started = start(
        consumer(&source, &probe)
            .max_deliveries(5)
            .backoff(Duration::from_millis(10), Duration::from_millis(20)),
        Idempotency::new(store),
        &probe,
    );
    let first = source.publish("c-1", "ok 1");
    source.settled().await;
    assert_eq!(answers_of(&source, &first), [(1, Answer::Ack)]);
    assert_eq!(damage_records(&url, &prefix).await, 1);

    let again = source.publish("c-1", "ok 1");
    source.settled().await;
    let report = started.stop().await;
    let answers = answers_of(&source, &again);
    let [(1, Answer::DeadLetter(reason))] = answers.as_slice() else {
        panic!("dead-lettered at its first delivery: {answers:?}");
    };
    assert!(reason.contains("corrupt_record"), "{reason}");
    assert!(probe.seen.observed().iter().any(|((position, _), o)| {
        *position == again && matches!(o, Observed::DeadLettered(Failure::Malformed(_)))
    }));
    assert_eq!(probe.seen.runs_of("c-1").len(), 1, "applied once");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
}
