//! What one round of an HTTP row measures: the load generator's traffic and latencies, and the
//! exactly-once audit over the handler's executions.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::cache::CacheWindow;
use crate::fixture::Executions;

/// Response latencies in microseconds, 1 µs to 60 s at three significant digits.
#[derive(Clone)]
pub(crate) struct Latencies {
    histogram: Histogram<u64>,
}

impl Latencies {
    const MAX_US: u64 = 60_000_000;

    pub(crate) fn new() -> Self {
        Latencies {
            histogram: Histogram::new_with_bounds(1, Self::MAX_US, 3)
                .expect("static histogram bounds are valid"),
        }
    }

    /// Records one response; sub-microsecond times count as 1 µs, over 60 s as 60 s.
    pub(crate) fn record(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.histogram.saturating_record(us.clamp(1, Self::MAX_US));
    }

    pub(crate) fn merge(&mut self, other: &Latencies) {
        self.histogram
            .add(&other.histogram)
            .expect("histograms with the same bounds merge");
    }

    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.histogram.len()
    }

    /// The latency at `quantile` (0.0 to 1.0) in microseconds: the smallest recorded value
    /// that at least that share of the responses did not exceed; 0 when nothing was recorded.
    pub(crate) fn quantile_us(&self, quantile: f64) -> u64 {
        if self.histogram.is_empty() {
            return 0;
        }
        self.histogram.value_at_quantile(quantile)
    }
}

/// The exactly-once verdict over one row's executions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Audit {
    /// Handler executions in the row (warm-up, timed phase and probes).
    pub(crate) executions: u64,
    /// Keys that ran at least once.
    pub(crate) distinct_keys: u64,
    /// Keys that ran more than once.
    pub(crate) duplicated_keys: u64,
    /// Probe keys sent, and how many of them ran exactly once.
    pub(crate) probe_keys: u64,
    pub(crate) probe_keys_once: u64,
    /// Executions the handler could not attribute to a key.
    pub(crate) unattributed: u64,
}

impl Audit {
    pub(crate) fn of(executions: &Executions) -> Audit {
        let mut audit = Audit {
            unattributed: executions.unattributed,
            executions: executions.unattributed,
            ..Audit::default()
        };
        let counts = executions.lanes.iter().flatten().chain(&executions.probes);
        for &count in counts {
            audit.executions += u64::from(count);
            audit.distinct_keys += u64::from(count > 0);
            audit.duplicated_keys += u64::from(count > 1);
        }
        audit.probe_keys = executions.probes.len() as u64;
        audit.probe_keys_once = executions.probes.iter().filter(|&&n| n == 1).count() as u64;
        audit
    }

    /// Every key ran at most once, every probe key exactly once, and every execution had a key.
    pub(crate) fn exactly_once(&self) -> bool {
        self.duplicated_keys == 0
            && self.unattributed == 0
            && self.probe_keys > 0
            && self.probe_keys_once == self.probe_keys
    }
}

/// What the load generator saw in one timed phase.
#[derive(Clone)]
pub(crate) struct Traffic {
    pub(crate) latencies: Latencies,
    /// Responses by status code.
    pub(crate) statuses: BTreeMap<u16, u64>,
    /// Requests that got no response (connection errors).
    pub(crate) transport_errors: u64,
    /// Responses marked as replays (`Idempotent-Replayed` or `Idempotency-Replayed: true`).
    pub(crate) replayed: u64,
    pub(crate) elapsed: Duration,
    /// CPU time of the server's and of the load generator's threads during the timed phase.
    pub(crate) server_cpu: Duration,
    pub(crate) client_cpu: Duration,
    /// Busy time of all the machine's CPUs during the timed phase, and its share of their
    /// time (`machine.rs`).
    pub(crate) machine_cpu: Duration,
    pub(crate) machine_busy: f64,
    /// The row's cache tier during the timed phase, if it has one (`cache.rs`).
    pub(crate) cache: Option<CacheWindow>,
}

impl Traffic {
    pub(crate) fn new() -> Self {
        Traffic {
            latencies: Latencies::new(),
            statuses: BTreeMap::new(),
            transport_errors: 0,
            replayed: 0,
            elapsed: Duration::ZERO,
            server_cpu: Duration::ZERO,
            client_cpu: Duration::ZERO,
            machine_cpu: Duration::ZERO,
            machine_busy: 0.0,
            cache: None,
        }
    }

    pub(crate) fn merge(&mut self, other: &Traffic) {
        self.latencies.merge(&other.latencies);
        for (status, n) in &other.statuses {
            *self.statuses.entry(*status).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.replayed += other.replayed;
        self.elapsed = self.elapsed.max(other.elapsed);
        self.server_cpu += other.server_cpu;
        self.client_cpu += other.client_cpu;
        self.machine_cpu += other.machine_cpu;
        self.machine_busy = self.machine_busy.max(other.machine_busy);
        match (&mut self.cache, &other.cache) {
            (Some(cache), Some(other)) => cache.merge(other),
            (cache @ None, Some(other)) => *cache = Some(other.clone()),
            (_, None) => {}
        }
    }

    /// Responses of any status, plus requests without one.
    pub(crate) fn requests(&self) -> u64 {
        self.statuses.values().sum::<u64>() + self.transport_errors
    }

    /// Server CPU time per request in the timed phase, in microseconds.
    pub(crate) fn server_us_per_request(&self) -> f64 {
        per_request_us(self.server_cpu, self.requests())
    }

    /// Load-generator CPU time per request in the timed phase, in microseconds.
    pub(crate) fn client_us_per_request(&self) -> f64 {
        per_request_us(self.client_cpu, self.requests())
    }

    /// Busy time of the whole machine per request in the timed phase, in microseconds.
    pub(crate) fn machine_us_per_request(&self) -> f64 {
        per_request_us(self.machine_cpu, self.requests())
    }

    pub(crate) fn successes(&self) -> u64 {
        self.statuses
            .iter()
            .filter(|(status, _)| (200..300).contains(*status))
            .map(|(_, n)| n)
            .sum()
    }

    /// Responses that were not 2xx, plus requests without a response.
    pub(crate) fn failures(&self) -> u64 {
        self.requests() - self.successes()
    }

    /// Successful responses per second; failures do not count.
    pub(crate) fn rps(&self) -> f64 {
        if self.elapsed.is_zero() {
            return 0.0;
        }
        self.successes() as f64 / self.elapsed.as_secs_f64()
    }
}

fn per_request_us(cpu: Duration, requests: u64) -> f64 {
    if requests == 0 {
        return 0.0;
    }
    round1(cpu.as_secs_f64() * 1e6 / requests as f64)
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

#[cfg(test)]
impl Traffic {
    /// A timed phase of `ok` 201s taking `latency_us` each and `conflicts` 409s over `seconds`.
    pub(crate) fn sample(ok: u64, conflicts: u64, seconds: u64, latency_us: u64) -> Traffic {
        let mut t = Traffic::new();
        for _ in 0..ok {
            t.latencies.record(Duration::from_micros(latency_us));
        }
        t.statuses.insert(201, ok);
        if conflicts > 0 {
            t.statuses.insert(409, conflicts);
        }
        t.elapsed = Duration::from_secs(seconds);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_a_known_distribution() {
        let mut l = Latencies::new();
        for us in 1..=1000 {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.count(), 1000);
        // Three significant digits: exact below 2048 µs.
        assert_eq!(l.quantile_us(0.5), 500);
        assert_eq!(l.quantile_us(0.99), 990);
        assert_eq!(l.quantile_us(1.0), 1000);
    }

    #[test]
    fn quantiles_clamp_and_merge() {
        let mut a = Latencies::new();
        a.record(Duration::from_nanos(10)); // below 1 µs counts as 1 µs
        let mut b = Latencies::new();
        b.record(Duration::from_secs(3600)); // beyond the range counts as its top
        a.merge(&b);
        assert_eq!(a.count(), 2);
        assert_eq!(a.quantile_us(0.0), 1);
        assert!(a.quantile_us(1.0) >= 59_900_000);
        assert_eq!(Latencies::new().quantile_us(0.5), 0);
    }

    #[test]
    fn failures_do_not_count_as_throughput() {
        let mut t = Traffic::sample(1000, 9000, 2, 100);
        t.transport_errors = 5;
        assert_eq!(t.successes(), 1000);
        assert_eq!(t.failures(), 9005);
        assert_eq!(t.rps(), 500.0);
    }

    #[test]
    fn audit_counts_keys_and_duplicates() {
        let once = Executions {
            lanes: vec![vec![1, 1, 0], vec![1]],
            probes: vec![1, 1],
            unattributed: 0,
        };
        let audit = Audit::of(&once);
        assert_eq!(audit.executions, 5);
        assert_eq!(audit.distinct_keys, 5);
        assert_eq!(audit.duplicated_keys, 0);
        assert!(audit.exactly_once());

        let replayed_twice = Executions {
            lanes: vec![vec![1, 3]],
            ..once.clone()
        };
        let audit = Audit::of(&replayed_twice);
        assert_eq!((audit.executions, audit.duplicated_keys), (6, 1));
        assert!(!audit.exactly_once());

        let duplicate_probe = Executions {
            probes: vec![1, 2],
            ..once.clone()
        };
        assert!(!Audit::of(&duplicate_probe).exactly_once());
        let lost_probe = Executions {
            probes: vec![1, 0],
            ..once.clone()
        };
        assert!(!Audit::of(&lost_probe).exactly_once());
        let unattributed = Executions {
            unattributed: 1,
            ..once
        };
        assert!(!Audit::of(&unattributed).exactly_once());
        assert!(!Audit::default().exactly_once(), "no probe, no verdict");
    }
}
