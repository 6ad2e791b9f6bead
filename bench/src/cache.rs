//! The cache tier of the cached rows (`redis+memcache`, `postgres+memcache`,
//! `postgres+rediscache`), and how their hit rate is counted.
//!
//! A tier counts its lookups in `idempotency.cache.lookups` (labels `tier`, `outcome`: `hit`,
//! `miss`, `error`). The tier registers those counters once, when it is created, with the
//! `metrics` recorder then in force: each row's tier is created with a recorder of its own
//! ([`LookupCounter`]) in force, so its counters are the row's alone, and nothing else the
//! server does is counted (every other metric gets the no-op handle it gets without a
//! recorder). The load generator reads them at the edges of the timed phase: a row's hit rate
//! is `hit / (hit + miss + error)` of the lookups made during its timed phase.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use idempotent_cache::{CACHE_LOOKUPS, CacheTier};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use serde::{Deserialize, Serialize};

use crate::cli::Backends;
use crate::rows::Cache;

/// The prefix of the Redis tier's keys, beside the Redis rows' records on the same server.
/// Every row has a namespace of its own, so the entries of two rows never meet.
pub(crate) const REDIS_PREFIX: &str = "idempotent-bench:cache:";

/// Entries of the in-process tier: every key a row ever replays, so the replay working set
/// fits whole. Each load-generator connection cycles over its own `replay_keys` keys, and
/// each probe key is retried once after it completed.
pub(crate) fn memory_entries(connections: usize, replay_keys: usize, probe_keys: usize) -> u64 {
    (connections * replay_keys + probe_keys) as u64
}

/// A `metrics` recorder that counts `idempotency.cache.lookups` by outcome and hands every
/// other metric a no-op handle.
#[derive(Debug, Default)]
pub(crate) struct LookupCounter {
    hit: Arc<AtomicU64>,
    miss: Arc<AtomicU64>,
    error: Arc<AtomicU64>,
}

impl LookupCounter {
    fn read(&self) -> Lookups {
        Lookups {
            hit: self.hit.load(Ordering::Relaxed),
            miss: self.miss.load(Ordering::Relaxed),
            error: self.error.load(Ordering::Relaxed),
        }
    }
}

impl Recorder for LookupCounter {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() != CACHE_LOOKUPS {
            return Counter::noop();
        }
        let outcome = key
            .labels()
            .find(|label| label.key() == "outcome")
            .map(|label| label.value());
        match outcome {
            Some("hit") => Counter::from_arc(Arc::clone(&self.hit)),
            Some("miss") => Counter::from_arc(Arc::clone(&self.miss)),
            Some("error") => Counter::from_arc(Arc::clone(&self.error)),
            _ => Counter::noop(),
        }
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// `future`, with `recorder` in force on whichever thread polls it, during each poll only.
struct Recording<'a, F> {
    recorder: &'a dyn Recorder,
    future: Pin<Box<F>>,
}

impl<F: Future> Future for Recording<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let _recording = metrics::set_default_local_recorder(this.recorder);
        this.future.as_mut().poll(cx)
    }
}

/// Lookups of a tier, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Lookups {
    /// Answered from the tier.
    pub(crate) hit: u64,
    /// Not in the tier: sent to the store.
    pub(crate) miss: u64,
    /// The tier failed, or rested after a failure: sent to the store.
    pub(crate) error: u64,
}

impl Lookups {
    /// The lookups since `before`.
    pub(crate) fn since(self, before: Lookups) -> Lookups {
        Lookups {
            hit: self.hit.saturating_sub(before.hit),
            miss: self.miss.saturating_sub(before.miss),
            error: self.error.saturating_sub(before.error),
        }
    }

    pub(crate) fn total(self) -> u64 {
        self.hit + self.miss + self.error
    }

    /// `hit / (hit + miss + error)`; `None` without lookups.
    pub(crate) fn hit_rate(self) -> Option<f64> {
        match self.total() {
            0 => None,
            total => Some(self.hit as f64 / total as f64),
        }
    }

    fn add(&mut self, other: Lookups) {
        self.hit += other.hit;
        self.miss += other.miss;
        self.error += other.error;
    }
}

/// A row's tier, and its lookups as they are counted.
#[derive(Debug)]
pub(crate) struct RowTier {
    pub(crate) tier: CacheTier,
    /// The in-process tier's bound on entries; `None` for the Redis tier.
    pub(crate) capacity: Option<u64>,
    lookups: Arc<LookupCounter>,
}

impl RowTier {
    /// The tier `cache` names: in-process with `entries` entries, or on the Redis rows' server
    /// under [`REDIS_PREFIX`], with the defaults otherwise. Called inside the server's runtime
    /// (the Redis tier writes in the background).
    pub(crate) async fn create(
        cache: Cache,
        entries: u64,
        backends: &Backends,
    ) -> Result<RowTier, String> {
        let lookups = Arc::new(LookupCounter::default());
        let (tier, capacity) = match cache {
            Cache::None => return Err("no cache tier".into()),
            Cache::Memory => (
                metrics::with_local_recorder(&*lookups, || CacheTier::memory(entries)),
                Some(entries),
            ),
            Cache::Redis => {
                let url = backends
                    .redis_url
                    .as_deref()
                    .ok_or("the Redis cache tier needs a Redis URL")?;
                let connect = idempotent_redis::RedisCacheBuilder::new(url)
                    .key_prefix(REDIS_PREFIX)
                    .connect();
                let tier = Recording {
                    recorder: &*lookups,
                    future: Box::pin(connect),
                }
                .await
                .map_err(|e| format!("cannot connect the Redis cache tier at {url}: {e}"))?;
                (tier, None)
            }
        };
        Ok(RowTier {
            tier,
            capacity,
            lookups,
        })
    }

    /// The lookups so far.
    pub(crate) fn lookups(&self) -> Lookups {
        self.lookups.read()
    }

    /// What the timed phase saw, from the lookups at its start and end.
    pub(crate) fn window(&self, before: Lookups, after: Lookups) -> CacheWindow {
        CacheWindow {
            tier: self.tier.name().to_owned(),
            capacity: self.capacity,
            entries: self.tier.entries(),
            lookups: after.since(before),
        }
    }
}

/// A row's tier in one timed phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct CacheWindow {
    /// `memory` or `redis`.
    pub(crate) tier: String,
    /// The in-process tier's bound on entries; `None` for the Redis tier.
    pub(crate) capacity: Option<u64>,
    /// Entries of the in-process tier at the end of the timed phase; `None` for the Redis tier.
    pub(crate) entries: Option<u64>,
    /// The tier's lookups during the timed phase.
    pub(crate) lookups: Lookups,
}

impl CacheWindow {
    /// Adds the lookups of `other` (a window of the same tier).
    pub(crate) fn merge(&mut self, other: &CacheWindow) {
        self.lookups.add(other.lookups);
        self.entries = match (self.entries, other.entries) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_keeps_the_lookups_alone() {
        let counter = LookupCounter::default();
        metrics::with_local_recorder(&counter, || {
            let lookup = |tier: &'static str, outcome: &'static str| metrics::counter!(CACHE_LOOKUPS, "tier" => tier, "outcome" => outcome);
            lookup("memory", "hit").increment(3);
            lookup("memory", "miss").increment(1);
            lookup("memory", "error").increment(2);
            metrics::counter!("idempotency.cache.writes", "tier" => "memory", "result" => "hit")
                .increment(100);
            metrics::counter!("idempotency.requests", "outcome" => "hit").increment(100);
        });
        assert_eq!(
            counter.read(),
            Lookups {
                hit: 3,
                miss: 1,
                error: 2
            }
        );
    }

    #[test]
    fn hit_rate_over_a_window() {
        let before = Lookups {
            hit: 10,
            miss: 256,
            error: 0,
        };
        let after = Lookups {
            hit: 1010,
            miss: 256,
            error: 0,
        };
        let window = after.since(before);
        assert_eq!(window.total(), 1000);
        assert_eq!(window.hit_rate(), Some(1.0));
        let fresh = Lookups {
            hit: 0,
            miss: 40,
            error: 10,
        };
        assert_eq!(fresh.hit_rate(), Some(0.0));
        let half = Lookups {
            hit: 50,
            miss: 25,
            error: 25,
        };
        assert_eq!(half.hit_rate(), Some(0.5), "errors are lookups too");
        assert_eq!(Lookups::default().hit_rate(), None);
    }
}
