//! The latencies a row reports: from a message's receipt to the broker's answer to its ack
//! (the runtime's `idempotency.message.duration`, caught by a `metrics` recorder of its own; the
//! bare loops time the same span) and, with `--paced`, from its publication.

use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::Histogram;
use idempotent_consumer::MESSAGE_DURATION;

use super::postings::now_micros;

/// The largest latency recorded, in microseconds: two minutes.
const MAX_US: u64 = 120_000_000;

/// An empty histogram of latencies, 1 µs to [`MAX_US`] at three significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_US, 3).unwrap()
}

/// Receipt-to-answer durations of the current row, in microseconds.
pub(crate) static LATENCY: LazyLock<Mutex<Histogram<u64>>> =
    LazyLock::new(|| Mutex::new(histogram()));

/// Records one message's receipt-to-answer time.
pub(crate) fn record_latency(elapsed: Duration) {
    let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    let _ = LATENCY
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .record(micros.clamp(1, MAX_US));
}

/// With `--paced`: from a message's publication to the broker's answer to its ack, in
/// microseconds (this process's clock on both sides).
pub(crate) static END_TO_END: LazyLock<Mutex<Histogram<u64>>> =
    LazyLock::new(|| Mutex::new(histogram()));

/// Records the time since `sent` (microseconds since the Unix epoch), if the message carried
/// one.
pub(crate) fn record_end_to_end(sent: Option<u64>) {
    if let Some(sent) = sent {
        let _ = END_TO_END
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(now_micros().saturating_sub(sent).clamp(1, MAX_US));
    }
}

/// Empties both histograms, before a row.
pub(crate) fn reset_histograms() {
    for kept in [&LATENCY, &END_TO_END] {
        *kept.lock().unwrap_or_else(PoisonError::into_inner) = histogram();
    }
}

/// A `metrics` recorder that keeps only the runtime's `idempotency.message.duration` (from a
/// message's receipt to the broker's answer), in [`LATENCY`]; every other metric is a no-op,
/// as with no recorder.
pub(crate) struct DurationRecorder;

struct DurationHistogram;

impl metrics::HistogramFn for DurationHistogram {
    fn record(&self, seconds: f64) {
        record_latency(Duration::from_secs_f64(seconds.max(0.0)));
    }
}

static DURATION_HISTOGRAM: LazyLock<Arc<DurationHistogram>> =
    LazyLock::new(|| Arc::new(DurationHistogram));

impl metrics::Recorder for DurationRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        if key.name() == MESSAGE_DURATION {
            metrics::Histogram::from_arc(Arc::clone(&DURATION_HISTOGRAM))
        } else {
            metrics::Histogram::noop()
        }
    }
}
