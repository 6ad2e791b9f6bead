//! The consumer runtime when something fails (over the in-process source of `support::source`
//! and the handler of `support::probe`): dead-lettering on the `max_deliveries`-th delivery
//! with the backoff's delays, unbounded retries of transient failures, handlers and decoders
//! that panic, a handler past its timeout, and the broker failing to receive, acknowledge,
//! retry or dead-letter.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idempotent_consumer::{Failure, MESSAGE_DEAD_LETTERS, MESSAGE_DURATION, MESSAGES};
use support::probe::*;
use support::source::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rejected_message_is_dead_lettered_on_its_max_deliveries_th_delivery_after_backed_off_retries()
 {
    let source = TestSource::new();
    let rejected: Vec<_> = (0..10)
        .map(|i| source.publish(&format!("r-{i}"), &format!("reject {i}")))
        .collect();
    let fine: Vec<_> = (0..10)
        .map(|i| source.publish(&format!("f-{i}"), &format!("ok {i}")))
        .collect();
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .max_deliveries(5)
        .backoff(Duration::from_millis(10), Duration::from_millis(25));
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 10, "{report:?}");
    assert_eq!(report.retried, 40, "{report:?}");
    assert_eq!(report.dead_lettered, 10, "{report:?}");

    let ms = Duration::from_millis;
    for position in &rejected {
        assert_eq!(
            answers_of(&source, position),
            [
                (1, Answer::Retry(ms(10))),
                (2, Answer::Retry(ms(20))),
                (3, Answer::Retry(ms(25))),
                (4, Answer::Retry(ms(25))),
                (5, Answer::DeadLetter(REJECTED.into())),
            ],
            "message {position}"
        );
    }
    for position in &fine {
        assert_eq!(answers_of(&source, position), [(1, Answer::Ack)]);
    }
    for i in 0..10 {
        assert_eq!(
            probe.seen.runs_of(&format!("r-{i}")).len(),
            5,
            "the handler ran on each delivery"
        );
    }
    assert_eq!(source.dead_letters().len(), 10);
    let observed = probe.seen.observed();
    assert!(observed.iter().all(|(_, o)| match o {
        Observed::Retried(failure, _) | Observed::DeadLettered(failure) =>
            *failure == Failure::Rejected(REJECTED.into()),
        _ => true,
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transient_failure_is_retried_past_max_deliveries_and_never_dead_lettered() {
    let source = TestSource::new();
    // Fails until its eighth delivery; max_deliveries is three.
    let positions: Vec<_> = (0..10)
        .map(|i| source.publish(&format!("t-{i}"), &format!("transient 8 {i}")))
        .collect();
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .max_deliveries(3)
        .backoff(Duration::from_millis(2), Duration::from_millis(10));
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 10, "{report:?}");
    assert_eq!(report.retried, 70, "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert!(source.dead_letters().is_empty());
    let ms = Duration::from_millis;
    for position in &positions {
        let mut expected: Vec<_> = [2, 4, 8, 10, 10, 10, 10]
            .into_iter()
            .zip(1..)
            .map(|(delay, n)| (n, Answer::Retry(ms(delay))))
            .collect();
        expected.push((8, Answer::Ack));
        assert_eq!(
            answers_of(&source, position),
            expected,
            "message {position}"
        );
    }
    for (id, applied) in probe.seen.effects() {
        assert_eq!(applied.len(), 1, "{id}");
        let deliveries: Vec<_> = probe
            .seen
            .runs_of(&id)
            .iter()
            .map(|r| r.deliveries)
            .collect();
        assert_eq!(deliveries, (1..=8).collect::<Vec<_>>(), "{id}");
    }
    assert!(probe.seen.observed().iter().all(|(_, o)| match o {
        Observed::Retried(failure, _) => *failure == Failure::Transient(TRANSIENT.into()),
        o => *o == Observed::Applied,
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_panics_fails_its_message_not_the_consumer() {
    let source = TestSource::new();
    let panics = source.publish("p-1", "panic");
    for i in 0..20 {
        source.publish(&format!("after-{i}"), &format!("sleep 5 {i}"));
    }
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .max_deliveries(3)
        .backoff(Duration::from_millis(20), Duration::from_millis(40));
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);

    let panicked = "the handler panicked".to_owned();
    assert_eq!(
        answers_of(&source, &panics),
        [
            (1, Answer::Retry(Duration::from_millis(20))),
            (2, Answer::Retry(Duration::from_millis(40))),
            (3, Answer::DeadLetter(panicked.clone())),
        ]
    );
    // Each delivery ran the handler again: the panic released the claim.
    assert_eq!(probe.seen.runs_of("p-1").len(), 3);
    assert!(
        probe
            .seen
            .observed()
            .iter()
            .all(|((position, _), o)| match o {
                Observed::Retried(failure, _) | Observed::DeadLettered(failure) =>
                    *position == panics && *failure == Failure::Rejected(panicked.clone()),
                _ => true,
            })
    );
    assert_eq!(report.applied, 20, "the consumer went on: {report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(probe.seen.running(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn receive_failures_are_waited_out_then_everything_is_processed() {
    let source = TestSource::new();
    source.inject(|f| f.receive = 3);
    for i in 0..100 {
        source.publish(&format!("m-{i}"), &format!("ok {i}"));
    }
    let probe = Probe::default();
    let began = Instant::now();
    let report = run_until_settled(consumer(&source, &probe), memory(), &probe).await;
    // 100 + 200 + 400 ms of backoff before the first message.
    assert!(
        began.elapsed() >= Duration::from_millis(650),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(source.lock().receive_errors, 3);
    assert_eq!(report.source_errors, 3, "{report:?}");
    assert_eq!(report.applied, 100, "{report:?}");
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(probe.seen.effects().len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_ack_is_redelivered_and_then_counted_as_a_duplicate() {
    let source = TestSource::new();
    source.inject(|f| f.ack = 5);
    for i in 0..50 {
        source.publish(&format!("a-{i}"), &format!("sleep 1 {i}"));
    }
    let probe = Probe::default();
    let report =
        run_until_settled(consumer(&source, &probe).concurrency(8), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 50, "{report:?}");
    assert_eq!(report.duplicates, 5, "{report:?}");
    assert_eq!(report.source_errors, 5, "{report:?}");
    assert_eq!(
        probe.seen.runs().len(),
        50,
        "the handler ran once per message"
    );
    let deliveries = source.deliveries();
    let failed: Vec<_> = deliveries
        .iter()
        .filter(|d| d.answers[0].failed)
        .map(|d| d.message.position().to_owned())
        .collect();
    assert_eq!(failed.len(), 5);
    for position in failed {
        let answers = answers_of(&source, &position);
        assert_eq!(answers, [(1, Answer::Ack), (2, Answer::Ack)]);
        let observed: Vec<_> = probe
            .seen
            .observed()
            .into_iter()
            .filter(|((p, _), _)| *p == position)
            .map(|((_, n), o)| (n, o))
            .collect();
        assert_eq!(observed.len(), 2);
        assert!(observed.contains(&(1, Observed::Applied)));
        assert!(observed.contains(&(2, Observed::Duplicate)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_retries_and_dead_letters_are_left_to_the_broker() {
    let source = TestSource::new();
    source.inject(|f| {
        f.retry = 1;
        f.dead_letter = 1;
    });
    let transient = source.publish("t", "transient 2 t");
    let malformed = source.publish("m", "garbage");
    let probe = Probe::default();
    let report =
        run_until_settled(consumer(&source, &probe).concurrency(1), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(
        answers_of(&source, &transient),
        [
            (1, Answer::Retry(Duration::from_millis(100))),
            (2, Answer::Ack)
        ]
    );
    assert_eq!(
        answers_of(&source, &malformed),
        [
            (1, Answer::DeadLetter("cannot decode \"garbage\"".into())),
            (2, Answer::DeadLetter("cannot decode \"garbage\"".into())),
        ]
    );
    assert_eq!(source.dead_letters().len(), 1);
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(report.source_errors, 2, "{report:?}");
}

/// A decoder is the application's code too: one that panics on a message must fail that
/// message (which a restarted consumer would receive again, and panic on again), not end the
/// consumer with every message of its batch unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decoder_that_panics_fails_its_message_not_the_consumer() {
    let source = TestSource::new();
    let boom = source.publish("boom", "boom");
    for i in 0..5 {
        source.publish(&format!("after-{i}"), &format!("ok {i}"));
    }
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .max_deliveries(2)
        .backoff(Duration::from_millis(5), Duration::from_millis(5));
    let started = start(consumer, memory(), &probe);
    wait_until("the source to settle or the consumer to end", || {
        source.is_settled() || started.task.is_finished()
    })
    .await;
    let report = started.stop().await;
    assert_eq!(report.applied, 5, "{report:?}");
    let answers = answers_of(&source, &boom);
    assert!(
        matches!(answers.last(), Some((_, Answer::DeadLetter(_)))),
        "{answers:?}"
    );
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
}

/// A dead letter that finds the message answered by another consumer meanwhile wrote nothing:
/// the message is a duplicate (the report, the observer, the metrics), not dead-lettered.
#[test]
fn a_dead_letter_finding_the_message_answered_elsewhere_is_a_duplicate() {
    let source = TestSource::new();
    let probe = Probe::default();
    let applied = source.publish("a", "ok a");
    let malformed = source.publish("m", "garbage");
    let rejected = source.publish("r", "reject r");
    let dead = source.publish("d", "garbage d");
    source.answer_elsewhere(&malformed);
    source.answer_elsewhere(&rejected);
    let consumer = consumer(&source, &probe).max_deliveries(1);
    let (report, recorded) = run_captured(consumer, &probe);
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(counts(&report), (1, 2, 0, 1, 0), "{report:?}");
    assert_eq!(
        answers_of(&source, &malformed),
        [(
            1,
            Answer::DeadLetterAlready("cannot decode \"garbage\"".into())
        )]
    );
    assert_eq!(
        answers_of(&source, &rejected),
        [(1, Answer::DeadLetterAlready(REJECTED.into()))]
    );
    let dead_letters = source.dead_letters();
    assert_eq!(dead_letters.len(), 1);
    assert_eq!(dead_letters[0].0.position(), dead);

    let observed: HashMap<_, _> = probe.seen.observed().into_iter().collect();
    let at = |position: &str| observed[&(position.to_owned(), 1)].clone();
    assert_eq!(at(&applied), Observed::Applied);
    assert_eq!(at(&malformed), Observed::Duplicate);
    assert_eq!(at(&rejected), Observed::Duplicate);
    assert_eq!(
        at(&dead),
        Observed::DeadLettered(Failure::Malformed("cannot decode \"garbage d\"".into()))
    );

    let source_label = ("source", SOURCE_NAME);
    let messages = |outcome| recorded.counter(MESSAGES, &[source_label, ("outcome", outcome)]);
    assert_eq!(messages("applied"), 1);
    assert_eq!(messages("duplicate"), 2);
    assert_eq!(messages("retried"), 0);
    assert_eq!(messages("dead_lettered"), 1);
    let duplicate_durations =
        recorded.histogram(MESSAGE_DURATION, &[source_label, ("outcome", "duplicate")]);
    assert_eq!(duplicate_durations.0, 2);
    let dead = |kind| recorded.counter(MESSAGE_DEAD_LETTERS, &[source_label, ("kind", kind)]);
    assert_eq!(dead("malformed"), 1);
    assert_eq!(dead("rejected"), 0);
}

/// A handler stopped at the handler timeout has its claim released and its message retried:
/// the next delivery runs it at once (not held off as in flight until the lease ends), and
/// its effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_past_its_timeout_is_stopped_its_claim_released_and_its_message_retried() {
    let source = TestSource::new();
    let position = source.publish("slow-1", "slow 2 60000 once");
    let quick = source.publish("quick-1", "ok fast");
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .handler_timeout(Duration::from_millis(200))
        .backoff(Duration::from_millis(5), Duration::from_millis(5));
    let started = Instant::now();
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the stopped handler's claim held the key: {:?}",
        started.elapsed()
    );
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 2, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    let answers = answers_of(&source, &position);
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(answers[0], (1, Answer::Retry(Duration::from_millis(5))));
    assert_eq!(answers[1], (2, Answer::Ack));
    assert_eq!(answers_of(&source, &quick), [(1, Answer::Ack)]);
    assert_eq!(probe.seen.effects()["slow-1"].len(), 1);
    assert!(probe.seen.observed().iter().any(|(_, o)| matches!(
        o,
        Observed::Retried(Failure::Transient(reason), _) if reason.contains("ran longer than 200ms")
    )));
}

/// Every duration setting of the runtime at its largest (a natural way to write "no limit"):
/// the handler timeout, the backoff, the source's keep-alive period and its handling limit.
/// Each used to overflow an `Instant` inside the message's task, which panicked there: the
/// message was never answered and, with an ordering key, every later message of that key
/// waited behind it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duration_max_settings_neither_panic_nor_stop_the_consumer() {
    let source = TestSource::with_limits(Some(Duration::MAX), Some(Duration::MAX));
    let positions: Vec<_> = (0..6)
        .map(|i| source.publish_with(&format!("m-{i}"), &format!("ok {i}"), Some("k")))
        .collect();
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .concurrency(1)
        .batch(1)
        .handler_timeout(Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX);
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 6, "{report:?}");
    for position in &positions {
        assert_eq!(answers_of(&source, position), [(1, Answer::Ack)]);
    }
}

/// A panic in the runtime's own per-message code (here the source's acknowledgement, called
/// after the handler) fails that message by the usual rules (retried, dead-lettered after
/// `max_deliveries`) and frees its ordering key: the messages behind it on that key are
/// handled, and the consumer keeps receiving. It used to end the message's task: the message
/// never answered, its key taken for good, and, once `concurrency + batch` messages waited
/// behind it, nothing received at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panic_in_the_runtimes_own_per_message_code_fails_the_message_and_frees_its_ordering_key()
{
    let source = TestSource::new();
    source.inject(|faults| faults.ack_panic = 1);
    let first = source.publish_with("o-0", "ok 0", Some("k"));
    let behind: Vec<_> = (1..8)
        .map(|i| source.publish_with(&format!("o-{i}"), &format!("ok {i}"), Some("k")))
        .collect();
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .concurrency(1)
        .batch(2)
        .max_deliveries(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(10));
    let report = run_until_settled(consumer, memory(), &probe).await;
    let panicked = "the consumer runtime panicked while finishing the message".to_owned();
    // Its first delivery: the ack panicked, and the message was retried as a failure; its
    // second: recorded already, a duplicate, acknowledged.
    assert_eq!(
        answers_of(&source, &first),
        [
            (1, Answer::Retry(Duration::from_millis(10))),
            (2, Answer::Ack)
        ]
    );
    assert!(probe.seen.observed().iter().any(|((position, _), o)| {
        *position == first
            && *o
                == Observed::Retried(
                    Failure::Rejected(panicked.clone()),
                    Duration::from_millis(10),
                )
    }));
    for position in &behind {
        assert_eq!(answers_of(&source, position), [(1, Answer::Ack)]);
    }
    // Applied once: the handler ran on the first delivery only.
    assert_eq!(probe.seen.runs_of("o-0").len(), 1);
    // Counted as retried on its first delivery (the broker was answered so) and as a
    // duplicate on its second; the seven behind it applied.
    assert_eq!(report.applied, 7, "{report:?}");
    assert_eq!(report.duplicates, 1, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
}
