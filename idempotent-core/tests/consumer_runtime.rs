//! The consumer runtime itself, over an in-process source (a queue behind a mutex that records
//! every answer the runtime gives it, redelivers what it is asked to retry with the delivery
//! count incremented, and fails operations on demand) and `Idempotency` over `MemoryStore` in
//! claim mode: exactly one effect per key under duplicates and malformed messages, the
//! concurrency bound, ordering keys, dead-lettering on the `max_deliveries`-th delivery with
//! the backoff's delays, unbounded retries of transient failures, fingerprint mismatches,
//! handlers that panic, keep-alive, drain on shutdown, broker failures, the observer and the
//! metrics.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idempotent_core::consumer::{
    Consumer, DeadLettered, Decode, Failure, Handler, MESSAGE_DEAD_LETTERS, MESSAGE_DURATION,
    MESSAGE_REDELIVERIES, MESSAGES, Message, Outcome, Received, Report, SOURCE_ERRORS, Source,
    SourceError,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::{REQUESTS, Recorded};
use idempotent_core::{ClaimHandle, Idempotency};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

/// The longest any test waits for the state it expects.
const PATIENCE: Duration = Duration::from_secs(15);
/// How long `receive` waits for a message before it answers with none.
const IDLE_WAIT: Duration = Duration::from_millis(10);
/// The `source` label of the test source.
const SOURCE_NAME: &str = "test";
/// The reason the test handler rejects a message with.
const REJECTED: &str = "refused by the test handler";
/// The reason the test handler fails transiently with.
const TRANSIENT: &str = "the test handler's database is down";

// ---------------------------------------------------------------------------------------------
// The source
// ---------------------------------------------------------------------------------------------

/// One answer the runtime gave the source about one delivery.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Ack,
    Retry(Duration),
    DeadLetter(String),
    /// A dead letter asked for a message another consumer had answered meanwhile: the source
    /// wrote nothing and said [`DeadLettered::Already`].
    DeadLetterAlready(String),
}

/// An answer, and whether the source failed it on purpose.
#[derive(Debug, Clone, PartialEq)]
struct Answered {
    answer: Answer,
    failed: bool,
}

/// One delivery of one message, and everything the runtime did about it.
#[derive(Debug, Clone)]
struct Delivered {
    message: Message,
    answers: Vec<Answered>,
    /// When the runtime kept it alive.
    keep_alives: Vec<Instant>,
}

/// How many of the next calls of each operation fail.
#[derive(Debug, Default, Clone, Copy)]
struct Faults {
    receive: u32,
    ack: u32,
    retry: u32,
    dead_letter: u32,
    keep_alive: u32,
}

#[derive(Debug, Default)]
struct State {
    /// Messages ready to be received, in order.
    ready: VecDeque<Message>,
    /// Retried messages waiting out their delay.
    delayed: usize,
    /// Every delivery, by its handle (the index).
    deliveries: Vec<Delivered>,
    /// The dead letters, with their reasons.
    dead_letters: Vec<(Message, String)>,
    /// Messages published so far (the next position).
    published: usize,
    /// The `max` of every `receive`.
    asked: Vec<usize>,
    /// `receive` calls failed on purpose.
    receive_errors: u32,
    /// Positions of messages another consumer answered meanwhile: dead-lettering them finds
    /// [`DeadLettered::Already`].
    answered_elsewhere: Vec<String>,
    faults: Faults,
}

struct Inner {
    state: Mutex<State>,
    arrived: Notify,
    keep_alive_every: Option<Duration>,
    handling_limit: Option<Duration>,
}

/// The in-process broker: a handle the test keeps while the consumer owns a clone.
#[derive(Clone)]
struct TestSource {
    inner: Arc<Inner>,
}

impl TestSource {
    fn new() -> Self {
        Self::with_keep_alive(None)
    }

    fn with_keep_alive(keep_alive_every: Option<Duration>) -> Self {
        Self::with_limits(keep_alive_every, None)
    }

    fn with_limits(keep_alive_every: Option<Duration>, handling_limit: Option<Duration>) -> Self {
        TestSource {
            inner: Arc::new(Inner {
                state: Mutex::default(),
                arrived: Notify::new(),
                keep_alive_every,
                handling_limit,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes a message with id `id` and body `body` (its position is its publication
    /// number); returns the position.
    fn publish(&self, id: &str, body: &str) -> String {
        self.publish_with(id, body, None)
    }

    /// Publishes a message with an `order` field when `order` is given.
    fn publish_with(&self, id: &str, body: &str, order: Option<&str>) -> String {
        let mut state = self.lock();
        let position = format!("{:05}", state.published);
        state.published += 1;
        let mut message = Message::new(position.clone(), body.to_owned()).with_id(id);
        if let Some(order) = order {
            message = message.with_field("order", order.to_owned());
        }
        state.ready.push_back(message);
        drop(state);
        self.inner.arrived.notify_one();
        position
    }

    /// Makes the next calls of some operations fail.
    fn inject(&self, set: impl FnOnce(&mut Faults)) {
        set(&mut self.lock().faults);
    }

    /// Makes dead-lettering the message at `position` find it answered by another consumer.
    fn answer_elsewhere(&self, position: &str) {
        self.lock().answered_elsewhere.push(position.to_owned());
    }

    /// Every delivery so far.
    fn deliveries(&self) -> Vec<Delivered> {
        self.lock().deliveries.clone()
    }

    fn dead_letters(&self) -> Vec<(Message, String)> {
        self.lock().dead_letters.clone()
    }

    /// Nothing left to do: no message ready, none waiting out a retry's delay, every delivery
    /// answered.
    fn is_settled(&self) -> bool {
        let state = self.lock();
        state.ready.is_empty()
            && state.delayed == 0
            && state.deliveries.iter().all(|d| !d.answers.is_empty())
    }

    async fn settled(&self) {
        wait_until("the source to settle", || self.is_settled()).await;
    }

    /// The message again, delivered once more, at the back of the queue.
    fn redeliver(&self, state: &mut State, delivery: usize) {
        let message = state.deliveries[delivery].message.clone();
        let deliveries = message.deliveries() + 1;
        state.ready.push_back(message.with_deliveries(deliveries));
        self.inner.arrived.notify_one();
    }

    /// Records `answer` for `delivery`; whether it fails (and then the message is delivered
    /// again, as a broker does with a message it was not answered about).
    fn answer(&self, delivery: usize, answer: Answer, fault: fn(&mut Faults) -> &mut u32) -> bool {
        let mut state = self.lock();
        let failed = take_one(fault(&mut state.faults));
        state.deliveries[delivery]
            .answers
            .push(Answered { answer, failed });
        if failed {
            self.redeliver(&mut state, delivery);
        }
        failed
    }
}

/// Takes one from `n` if it is not zero: whether it was.
fn take_one(n: &mut u32) -> bool {
    let was = *n > 0;
    *n = n.saturating_sub(1);
    was
}

fn injected(operation: &str) -> SourceError {
    SourceError::new(operation, "the test source fails on purpose")
}

impl Source for TestSource {
    type Delivery = usize;

    fn name(&self) -> &'static str {
        SOURCE_NAME
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<usize>>, SourceError> {
        for attempt in 0..2 {
            {
                let mut state = self.lock();
                if attempt == 0 {
                    state.asked.push(max);
                    if take_one(&mut state.faults.receive) {
                        state.receive_errors += 1;
                        return Err(injected("receive"));
                    }
                }
                if !state.ready.is_empty() || attempt == 1 {
                    let n = max.min(state.ready.len());
                    let mut batch = Vec::with_capacity(n);
                    for message in state.ready.drain(..n).collect::<Vec<_>>() {
                        let delivery = state.deliveries.len();
                        state.deliveries.push(Delivered {
                            message: message.clone(),
                            answers: Vec::new(),
                            keep_alives: Vec::new(),
                        });
                        batch.push(Received { message, delivery });
                    }
                    return Ok(batch);
                }
            }
            let _ = tokio::time::timeout(IDLE_WAIT, self.inner.arrived.notified()).await;
        }
        unreachable!("the second attempt returns")
    }

    async fn ack(&self, delivery: &usize) -> Result<(), SourceError> {
        match self.answer(*delivery, Answer::Ack, |f| &mut f.ack) {
            true => Err(injected("ack")),
            false => Ok(()),
        }
    }

    async fn retry(&self, delivery: &usize, delay: Duration) -> Result<(), SourceError> {
        if self.answer(*delivery, Answer::Retry(delay), |f| &mut f.retry) {
            return Err(injected("retry"));
        }
        self.lock().delayed += 1;
        let source = self.clone();
        let delivery = *delivery;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut state = source.lock();
            state.delayed -= 1;
            source.redeliver(&mut state, delivery);
        });
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &usize,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        let reason = reason.to_owned();
        let elsewhere = self
            .lock()
            .answered_elsewhere
            .iter()
            .any(|p| p == message.position());
        let answer = match elsewhere {
            true => Answer::DeadLetterAlready(reason.clone()),
            false => Answer::DeadLetter(reason.clone()),
        };
        if self.answer(*delivery, answer, |f| &mut f.dead_letter) {
            return Err(injected("dead_letter"));
        }
        if elsewhere {
            return Ok(DeadLettered::Already);
        }
        self.lock().dead_letters.push((message.clone(), reason));
        Ok(DeadLettered::Now)
    }

    async fn keep_alive(&self, delivery: &usize) -> Result<(), SourceError> {
        let mut state = self.lock();
        state.deliveries[*delivery].keep_alives.push(Instant::now());
        match take_one(&mut state.faults.keep_alive) {
            true => Err(injected("keep_alive")),
            false => Ok(()),
        }
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        self.inner.keep_alive_every
    }

    fn handling_limit(&self) -> Option<Duration> {
        self.inner.handling_limit
    }
}

// ---------------------------------------------------------------------------------------------
// The handler
// ---------------------------------------------------------------------------------------------

/// What the handler does with a message: the first word of its body.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// `ok PAYLOAD`: applies at once.
    Ok,
    /// `sleep MS PAYLOAD`: applies after MS milliseconds.
    Sleep(u64),
    /// `reject PAYLOAD`: always [`Failure::Rejected`].
    Reject,
    /// `transient N PAYLOAD`: [`Failure::Transient`] on deliveries before the N-th.
    TransientUntil(u64),
    /// `panic`: panics. (`boom`: the decoder panics.)
    Panic,
    /// `slow N MS PAYLOAD`: sleeps MS milliseconds on deliveries before the N-th, then applies.
    SlowUntil(u64, u64),
}

#[derive(Debug)]
struct Input {
    id: String,
    position: String,
    deliveries: u64,
    action: Action,
    payload: String,
    order: Option<String>,
}

/// One call of the handler.
#[derive(Debug, Clone)]
struct Run {
    id: String,
    position: String,
    deliveries: u64,
    order: Option<String>,
    started: Instant,
    ended: Option<Instant>,
    /// The thread the handler ran on.
    thread: std::thread::ThreadId,
    /// `ClaimHandle::current()` inside the handler: whether it was there and named the same
    /// operation as the handle passed in.
    claim_current: bool,
}

/// What an observer saw.
#[derive(Debug, Clone, PartialEq)]
enum Observed {
    Applied,
    Duplicate,
    Retried(Failure, Duration),
    DeadLettered(Failure),
}

#[derive(Debug, Default)]
struct Seen {
    runs: Mutex<Vec<Run>>,
    running: AtomicUsize,
    max_running: AtomicUsize,
    /// The payloads each id's effect was applied with.
    effects: Mutex<HashMap<String, Vec<String>>>,
    /// (position, deliveries) → what the observer saw.
    observed: Mutex<Vec<((String, u64), Observed)>>,
}

impl Seen {
    fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    fn effects(&self) -> HashMap<String, Vec<String>> {
        self.effects.lock().unwrap().clone()
    }

    fn observed(&self) -> Vec<((String, u64), Observed)> {
        self.observed.lock().unwrap().clone()
    }

    fn max_running(&self) -> usize {
        self.max_running.load(Ordering::SeqCst)
    }

    fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// The handler's calls for `id`.
    fn runs_of(&self, id: &str) -> Vec<Run> {
        self.runs().into_iter().filter(|r| r.id == id).collect()
    }
}

/// A handler running: counted in `running` until dropped (returned, failed or panicked).
struct Running {
    seen: Arc<Seen>,
    index: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.seen
            .runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[self.index]
            .ended = Some(Instant::now());
        self.seen.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The test's decoder and handler.
#[derive(Clone, Default)]
struct Probe {
    seen: Arc<Seen>,
}

impl Probe {
    fn begin(&self, input: &Input, claim_current: bool) -> Running {
        let index = {
            let mut runs = self.seen.runs.lock().unwrap();
            runs.push(Run {
                id: input.id.clone(),
                position: input.position.clone(),
                deliveries: input.deliveries,
                order: input.order.clone(),
                started: Instant::now(),
                ended: None,
                thread: std::thread::current().id(),
                claim_current,
            });
            runs.len() - 1
        };
        let now = self.seen.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.seen.max_running.fetch_max(now, Ordering::SeqCst);
        Running {
            seen: Arc::clone(&self.seen),
            index,
        }
    }
}

fn number(word: Option<&str>, body: &str) -> Result<u64, Failure> {
    word.and_then(|w| w.parse().ok())
        .ok_or_else(|| Failure::Malformed(format!("cannot decode {body:?}")))
}

impl Decode for Probe {
    type Input = Input;

    fn decode(&self, message: &Message) -> Result<Input, Failure> {
        let body = std::str::from_utf8(message.body())
            .map_err(|_| Failure::Malformed("cannot decode a body that is not UTF-8".into()))?;
        let mut words = body.split(' ');
        let action = match words.next() {
            Some("ok") => Action::Ok,
            Some("sleep") => Action::Sleep(number(words.next(), body)?),
            Some("reject") => Action::Reject,
            Some("transient") => Action::TransientUntil(number(words.next(), body)?),
            Some("panic") => Action::Panic,
            Some("slow") => {
                Action::SlowUntil(number(words.next(), body)?, number(words.next(), body)?)
            }
            Some("boom") => panic!("the test decoder panics on purpose"),
            _ => return Err(Failure::Malformed(format!("cannot decode {body:?}"))),
        };
        Ok(Input {
            id: message.id().unwrap_or_default().to_owned(),
            position: message.position().to_owned(),
            deliveries: message.deliveries(),
            action,
            payload: words.collect::<Vec<_>>().join(" "),
            order: message
                .field("order")
                .map(|v| String::from_utf8_lossy(v).into_owned()),
        })
    }

    fn ordering_key(&self, _message: &Message, input: &Input) -> Option<String> {
        input.order.clone()
    }
}

impl Handler for Probe {
    type Output = String;

    async fn handle(&self, input: &Input, claim: &ClaimHandle) -> Result<String, Failure> {
        let claim_current =
            ClaimHandle::current().is_some_and(|c| c.operation_key() == claim.operation_key());
        let _running = self.begin(input, claim_current);
        match input.action {
            Action::Ok => {}
            Action::Sleep(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Action::Reject => return Err(Failure::Rejected(REJECTED.into())),
            Action::TransientUntil(n) if input.deliveries < n => {
                return Err(Failure::Transient(TRANSIENT.into()));
            }
            Action::TransientUntil(_) => {}
            Action::Panic => panic!("the test handler panics on purpose"),
            Action::SlowUntil(n, ms) if input.deliveries < n => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Action::SlowUntil(..) => {}
        }
        self.seen
            .effects
            .lock()
            .unwrap()
            .entry(input.id.clone())
            .or_default()
            .push(input.payload.clone());
        Ok(input.payload.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Running a consumer
// ---------------------------------------------------------------------------------------------

/// A consumer of `source` whose observer records into `probe`.
fn consumer(source: &TestSource, probe: &Probe) -> Consumer<TestSource> {
    let seen = Arc::clone(&probe.seen);
    Consumer::new(source.clone())
        .on_outcome(move |message, outcome| observe(&seen, message, outcome))
}

/// Records what the observer was told into `seen`.
fn observe(seen: &Seen, message: &Message, outcome: Outcome<'_>) {
    let observed = match outcome {
        Outcome::Applied => Observed::Applied,
        Outcome::Duplicate => Observed::Duplicate,
        Outcome::Retried { failure, delay } => Observed::Retried(failure.clone(), delay),
        Outcome::DeadLettered { failure } => Observed::DeadLettered(failure.clone()),
        other => panic!("an outcome the test does not know: {other:?}"),
    };
    seen.observed.lock().unwrap().push((
        (message.position().to_owned(), message.deliveries()),
        observed,
    ));
}

/// A consumer running on a task of its own until stopped.
struct Started {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Report>,
}

fn start(consumer: Consumer<TestSource>, idempotency: Idempotency, probe: &Probe) -> Started {
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    let task = tokio::spawn(consumer.run(idempotency, probe.clone(), shutdown));
    Started { stop, task }
}

impl Started {
    /// Triggers the shutdown and waits for the drain.
    async fn stop(self) -> Report {
        let _ = self.stop.send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the consumer drains and returns")
            .expect("the consumer does not panic")
    }
}

/// Runs a consumer until the source has nothing left to do, then shuts it down.
async fn run_until_settled(
    consumer: Consumer<TestSource>,
    idempotency: Idempotency,
    probe: &Probe,
) -> Report {
    let source = consumer.source().clone();
    let started = start(consumer, idempotency, probe);
    source.settled().await;
    started.stop().await
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn memory() -> Idempotency {
    Idempotency::new(MemoryStore::new())
}

/// The report a consumer should have returned for what the source saw.
fn report_of(deliveries: &[Delivered], seen: &Seen) -> (u64, u64, u64, u64) {
    let (mut acked, mut already, mut retried, mut dead) = (0, 0, 0, 0);
    for delivery in deliveries {
        match &delivery.answers[0] {
            Answered {
                answer: Answer::Ack,
                ..
            } => acked += 1,
            Answered {
                answer: Answer::Retry(_),
                ..
            }
            | Answered {
                answer: Answer::DeadLetter(_),
                failed: true,
            } => retried += 1,
            Answered {
                answer: Answer::DeadLetter(_),
                failed: false,
            } => dead += 1,
            Answered {
                answer: Answer::DeadLetterAlready(_),
                failed,
            } => match failed {
                true => retried += 1,
                false => already += 1,
            },
        }
    }
    let applied = seen
        .observed()
        .iter()
        .filter(|(_, o)| *o == Observed::Applied)
        .count() as u64;
    (applied, acked - applied + already, retried, dead)
}

/// Every delivery was answered exactly once (ack xor retry xor dead letter), and the observer
/// saw, for each, the outcome matching that answer; the report counts the same.
fn assert_every_delivery_answered_once(source: &TestSource, seen: &Seen, report: &Report) {
    let deliveries = source.deliveries();
    let observed: HashMap<_, _> = seen.observed().into_iter().collect();
    assert_eq!(
        observed.len(),
        seen.observed().len(),
        "the observer saw each delivery once"
    );
    assert_eq!(observed.len(), deliveries.len(), "one outcome per delivery");
    for delivery in &deliveries {
        let message = &delivery.message;
        assert_eq!(
            delivery.answers.len(),
            1,
            "delivery {} of message {} was answered {:?}",
            message.deliveries(),
            message.position(),
            delivery.answers
        );
        let answered = &delivery.answers[0];
        let outcome = observed
            .get(&(message.position().to_owned(), message.deliveries()))
            .unwrap_or_else(|| panic!("no outcome observed for {message:?}"));
        match (&answered.answer, answered.failed, outcome) {
            (Answer::Ack, _, Observed::Applied | Observed::Duplicate) => {}
            (Answer::Retry(asked), _, Observed::Retried(_, delay)) => assert_eq!(asked, delay),
            (Answer::DeadLetter(reason), false, Observed::DeadLettered(failure)) => {
                assert_eq!(reason, failure.reason());
            }
            // Answered by another consumer meanwhile: a duplicate.
            (Answer::DeadLetterAlready(_), false, Observed::Duplicate) => {}
            // A dead letter the broker refused: the message stays the broker's.
            (
                Answer::DeadLetter(_) | Answer::DeadLetterAlready(_),
                true,
                Observed::Retried(_, delay),
            ) => {
                assert_eq!(*delay, Duration::ZERO);
            }
            (answer, failed, outcome) => panic!(
                "{message:?} was answered {answer:?} (failed: {failed}) but observed as {outcome:?}"
            ),
        }
    }
    let (applied, duplicates, retried, dead_lettered) = report_of(&deliveries, seen);
    assert_eq!(report.applied, applied, "{report:?}");
    assert_eq!(report.duplicates, duplicates, "{report:?}");
    assert_eq!(report.retried, retried, "{report:?}");
    assert_eq!(report.dead_lettered, dead_lettered, "{report:?}");
}

/// The answers to the deliveries of the message at `position`, in delivery order.
fn answers_of(source: &TestSource, position: &str) -> Vec<(u64, Answer)> {
    source
        .deliveries()
        .into_iter()
        .filter(|d| d.message.position() == position)
        .filter_map(|d| Some((d.message.deliveries(), d.answers.first()?.answer.clone())))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

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
    let (report, recorded) = Recorded::capture(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_until_settled(consumer, memory(), &probe))
    });
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(
        (
            report.applied,
            report.duplicates,
            report.retried,
            report.dead_lettered,
            report.source_errors
        ),
        (1, 2, 1, 2, 2),
        "{report:?}"
    );

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
    let (report, recorded) = Recorded::capture(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_until_settled(consumer, memory(), &probe))
    });
    assert_every_delivery_answered_once(&source, &probe.seen, &report);
    assert_eq!(
        (
            report.applied,
            report.duplicates,
            report.retried,
            report.dead_lettered,
            report.source_errors
        ),
        (1, 2, 0, 1, 0),
        "{report:?}"
    );
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
    assert_eq!(
        (
            report.applied,
            report.duplicates,
            report.retried,
            report.dead_lettered,
            report.source_errors
        ),
        (20, 1, 1, 2, 1),
        "{report:?}"
    );
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
    wait_until("six answered", || {
        source
            .deliveries()
            .iter()
            .filter(|d| !d.answers.is_empty())
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
