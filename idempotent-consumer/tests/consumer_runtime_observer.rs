//! The consumer runtime's observer and metrics (over the in-process source of
//! `support::source` and the handler of `support::probe`): both see every outcome, on a
//! current-thread and a multi-thread runtime, and an observer that panics harms neither its
//! ordering key nor the drain.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent_consumer::{
    Consumer, Failure, MESSAGE_DEAD_LETTERS, MESSAGE_DURATION, MESSAGE_REDELIVERIES, MESSAGES,
    Report, SOURCE_ERRORS,
};
use idempotent_core::metrics::{REQUESTS, Recorded};
use support::probe::*;
use support::source::*;
use tokio::sync::oneshot;

/// The observer and the runtime's metrics over one small, sequential run, recorded through
/// `Recorded::capture` around a current-thread runtime (on a multi-thread one:
/// `the_metrics_are_captured_on_a_multi_thread_runtime_too`).
#[test]
fn the_observer_and_the_metrics_see_every_outcome() {
    let source = TestSource::new();
    let probe = Probe::default();
    source.inject(|f| {
        f.receive = 1;
        f.ack = 1;
    });
    let applied = source.publish("a", "ok a");
    let duplicate = source.publish("a", "ok a");
    let malformed = source.publish("m", "garbage");
    let rejected = source.publish("r", "reject r");
    let consumer = consumer(&source, &probe)
        .concurrency(1)
        .max_deliveries(2)
        .backoff(Duration::from_millis(5), Duration::from_millis(5));
    let (report, recorded) = run_captured(consumer, &probe);
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(counts(&report), (1, 2, 1, 2, 2), "{report:?}");

    // The observer, delivery by delivery.
    let observed: HashMap<_, _> = probe.seen.observed().into_iter().collect();
    let at = |position: &str, n: u64| observed[&(position.to_owned(), n)].clone();
    assert_eq!(at(&applied, 1), Observed::Applied);
    assert_eq!(at(&applied, 2), Observed::Duplicate, "its ack failed");
    assert_eq!(at(&duplicate, 1), Observed::Duplicate);
    assert_eq!(
        at(&malformed, 1),
        Observed::DeadLettered(Failure::Malformed("cannot decode \"garbage\"".into()))
    );
    assert_eq!(
        at(&rejected, 1),
        Observed::Retried(Failure::Rejected(REJECTED.into()), Duration::from_millis(5))
    );
    assert_eq!(
        at(&rejected, 2),
        Observed::DeadLettered(Failure::Rejected(REJECTED.into()))
    );
    assert_eq!(observed.len(), 6);

    // The metrics.
    let source_label = ("source", SOURCE_NAME);
    let messages = |outcome| recorded.counter(MESSAGES, &[source_label, ("outcome", outcome)]);
    assert_eq!(messages("applied"), 1);
    assert_eq!(messages("duplicate"), 2);
    assert_eq!(messages("retried"), 1);
    assert_eq!(messages("dead_lettered"), 2);
    assert_eq!(recorded.histogram(MESSAGE_DURATION, &[source_label]).0, 6);
    let dead = |kind| recorded.counter(MESSAGE_DEAD_LETTERS, &[source_label, ("kind", kind)]);
    assert_eq!(dead("malformed"), 1);
    assert_eq!(dead("rejected"), 1);
    assert_eq!(recorded.counter(MESSAGE_REDELIVERIES, &[source_label]), 2);
    let errors =
        |operation| recorded.counter(SOURCE_ERRORS, &[source_label, ("operation", operation)]);
    assert_eq!(errors("receive"), 1);
    assert_eq!(errors("ack"), 1);
    assert_eq!(recorded.counter(SOURCE_ERRORS, &[]), 2);
    // The claims: the handler ran on three deliveries (one applied, two rejected), two
    // duplicates replayed; the malformed message never claimed.
    let requests =
        |outcome| recorded.counter(REQUESTS, &[("protocol", "message"), ("outcome", outcome)]);
    assert_eq!(requests("fresh"), 3);
    assert_eq!(requests("replayed"), 2);
    assert_eq!(recorded.counter(REQUESTS, &[("protocol", "message")]), 5);
    assert_eq!(recorded.counter(REQUESTS, &[("protocol", "call")]), 0);
}

/// An observer is the application's code too: one that panics is logged and harms nothing
/// else. The message's ordering key in particular goes on, for the messages waiting behind it
/// and for those that arrive later; and the consumer drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_observer_that_panics_harms_neither_its_ordering_key_nor_the_drain() {
    let source = TestSource::new();
    let first = source.publish_with("k-0", "sleep 20 0", Some("K"));
    let mut on_k = vec![first.clone()];
    for i in 1..5 {
        on_k.push(source.publish_with(&format!("k-{i}"), &format!("ok {i}"), Some("K")));
        source.publish_with(&format!("l-{i}"), &format!("ok {i}"), Some("L"));
    }
    let probe = Probe::default();
    let panicked = Arc::new(AtomicBool::new(false));
    let consumer = Consumer::new(source.clone()).on_outcome({
        let seen = Arc::clone(&probe.seen);
        let panicked = Arc::clone(&panicked);
        move |message, outcome| {
            if message.field("order").is_some_and(|v| v.as_ref() == b"K")
                && !panicked.swap(true, Ordering::SeqCst)
            {
                panic!("the test observer panics on purpose");
            }
            observe(&seen, message, outcome);
        }
    });
    let started = start(consumer, memory(), &probe);
    source.settled().await;
    // The key was released: a message on it arriving later is handled too.
    on_k.push(source.publish_with("k-later", "ok later", Some("K")));
    source.settled().await;
    let report = started.stop().await;

    assert!(panicked.load(Ordering::SeqCst));
    assert_eq!(report.applied, 10, "{report:?}");
    let deliveries = source.deliveries();
    assert_eq!(deliveries.len(), 10);
    assert!(
        deliveries.iter().all(|d| d.answers
            == [Answered {
                answer: Answer::Ack,
                failed: false
            }]),
        "each acknowledged once: {deliveries:?}"
    );
    let mut runs: Vec<_> = probe
        .seen
        .runs()
        .into_iter()
        .filter(|r| r.order.as_deref() == Some("K"))
        .collect();
    runs.sort_by_key(|r| r.started);
    assert_eq!(
        runs.iter().map(|r| r.position.clone()).collect::<Vec<_>>(),
        on_k,
        "K's messages ran in order"
    );
    for pair in runs.windows(2) {
        assert!(pair[1].started >= pair[0].ended.unwrap(), "{runs:?}");
    }
    // The observer saw every outcome but the one it panicked on.
    let observed = probe.seen.observed();
    assert_eq!(observed.len(), 9, "{observed:?}");
    assert!(
        observed
            .iter()
            .all(|((position, _), o)| *position != first && *o == Observed::Applied)
    );
}

/// Runs `consumer` until its source settles, on a multi-thread runtime created inside
/// `Recorded::capture`: the consumer's own future runs on the capturing thread, its messages'
/// tasks on the runtime's workers, where no recorder is installed.
fn run_captured_on_workers(consumer: Consumer<TestSource>, probe: &Probe) -> (Report, Recorded) {
    let source = consumer.source().clone();
    let probe = probe.clone();
    Recorded::capture(move || {
        let idempotency = memory();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let (stop, stopped) = oneshot::channel::<()>();
                let settled = tokio::spawn(async move {
                    source.settled().await;
                    let _ = stop.send(());
                });
                let shutdown = async move {
                    let _ = stopped.await;
                };
                let run = consumer.run(idempotency, probe, shutdown);
                let report = tokio::time::timeout(2 * PATIENCE, run)
                    .await
                    .expect("the consumer drains and returns");
                settled.await.expect("the source settles");
                report
            })
    })
}

/// The consumer's metrics registered when it starts, with the recorder installed then: a
/// capture around the whole consumer sees what its messages' tasks record on a multi-thread
/// runtime's workers too.
#[test]
fn the_metrics_are_captured_on_a_multi_thread_runtime_too() {
    let source = TestSource::new();
    let probe = Probe::default();
    source.inject(|f| f.ack = 1);
    for i in 0..20 {
        source.publish(&format!("m-{i}"), &format!("sleep 2 {i}"));
    }
    source.publish("g", "garbage");
    source.publish("r", "reject r");
    let consumer = consumer(&source, &probe)
        .concurrency(8)
        .max_deliveries(2)
        .backoff(Duration::from_millis(5), Duration::from_millis(5));
    let (report, recorded) = run_captured_on_workers(consumer, &probe);
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(counts(&report), (20, 1, 1, 2, 1), "{report:?}");
    let here = std::thread::current().id();
    assert!(
        probe.seen.runs().iter().all(|r| r.thread != here),
        "the handlers ran on the workers"
    );

    let source_label = ("source", SOURCE_NAME);
    let messages = |outcome| recorded.counter(MESSAGES, &[source_label, ("outcome", outcome)]);
    assert_eq!(messages("applied"), report.applied);
    assert_eq!(messages("duplicate"), report.duplicates);
    assert_eq!(messages("retried"), report.retried);
    assert_eq!(messages("dead_lettered"), report.dead_lettered);
    assert_eq!(recorded.counter(MESSAGES, &[source_label]), 24);
    assert_eq!(recorded.histogram(MESSAGE_DURATION, &[source_label]).0, 24);
    let dead = |kind| recorded.counter(MESSAGE_DEAD_LETTERS, &[source_label, ("kind", kind)]);
    assert_eq!(dead("malformed"), 1);
    assert_eq!(dead("rejected"), 1);
    assert_eq!(
        recorded.counter(SOURCE_ERRORS, &[source_label, ("operation", "ack")]),
        1
    );
    assert_eq!(recorded.counter(MESSAGE_REDELIVERIES, &[source_label]), 2);
}
