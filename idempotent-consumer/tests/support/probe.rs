//! The handler and the running of the consumer runtime's tests: a decoder and handler driven
//! by each message's body (apply, sleep, reject, fail transiently, panic) that records every
//! run, effect and observed outcome; a consumer running on a task of its own; and the checks
//! that every delivery was answered once and the report agrees.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idempotent_consumer::{Consumer, Decode, Failure, Handler, Message, Outcome, Report};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Idempotency};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::source::{Answer, Answered, Delivered, PATIENCE, TestSource};

/// The reason the test handler rejects a message with.
pub const REJECTED: &str = "refused by the test handler";
/// The reason the test handler fails transiently with.
pub const TRANSIENT: &str = "the test handler's database is down";

/// What the handler does with a message: the first word of its body.
#[derive(Debug, Clone, Copy)]
pub enum Action {
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
pub struct Input {
    pub id: String,
    pub position: String,
    pub deliveries: u64,
    pub action: Action,
    pub payload: String,
    pub order: Option<String>,
}

/// One call of the handler.
#[derive(Debug, Clone)]
pub struct Run {
    pub id: String,
    pub position: String,
    pub deliveries: u64,
    pub order: Option<String>,
    pub started: Instant,
    pub ended: Option<Instant>,
    /// The thread the handler ran on.
    pub thread: std::thread::ThreadId,
    /// `ClaimHandle::current()` inside the handler: whether it was there and named the same
    /// operation as the handle passed in.
    pub claim_current: bool,
}

/// What an observer saw.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    Applied,
    Duplicate,
    Retried(Failure, Duration),
    DeadLettered(Failure),
}

#[derive(Debug, Default)]
pub struct Seen {
    pub runs: Mutex<Vec<Run>>,
    pub running: AtomicUsize,
    pub max_running: AtomicUsize,
    /// The payloads each id's effect was applied with.
    pub effects: Mutex<HashMap<String, Vec<String>>>,
    /// (position, deliveries) → what the observer saw.
    pub observed: Mutex<Vec<((String, u64), Observed)>>,
}

impl Seen {
    pub fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    pub fn effects(&self) -> HashMap<String, Vec<String>> {
        self.effects.lock().unwrap().clone()
    }

    pub fn observed(&self) -> Vec<((String, u64), Observed)> {
        self.observed.lock().unwrap().clone()
    }

    pub fn max_running(&self) -> usize {
        self.max_running.load(Ordering::SeqCst)
    }

    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// The handler's calls for `id`.
    pub fn runs_of(&self, id: &str) -> Vec<Run> {
        self.runs().into_iter().filter(|r| r.id == id).collect()
    }
}

/// A handler running: counted in `running` until dropped (returned, failed or panicked).
pub struct Running {
    pub seen: Arc<Seen>,
    pub index: usize,
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
pub struct Probe {
    pub seen: Arc<Seen>,
}

impl Probe {
    pub fn begin(&self, input: &Input, claim_current: bool) -> Running {
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

pub fn number(word: Option<&str>, body: &str) -> Result<u64, Failure> {
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

/// A consumer of `source` whose observer records into `probe`.
pub fn consumer(source: &TestSource, probe: &Probe) -> Consumer<TestSource> {
    let seen = Arc::clone(&probe.seen);
    Consumer::new(source.clone())
        .on_outcome(move |message, outcome| observe(&seen, message, outcome))
}

/// Records what the observer was told into `seen`.
pub fn observe(seen: &Seen, message: &Message, outcome: Outcome<'_>) {
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
pub struct Started {
    pub stop: oneshot::Sender<()>,
    pub task: JoinHandle<Report>,
}

pub fn start(consumer: Consumer<TestSource>, idempotency: Idempotency, probe: &Probe) -> Started {
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    let task = tokio::spawn(consumer.run(idempotency, probe.clone(), shutdown));
    Started { stop, task }
}

impl Started {
    /// Triggers the shutdown and waits for the drain.
    pub async fn stop(self) -> Report {
        let _ = self.stop.send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the consumer drains and returns")
            .expect("the consumer does not panic")
    }
}

/// Runs a consumer until the source has nothing left to do, then shuts it down.
pub async fn run_until_settled(
    consumer: Consumer<TestSource>,
    idempotency: Idempotency,
    probe: &Probe,
) -> Report {
    let source = consumer.source().clone();
    let started = start(consumer, idempotency, probe);
    source.settled().await;
    started.stop().await
}

pub fn memory() -> Idempotency {
    Idempotency::new(MemoryStore::new())
}

/// The report a consumer should have returned for what the source saw.
pub fn report_of(deliveries: &[Delivered], seen: &Seen) -> (u64, u64, u64, u64) {
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
pub fn assert_every_delivery_answered_once(source: &TestSource, seen: &Seen, report: &Report) {
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

/// Runs `consumer` until its source settles, on a current-thread runtime of its own inside
/// `Recorded::capture`: its report, and the metrics it recorded.
pub fn run_captured(
    consumer: Consumer<TestSource>,
    probe: &Probe,
) -> (Report, idempotent_core::metrics::Recorded) {
    idempotent_core::metrics::Recorded::capture(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_until_settled(consumer, memory(), probe))
    })
}

/// The report's counts: applied, duplicates, retried, dead-lettered, source errors.
pub fn counts(report: &Report) -> (u64, u64, u64, u64, u64) {
    (
        report.applied,
        report.duplicates,
        report.retried,
        report.dead_lettered,
        report.source_errors,
    )
}
