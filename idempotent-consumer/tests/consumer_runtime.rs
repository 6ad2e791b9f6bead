//! The consumer runtime over an in-process source (`support::source`) and `Idempotency` over
//! `MemoryStore` in claim mode, with a handler driven by each message's body
//! (`support::probe`): exactly one effect per key under duplicates and malformed messages, the
//! concurrency bound, ordering keys, fingerprint mismatches, drain on shutdown, and content
//! keys and scopes. Failures are in `consumer_runtime_failures`, keep-alive and handling
//! limits in `consumer_runtime_keep_alive`, the observer and the metrics in
//! `consumer_runtime_observer`.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_consumer::{Consumer, Decode, Failure, Handler, Message};
use idempotent_core::ClaimHandle;
use idempotent_core::metrics::{REQUESTS, Recorded};
use support::probe::*;
use support::source::*;
use tokio::sync::oneshot;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_key_is_applied_once_duplicates_are_acknowledged_and_malformed_dead_lettered() {
    let source = TestSource::new();
    // 500 messages: 180 ids published once, 100 ids published three times (twice in a row,
    // then again far behind), and 20 that cannot be decoded, interleaved.
    let mut positions_of: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut publish = |id: String, body: String| {
        let position = source.publish(&id, &body);
        positions_of.entry(id).or_default().push(position);
    };
    for i in 0..100 {
        for _ in 0..2 {
            publish(format!("triple-{i}"), format!("sleep 2 triple payload {i}"));
        }
        publish(format!("single-{i}"), format!("sleep 1 single payload {i}"));
        if i % 5 == 0 {
            publish(format!("bad-{}", i / 5), format!("garbage {i}"));
        }
    }
    for i in 100..180 {
        publish(format!("single-{i}"), format!("ok single payload {i}"));
    }
    for i in (0..100).rev() {
        publish(format!("triple-{i}"), format!("sleep 2 triple payload {i}"));
    }
    assert_eq!(positions_of.values().map(Vec::len).sum::<usize>(), 500);

    let probe = Probe::default();
    let (idempotency, recorded) = Recorded::capture(memory);
    let consumer = consumer(&source, &probe)
        .concurrency(32)
        .backoff(Duration::from_millis(5), Duration::from_millis(20));
    let report = run_until_settled(consumer, idempotency, &probe).await;

    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(report.applied, 280, "{report:?}");
    assert_eq!(report.duplicates, 200, "{report:?}");
    assert_eq!(report.dead_lettered, 20, "{report:?}");
    assert_eq!(report.source_errors, 0, "{report:?}");
    // The second copy of each id is received with the first: they meet in flight.
    assert!(report.retried > 0, "{report:?}");

    // Each id's effect happened exactly once, with its own payload; no malformed message
    // reached the handler, and the handler never ran for a duplicate.
    let effects = probe.seen.effects();
    assert_eq!(effects.len(), 280);
    let runs = probe.seen.runs();
    assert_eq!(runs.len(), 280, "the handler ran once per id");
    for (id, positions) in &positions_of {
        let applied = effects.get(id);
        if id.starts_with("bad-") {
            assert!(applied.is_none(), "{id} was handled");
            continue;
        }
        let applied = applied.unwrap_or_else(|| panic!("{id} was never applied"));
        assert_eq!(applied.len(), 1, "{id} applied {applied:?}");
        let (kind, i) = id.split_once('-').unwrap();
        assert_eq!(applied[0], format!("{kind} payload {i}"), "{id}");
        // Every copy was acknowledged, once, in the end.
        let acks: usize = positions
            .iter()
            .map(|p| {
                answers_of(&source, p)
                    .iter()
                    .filter(|(_, a)| *a == Answer::Ack)
                    .count()
            })
            .sum();
        assert_eq!(acks, positions.len(), "{id}");
    }
    assert!(
        runs.iter().all(|r| r.claim_current),
        "ClaimHandle::current() in the handler"
    );

    // The malformed ones: dead-lettered once each, on their first delivery, with the decode
    // error as the reason.
    let dead = source.dead_letters();
    assert_eq!(dead.len(), 20);
    let mut dead_ids: Vec<_> = dead
        .iter()
        .map(|(m, reason)| {
            assert_eq!(m.deliveries(), 1);
            assert_eq!(
                reason,
                &format!("cannot decode {:?}", std::str::from_utf8(m.body()).unwrap())
            );
            m.id().unwrap().to_owned()
        })
        .collect();
    dead_ids.sort();
    dead_ids.dedup();
    assert_eq!(dead_ids.len(), 20);

    // Retries happen only when a copy meets its twin in flight; each is redelivered with its
    // count incremented and ends as a duplicate.
    for ((position, deliveries), observed) in probe.seen.observed() {
        if let Observed::Retried(failure, _) = observed {
            assert!(matches!(failure, Failure::Transient(_)), "{failure:?}");
            let next = answers_of(&source, &position);
            assert!(
                next.iter().any(|(n, _)| *n == deliveries + 1),
                "{position} redelivered"
            );
        }
    }
    // The claims, counted by the runtime's own handles (registered when it was created).
    let requests =
        |outcome| recorded.counter(REQUESTS, &[("protocol", "message"), ("outcome", outcome)]);
    assert_eq!(requests("fresh"), 280);
    assert_eq!(requests("replayed"), 200);
    assert_eq!(requests("in_flight"), report.retried);
    assert_eq!(
        recorded.counter(REQUESTS, &[("protocol", "message")]),
        480 + report.retried
    );
}

/// Runs `messages` handlers of 20 ms with `concurrency(n)`: the most running at once.
async fn most_running_at_once(n: usize, messages: usize) -> usize {
    let source = TestSource::new();
    for i in 0..messages {
        source.publish(&format!("c-{i}"), &format!("sleep 20 {i}"));
    }
    let probe = Probe::default();
    let report =
        run_until_settled(consumer(&source, &probe).concurrency(n), memory(), &probe).await;
    assert_eq!(report.applied, messages as u64);
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    // Never more asked for than a batch (the default, 32), nor than there is room for in
    // hand (the concurrency plus a batch).
    let asked = source.lock().asked.clone();
    assert!(
        asked.iter().all(|&max| (1..=32).contains(&max)),
        "asked for {asked:?}"
    );
    probe.seen.max_running()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_more_handlers_run_at_once_than_the_concurrency() {
    assert_eq!(most_running_at_once(8, 160).await, 8);
    assert_eq!(most_running_at_once(1, 15).await, 1);
    assert_eq!(most_running_at_once(40, 200).await, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_sharing_an_ordering_key_run_one_at_a_time_in_arrival_order() {
    let source = TestSource::new();
    // Ten keys, twenty messages each, published in turns; the keys' handlers are slow enough
    // to overlap if the runtime let them.
    for j in 0..20 {
        for k in 0..10 {
            source.publish_with(
                &format!("o-{k}-{j}"),
                &format!("sleep 3 {k} {j}"),
                Some(&format!("key-{k}")),
            );
        }
    }
    let probe = Probe::default();
    let report =
        run_until_settled(consumer(&source, &probe).concurrency(16), memory(), &probe).await;
    assert_eq!(report.applied, 200, "{report:?}");
    assert_every_delivery_answered_once(&source, &probe.seen, &report);

    let arrival: HashMap<String, usize> = source
        .deliveries()
        .iter()
        .enumerate()
        .map(|(i, d)| (d.message.position().to_owned(), i))
        .collect();
    let mut by_key: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    for run in probe.seen.runs() {
        by_key
            .entry(run.order.clone().unwrap())
            .or_default()
            .push(run);
    }
    assert_eq!(by_key.len(), 10);
    for (key, mut runs) in by_key {
        runs.sort_by_key(|r| r.started);
        assert_eq!(runs.len(), 20, "{key}");
        for pair in runs.windows(2) {
            assert!(
                pair[1].started >= pair[0].ended.unwrap(),
                "{key}: {} started before {} ended",
                pair[1].position,
                pair[0].position
            );
            assert!(
                arrival[&pair[1].position] > arrival[&pair[0].position],
                "{key}: {} (arrived later) ran before {}",
                pair[0].position,
                pair[1].position
            );
        }
    }
    // Different keys ran side by side.
    let most = probe.seen.max_running();
    assert!(most >= 5, "at most {most} keys ran at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_reused_for_other_content_is_dead_lettered_and_the_first_effect_stands() {
    let source = TestSource::new();
    let probe = Probe::default();
    let started = start(consumer(&source, &probe), memory(), &probe);
    let first = source.publish("order-7", "ok alpha");
    source.settled().await;
    let other = source.publish("order-7", "ok beta");
    source.settled().await;
    let again = source.publish("order-7", "ok alpha");
    source.settled().await;
    let report = started.stop().await;
    assert_every_delivery_answered_once(&source, &probe.seen, &report);

    assert_eq!(answers_of(&source, &first), [(1, Answer::Ack)]);
    let answers = answers_of(&source, &other);
    assert_eq!(answers.len(), 1, "dead-lettered at once: {answers:?}");
    match &answers[0] {
        (1, Answer::DeadLetter(reason)) => {
            assert!(reason.contains("fingerprint mismatch"), "{reason}");
        }
        answer => panic!("{answer:?}"),
    }
    assert_eq!(answers_of(&source, &again), [(1, Answer::Ack)]);
    assert_eq!(
        (report.applied, report.dead_lettered, report.duplicates),
        (1, 1, 1),
        "{report:?}"
    );
    assert_eq!(
        probe.seen.effects(),
        HashMap::from([("order-7".to_owned(), vec!["alpha".to_owned()])])
    );
    assert_eq!(probe.seen.runs().len(), 1);
    let observed: HashMap<_, _> = probe.seen.observed().into_iter().collect();
    assert!(matches!(
        observed[&(other, 1)],
        Observed::DeadLettered(Failure::Malformed(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_drains_every_message_in_hand_and_receives_no_more() {
    let source = TestSource::new();
    for i in 0..200 {
        source.publish(&format!("d-{i}"), &format!("sleep 400 {i}"));
    }
    let probe = Probe::default();
    let started = start(consumer(&source, &probe).concurrency(50), memory(), &probe);
    wait_until("50 handlers to run", || probe.seen.running() == 50).await;
    let stopping = Instant::now();
    let report = started.stop().await;
    let returned = Instant::now();

    // It waited for the handlers, then for those of the messages waiting in hand for a slot,
    // and answered each message it had received: at most the concurrency plus a batch.
    assert!(
        returned - stopping >= Duration::from_millis(300),
        "{:?}",
        returned - stopping
    );
    assert_eq!(probe.seen.running(), 0);
    let deliveries = source.deliveries();
    let received = deliveries.len();
    assert!(
        (50..=50 + 32).contains(&received),
        "received {received}: more than the concurrency plus a batch"
    );
    assert!(deliveries.iter().all(|d| d.answers
        == [Answered {
            answer: Answer::Ack,
            failed: false
        }]));
    assert_eq!(
        source.lock().ready.len(),
        200 - received,
        "the rest is still the broker's"
    );
    assert_eq!(report.applied, received as u64, "{report:?}");
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    let runs = probe.seen.runs();
    assert_eq!(runs.len(), received);
    assert!(runs.iter().all(|r| r.ended.is_some_and(|e| e <= returned)));
    let mut ids: Vec<_> = runs.iter().map(|r| r.id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), received, "nothing handled twice");
}

/// Keys from the content, scoped by a field: counts each (scope, body) effect.
#[derive(Default, Clone)]
struct Scoped {
    effects: Arc<Mutex<BTreeMap<(String, String), usize>>>,
}

impl Decode for Scoped {
    type Input = (String, String);

    fn decode(&self, message: &Message) -> Result<(String, String), Failure> {
        let scope = message
            .field("order")
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        let body = String::from_utf8_lossy(message.body()).into_owned();
        Ok((scope, body))
    }

    fn key(
        &self,
        message: &Message,
        _: &(String, String),
    ) -> Result<idempotent_core::Key, Failure> {
        Ok(message.content_key())
    }

    fn scope(&self, _: &Message, (scope, _): &(String, String)) -> Option<idempotent_core::Scope> {
        (!scope.is_empty()).then(|| idempotent_core::Scope::new().tenant(scope))
    }
}

impl Handler for Scoped {
    type Output = ();

    async fn handle(&self, input: &(String, String), _: &ClaimHandle) -> Result<(), Failure> {
        *self
            .effects
            .lock()
            .unwrap()
            .entry(input.clone())
            .or_default() += 1;
        Ok(())
    }
}

/// A content-based key makes the same content one message, whatever its message id; a scope
/// makes the same key in two tenants two messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn content_keys_and_scopes_decide_what_is_the_same_message() {
    let source = TestSource::new();
    for (id, body, tenant) in [
        ("a", "pay 5", Some("t1")),
        ("b", "pay 5", Some("t1")), // same content, another id: a duplicate
        ("c", "pay 5", Some("t2")), // same content in another tenant: applied
        ("d", "pay 7", Some("t1")),
        ("e", "pay 7", None),
        ("f", "pay 7", None),
    ] {
        source.publish_with(id, body, tenant);
    }
    let handler = Scoped::default();
    let (stop, done) = oneshot::channel::<()>();
    let run =
        tokio::spawn(
            Consumer::new(source.clone()).run(memory(), handler.clone(), async move {
                let _ = done.await;
            }),
        );
    // Acknowledged, not only answered: `e` and `f` share no ordering key, so `f` may meet `e`
    // in flight, be retried, and be acknowledged as a duplicate on its next delivery.
    wait_until("six acknowledged", || {
        source
            .deliveries()
            .iter()
            .filter(|d| d.answers.iter().any(|a| a.answer == Answer::Ack))
            .count()
            == 6
    })
    .await;
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert_eq!((report.applied, report.duplicates), (4, 2), "{report:?}");
    let effects = handler.effects.lock().unwrap().clone();
    let expected: BTreeMap<(String, String), usize> = [
        (("t1", "pay 5"), 1),
        (("t2", "pay 5"), 1),
        (("t1", "pay 7"), 1),
        (("", "pay 7"), 1),
    ]
    .into_iter()
    .map(|((s, b), n)| ((s.to_owned(), b.to_owned()), n))
    .collect();
    assert_eq!(effects, expected);
}
