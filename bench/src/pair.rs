//! Two HTTP rows measured by turns: the summary's ratios of two HTTP rows, each measured with
//! both rows' servers up and their loads taking turns on the machine in short slices (50 ms
//! by default), rather than each row in its own seconds of each round.
//!
//! This machine's speed moves by ±15 % within a second (a CPU-bound loop alone takes 530 to 810
//! ns an iteration from one 20 ms run to the next), so two rows measured seconds apart can
//! differ by that much for no reason of their own, and three rounds do not average it out: a
//! ratio by rounds moved by ±0.1 from round to round. In turns, each timed pair of slices
//! holds one turn of each row, a turn apart, the order swaps from one pair to the
//! next (a steady drift favours neither row), and the ratio is the median over the pairs of the
//! numerator's 2xx responses in its turn over the denominator's in the same pair (turns are
//! equally long). BENCHMARKS.md ("measured by turns") shows the spread of both methods.

use serde::{Deserialize, Serialize};

use crate::cli::Options;
use crate::load::{self, TurnTraffic, Turns};
use crate::rows::{Row, Scenario};

/// A ratio of two HTTP rows by their labels: the numerator's row, the denominator's.
pub(crate) type Pair = (&'static str, &'static str);

pub(crate) const MEMORY_FRESH: Pair = ("idempotent-tower/fresh/memory", "bare/none/none");
pub(crate) const MEMORY_REPLAY: Pair = ("idempotent-tower/replay/memory", "bare/none/none");
pub(crate) const MEMORY_SESSION: Pair = (
    "idempotent-tower/session/memory",
    "idempotent-tower/fresh/memory",
);
pub(crate) const REDIS_SESSION: Pair = (
    "idempotent-tower/session/redis",
    "idempotent-tower/fresh/redis",
);
pub(crate) const POSTGRES_SESSION: Pair = (
    "idempotent-tower/session/postgres",
    "idempotent-tower/fresh/postgres",
);

/// The floor's rows over bare: the summary's `floor` column of the memory ratios.
pub(crate) const FLOOR_FRESH: Pair = ("floor/fresh/memory", "bare/none/none");
pub(crate) const FLOOR_REPLAY: Pair = ("floor/replay/memory", "bare/none/none");

/// The summary's ratios of two HTTP rows and the floor's beside them, in the summary's order.
pub(crate) const PAIRS: [Pair; 7] = [
    MEMORY_FRESH,
    FLOOR_FRESH,
    MEMORY_REPLAY,
    FLOOR_REPLAY,
    MEMORY_SESSION,
    REDIS_SESSION,
    POSTGRES_SESSION,
];

/// Untimed turns of each row before the timed ones: the servers are new, their first requests
/// warm them.
pub(crate) const WARMUP_TURNS: usize = 5;

/// Two rows measured by turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PairRecord {
    /// The labels of the numerator's row and of the denominator's.
    pub(crate) over: String,
    pub(crate) under: String,
    /// How long a turn lasted, and how many timed turns each row had.
    pub(crate) turn_ms: f64,
    pub(crate) turns: usize,
    /// The median of `ratios`: the ratio the summary shows.
    pub(crate) ratio: f64,
    /// For each timed pair of turns, the numerator's 2xx responses over the denominator's.
    pub(crate) ratios: Vec<f64>,
    /// Each row's 2xx responses per second of its own timed turns.
    pub(crate) over_rps: f64,
    pub(crate) under_rps: f64,
    /// Timed requests of either row that got no 2xx answer, and the timed responses of a
    /// replay row that were not replays: a pair with any is not to be trusted.
    pub(crate) failures: u64,
    pub(crate) not_replayed: u64,
}

impl PairRecord {
    /// The record of `over` and `under` (rows 1 and 0 of [`load::run_turns`]).
    fn of(
        (over_row, under_row): (&Row, &Row),
        turns: &Turns,
        over: &TurnTraffic,
        under: &TurnTraffic,
    ) -> PairRecord {
        let ratios: Vec<f64> = turns
            .timed_pairs()
            .filter_map(|pair| {
                let (o, u) = (over.in_pair(pair), under.in_pair(pair));
                (u > 0).then(|| o as f64 / u as f64)
            })
            .collect();
        let ratio = crate::report::median_rate(ratios.iter().copied()).unwrap_or(0.0);
        let seconds = turns.slice.as_secs_f64() * turns.timed as f64;
        let per_second = |n: u64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        let over_successes = over.timed_successes(turns);
        // Only a numerator replays (no pair divides by a replay row).
        let not_replayed = if over_row.scenario == Scenario::Replay {
            over_successes.saturating_sub(over.replayed)
        } else {
            0
        };
        PairRecord {
            over: over_row.label(),
            under: under_row.label(),
            turn_ms: turns.slice.as_secs_f64() * 1e3,
            turns: turns.timed,
            ratio,
            ratios,
            over_rps: per_second(over_successes),
            under_rps: per_second(under.timed_successes(turns)),
            failures: over.failures + under.failures,
            not_replayed,
        }
    }

    /// What makes this pair's ratio not to be trusted, as messages.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let name = format!("{} / {} by turns", self.over, self.under);
        if self.ratios.len() < self.turns {
            problems.push(format!(
                "{name}: {} of {} pairs of turns had no responses from the denominator",
                self.turns - self.ratios.len(),
                self.turns
            ));
        }
        if self.failures > 0 {
            problems.push(format!(
                "{name}: {} timed requests failed or were not 2xx",
                self.failures
            ));
        }
        if self.not_replayed > 0 {
            problems.push(format!(
                "{name}: {} timed responses of the replay row were not replays",
                self.not_replayed
            ));
        }
        problems
    }
}

/// The pairs of [`PAIRS`] whose two rows are both among `rows`, as (numerator, denominator).
pub(crate) fn selected(rows: &[Row]) -> Vec<(Row, Row)> {
    let find = |label: &str| rows.iter().find(|row| row.label() == label).copied();
    PAIRS
        .iter()
        .filter_map(|(over, under)| Some((find(over)?, find(under)?)))
        .collect()
}

/// Measures `over` against `under` by `turns` (see the module's docs): both rows' servers
/// started, each with its own connections, which take turns.
pub(crate) fn run(
    (over, under): (Row, Row),
    turns: Turns,
    options: &Options,
    client: &tokio::runtime::Runtime,
) -> Result<PairRecord, String> {
    let under_server = crate::start_server(under, options)?;
    let over_server = match crate::start_server(over, options) {
        Ok(server) => server,
        Err(message) => {
            under_server.stop();
            return Err(message);
        }
    };
    let outcome = client.block_on(load::run_turns(
        [
            &crate::plan(under, &under_server, options),
            &crate::plan(over, &over_server, options),
        ],
        turns,
    ));
    over_server.stop();
    under_server.stop();
    let [under_traffic, over_traffic] = outcome?;
    Ok(PairRecord::of(
        (&over, &under),
        &turns,
        &over_traffic,
        &under_traffic,
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::rows::{Cache, Implementation, StoreKind};

    fn row(implementation: Implementation, scenario: Scenario) -> Row {
        let store = match implementation {
            Implementation::Bare => StoreKind::None,
            _ => StoreKind::Memory,
        };
        Row {
            implementation,
            scenario,
            store,
            cache: Cache::None,
            prefilled: 0,
        }
    }

    #[test]
    fn the_ratio_is_the_median_over_pairs_of_turns_of_timed_slices() {
        let turns = Turns {
            slice: Duration::from_millis(100),
            warmup: 1,
            timed: 3,
        };
        // Owners by slice: 0 1 | 1 0 | 0 1 | 1 0; slices 0 and 1 are the warm-up.
        let mut over = TurnTraffic {
            successes: vec![0, 999, 90, 0, 0, 80, 70, 0],
            failures: 0,
            replayed: 240,
        };
        let under = TurnTraffic {
            successes: vec![999, 0, 0, 100, 100, 0, 0, 100],
            failures: 0,
            replayed: 0,
        };
        let (o, u) = (
            row(Implementation::Tower, Scenario::Replay),
            row(Implementation::Bare, Scenario::None),
        );
        let record = PairRecord::of((&o, &u), &turns, &over, &under);
        assert_eq!(record.ratios, [0.9, 0.8, 0.7]);
        assert_eq!(record.ratio, 0.8);
        assert_eq!(
            (record.over.as_str(), record.under.as_str()),
            ("idempotent-tower/replay/memory", "bare/none/none")
        );
        assert!(
            (record.over_rps - 800.0).abs() < 1e-9,
            "{}",
            record.over_rps
        );
        assert!(
            (record.under_rps - 1000.0).abs() < 1e-9,
            "{}",
            record.under_rps
        );
        assert!(record.problems().is_empty(), "{:?}", record.problems());

        // A replay row whose answers were not all replays, and a pair with no denominator.
        over.replayed = 200;
        let mut empty = under.clone();
        empty.successes[3] = 0;
        let record = PairRecord::of((&o, &u), &turns, &over, &empty);
        assert_eq!(record.ratios, [0.8, 0.7]);
        assert_eq!(record.not_replayed, 40);
        assert_eq!(record.problems().len(), 2, "{:?}", record.problems());
    }

    #[test]
    fn pairs_are_selected_only_when_both_rows_run() {
        let bare = row(Implementation::Bare, Scenario::None);
        let fresh = row(Implementation::Tower, Scenario::Fresh);
        let replay = row(Implementation::Tower, Scenario::Replay);
        assert_eq!(selected(&[bare, replay]), [(replay, bare)]);
        assert_eq!(
            selected(&[fresh, replay, bare]),
            [(fresh, bare), (replay, bare)]
        );
        assert!(selected(&[fresh, replay]).is_empty());
        for (over, under) in PAIRS {
            assert_ne!(over, under);
        }
    }
}
