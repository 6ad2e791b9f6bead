//! The loop: receive, dispatch within the concurrency bound and per ordering key, apply,
//! answer the broker, drain.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use metrics::{Counter, Histogram};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::effect::{Count, Effect, Prepared, Processed};
use super::{
    DeadLettered, Failure, MESSAGE_DEAD_LETTERS, MESSAGE_DURATION, MESSAGE_REDELIVERIES, MESSAGES,
    Outcome, Received, SOURCE_ERRORS, Settings, Source, backoff_delay,
};

/// What a consumer did, from its start to its drain: returned by
/// [`Consumer::run`](super::Consumer::run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Messages applied now and acknowledged.
    pub applied: u64,
    /// Messages found recorded already, acknowledged without running the handler.
    pub duplicates: u64,
    /// Messages left for the broker to deliver again.
    pub retried: u64,
    /// Messages dead-lettered by this consumer.
    pub dead_lettered: u64,
    /// Broker operations that failed (and were left to the broker's redelivery).
    pub source_errors: u64,
}

#[derive(Default)]
struct Counters {
    applied: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    source_errors: AtomicU64,
}

impl Counters {
    fn report(&self) -> Report {
        Report {
            applied: self.applied.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            source_errors: self.source_errors.load(Ordering::Relaxed),
        }
    }
}

/// The consumer's metrics, registered once with the recorder installed when it starts.
struct Metrics {
    /// By outcome, in [`OUTCOMES`]' order.
    messages: [Counter; 4],
    durations: [Histogram; 4],
    redeliveries: Counter,
    /// `malformed`, `rejected`.
    dead_letters: [Counter; 2],
    /// By operation, in [`OPERATIONS`]' order.
    source_errors: [Counter; 5],
}

const OUTCOMES: [&str; 4] = ["applied", "duplicate", "retried", "dead_lettered"];
const OPERATIONS: [&str; 5] = ["receive", "ack", "retry", "dead_letter", "keep_alive"];

impl Metrics {
    fn register(source: &'static str) -> Metrics {
        describe();
        Metrics {
            messages: OUTCOMES.map(|outcome| {
                metrics::counter!(MESSAGES, "source" => source, "outcome" => outcome)
            }),
            durations: OUTCOMES.map(|outcome| {
                metrics::histogram!(MESSAGE_DURATION, "source" => source, "outcome" => outcome)
            }),
            redeliveries: metrics::counter!(MESSAGE_REDELIVERIES, "source" => source),
            dead_letters: ["malformed", "rejected"].map(|kind| {
                metrics::counter!(MESSAGE_DEAD_LETTERS, "source" => source, "kind" => kind)
            }),
            source_errors: OPERATIONS.map(|operation| {
                metrics::counter!(SOURCE_ERRORS, "source" => source, "operation" => operation)
            }),
        }
    }
}

/// The first pause after the broker failed to deliver, doubled per failure in a row.
const RECEIVE_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// Everything a message's task shares with the others.
struct Shared<S: Source, E: Effect> {
    source: Arc<S>,
    effect: Arc<E>,
    settings: Settings,
    counters: Counters,
    metrics: Metrics,
    /// Handler slots: the concurrency.
    slots: Arc<Semaphore>,
    /// Ordering keys with a message being handled, and the messages waiting behind it.
    ordered: Mutex<HashMap<String, VecDeque<Job<S, E>>>>,
}

/// One received message on its way through.
struct Job<S: Source, E: Effect> {
    received: Arc<Received<S::Delivery>>,
    prepared: Result<Arc<Prepared<E::Input>>, Failure>,
    started: Instant,
    /// Its place among the messages in hand.
    _hand: OwnedSemaphorePermit,
}

pub(crate) async fn run<S: Source, E: Effect>(
    source: Arc<S>,
    settings: Settings,
    effect: Arc<E>,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    // Messages in hand (received and not yet answered) are at most a batch more than the
    // concurrency; those waiting for a handler slot are kept alive meanwhile.
    let hand = Arc::new(Semaphore::new(settings.concurrency + settings.batch));
    let shared = Arc::new(Shared {
        metrics: Metrics::register(source.name()),
        slots: Arc::new(Semaphore::new(settings.concurrency)),
        source,
        effect,
        settings,
        counters: Counters::default(),
        ordered: Mutex::new(HashMap::new()),
    });
    let name = shared.source.name();
    let mut tasks = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut stopping = false;
    let mut failures: u32 = 0;
    while !stopping {
        // Room for half a batch in hand, then as much as there is room for, up to a batch:
        // asking for whatever happens to be free makes batches small and round trips many.
        let batch = shared.settings.batch;
        let wanted = batch.div_ceil(2);
        let mut permits = Vec::with_capacity(batch);
        while permits.len() < wanted {
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break,
                permit = Arc::clone(&hand).acquire_owned() => permit,
            };
            match permit {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
            while permits.len() < batch {
                match Arc::clone(&hand).try_acquire_owned() {
                    Ok(permit) => permits.push(permit),
                    Err(_) => break,
                }
            }
        }
        if permits.len() < wanted {
            break;
        }
        // The receive is never abandoned halfway (what the broker handed over would wait for
        // its redelivery): a shutdown during it is noticed when it returns, within about a
        // second.
        let received = {
            let mut receive = std::pin::pin!(shared.source.receive(permits.len()));
            loop {
                tokio::select! {
                    biased;
                    received = &mut receive => break received,
                    () = &mut shutdown, if !stopping => stopping = true,
                }
            }
        };
        let batch = match received {
            Ok(batch) => {
                failures = 0;
                batch
            }
            Err(error) => {
                shared.source_error(0, &error);
                if stopping {
                    // The shutdown future has completed: it must not be polled again.
                    break;
                }
                let pause = backoff_delay(RECEIVE_BACKOFF, u64::from(failures) + 1);
                failures = failures.saturating_add(1);
                tracing::warn!(source = name, %error, "cannot receive messages; trying again in {pause:?}");
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(pause) => {}
                }
                continue;
            }
        };
        for received in batch {
            // A source that returned more than it was asked for still gets every message
            // handled: the extra ones wait for a slot.
            let permit = match permits.pop() {
                Some(permit) => permit,
                None => match Arc::clone(&hand).acquire_owned().await {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            if received.message.deliveries() > 1 {
                shared.metrics.redeliveries.increment(1);
            }
            // A decoder that panics fails its message (as data the handler cannot take:
            // dead-lettered after max_deliveries), not the consumer.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                shared.effect.prepare(&received.message)
            }))
            .unwrap_or_else(|_| Err(Failure::Rejected("the decoder panicked".into())))
            .map(Arc::new);
            let ordering = prepared.as_ref().ok().and_then(|p| p.ordering.clone());
            let job = Job {
                received: Arc::new(received),
                prepared,
                started: Instant::now(),
                _hand: permit,
            };
            match ordering {
                None => {
                    let shared = Arc::clone(&shared);
                    tasks.spawn(async move { shared.finish(job, None).await });
                }
                Some(key) => {
                    let mut ordered = shared
                        .ordered
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    if let Some(waiting) = ordered.get_mut(&key) {
                        waiting.push_back(job);
                        continue;
                    }
                    ordered.insert(key.clone(), VecDeque::new());
                    drop(ordered);
                    let shared = Arc::clone(&shared);
                    tasks.spawn(async move { shared.finish_in_order(key, job).await });
                }
            }
        }
        // Finished tasks' results are not needed: reap them so the set stays small.
        while let Some(joined) = tasks.try_join_next() {
            log_panic(name, joined);
        }
    }
    // Drain: every message received is finished, handled and answered.
    while let Some(joined) = tasks.join_next().await {
        log_panic(name, joined);
    }
    shared.counters.report()
}

impl<S: Source, E: Effect> Shared<S, E> {
    /// Finishes `job`, then every message that arrived behind it with the same ordering key.
    async fn finish_in_order(self: Arc<Self>, key: String, job: Job<S, E>) {
        let mut next = Some(job);
        while let Some(job) = next.take() {
            self.finish(job, Some(&key)).await;
            let mut ordered = self.ordered.lock().unwrap_or_else(PoisonError::into_inner);
            match ordered.get_mut(&key).and_then(VecDeque::pop_front) {
                Some(job) => next = Some(job),
                None => {
                    ordered.remove(&key);
                }
            }
        }
    }

    /// Applies one message and answers the broker. Messages waiting behind it on its
    /// ordering key are kept alive with it.
    async fn finish(self: &Arc<Self>, job: Job<S, E>, ordering: Option<&str>) {
        let Job {
            received,
            prepared,
            started,
            _hand,
        } = job;
        // The runtime's own code for this message runs under `catch_unwind`: a panic in it
        // (or in the source's calls it makes) fails this message by the usual rules, and never
        // ends the task, which would leave the message unanswered and its ordering key taken.
        let processed = match prepared {
            Err(failure) => Processed::Failed(failure),
            Ok(prepared) => {
                let work = async {
                    // A source without a delivery count of its own (Kafka) redelivers a
                    // retried message itself, behind the messages that came after it: one
                    // with an ordering key is retried here instead, in its place, so that
                    // its key's later messages keep waiting for it.
                    let in_place = !self.source.counts_deliveries() && ordering.is_some();
                    let mut seen = received.message.deliveries();
                    loop {
                        let processed = {
                            // Waiting for a handler slot, kept alive.
                            let slot = Arc::clone(&self.slots).acquire_owned();
                            let _slot = self.kept_alive(&received.delivery, ordering, slot).await;
                            // Counted on the record where the broker does not count deliveries.
                            let count = (!self.source.counts_deliveries()).then(|| Count {
                                max: self.settings.max_deliveries,
                                seen,
                            });
                            self.apply(
                                &received.delivery,
                                Arc::clone(&prepared),
                                count,
                                ordering,
                                started,
                            )
                            .await
                        };
                        let failure = match &processed {
                            Processed::Failed(failure @ Failure::Transient(_)) => failure,
                            Processed::Failed(failure @ Failure::Rejected(_))
                                if seen < self.settings.max_deliveries =>
                            {
                                failure
                            }
                            // Its deliveries here reached the bound.
                            Processed::Failed(Failure::Rejected(_)) if in_place => {
                                break match processed {
                                    Processed::Failed(failure) => Processed::Exhausted(failure),
                                    processed => processed,
                                };
                            }
                            _ => break processed,
                        };
                        if !in_place {
                            break processed;
                        }
                        let delay = backoff_delay(self.settings.backoff, seen);
                        self.retried_in_place(&received.message, failure, seen, delay);
                        tokio::time::sleep(delay).await;
                        seen = seen.saturating_add(1);
                    }
                };
                caught(work).await.unwrap_or_else(|()| {
                    tracing::error!(
                        source = self.source.name(),
                        position = received.message.position(),
                        "the consumer runtime panicked while handling a message"
                    );
                    Processed::Failed(Failure::Rejected(RUNTIME_PANICKED.into()))
                })
            }
        };
        let outcome = match caught(self.answer(&received, processed)).await {
            Ok(outcome) => outcome,
            Err(()) => {
                // Whatever the broker was told before the panic, the message is answered
                // again as a failure: retried (a redelivery of an applied message is a
                // duplicate), or dead-lettered from its `max_deliveries`-th delivery.
                tracing::error!(
                    source = self.source.name(),
                    position = received.message.position(),
                    "the consumer runtime panicked while answering the broker about a message; \
                     answering it again as failed"
                );
                let failed = Processed::Failed(Failure::Rejected(RUNTIME_PANICKED.into()));
                match caught(self.answer(&received, failed)).await {
                    Ok(outcome) => outcome,
                    Err(()) => {
                        // Left to the broker, which delivers it again.
                        tracing::error!(
                            source = self.source.name(),
                            position = received.message.position(),
                            "the consumer runtime panicked again; the message is left to the \
                             broker's redelivery"
                        );
                        self.counters.source_errors.fetch_add(1, Ordering::Relaxed);
                        self.counters.retried.fetch_add(1, Ordering::Relaxed);
                        2
                    }
                }
            }
        };
        self.metrics.messages[outcome].increment(1);
        self.metrics.durations[outcome].record(started.elapsed());
    }

    /// Runs `work`, keeping `delivery` (and the messages waiting behind it on `ordering`)
    /// alive at the broker meanwhile, every [`Source::keep_alive_every`].
    async fn kept_alive<F: Future>(
        &self,
        delivery: &S::Delivery,
        ordering: Option<&str>,
        work: F,
    ) -> F::Output {
        let Some(every) = self.source.keep_alive_every() else {
            return work.await;
        };
        // At most every millisecond: a timer's period cannot be zero (a source's mistake).
        let every = every.max(Duration::from_millis(1));
        // A period too long to add to the clock (`Duration::MAX`): never due.
        let Some(first) = tokio::time::Instant::now().checked_add(every) else {
            return work.await;
        };
        let mut work = std::pin::pin!(work);
        let mut ticks = tokio::time::interval_at(first, every);
        loop {
            tokio::select! {
                output = &mut work => return output,
                _ = ticks.tick() => self.keep_alive(delivery, ordering).await,
            }
        }
    }

    /// Keeps `delivery` alive, and the messages waiting behind it on `ordering`.
    async fn keep_alive(&self, delivery: &S::Delivery, ordering: Option<&str>) {
        let waiting: Vec<Arc<Received<S::Delivery>>> = match ordering {
            None => Vec::new(),
            Some(key) => self
                .ordered
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(key)
                .map(|queue| queue.iter().map(|job| Arc::clone(&job.received)).collect())
                .unwrap_or_default(),
        };
        let deliveries = std::iter::once(delivery).chain(waiting.iter().map(|r| &r.delivery));
        for delivery in deliveries {
            if let Err(error) = self.source.keep_alive(delivery).await {
                self.source_error(4, &error);
            }
        }
    }

    /// Runs the effect on a task of its own (a handler that panics fails its message, not the
    /// consumer), keeping the message alive at the broker while it runs, and stopping it at the
    /// handler timeout (from its start) or the source's handling limit (from `received`),
    /// whichever comes first.
    async fn apply(
        &self,
        delivery: &S::Delivery,
        prepared: Arc<Prepared<E::Input>>,
        count: Option<Count>,
        ordering: Option<&str>,
        received: Instant,
    ) -> Processed {
        let now = tokio::time::Instant::now();
        // Each limit: when it ends, and what to say when it does.
        // A limit too long to add to the clock (`Duration::MAX`, say) is no limit.
        let handler = self.settings.handler_timeout.and_then(|timeout| {
            let reason = format!("the handler ran longer than {timeout:?} and was stopped");
            Some((now.checked_add(timeout)?, reason))
        });
        let broker = self.source.handling_limit().and_then(|limit| {
            let reason = format!("the message was in hand for {limit:?}, the broker's limit");
            let at = tokio::time::Instant::from_std(received).checked_add(limit)?;
            Some((at, reason))
        });
        let limit = match (handler, broker) {
            (Some(h), Some(b)) => Some(if h.0 <= b.0 { h } else { b }),
            (h, b) => h.or(b),
        };
        if let Some((at, reason)) = &limit
            && *at <= now
        {
            // It waited in hand until the broker is about to take it back: not started.
            return Processed::Failed(Failure::Transient(reason.clone()));
        }
        let effect = Arc::clone(&self.effect);
        // Aborted if this is dropped (a panic in the runtime's code around it, a stopped
        // consumer): a handler must not go on unseen once its message is answered otherwise.
        let mut work = AbortOnDrop(tokio::spawn(
            async move { effect.apply(&prepared, count).await },
        ));
        // Unused without a limit (the `select!` below disables it).
        let deadline = tokio::time::sleep_until(limit.as_ref().map_or(now, |(at, _)| *at));
        let ended = self
            .kept_alive(delivery, ordering, async {
                tokio::select! {
                    joined = &mut work.0 => Some(joined),
                    () = deadline, if limit.is_some() => None,
                }
            })
            .await;
        let Some(joined) = ended else {
            // Stopped before the broker takes the message back on its own: its claim is
            // released (or its transaction rolled back) and it is retried.
            work.0.abort();
            let reason = limit.map_or_else(String::new, |(_, reason)| reason);
            return Processed::Failed(Failure::Transient(reason));
        };
        match joined {
            Ok(processed) => processed,
            // Dead-lettered after max_deliveries, like data the handler cannot take: a handler
            // that panics on a message will panic on it again.
            Err(error) if error.is_panic() => {
                Processed::Failed(Failure::Rejected("the handler panicked".into()))
            }
            Err(_) => Processed::Failed(Failure::Transient("the handler was cancelled".into())),
        }
    }

    /// Acknowledges, retries or dead-letters; the outcome's index in [`OUTCOMES`].
    async fn answer(&self, received: &Received<S::Delivery>, processed: Processed) -> usize {
        let Received { message, delivery } = received;
        let name = self.source.name();
        let counters = &self.counters;
        let exhausted = matches!(processed, Processed::Exhausted(_));
        match processed {
            Processed::Applied | Processed::Duplicate => {
                let duplicate = matches!(processed, Processed::Duplicate);
                if let Err(error) = self.source.ack(delivery).await {
                    // Applied and recorded: its redelivery is a duplicate.
                    self.source_error(1, &error);
                }
                self.observe(
                    message,
                    if duplicate {
                        Outcome::Duplicate
                    } else {
                        Outcome::Applied
                    },
                );
                if duplicate {
                    counters.duplicates.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        source = name,
                        position = message.position(),
                        "duplicate acknowledged"
                    );
                    1
                } else {
                    counters.applied.fetch_add(1, Ordering::Relaxed);
                    0
                }
            }
            Processed::Failed(failure) | Processed::Exhausted(failure) => {
                let kind = match &failure {
                    Failure::Malformed(_) => Some(0),
                    // Counted on the record, where the broker does not count deliveries.
                    _ if exhausted => Some(1),
                    // As the broker counts them, or (a source that does not) at least the
                    // deliveries this source made itself.
                    Failure::Rejected(_)
                        if message.deliveries() >= self.settings.max_deliveries =>
                    {
                        Some(1)
                    }
                    _ => None,
                };
                if let Some(kind) = kind {
                    return match self
                        .source
                        .dead_letter(message, delivery, failure.reason())
                        .await
                    {
                        // Another consumer answered it meanwhile: nothing was written here.
                        Ok(DeadLettered::Already) => {
                            counters.duplicates.fetch_add(1, Ordering::Relaxed);
                            self.observe(message, Outcome::Duplicate);
                            1
                        }
                        Ok(DeadLettered::Now) => {
                            {
                                counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
                                self.metrics.dead_letters[kind].increment(1);
                                tracing::warn!(
                                    source = name,
                                    position = message.position(),
                                    deliveries = message.deliveries(),
                                    reason = failure.reason(),
                                    "message dead-lettered"
                                );
                                self.observe(message, Outcome::DeadLettered { failure: &failure });
                            }
                            3
                        }
                        Err(error) => {
                            // Still the broker's: delivered again, and dead-lettered then.
                            self.source_error(3, &error);
                            self.observe(
                                message,
                                Outcome::Retried {
                                    failure: &failure,
                                    delay: Duration::ZERO,
                                },
                            );
                            counters.retried.fetch_add(1, Ordering::Relaxed);
                            2
                        }
                    };
                }
                let delay = backoff_delay(self.settings.backoff, message.deliveries());
                tracing::info!(
                    source = name,
                    position = message.position(),
                    deliveries = message.deliveries(),
                    max_deliveries = self.settings.max_deliveries,
                    %failure,
                    "message not applied; retried in {delay:?}"
                );
                if let Err(error) = self.source.retry(delivery, delay).await {
                    self.source_error(2, &error);
                }
                self.observe(
                    message,
                    Outcome::Retried {
                        failure: &failure,
                        delay,
                    },
                );
                counters.retried.fetch_add(1, Ordering::Relaxed);
                2
            }
        }
    }

    /// Counts, logs and observes a retry the runtime makes itself, in the message's place.
    fn retried_in_place(
        &self,
        message: &super::Message,
        failure: &Failure,
        deliveries: u64,
        delay: Duration,
    ) {
        tracing::info!(
            source = self.source.name(),
            position = message.position(),
            deliveries,
            max_deliveries = self.settings.max_deliveries,
            %failure,
            "message not applied; retried in its place in {delay:?}"
        );
        self.counters.retried.fetch_add(1, Ordering::Relaxed);
        self.metrics.messages[2].increment(1);
        self.observe(message, Outcome::Retried { failure, delay });
    }

    /// Tells the observer; one that panics is logged, and harms nothing else.
    fn observe(&self, message: &super::Message, outcome: Outcome<'_>) {
        if let Some(observer) = &self.settings.observer {
            let observed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                observer(message, outcome)
            }));
            if observed.is_err() {
                tracing::error!(
                    position = message.position(),
                    "the consumer's observer panicked"
                );
            }
        }
    }

    /// Counts and logs a failed broker operation, `OPERATIONS[operation]`.
    fn source_error(&self, operation: usize, error: &super::SourceError) {
        self.counters.source_errors.fetch_add(1, Ordering::Relaxed);
        self.metrics.source_errors[operation].increment(1);
        let name = self.source.name();
        tracing::warn!(source = name, operation = OPERATIONS[operation], %error, "broker operation failed");
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The failure of a message whose handling or answer panicked in the runtime's own code.
const RUNTIME_PANICKED: &str = "the consumer runtime panicked while finishing the message";

/// Runs `future`, catching a panic in any of its polls.
async fn caught<F: Future>(future: F) -> Result<F::Output, ()> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(_) => std::task::Poll::Ready(Err(())),
        }
    })
    .await
}

/// A message's task never panics (its work is [`caught`]); should one all the same, it is
/// logged rather than dropped unseen.
fn log_panic(source: &str, joined: Result<(), tokio::task::JoinError>) {
    if let Err(error) = joined
        && error.is_panic()
    {
        tracing::error!(source, "a message's task panicked");
    }
}

fn describe() {
    use metrics::Unit;
    metrics::describe_counter!(
        MESSAGES,
        Unit::Count,
        "Messages consumed, by source and outcome."
    );
    metrics::describe_histogram!(
        MESSAGE_DURATION,
        Unit::Seconds,
        "Messages from receipt to the broker's answer, by source and outcome."
    );
    metrics::describe_counter!(
        MESSAGE_REDELIVERIES,
        Unit::Count,
        "Messages received that the broker had delivered before."
    );
    metrics::describe_counter!(
        MESSAGE_DEAD_LETTERS,
        Unit::Count,
        "Messages dead-lettered, by source and kind (malformed, rejected)."
    );
    metrics::describe_counter!(
        SOURCE_ERRORS,
        Unit::Count,
        "Broker operations that failed, by source and operation."
    );
}
