//! The consumer runtime over stores that fail in ways only a store can: a record the store
//! reports as corrupt (a real Redis, its hash damaged), and a completion the store refuses
//! to write (`FaultyStore`).

mod support;

use std::time::Duration;

use idempotent_consumer::Failure;
use idempotent_core::Idempotency;
use idempotent_core::conformance::{Fault, FaultyStore, Op};
use idempotent_core::memory::MemoryStore;
use idempotent_redis::RedisStore;
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

/// A claim-mode consumer whose store refuses the completion: the runtime retries the write in
/// the background while it keeps the claim, and the message is acknowledged only once the
/// record is written, never before (it used to be acknowledged as applied at once, the record
/// still unwritten: had the retries given up or the process died, the claim would have lapsed
/// and a redelivered duplicate run the handler again). A duplicate sent meanwhile meets the
/// claim and waits; the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_is_acknowledged_only_once_its_record_is_written() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    faults.fail(Op::Complete, Fault::Unavailable);
    let source = TestSource::new();
    let probe = Probe::default();
    let started = start(
        consumer(&source, &probe).backoff(Duration::from_millis(10), Duration::from_millis(20)),
        Idempotency::new(store),
        &probe,
    );
    let first = source.publish("w-1", "ok 1");
    // The handler ran, and the runtime has retried the write a few times since.
    wait_until("the completion to be refused three times", || {
        faults.faulted(Op::Complete) >= 3
    })
    .await;
    assert_eq!(probe.seen.runs_of("w-1").len(), 1);
    assert_eq!(
        answers_of(&source, &first),
        [],
        "acknowledged before its record was written"
    );
    // A duplicate meanwhile: in flight, retried, never run.
    let duplicate = source.publish("w-1", "ok 1");
    wait_until("the duplicate to be retried", || {
        !answers_of(&source, &duplicate).is_empty()
    })
    .await;
    assert!(
        answers_of(&source, &first).is_empty(),
        "acknowledged before its record was written"
    );

    faults.heal(Op::Complete);
    source.settled().await;
    let report = started.stop().await;
    assert_eq!(answers_of(&source, &first), [(1, Answer::Ack)]);
    assert_eq!(
        answers_of(&source, &duplicate).last(),
        Some(&(answers_of(&source, &duplicate).len() as u64, Answer::Ack)),
        "the duplicate acknowledged once the record is written"
    );
    assert_eq!(probe.seen.runs_of("w-1").len(), 1, "the handler ran once");
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(report.duplicates, 1, "{report:?}");
}

/// When the runtime gives the completion up (its `record_retry` bound passed, the store still
/// refusing), the message is retried as transient, never acknowledged as applied: the broker
/// keeps it, and its redelivery meets the operation again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completion_given_up_is_a_retry_never_an_ack() {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    faults.fail(Op::Complete, Fault::Unavailable);
    let source = TestSource::new();
    let probe = Probe::default();
    let idempotency = Idempotency::builder(store)
        .record_retry(Duration::from_millis(300))
        .build();
    let started = start(
        consumer(&source, &probe).backoff(Duration::from_millis(10), Duration::from_millis(20)),
        idempotency,
        &probe,
    );
    let first = source.publish("g-1", "ok 1");
    wait_until("the first delivery to be answered", || {
        !answers_of(&source, &first).is_empty()
    })
    .await;
    let answers = answers_of(&source, &first);
    assert!(
        matches!(answers[0], (1, Answer::Retry(_))),
        "the record was never written: retried, not acknowledged: {answers:?}"
    );
    assert!(
        probe.seen.observed().iter().any(|((position, n), o)| {
            *position == first
                && *n == 1
                && matches!(o, Observed::Retried(Failure::Transient(_), _))
        }),
        "{:?}",
        probe.seen.observed()
    );
    faults.heal(Op::Complete);
    let _ = started.stop().await;
    assert!(
        answers_of(&source, &first)
            .iter()
            .all(|(n, a)| *n > 1 || !matches!(a, Answer::Ack)),
        "never acknowledged on the delivery whose record was not written"
    );
}
