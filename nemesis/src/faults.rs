//! The nemesis's schedule: which fault, when, on what, for how long, all drawn from the seed
//! before the run begins (so `--seed` gives the same schedule again), and the faults caused
//! to the real processes.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::run::StoreKind;

/// A kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FaultKind {
    /// `SIGKILL` of a `payments` instance, started again after the hold.
    KillInstance,
    /// `SIGSTOP` of a `payments` instance, `SIGCONT` after the hold (longer than its claims'
    /// lease: the other instance takes its operations over while it is paused, and what it
    /// writes when it continues must be refused).
    PauseInstance,
    /// `SIGKILL` of a `ledger` consumer, started again after the hold.
    KillConsumer,
    /// `SIGKILL` of the relay, started again after the hold.
    KillRelay,
    /// `SIGSTOP` of the store's processes, `SIGCONT` after the hold.
    FreezeStore,
    /// The store's network namespace cut off (its veth link down), joined again after the hold.
    PartitionStore,
    /// The broker's namespace cut off, joined again after the hold.
    PartitionBroker,
    /// The broker (a durable Redis) killed and started again on its data.
    RestartBroker,
    /// A Redis Cluster store: a replica of one of its primaries takes over (`CLUSTER
    /// FAILOVER`).
    FailoverStore,
}

impl FaultKind {
    /// The kinds a run over `store` draws from, and those it injects at least once. A store
    /// in its own process and namespace (Redis, PostgreSQL) is frozen and cut off; a Redis
    /// Cluster fails over; an embedded store (SQLite) has no process of its own to fault.
    pub(crate) fn of(store: StoreKind) -> (Vec<FaultKind>, Vec<FaultKind>) {
        use FaultKind::*;
        let mut all = vec![
            KillInstance,
            PauseInstance,
            KillConsumer,
            KillRelay,
            PartitionBroker,
            RestartBroker,
        ];
        let mut required = vec![KillInstance, RestartBroker, PauseInstance, KillConsumer];
        match store {
            StoreKind::Redis | StoreKind::Postgres => {
                all.extend([FreezeStore, PartitionStore]);
                required.extend([PartitionStore, FreezeStore]);
            }
            StoreKind::RedisCluster => {
                all.push(FailoverStore);
                required.extend([FailoverStore, PartitionBroker]);
            }
            StoreKind::Sqlite => required.push(PartitionBroker),
        }
        (all, required)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            FaultKind::KillInstance => "kill-instance",
            FaultKind::PauseInstance => "pause-instance",
            FaultKind::KillConsumer => "kill-consumer",
            FaultKind::KillRelay => "kill-relay",
            FaultKind::FreezeStore => "freeze-store",
            FaultKind::PartitionStore => "partition-store",
            FaultKind::PartitionBroker => "partition-broker",
            FaultKind::RestartBroker => "restart-broker",
            FaultKind::FailoverStore => "failover-store",
        }
    }

    /// What it acts on, so that two faults on one target do not overlap.
    pub(crate) fn target(self, which: usize) -> String {
        match self {
            FaultKind::KillInstance | FaultKind::PauseInstance => format!("payments-{which}"),
            FaultKind::KillConsumer => format!("ledger-{which}"),
            FaultKind::KillRelay => "relay".into(),
            FaultKind::FreezeStore | FaultKind::PartitionStore | FaultKind::FailoverStore => {
                "store".into()
            }
            FaultKind::PartitionBroker | FaultKind::RestartBroker => "broker".into(),
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One fault of the schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Planned {
    /// When it begins, from the start of the workload.
    pub(crate) at_ms: u64,
    pub(crate) kind: FaultKind,
    /// Which of two instances or consumers.
    pub(crate) which: usize,
    /// How long it lasts (for a kill: how long the process stays down).
    pub(crate) hold_ms: u64,
    /// The lane it runs in (`--concurrent N`: N lanes at once).
    pub(crate) lane: usize,
}

/// A small deterministic generator (xorshift64), so a schedule is its seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        // The seed through splitmix64's finaliser, so that nearby seeds start far apart; never
        // 0, which xorshift would keep.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        Rng(if z == 0 { 1 } else { z })
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In `low..=high`.
    pub(crate) fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

/// The schedule of a run of `duration` with `lanes` faults at a time: faults from 3 s in until
/// 5 s before the end, each held 1–5 s (a killed process down up to 1.5 s, a paused instance
/// 3.5–6 s), 1–3 s apart in a lane. Lane 0 begins with the kinds every run must inject, in an
/// order the seed picks.
pub(crate) fn schedule(
    seed: u64,
    duration: Duration,
    lanes: usize,
    store: StoreKind,
) -> Vec<Planned> {
    let (all, required) = FaultKind::of(store);
    let mut rng = Rng::new(seed);
    let end = u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_sub(5_000);
    let mut required = required;
    for i in (1..required.len()).rev() {
        let j = usize::try_from(rng.next() % (i as u64 + 1)).unwrap_or(0);
        required.swap(i, j);
    }
    let mut planned = Vec::new();
    for lane in 0..lanes.max(1) {
        let mut at = 3_000 + rng.between(0, 1_000);
        let mut first = if lane == 0 {
            required.clone()
        } else {
            Vec::new()
        };
        first.reverse();
        loop {
            let kind = first.pop().unwrap_or_else(|| {
                let n = all.len() as u64;
                all[usize::try_from(rng.next() % n).unwrap_or(0)]
            });
            let hold = match kind {
                FaultKind::KillInstance | FaultKind::KillConsumer | FaultKind::KillRelay => {
                    rng.between(0, 1_500)
                }
                FaultKind::RestartBroker | FaultKind::FailoverStore => 0,
                // Past the lease (2 s) and the impatient client's second.
                FaultKind::PauseInstance => rng.between(3_500, 6_000),
                _ => rng.between(1_000, 5_000),
            };
            if at + hold > end {
                break;
            }
            planned.push(Planned {
                at_ms: at,
                kind,
                which: usize::try_from(rng.next() % 2).unwrap_or(0),
                hold_ms: hold,
                lane,
            });
            at += hold + rng.between(1_000, 3_000);
        }
    }
    planned.sort_by_key(|p| p.at_ms);
    planned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule() {
        let two_minutes = Duration::from_secs(120);
        let a = schedule(42, two_minutes, 1, StoreKind::Redis);
        assert_eq!(a, schedule(42, two_minutes, 1, StoreKind::Redis));
        assert_ne!(a, schedule(43, two_minutes, 1, StoreKind::Redis));
        assert_ne!(a, schedule(42, two_minutes, 2, StoreKind::Redis));
    }

    #[test]
    fn every_run_of_two_minutes_injects_the_required_kinds_within_its_window() {
        let stores = [
            StoreKind::Redis,
            StoreKind::Postgres,
            StoreKind::RedisCluster,
            StoreKind::Sqlite,
        ];
        for (seed, store) in (0..200).flat_map(|seed| stores.map(|store| (seed, store))) {
            let (all, required) = FaultKind::of(store);
            for lanes in [1, 3] {
                let planned = schedule(seed, Duration::from_secs(120), lanes, store);
                for kind in &required {
                    assert!(
                        planned.iter().any(|p| p.kind == *kind),
                        "seed {seed}, {store:?}: no {kind}"
                    );
                }
                assert!(planned.iter().all(|p| all.contains(&p.kind)), "{planned:?}");
                for p in &planned {
                    assert!(p.at_ms >= 3_000 && p.at_ms + p.hold_ms <= 115_000, "{p:?}");
                    assert!(p.which < 2 && p.lane < lanes);
                }
                // A lane's faults do not overlap.
                for lane in 0..lanes {
                    let mine: Vec<&Planned> = planned.iter().filter(|p| p.lane == lane).collect();
                    for pair in mine.windows(2) {
                        assert!(pair[0].at_ms + pair[0].hold_ms < pair[1].at_ms, "{pair:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_run_too_short_for_faults_has_none() {
        assert!(schedule(7, Duration::from_secs(5), 2, StoreKind::Sqlite).is_empty());
    }
}
