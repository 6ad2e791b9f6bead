//! The in-process broker of the consumer runtime's tests: a queue behind a mutex that records
//! every answer the runtime gives it, redelivers what it is asked to retry with the delivery
//! count incremented, and fails operations on demand.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idempotent_consumer::{DeadLettered, Message, Received, Source, SourceError};
use tokio::sync::Notify;

/// The longest any test waits for the state it expects.
pub const PATIENCE: Duration = Duration::from_secs(15);
/// How long `receive` waits for a message before it answers with none.
pub const IDLE_WAIT: Duration = Duration::from_millis(10);
/// The `source` label of the test source.
pub const SOURCE_NAME: &str = "test";

/// One answer the runtime gave the source about one delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Ack,
    Retry(Duration),
    DeadLetter(String),
    /// A dead letter asked for a message another consumer had answered meanwhile: the source
    /// wrote nothing and said [`DeadLettered::Already`].
    DeadLetterAlready(String),
}

/// An answer, and whether the source failed it on purpose.
#[derive(Debug, Clone, PartialEq)]
pub struct Answered {
    pub answer: Answer,
    pub failed: bool,
}

/// One delivery of one message, and everything the runtime did about it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub message: Message,
    pub answers: Vec<Answered>,
    /// When the runtime kept it alive.
    pub keep_alives: Vec<Instant>,
}

/// How many of the next calls of each operation fail.
#[derive(Debug, Default, Clone, Copy)]
pub struct Faults {
    pub receive: u32,
    pub ack: u32,
    pub retry: u32,
    pub dead_letter: u32,
    pub keep_alive: u32,
    /// `ack` calls that panic (before anything is recorded): a panic in the runtime's own
    /// per-message code, after the handler.
    pub ack_panic: u32,
}

#[derive(Debug, Default)]
pub struct State {
    /// Messages ready to be received, in order.
    pub ready: VecDeque<Message>,
    /// Retried messages waiting out their delay.
    pub delayed: usize,
    /// Every delivery, by its handle (the index).
    pub deliveries: Vec<Delivered>,
    /// The dead letters, with their reasons.
    pub dead_letters: Vec<(Message, String)>,
    /// Messages published so far (the next position).
    pub published: usize,
    /// The `max` of every `receive`.
    pub asked: Vec<usize>,
    /// `receive` calls failed on purpose.
    pub receive_errors: u32,
    /// Positions of messages another consumer answered meanwhile: dead-lettering them finds
    /// [`DeadLettered::Already`].
    pub answered_elsewhere: Vec<String>,
    pub faults: Faults,
}

pub struct Inner {
    pub state: Mutex<State>,
    pub arrived: Notify,
    pub keep_alive_every: Option<Duration>,
    pub handling_limit: Option<Duration>,
}

/// The in-process broker: a handle the test keeps while the consumer owns a clone.
#[derive(Clone)]
pub struct TestSource {
    pub inner: Arc<Inner>,
}

impl TestSource {
    pub fn new() -> Self {
        Self::with_keep_alive(None)
    }

    pub fn with_keep_alive(keep_alive_every: Option<Duration>) -> Self {
        Self::with_limits(keep_alive_every, None)
    }

    pub fn with_limits(
        keep_alive_every: Option<Duration>,
        handling_limit: Option<Duration>,
    ) -> Self {
        TestSource {
            inner: Arc::new(Inner {
                state: Mutex::default(),
                arrived: Notify::new(),
                keep_alive_every,
                handling_limit,
            }),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes a message with id `id` and body `body` (its position is its publication
    /// number); returns the position.
    pub fn publish(&self, id: &str, body: &str) -> String {
        self.publish_with(id, body, None)
    }

    /// Publishes a message with an `order` field when `order` is given.
    pub fn publish_with(&self, id: &str, body: &str, order: Option<&str>) -> String {
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
    pub fn inject(&self, set: impl FnOnce(&mut Faults)) {
        set(&mut self.lock().faults);
    }

    /// Makes dead-lettering the message at `position` find it answered by another consumer.
    pub fn answer_elsewhere(&self, position: &str) {
        self.lock().answered_elsewhere.push(position.to_owned());
    }

    /// Every delivery so far.
    pub fn deliveries(&self) -> Vec<Delivered> {
        self.lock().deliveries.clone()
    }

    pub fn dead_letters(&self) -> Vec<(Message, String)> {
        self.lock().dead_letters.clone()
    }

    /// Nothing left to do: no message ready, none waiting out a retry's delay, every delivery
    /// answered.
    pub fn is_settled(&self) -> bool {
        let state = self.lock();
        state.ready.is_empty()
            && state.delayed == 0
            && state.deliveries.iter().all(|d| !d.answers.is_empty())
    }

    pub async fn settled(&self) {
        wait_until("the source to settle", || self.is_settled()).await;
    }

    /// The message again, delivered once more, at the back of the queue.
    pub fn redeliver(&self, state: &mut State, delivery: usize) {
        let message = state.deliveries[delivery].message.clone();
        let deliveries = message.deliveries() + 1;
        state.ready.push_back(message.with_deliveries(deliveries));
        self.inner.arrived.notify_one();
    }

    /// Records `answer` for `delivery`; whether it fails (and then the message is delivered
    /// again, as a broker does with a message it was not answered about).
    pub fn answer(
        &self,
        delivery: usize,
        answer: Answer,
        fault: fn(&mut Faults) -> &mut u32,
    ) -> bool {
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
pub fn take_one(n: &mut u32) -> bool {
    let was = *n > 0;
    *n = n.saturating_sub(1);
    was
}

pub fn injected(operation: &str) -> SourceError {
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
        let panics = take_one(&mut self.lock().faults.ack_panic);
        if panics {
            panic!("the test source's ack panics on purpose");
        }
        match self.answer(*delivery, Answer::Ack, |f| &mut f.ack) {
            true => Err(injected("ack")),
            false => Ok(()),
        }
    }

    async fn retry(&self, delivery: &usize, delay: Duration) -> Result<(), SourceError> {
        // Counted as waiting before the answer is recorded: in between, the source would look
        // settled (every delivery answered, nothing ready, nothing waiting) and a test would
        // stop its consumer before the redelivery.
        self.lock().delayed += 1;
        if self.answer(*delivery, Answer::Retry(delay), |f| &mut f.retry) {
            // Redelivered at once (ready) rather than after the delay.
            self.lock().delayed -= 1;
            return Err(injected("retry"));
        }
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

/// Waits until `done` holds; fails the test with `what` after [`PATIENCE`].
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    idempotent_test_kit::process::eventually(what, PATIENCE, || std::future::ready(done())).await;
}

/// The answers to the deliveries of the message at `position`, in delivery order.
pub fn answers_of(source: &TestSource, position: &str) -> Vec<(u64, Answer)> {
    source
        .deliveries()
        .into_iter()
        .filter(|d| d.message.position() == position)
        .filter_map(|d| Some((d.message.deliveries(), d.answers.first()?.answer.clone())))
        .collect()
}
