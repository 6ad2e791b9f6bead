#![doc = include_str!("../docs/metrics.md")]

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Unit};

use crate::{ProblemCode, StoreError};

/// `idempotency.requests` (counter; labels `protocol`, `outcome`).
pub const REQUESTS: &str = "idempotency.requests";
/// `idempotency.store.operation.duration` (histogram, seconds; labels `operation`, `store`,
/// `result`).
pub const STORE_OPERATION_DURATION: &str = "idempotency.store.operation.duration";
/// `idempotency.work.duration` (histogram, seconds).
pub const WORK_DURATION: &str = "idempotency.work.duration";
/// `idempotency.claims.in_flight` (gauge).
pub const CLAIMS_IN_FLIGHT: &str = "idempotency.claims.in_flight";
/// `idempotency.claims.lost` (counter).
pub const CLAIMS_LOST: &str = "idempotency.claims.lost";
/// `idempotency.completion.retries` (counter).
pub const COMPLETION_RETRIES: &str = "idempotency.completion.retries";

/// Which API a call or request came through: the `protocol` label of
/// [`REQUESTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProtocolLabel {
    /// The runtime's `run`/`run_with`, the attribute, the transactional mode: `call`.
    Call,
    /// The HTTP layer: `http`.
    Http,
    /// The gRPC layer: `grpc`.
    Grpc,
    /// The consumer runtime (`idempotent-consumer`): one message: `message`.
    Message,
}

impl ProtocolLabel {
    const ALL: [ProtocolLabel; 4] = [
        ProtocolLabel::Call,
        ProtocolLabel::Http,
        ProtocolLabel::Grpc,
        ProtocolLabel::Message,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProtocolLabel::Call => "call",
            ProtocolLabel::Http => "http",
            ProtocolLabel::Grpc => "grpc",
            ProtocolLabel::Message => "message",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// How a call or request ended: the `outcome` label of [`REQUESTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// The work ran: `fresh`.
    Fresh,
    /// A recorded result was replayed: `replayed`.
    Replayed,
    /// The store was unreachable and the request ran unprotected (fail-open): `bypassed`.
    Bypassed,
    /// Refused, or stopped, with this code: see the module's table for its label.
    Refused(ProblemCode),
}

/// Outcomes other than refusals, before the refusals in [`ProblemCode::ALL`]'s order.
const PLAIN_OUTCOMES: usize = 3;
const OUTCOMES: usize = PLAIN_OUTCOMES + ProblemCode::ALL.len();

impl RequestOutcome {
    /// The outcome of a call that ended with `error`.
    pub fn of_error(error: &crate::Error) -> RequestOutcome {
        RequestOutcome::Refused(error.code())
    }

    /// The label value: the one place each outcome's label is written.
    pub const fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Fresh => "fresh",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::Bypassed => "bypassed",
            RequestOutcome::Refused(code) => match code {
                ProblemCode::MissingKey => "missing_key",
                ProblemCode::InvalidKey => "invalid_key",
                ProblemCode::RequestBodyUnreadable => "request_body_unreadable",
                ProblemCode::MissingScope => "missing_scope",
                ProblemCode::InFlight => "in_flight",
                ProblemCode::ResultNotRetained => "not_retained",
                ProblemCode::RequestTooLarge => "request_too_large",
                ProblemCode::FingerprintMismatch => "mismatch",
                ProblemCode::CorruptRecord => "corrupt_record",
                ProblemCode::InvalidFingerprint => "invalid_fingerprint",
                ProblemCode::PayloadError => "payload_error",
                ProblemCode::ClaimLost => "claim_lost",
                ProblemCode::ShuttingDown => "shutting_down",
                ProblemCode::StoreUnavailable => "store_error",
                ProblemCode::StoreCapacity => "store_full",
                ProblemCode::InvalidSession => "invalid_session",
                ProblemCode::ConflictingIdempotencyHeaders => "conflicting_headers",
                ProblemCode::SequenceAcknowledged => "sequence_acknowledged",
                ProblemCode::SessionExpired => "session_expired",
                ProblemCode::SessionWindowFull => "session_window_full",
                ProblemCode::OperationFailed => "operation_failed",
            },
        }
    }

    fn index(self) -> usize {
        match self {
            RequestOutcome::Fresh => 0,
            RequestOutcome::Replayed => 1,
            RequestOutcome::Bypassed => 2,
            RequestOutcome::Refused(code) => PLAIN_OUTCOMES + code.index(),
        }
    }

    fn all() -> impl Iterator<Item = RequestOutcome> {
        [
            RequestOutcome::Fresh,
            RequestOutcome::Replayed,
            RequestOutcome::Bypassed,
        ]
        .into_iter()
        .chain(ProblemCode::ALL.into_iter().map(RequestOutcome::Refused))
    }
}

/// A store operation: the `operation` label of
/// [`STORE_OPERATION_DURATION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// [`Store::claim`](crate::Store::claim).
    Claim,
    /// [`Store::complete`](crate::Store::complete).
    Complete,
    /// [`Store::release`](crate::Store::release).
    Release,
    /// [`Store::renew`](crate::Store::renew).
    Renew,
    /// [`SessionStore::open_session`](crate::SessionStore::open_session). Since 0.4 the runtime
    /// asks for the gate within [`ClaimInSession`](Self::ClaimInSession), and on its own only
    /// for a resume-only call in a session.
    OpenSession,
    /// [`SessionStore::session_mark`](crate::SessionStore::session_mark). Since 0.4 the runtime
    /// asks for the check within [`ClaimInSession`](Self::ClaimInSession), and on its own only
    /// for a resume-only call in a session.
    SessionMark,
    /// [`SessionStore::claim_in_session`](crate::SessionStore::claim_in_session): a session
    /// request's gate and claim (and, on a store that makes them two steps, its mark check),
    /// as the runtime asks for them.
    ClaimInSession,
    /// [`CheckpointStore::resume`](crate::CheckpointStore::resume).
    Resume,
    /// [`CheckpointStore::save_step`](crate::CheckpointStore::save_step).
    SaveStep,
    /// [`CheckpointStore::load_steps`](crate::CheckpointStore::load_steps).
    LoadSteps,
    /// [`CheckpointStore::save_request`](crate::CheckpointStore::save_request).
    SaveRequest,
    /// [`CheckpointStore::abandoned`](crate::CheckpointStore::abandoned).
    Abandoned,
}

impl Operation {
    const ALL: [Operation; 12] = [
        Operation::Claim,
        Operation::Complete,
        Operation::Release,
        Operation::Renew,
        Operation::OpenSession,
        Operation::SessionMark,
        Operation::ClaimInSession,
        Operation::Resume,
        Operation::SaveStep,
        Operation::LoadSteps,
        Operation::SaveRequest,
        Operation::Abandoned,
    ];

    const fn as_str(self) -> &'static str {
        match self {
            Operation::Claim => "claim",
            Operation::Complete => "complete",
            Operation::Release => "release",
            Operation::Renew => "renew",
            Operation::OpenSession => "open_session",
            Operation::SessionMark => "session_mark",
            Operation::ClaimInSession => "claim_in_session",
            Operation::Resume => "resume",
            Operation::SaveStep => "save_step",
            Operation::LoadSteps => "load_steps",
            Operation::SaveRequest => "save_request",
            Operation::Abandoned => "abandoned",
        }
    }
}

/// The `result` label of a store operation, one per [`StoreError`] variant plus `ok`.
const RESULTS: [&str; 6] = [
    "ok",
    "token_rejected",
    "capacity",
    "unavailable",
    "corrupt",
    "backend",
];

fn result_index(error: Option<&StoreError>) -> usize {
    match error {
        None => 0,
        Some(StoreError::TokenRejected) => 1,
        Some(StoreError::Capacity { .. }) => 2,
        Some(StoreError::Unavailable(_)) => 3,
        Some(StoreError::Corrupt(_)) => 4,
        Some(StoreError::Backend(_)) => 5,
    }
}

/// The handles of one runtime's metrics (or one transactional mode's), registered with the
/// recorder installed when it was created, under a store's name (the `store` label). With no
/// recorder installed, every handle is a no-op. A store's own companions that answer calls
/// without the runtime (a transactional mode) count them here, so that they show in the same
/// series as the runtime's.
pub struct StoreMetrics {
    requests: [[Counter; OUTCOMES]; 4],
    store: [[Histogram; RESULTS.len()]; Operation::ALL.len()],
    pub(crate) work: Histogram,
    pub(crate) in_flight: Gauge,
    pub(crate) lost: Counter,
    pub(crate) completion_retries: Counter,
}

impl StoreMetrics {
    /// Registers (and describes) every metric with the current recorder, for a store named
    /// `store`.
    pub fn register(store: &'static str) -> StoreMetrics {
        describe();
        let requests = ProtocolLabel::ALL.map(|protocol| {
            let mut counters = RequestOutcome::all().map(|outcome| {
                metrics::counter!(
                    REQUESTS,
                    "protocol" => protocol.as_str(),
                    "outcome" => outcome.as_str()
                )
            });
            std::array::from_fn(|_| counters.next().expect("OUTCOMES outcomes"))
        });
        let store = Operation::ALL.map(|operation| {
            RESULTS.map(|result| {
                metrics::histogram!(
                    STORE_OPERATION_DURATION,
                    "operation" => operation.as_str(),
                    "store" => store,
                    "result" => result
                )
            })
        });
        StoreMetrics {
            requests,
            store,
            work: metrics::histogram!(WORK_DURATION),
            in_flight: metrics::gauge!(CLAIMS_IN_FLIGHT),
            lost: metrics::counter!(CLAIMS_LOST),
            completion_retries: metrics::counter!(COMPLETION_RETRIES),
        }
    }

    /// Counts one request of `protocol` that ended with `outcome` (`idempotency.requests`).
    pub fn request(&self, protocol: ProtocolLabel, outcome: RequestOutcome) {
        self.requests[protocol.index()][outcome.index()].increment(1);
    }

    /// Counts a call of the runtime's own API that ended with `result`.
    pub(crate) fn call<T>(&self, result: &Result<crate::Execution<T>, crate::Error>) {
        self.request(
            ProtocolLabel::Call,
            match result {
                Ok(crate::Execution::Fresh(_)) => RequestOutcome::Fresh,
                Ok(crate::Execution::Replayed(_)) => RequestOutcome::Replayed,
                Err(error) => RequestOutcome::of_error(error),
            },
        );
    }

    /// Records one store operation that took `took` and failed with `error`, if it did
    /// (`idempotency.store.operation.duration`).
    pub fn store_operation(
        &self,
        operation: Operation,
        error: Option<&StoreError>,
        took: Duration,
    ) {
        self.store[operation as usize][result_index(error)].record(took);
    }
}

/// Describes every metric (unit and help text) to the installed recorder. Runtimes do this
/// when they are created; call it yourself only if the recorder is installed later.
pub fn describe() {
    metrics::describe_counter!(
        REQUESTS,
        Unit::Count,
        "Idempotent calls and requests, by protocol and outcome."
    );
    metrics::describe_histogram!(
        STORE_OPERATION_DURATION,
        Unit::Seconds,
        "Idempotency store operations, by operation, store and result."
    );
    metrics::describe_histogram!(
        WORK_DURATION,
        Unit::Seconds,
        "The protected work of each owner of a claim."
    );
    metrics::describe_gauge!(
        CLAIMS_IN_FLIGHT,
        Unit::Count,
        "Claims this process owns: work running or its outcome being recorded."
    );
    metrics::describe_counter!(
        CLAIMS_LOST,
        Unit::Count,
        "Claims lost while their work ran."
    );
    metrics::describe_counter!(
        COMPLETION_RETRIES,
        Unit::Count,
        "Result writes retried after the store failed or was slow."
    );
}

/// What runtimes created inside [`Recorded::capture`] recorded: a test's view of the metrics,
/// with no global recorder (feature `test-util`).
///
/// ```
/// # use idempotent_core::{Call, Idempotency, memory::MemoryStore, metrics::{self, Recorded}};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let (idempotency, recorded) = Recorded::capture(|| Idempotency::new(MemoryStore::new()));
/// idempotency.run(&Call::new("k".parse().unwrap()), async { 1 }).await.unwrap();
/// assert_eq!(recorded.counter(metrics::REQUESTS, &[("outcome", "fresh")]), 1);
/// # }
/// ```
#[cfg(feature = "test-util")]
pub struct Recorded {
    snapshotter: metrics_util::debugging::Snapshotter,
    /// Every value seen so far: a snapshot resets what it reads.
    seen: std::sync::Mutex<Vec<(metrics_util::CompositeKey, f64, usize)>>,
}

#[cfg(feature = "test-util")]
impl std::fmt::Debug for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorded").finish_non_exhaustive()
    }
}

#[cfg(feature = "test-util")]
impl Recorded {
    /// Runs `create` with a recorder of its own installed for this thread: the runtimes (and
    /// transactional modes) it creates record into that recorder for their whole life, from
    /// any thread.
    pub fn capture<T>(create: impl FnOnce() -> T) -> (T, Recorded) {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let created = ::metrics::with_local_recorder(&recorder, create);
        let recorded = Recorded {
            snapshotter,
            seen: std::sync::Mutex::default(),
        };
        (created, recorded)
    }

    /// The sum of the counters named `name` whose labels include every pair of `labels`.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.sum(metrics_util::MetricKind::Counter, name, labels).0 as u64
    }

    /// The sum of the gauges named `name` whose labels include every pair of `labels`.
    pub fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.sum(metrics_util::MetricKind::Gauge, name, labels).0
    }

    /// How many values the histograms named `name` whose labels include every pair of
    /// `labels` have recorded, and their sum.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> (usize, f64) {
        let (sum, count) = self.sum(metrics_util::MetricKind::Histogram, name, labels);
        (count, sum)
    }

    fn sum(
        &self,
        kind: metrics_util::MetricKind,
        name: &str,
        labels: &[(&str, &str)],
    ) -> (f64, usize) {
        use metrics_util::debugging::DebugValue;
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let (value, count) = match value {
                DebugValue::Counter(n) => (n as f64, 1),
                DebugValue::Gauge(x) => (x.into_inner(), 1),
                DebugValue::Histogram(xs) => (xs.iter().map(|x| x.into_inner()).sum(), xs.len()),
            };
            match seen.iter_mut().find(|(k, _, _)| *k == key) {
                Some((_, total, n)) => {
                    *total += value;
                    *n += count;
                }
                None => seen.push((key, value, count)),
            }
        }
        seen.iter()
            .filter(|(key, _, _)| {
                key.kind() == kind
                    && key.key().name() == name
                    && labels.iter().all(|(k, v)| {
                        key.key()
                            .labels()
                            .any(|label| label.key() == *k && label.value() == *v)
                    })
            })
            .fold((0.0, 0), |(total, n), (_, value, count)| {
                (total + value, n + count)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_has_its_own_index_and_label() {
        let outcomes: Vec<_> = RequestOutcome::all().collect();
        assert_eq!(outcomes.len(), OUTCOMES);
        for (i, outcome) in outcomes.iter().enumerate() {
            assert_eq!(outcome.index(), i);
        }
        let mut labels: Vec<_> = outcomes.iter().map(|o| o.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), OUTCOMES, "labels are distinct");
        for label in labels {
            assert!(
                label.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{label}"
            );
        }
    }

    #[test]
    fn the_outcomes_operators_alert_on_are_labels() {
        let labels: Vec<_> = RequestOutcome::all().map(RequestOutcome::as_str).collect();
        for wanted in [
            "fresh",
            "replayed",
            "in_flight",
            "mismatch",
            "invalid_key",
            "store_error",
            "not_retained",
            "bypassed",
            "shutting_down",
        ] {
            assert!(labels.contains(&wanted), "{wanted}");
        }
    }

    #[test]
    fn every_store_error_has_its_result_label() {
        let errors = [
            StoreError::TokenRejected,
            StoreError::Capacity { what: "records" },
            StoreError::Unavailable("down".into()),
            StoreError::Corrupt("bad".into()),
            StoreError::Backend("odd".into()),
        ];
        let labels: Vec<_> = errors
            .iter()
            .map(|e| RESULTS[result_index(Some(e))])
            .collect();
        assert_eq!(
            labels,
            [
                "token_rejected",
                "capacity",
                "unavailable",
                "corrupt",
                "backend"
            ]
        );
        assert_eq!(RESULTS[result_index(None)], "ok");
    }
}
