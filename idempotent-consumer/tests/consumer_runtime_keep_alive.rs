//! The consumer runtime's keep-alive and the broker's handling limit (over the in-process
//! source of `support::source` and the handler of `support::probe`): a slow handler's message
//! is kept alive and quick ones are not, messages waiting on their ordering key or for a
//! handler slot are kept alive until their turn, and the handling limit counts from receipt.

mod support;

use std::time::Duration;

use idempotent_consumer::Failure;
use support::probe::*;
use support::source::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_handlers_message_is_kept_alive_and_quick_ones_are_not() {
    let source = TestSource::with_keep_alive(Some(Duration::from_millis(50)));
    // Keep-alives that fail are counted and change nothing else.
    source.inject(|f| f.keep_alive = 2);
    let slow = source.publish("slow", "sleep 300 slow");
    let quick: Vec<_> = (0..20)
        .map(|i| source.publish(&format!("quick-{i}"), &format!("ok {i}")))
        .collect();
    let probe = Probe::default();
    let report = run_until_settled(consumer(&source, &probe), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 21, "{report:?}");
    assert_eq!(report.source_errors, 2, "{report:?}");
    let keep_alives = |position: &str| {
        source
            .deliveries()
            .iter()
            .find(|d| d.message.position() == position)
            .unwrap()
            .keep_alives
            .len()
    };
    let slow = keep_alives(&slow);
    assert!(
        (4..=7).contains(&slow),
        "the 300 ms handler's message was kept alive {slow} times"
    );
    for position in &quick {
        assert_eq!(keep_alives(position), 0, "{position}");
    }
}

/// Messages waiting behind a slow one on their ordering key are this consumer's too: each tick
/// of the running message's keep-alive keeps them alive as well, so that the broker does not
/// hand them to another consumer before their turn comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_waiting_on_their_ordering_key_are_kept_alive_until_their_turn() {
    let source = TestSource::with_keep_alive(Some(Duration::from_millis(20)));
    let positions: Vec<_> = (0..3)
        .map(|i| source.publish_with(&format!("w-{i}"), &format!("sleep 200 {i}"), Some("K")))
        .collect();
    let probe = Probe::default();
    let report = run_until_settled(consumer(&source, &probe), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 3, "{report:?}");
    let deliveries = source.deliveries();
    assert_eq!(deliveries.len(), 3, "each delivered once");

    // One at a time, in order.
    let runs: Vec<Run> = positions
        .iter()
        .map(|position| {
            let runs: Vec<_> = probe
                .seen
                .runs()
                .into_iter()
                .filter(|r| r.position == *position)
                .collect();
            assert_eq!(runs.len(), 1, "{position}: {runs:?}");
            runs[0].clone()
        })
        .collect();
    for pair in runs.windows(2) {
        assert!(pair[1].started >= pair[0].ended.unwrap(), "{runs:?}");
    }
    // The keep-alives of message `i`: before its handler started, and after.
    let kept = |i: usize| {
        let delivery = deliveries
            .iter()
            .find(|d| d.message.position() == positions[i])
            .unwrap();
        let before = delivery
            .keep_alives
            .iter()
            .filter(|&&at| at < runs[i].started)
            .count();
        (before, delivery.keep_alives.len() - before)
    };
    let (first_before, first_during) = kept(0);
    let first = first_before + first_during;
    let (second_before, second_during) = kept(1);
    let (third_before, _) = kept(2);
    assert!(
        first >= 5,
        "the first, running 200 ms, kept alive {first} times"
    );
    // Every tick of the first kept the second and the third alive; every tick of the second
    // (once running) the third.
    assert!(
        second_before >= first,
        "the second was kept alive {second_before} times while it waited, the first {first}"
    );
    assert!(
        third_before >= first + second_during,
        "the third was kept alive {third_before} times while it waited; the first {first} \
         times, the second {second_during} while it ran"
    );
}

/// Messages received beyond the free handler slots wait in hand for one, kept alive meanwhile,
/// and are then handled: one slot, three messages of 200 ms received in one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_waiting_for_a_handler_slot_are_kept_alive_until_their_turn() {
    let source = TestSource::with_keep_alive(Some(Duration::from_millis(20)));
    let positions: Vec<_> = (0..3)
        .map(|i| source.publish(&format!("s-{i}"), &format!("sleep 200 {i}")))
        .collect();
    let probe = Probe::default();
    let report =
        run_until_settled(consumer(&source, &probe).concurrency(1), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 3, "{report:?}");
    assert_eq!(probe.seen.max_running(), 1);
    let deliveries = source.deliveries();
    assert_eq!(deliveries.len(), 3, "each delivered once");
    // The one whose turn came last (without an ordering key, any of the three).
    let runs = probe.seen.runs();
    let last = runs.iter().max_by_key(|r| r.started).unwrap();
    assert!(positions.contains(&last.position));
    let started = last.started;
    let delivery = deliveries
        .iter()
        .find(|d| d.message.position() == last.position)
        .unwrap();
    let waiting = delivery
        .keep_alives
        .iter()
        .filter(|&&at| at < started)
        .count();
    // It waited for two handlers of 200 ms: about 20 ticks of 20 ms.
    assert!(
        waiting >= 10,
        "kept alive {waiting} times while it waited for a slot"
    );
}

/// The source's handling limit (RabbitMQ's consumer timeout) counts from receipt, not from the
/// handler's start: with a limit of 300 ms, the first message's handler (400 ms on its first
/// delivery) is stopped at the limit, and the second, which waited those 300 ms behind it, is
/// not given a fresh 300 ms: both are retried, then applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_brokers_handling_limit_counts_from_receipt() {
    let source = TestSource::with_limits(None, Some(Duration::from_millis(300)));
    // One ordering key, so that they run in this order.
    let first = source.publish_with("h-0", "slow 2 400 a", Some("K"));
    let second = source.publish_with("h-1", "sleep 20 b", Some("K"));
    let probe = Probe::default();
    let consumer = consumer(&source, &probe)
        .concurrency(1)
        .backoff(Duration::from_millis(5), Duration::from_millis(5));
    let report = run_until_settled(consumer, memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 2, "{report:?}");
    for position in [&first, &second] {
        let answers = answers_of(&source, position);
        assert_eq!(answers.len(), 2, "{position}: {answers:?}");
        assert_eq!(
            answers[0],
            (1, Answer::Retry(Duration::from_millis(5))),
            "{position}"
        );
        assert_eq!(answers[1], (2, Answer::Ack), "{position}");
    }
    let limited = probe
        .seen
        .observed()
        .iter()
        .filter(|(_, o)| matches!(
            o,
            Observed::Retried(Failure::Transient(reason), _) if reason.contains("the broker's limit")
        ))
        .count();
    assert_eq!(limited, 2);
    for id in ["h-0", "h-1"] {
        assert_eq!(probe.seen.effects()[id].len(), 1, "{id}");
    }
}

/// A source that asks for keep-alives every `Duration::ZERO` (a custom source's mistake) gets
/// them at most every millisecond: its messages are applied, never failed by a panic of the
/// timer (`interval` refuses a zero period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_period_of_zero_is_a_millisecond_not_a_panic() {
    let source = TestSource::with_keep_alive(Some(Duration::ZERO));
    for i in 0..5 {
        source.publish(&format!("z-{i}"), &format!("sleep 20 {i}"));
    }
    let probe = Probe::default();
    let report = run_until_settled(consumer(&source, &probe), memory(), &probe).await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 5, "{report:?}");
    for i in 0..5 {
        assert_eq!(probe.seen.runs_of(&format!("z-{i}")).len(), 1, "z-{i}");
    }
}
