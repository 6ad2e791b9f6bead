//! What a run produces: the records of the HTTP rows, the limit rows, the prefills, the
//! memory mode and the sessions mode, their markdown tables and the JSON file.

use std::collections::BTreeMap;
use std::path::Path;

use idempotent_bench::table::thousands;
use serde::{Deserialize, Serialize};

use crate::cache::CacheWindow;
use crate::measure::{Audit, Traffic, round1};
use crate::pair::{self, PairRecord};
use crate::rows::Row;
use crate::sessions::SessionRecord;

/// One object of `http.json`: a row of the HTTP benchmark, a memory measurement or a
/// sessions measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub(crate) enum Record {
    Http(HttpRecord),
    Limit(LimitRecord),
    Memory(MemoryRecord),
    /// How a shared store was prefilled for the prefilled rows, and its size then.
    Prefill(FillRecord),
    /// What a store holds for one client session against keys (`sessions.rs`).
    Sessions(SessionRecord),
    /// Two HTTP rows measured by turns (`pair.rs`).
    Pair(PairRecord),
}

/// A limit row: what the backend's own benchmark tool does with the store's statements
/// (see `limit.rs`), in operations per second: one fresh request's statements, or one
/// replay's, per operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LimitRecord {
    pub(crate) implementation: String,
    pub(crate) scenario: String,
    pub(crate) store: String,
    /// The median round's operations per second.
    pub(crate) rps: f64,
    pub(crate) connections: usize,
    /// Timed seconds per round, and the rate of every round.
    pub(crate) seconds: f64,
    pub(crate) rounds_rps: Vec<f64>,
    /// The share of the machine's CPU time that was busy while the median round's tool ran
    /// (its warm-up and timed runs).
    #[serde(default)]
    pub(crate) machine_busy: f64,
    /// The machine's CPUs while the row ran (`/proc/stat`), whose time `machine_busy` shares
    /// out; 0 where unknown (rows written before it was kept).
    #[serde(default)]
    pub(crate) cpus: usize,
}

impl LimitRecord {
    /// The median of `rounds` (operations per second, and the machine's busy share, per
    /// round).
    pub(crate) fn summarize(
        label: [&str; 3],
        connections: usize,
        seconds: u64,
        rounds: &[(f64, f64)],
    ) -> LimitRecord {
        assert!(!rounds.is_empty(), "a row has at least one round");
        let mut sorted = rounds.to_vec();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (rps, busy) = sorted[sorted.len() / 2];
        LimitRecord {
            implementation: label[0].to_owned(),
            scenario: label[1].to_owned(),
            store: label[2].to_owned(),
            rps: round1(rps),
            connections,
            seconds: seconds as f64,
            rounds_rps: rounds.iter().map(|(rps, _)| round1(*rps)).collect(),
            machine_busy: (busy * 1000.0).round() / 1000.0,
            cpus: idempotent_bench::machine::cpus().unwrap_or(0),
        }
    }
}

/// The limit rows as a markdown table, each beside the `idempotent-tower` row of the same
/// scenario and store and that row's fraction of the limit.
pub(crate) fn limit_table(limits: &[LimitRecord], rows: &[HttpRecord]) -> String {
    let mut out = String::from(
        "| limit | scenario | store | ops/s | machine busy | idempotent-tower rps | fraction of the limit | machine busy | server CPU µs/req | machine CPU µs/req |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let percent = |share: f64| format!("{:.0} %", 100.0 * share);
    for limit in limits {
        let layer = rows.iter().find(|r| {
            r.implementation == "idempotent-tower"
                && r.scenario == limit.scenario
                && r.store == limit.store
                && r.prefilled == 0
        });
        let columns = match layer {
            Some(r) if limit.rps > 0.0 => [
                thousands(r.rps.round() as u64),
                percent(r.rps / limit.rps),
                percent(r.machine_busy),
                format!("{:.1}", r.server_cpu_us),
                format!("{:.1}", r.machine_cpu_us),
            ],
            _ => std::array::from_fn(|_| "–".to_owned()),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            limit.implementation,
            limit.scenario,
            limit.store,
            thousands(limit.rps.round() as u64),
            percent(limit.machine_busy),
            columns.join(" | "),
        ));
    }
    out
}

/// The ratios BENCHMARKS.md's summary tracks (issue 43's table), each from this run's rows:
/// the layer against the bare handler on the memory store, against the store's own tool
/// (`redis-benchmark`, `pgbench`) on Redis and PostgreSQL, a session request against a
/// request with a key, and the memory store with records already in it against an empty one.
/// The relay's row (messages per second of one relay with the discarding sink, against 0.2's
/// 33k) and the consumer's (the runtime with the PostgreSQL effect against the bare loop doing
/// the same work) come from the other binaries' output (`others`, see [`OtherRows`]). A ratio
/// whose rows did not run is left out.
///
/// **This run's ratio is paired by round** where its two rows ran in the same rounds (every
/// row and limit row of the HTTP run's rounds, not the prefilled rows, which have rounds of
/// their own, nor the other binaries' rows): the median over the rounds of the two rows'
/// ratio in that round ([`paired`]). A slow minute of the machine that falls on one round
/// slows both of that round's rows, and leaves the ratio as it is, where it would move one
/// row's median and not the other's. The ratio of the two rows' medians is printed beside it
/// (`of the medians`), and stands in for it where the rows are not paired.
///
/// The rows against a store's tool also get the **ceiling on this machine** ([`ceiling`]):
/// the ratio the layer's row would reach with every CPU busy, given the CPU per request this
/// run measured. The rows over bare and over a store's tool also get the **floor**: the floor's
/// row of the same scenario and store over the same denominator (`floor.rs`: the least a layer
/// can do and answer each key once), what a layer that does nothing else reaches on this
/// machine, paired by round in the same way.
pub(crate) fn goals_table(
    records: &[HttpRecord],
    limits: &[LimitRecord],
    pairs: &[PairRecord],
    others: &OtherRows,
) -> String {
    let find = |scenario: &str, store: &str, prefilled: bool| {
        records.iter().find(|r| {
            r.implementation == "idempotent-tower"
                && r.scenario == scenario
                && r.store == store
                && (r.prefilled > 0) == prefilled
        })
    };
    let layer =
        |scenario: &str, store: &str, prefilled: bool| find(scenario, store, prefilled).map(rate);
    let bare = records
        .iter()
        .find(|r| r.implementation == "bare" && r.prefilled == 0)
        .map(rate);
    let find_limit = |tool: &str, scenario: &str| {
        limits
            .iter()
            .find(|l| l.implementation == tool && l.scenario == scenario)
    };
    let floor = |scenario: &str, store: &str| {
        records
            .iter()
            .find(|r| {
                r.implementation == "floor"
                    && r.scenario == scenario
                    && r.store == store
                    && r.prefilled == 0
            })
            .map(rate)
    };
    // Over the store's own tool: the floor on the same store, and the CPU ceiling.
    let against_limit = |scenario: &str, store: &str, tool: &str| {
        let row = find(scenario, store, false);
        let tool = find_limit(tool, scenario);
        Ratio {
            over: row.map(rate),
            under: tool.map(|l| Rate {
                median: l.rps,
                rounds: &l.rounds_rps,
            }),
            floor: floor(scenario, store),
            ceiling: row
                .zip(tool)
                .and_then(|(row, tool)| ceiling(row, tool, tool.cpus)),
            rows: None,
            floor_rows: None,
        }
    };
    let prefilled = records
        .iter()
        .find(|r| {
            r.implementation == "idempotent-tower"
                && r.scenario == "fresh"
                && r.store == "memory"
                && r.prefilled > 0
        })
        .map_or_else(String::new, |r| crate::rows::count_name(r.prefilled));
    let prefilled_name = format!("memory fresh, {prefilled} records before / none");
    let unpaired = |rate: Option<f64>| {
        rate.map(|median| Rate {
            median,
            rounds: &[],
        })
    };
    // Over bare: the floor on memory.
    let against_bare = |scenario: &str, rows, floor_rows| Ratio {
        over: layer(scenario, "memory", false),
        under: bare,
        floor: floor(scenario, "memory"),
        ceiling: None,
        rows: Some(rows),
        floor_rows: Some(floor_rows),
    };
    // A session row over its store's fresh row, by turns where they took turns.
    let session = |store: &str, rows| Ratio {
        rows: Some(rows),
        ..plain(layer("session", store, false), layer("fresh", store, false))
    };
    let ratios: [(&str, Ratio<'_>, f64); 12] = [
        (
            "memory fresh / bare",
            against_bare("fresh", pair::MEMORY_FRESH, pair::FLOOR_FRESH),
            0.85,
        ),
        (
            "memory replay / bare",
            against_bare("replay", pair::MEMORY_REPLAY, pair::FLOOR_REPLAY),
            0.95,
        ),
        (
            "Redis fresh / `redis-benchmark` fresh",
            against_limit("fresh", "redis", "redis-benchmark"),
            0.8,
        ),
        (
            "Redis replay / `redis-benchmark` replay",
            against_limit("replay", "redis", "redis-benchmark"),
            0.35,
        ),
        (
            "PostgreSQL fresh / `pgbench` fresh",
            against_limit("fresh", "postgres", "pgbench"),
            0.85,
        ),
        (
            "PostgreSQL replay / `pgbench` replay",
            against_limit("replay", "postgres", "pgbench"),
            0.7,
        ),
        (
            "memory session / fresh",
            session("memory", pair::MEMORY_SESSION),
            0.95,
        ),
        (
            "Redis session / fresh",
            session("redis", pair::REDIS_SESSION),
            0.85,
        ),
        (
            "PostgreSQL session / fresh",
            session("postgres", pair::POSTGRES_SESSION),
            0.85,
        ),
        (
            prefilled_name.as_str(),
            plain(
                layer("fresh", "memory", true),
                layer("fresh", "memory", false),
            ),
            0.9,
        ),
        (
            "relay, discarding sink, 1 relay / 0.2's 33k messages/s",
            plain(
                unpaired(others.relay),
                unpaired(others.relay.map(|_| RELAY_0_2)),
            ),
            0.8,
        ),
        (
            "consumer with the PostgreSQL effect / bare-pg loop (Redis Streams)",
            plain(unpaired(others.consumer_pg), unpaired(others.bare_pg)),
            0.75,
        ),
    ];
    let mut out = String::from(
        "| ratio | this run | goal | by rounds | of the medians | floor | ceiling on this machine |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (name, ratio, goal) in ratios {
        let cell = |value: Option<f64>| value.map_or_else(|| "–".to_owned(), |v| shown(v, goal));
        let (Some(over), Some(under)) = (ratio.over, ratio.under) else {
            continue;
        };
        if under.median <= 0.0 {
            continue;
        }
        let of_medians = over.median / under.median;
        let by_rounds = paired(over.rounds, under.rounds).unwrap_or(of_medians);
        let turned = |rows: Option<pair::Pair>| {
            let (over, under) = rows?;
            pairs
                .iter()
                .find(|pair| pair.over == over && pair.under == under)
                .map(|pair| pair.ratio)
        };
        let (in_turns, floor_in_turns) = (turned(ratio.rows), turned(ratio.floor_rows));
        let floor = ratio.floor.map(|floor| {
            floor_in_turns.unwrap_or_else(|| {
                paired(floor.rounds, under.rounds).unwrap_or(floor.median / under.median)
            })
        });
        out.push_str(&format!(
            "| {name} | {} | ≥ {goal} | {} | {} | {} | {} |\n",
            cell(Some(in_turns.unwrap_or(by_rounds))),
            cell(Some(by_rounds)),
            cell(Some(of_medians)),
            cell(floor),
            cell(ratio.ceiling),
        ));
    }
    out
}

/// `ratio` as the summary prints it beside `goal`: two decimals, or as many more (up to six)
/// as it takes for a ratio below its goal not to read as meeting it (0.948 against 0.95, not
/// 0.95).
fn shown(ratio: f64, goal: f64) -> String {
    (2..=6)
        .map(|decimals| format!("{ratio:.decimals$}"))
        .find(|text| ratio >= goal || text.parse::<f64>().is_ok_and(|read| read < goal))
        .unwrap_or_else(|| format!("{ratio:.6}"))
}

/// A rate in one of the summary's ratios: a row's median rate, and its rate in each round of
/// the HTTP run (empty for a rate that has no such rounds).
#[derive(Debug, Clone, Copy)]
struct Rate<'a> {
    median: f64,
    rounds: &'a [f64],
}

/// `record`'s rate. Its rounds are the HTTP run's unless it is a prefilled row, whose rounds
/// are its own (they run after the prefill), so that it pairs with nothing.
fn rate(record: &HttpRecord) -> Rate<'_> {
    Rate {
        median: record.rps,
        rounds: if record.prefilled == 0 {
            &record.rounds_rps
        } else {
            &[]
        },
    }
}

/// A ratio's numerator and denominator, the floor's rate in the numerator's place (`floor.rs`)
/// and the ceiling on this machine, where the ratio has them.
struct Ratio<'a> {
    over: Option<Rate<'a>>,
    under: Option<Rate<'a>>,
    floor: Option<Rate<'a>>,
    ceiling: Option<f64>,
    /// The labels of the numerator's and the denominator's rows, for a ratio of two HTTP rows
    /// that `pair.rs` may have measured by turns; the same for the floor's ratio.
    rows: Option<pair::Pair>,
    floor_rows: Option<pair::Pair>,
}

/// A ratio with neither a floor nor a ceiling.
fn plain<'a>(over: Option<Rate<'a>>, under: Option<Rate<'a>>) -> Ratio<'a> {
    Ratio {
        over,
        under,
        floor: None,
        ceiling: None,
        rows: None,
        floor_rows: None,
    }
}

/// The median over the rounds of `over`'s rate in a round divided by `under`'s in the same
/// round (the upper one of an even count, as a row's own median is), or `None` when the two
/// rows did not run the same rounds: one has none, or fewer (a row that fails stops running,
/// so its rounds are the first ones and equal counts are the same rounds), or a rate that
/// divides nothing.
fn paired(over: &[f64], under: &[f64]) -> Option<f64> {
    if over.is_empty() || over.len() != under.len() || under.iter().any(|&rate| rate <= 0.0) {
        return None;
    }
    median_rate(over.iter().zip(under).map(|(o, u)| o / u))
}

/// The ratio of `row` (the layer on a store) to `limit` (the store's own tool running the
/// same statements or scripts) that the layer could reach on this machine of `cpus` CPUs (the
/// limit row's, counted when it ran) with all of them busy, given the CPU time per request this run measured. The store's work per
/// request is taken as the limit row's machine time per operation (`cpus × busy / rps`,
/// which includes the tool's own client: an overestimate of the store's part), and the
/// layer's as its server's and its load generator's threads' CPU per request. The layer's
/// row can reach at most `cpus / (store + layer)` requests per second; divided by the limit
/// row's rate, that is the ceiling. `None` when the rows lack what it needs.
pub(crate) fn ceiling(row: &HttpRecord, limit: &LimitRecord, cpus: usize) -> Option<f64> {
    if cpus == 0 || limit.rps <= 0.0 || limit.machine_busy <= 0.0 {
        return None;
    }
    let cpu_us = cpus as f64 * 1e6;
    let store_us = cpu_us * limit.machine_busy / limit.rps;
    let layer_us = row.server_cpu_us + row.client_cpu_us;
    if layer_us <= 0.0 {
        return None;
    }
    Some(cpu_us / (store_us + layer_us) / limit.rps)
}

/// The relay's messages per second in 0.2 (one relay, the discarding sink; BENCHMARKS.md, "0.2:
/// the transactional outbox"): the summary's reference for the relay row.
pub(crate) const RELAY_0_2: f64 = 33_000.0;

/// The summary's rows that the HTTP binary does not measure: the outbox binary's relay row and
/// the consumer binary's PostgreSQL rows (`idempotent-bench summary` reads them from their
/// output files).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct OtherRows {
    /// Messages per second of `relay/discard` with one relay.
    pub(crate) relay: Option<f64>,
    /// Messages per second of the consumer rows `runtime-pg` and `bare-pg` on Redis Streams
    /// (each row's median round).
    pub(crate) consumer_pg: Option<f64>,
    pub(crate) bare_pg: Option<f64>,
}

/// The median of `rates` (the upper one of an even count), `None` for none.
pub(crate) fn median_rate(rates: impl Iterator<Item = f64>) -> Option<f64> {
    let mut rates: Vec<f64> = rates.collect();
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied()
}

impl OtherRows {
    /// Reads the outbox binary's output (one JSON object per line) and the consumer binary's
    /// `--out` file; a file that is missing or unreadable leaves its rows out.
    pub(crate) fn read(outbox: Option<&Path>, consumer: Option<&Path>) -> OtherRows {
        let mut rows = OtherRows::default();
        if let Some(text) = outbox.and_then(|path| std::fs::read_to_string(path).ok()) {
            // The median of the runs in the file (`scripts/bench.sh --quick` runs it three
            // times), as the consumer's rows below.
            rows.relay = median_rate(
                text.lines()
                    .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
                    .filter(|row| row["row"] == "relay/discard" && row["relays"] == 1)
                    .filter_map(|row| row["messages_per_sec"].as_f64()),
            );
        }
        let consumer = consumer
            .and_then(|path| std::fs::read(path).ok())
            .and_then(|bytes| serde_json::from_slice::<Vec<serde_json::Value>>(&bytes).ok())
            .unwrap_or_default();
        let median = |name: &str| {
            let row = consumer
                .iter()
                .find(|row| row["broker"] == "redis" && row["row"] == name)?;
            median_rate(
                row["runs"]
                    .as_array()?
                    .iter()
                    .filter_map(|run| run["rate"].as_f64()),
            )
        };
        rows.consumer_pg = median("runtime-pg");
        rows.bare_pg = median("bare-pg");
        rows
    }
}

/// One row of the HTTP benchmark (the median round of `rounds`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct HttpRecord {
    pub(crate) implementation: String,
    pub(crate) scenario: String,
    pub(crate) store: String,
    /// 2xx responses per second in the timed phase.
    pub(crate) rps: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    /// The handler ran exactly once per distinct key, in every round.
    pub(crate) correct: bool,
    /// Responses in the timed phase, and how many were not 2xx (or had no response at all).
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    /// Responses in the timed phase marked as replays.
    pub(crate) replayed: u64,
    /// CPU time per request of the server's threads and of the load generator's, in the timed
    /// phase (from `/proc/self/task/*/stat`, 10 ms resolution).
    pub(crate) server_cpu_us: f64,
    pub(crate) client_cpu_us: f64,
    /// Busy CPU time of the whole machine per request (server, load generator, Redis or
    /// PostgreSQL, kernel), and the share of the machine's CPU time that was busy, in the
    /// timed phase (from `/proc/stat`).
    #[serde(default)]
    pub(crate) machine_cpu_us: f64,
    #[serde(default)]
    pub(crate) machine_busy: f64,
    /// Records in the store before the row started (`scale.rs`); 0 for the usual rows.
    #[serde(default)]
    pub(crate) prefilled: u64,
    /// Timed-phase responses by status code.
    pub(crate) statuses: BTreeMap<String, u64>,
    /// Executions over the row (warm-up, timed phase, probes) of the median round.
    pub(crate) audit: Audit,
    /// Timed seconds per round, and the rps of every round.
    pub(crate) seconds: f64,
    pub(crate) rounds_rps: Vec<f64>,
    /// Rows with a cache tier (`store` is then `redis+memcache` and so on): the tier, its
    /// lookups in the median round's timed phase, and their hit rate,
    /// `hit / (hit + miss + error)`. Absent for the other rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cache: Option<Box<CacheRecord>>,
}

/// The cache tier of a row, in the median round's timed phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct CacheRecord {
    #[serde(flatten)]
    pub(crate) window: CacheWindow,
    /// `hit / (hit + miss + error)` of `lookups`; `None` without lookups.
    pub(crate) hit_rate: Option<f64>,
}

impl CacheRecord {
    fn of(window: &CacheWindow) -> Box<CacheRecord> {
        Box::new(CacheRecord {
            window: window.clone(),
            hit_rate: window
                .lookups
                .hit_rate()
                .map(|rate| (rate * 10_000.0).round() / 10_000.0),
        })
    }
}

/// Resident memory per record of a `MemoryStore` filled through `IdempotencyLayer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct MemoryRecord {
    pub(crate) implementation: String,
    pub(crate) store: String,
    pub(crate) records: u64,
    /// Bytes of each response body.
    pub(crate) body_bytes: u64,
    /// Bytes of each stored record payload (the encoded response).
    pub(crate) payload_bytes: u64,
    pub(crate) rss_before: u64,
    pub(crate) rss_after: u64,
    /// (rss_after - rss_before) / records.
    pub(crate) bytes_per_record: u64,
    /// What the store charges each record against its byte bound.
    pub(crate) charged_bytes_per_record: u64,
}

/// How a store was prefilled, and what it then held.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FillRecord {
    pub(crate) store: String,
    /// Prefilled records in the store after this fill.
    pub(crate) records: u64,
    /// Seconds this fill took (the records it added).
    pub(crate) fill_seconds: f64,
    /// PostgreSQL: the table with its indexes and TOAST (`pg_total_relation_size`); Redis:
    /// `used_memory` of `INFO memory`. Everything in the store, the rows' own records too.
    pub(crate) store_bytes: u64,
    /// PostgreSQL: the indexes alone (`pg_indexes_size`).
    pub(crate) index_bytes: Option<u64>,
    /// Rows of the table, or keys of the Redis database, counted after the fill.
    pub(crate) entries: u64,
}

/// The median round of one row, by rps, and the row's verdict over all its rounds.
pub(crate) fn summarize(row: Row, rounds: &[(Traffic, Audit)]) -> HttpRecord {
    assert!(!rounds.is_empty(), "a row has at least one round");
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|&a, &b| rounds[a].0.rps().total_cmp(&rounds[b].0.rps()));
    let (traffic, audit) = &rounds[order[order.len() / 2]];
    HttpRecord {
        implementation: row.implementation.name().to_owned(),
        scenario: row.scenario.name().to_owned(),
        store: row.store_name(),
        rps: round1(traffic.rps()),
        p50_us: traffic.latencies.quantile_us(0.50),
        p99_us: traffic.latencies.quantile_us(0.99),
        correct: rounds.iter().all(|(_, audit)| audit.exactly_once()),
        requests: traffic.requests(),
        errors: traffic.failures(),
        replayed: traffic.replayed,
        server_cpu_us: traffic.server_us_per_request(),
        client_cpu_us: traffic.client_us_per_request(),
        machine_cpu_us: round1(traffic.machine_us_per_request()),
        machine_busy: (traffic.machine_busy * 1000.0).round() / 1000.0,
        prefilled: row.prefilled,
        statuses: traffic
            .statuses
            .iter()
            .map(|(status, n)| (status.to_string(), *n))
            .collect(),
        audit: *audit,
        seconds: round1(traffic.elapsed.as_secs_f64()),
        rounds_rps: rounds.iter().map(|(t, _)| round1(t.rps())).collect(),
        cache: traffic.cache.as_ref().map(CacheRecord::of),
    }
}

/// Why a row's numbers cannot be trusted, if they cannot.
pub(crate) fn problems(record: &HttpRecord) -> Vec<String> {
    let mut problems = Vec::new();
    let label = format!(
        "{} {} {}",
        record.implementation, record.scenario, record.store
    );
    if record.requests == 0 {
        problems.push(format!("{label}: no responses in the timed phase"));
    }
    if record.errors > 0 {
        problems.push(format!(
            "{label}: {} of {} timed requests failed or were not 2xx ({:?})",
            record.errors, record.requests, record.statuses
        ));
    }
    // A replay row of an implementation that deduplicates must answer every timed request
    // from the store; otherwise it measured something else.
    if record.scenario == "replay" && record.correct && record.replayed != record.requests {
        problems.push(format!(
            "{label}: only {} of {} timed responses were replays",
            record.replayed, record.requests
        ));
    }
    problems
}

/// The HTTP rows as a markdown table; `vs bare` is each row's rps over the `bare` row's;
/// `cache hits` is the hit rate of a row's cache tier in the timed phase (`–` without one).
pub(crate) fn markdown_table(records: &[HttpRecord]) -> String {
    let bare = records
        .iter()
        .find(|r| r.implementation == "bare")
        .map(|r| r.rps);
    let mut out = String::from(
        "| implementation | scenario | store | rps | vs bare | p50 µs | p99 µs | correct | non-2xx | replayed | server CPU µs/req | cache hits |\n\
         |---|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|\n",
    );
    for r in records {
        let versus = match bare {
            Some(bare) if bare > 0.0 => format!("{:.0} %", 100.0 * r.rps / bare),
            _ => "–".to_owned(),
        };
        let replayed = if r.requests == 0 {
            "–".to_owned()
        } else {
            format!("{:.0} %", 100.0 * r.replayed as f64 / r.requests as f64)
        };
        let cache_hits = match r.cache.as_ref().and_then(|cache| cache.hit_rate) {
            Some(rate) => format!("{:.1} %", 100.0 * rate),
            None => "–".to_owned(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {cache_hits} |\n",
            r.implementation,
            r.scenario,
            r.store,
            thousands(r.rps.round() as u64),
            versus,
            thousands(r.p50_us),
            thousands(r.p99_us),
            if r.correct { "yes" } else { "**no**" },
            r.errors,
            replayed,
            r.server_cpu_us,
        ));
    }
    out
}

/// The memory measurements as a markdown table.
pub(crate) fn memory_table(records: &[MemoryRecord]) -> String {
    let mut out = String::from(
        "| store | records | body B | payload B | RSS growth | bytes/record | charged bytes/record |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in records {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} MiB | {} | {} |\n",
            r.store,
            thousands(r.records),
            r.body_bytes,
            r.payload_bytes,
            thousands(r.rss_after.saturating_sub(r.rss_before) >> 20),
            r.bytes_per_record,
            r.charged_bytes_per_record,
        ));
    }
    out
}

/// The prefilled rows as a markdown table, each beside the same row on a store without
/// prefilled records, and the sizes of the shared stores after each fill.
pub(crate) fn prefilled_table(records: &[HttpRecord], fills: &[FillRecord]) -> String {
    let mut out = String::from(
        "| scenario | store | records before | rps | rps, no records before | ratio | within 20 % | server CPU µs/req | p99 µs |\n\
         |---|---|---:|---:|---:|---:|:---:|---:|---:|\n",
    );
    for r in records.iter().filter(|r| r.prefilled > 0) {
        let empty = records.iter().find(|e| {
            e.prefilled == 0
                && e.implementation == r.implementation
                && e.scenario == r.scenario
                && e.store == r.store
        });
        let (base, ratio, within) = match empty {
            Some(e) if e.rps > 0.0 => {
                let ratio = r.rps / e.rps;
                (
                    thousands(e.rps.round() as u64),
                    format!("{:.0} %", 100.0 * ratio),
                    if ratio >= 0.8 { "yes" } else { "**no**" }.to_owned(),
                )
            }
            _ => ("–".to_owned(), "–".to_owned(), "–".to_owned()),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {base} | {ratio} | {within} | {:.1} | {} |\n",
            r.scenario,
            r.store,
            thousands(r.prefilled),
            thousands(r.rps.round() as u64),
            r.server_cpu_us,
            thousands(r.p99_us),
        ));
    }
    if !fills.is_empty() {
        out.push_str(
            "\n| store | prefilled records | fill s | entries | size MiB | of which indexes MiB | bytes per entry |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
        );
        for f in fills {
            let mib = |bytes: u64| format!("{:.0}", bytes as f64 / f64::from(1 << 20));
            out.push_str(&format!(
                "| {} | {} | {:.1} | {} | {} | {} | {} |\n",
                f.store,
                thousands(f.records),
                f.fill_seconds,
                thousands(f.entries),
                mib(f.store_bytes),
                f.index_bytes.map_or("–".to_owned(), mib),
                f.store_bytes
                    .checked_div(f.entries)
                    .map_or("–".to_owned(), thousands),
            ));
        }
    }
    out
}

/// The records of a JSON file `write_json` wrote; the error names the file.
pub(crate) fn read_json(path: &Path) -> Result<Vec<Record>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Writes `records` to `path`, keeping the objects of the other modes already there (so the
/// HTTP, memory and sessions modes can run separately and still share one file). The limit
/// rows and the prefill records belong to the HTTP mode.
pub(crate) fn write_json(path: &Path, records: Vec<Record>) -> std::io::Result<()> {
    let mut all = read_json(path).unwrap_or_default();
    let replaces_http = records.iter().any(|r| {
        matches!(
            r,
            Record::Http(_) | Record::Limit(_) | Record::Prefill(_) | Record::Pair(_)
        )
    });
    let replaces_memory = records.iter().any(|r| matches!(r, Record::Memory(_)));
    let replaces_sessions = records.iter().any(|r| matches!(r, Record::Sessions(_)));
    all.retain(|r| match r {
        Record::Http(_) | Record::Limit(_) | Record::Prefill(_) | Record::Pair(_) => !replaces_http,
        Record::Memory(_) => !replaces_memory,
        Record::Sessions(_) => !replaces_sessions,
    });
    all.extend(records);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut json = serde_json::to_vec_pretty(&all).map_err(std::io::Error::other)?;
    json.push(b'\n');
    std::fs::write(path, json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Lookups;
    use crate::fixture::Executions;
    use crate::rows::{Cache, Implementation, Scenario, StoreKind};

    fn row() -> Row {
        Row {
            implementation: Implementation::Tower,
            scenario: Scenario::Replay,
            store: StoreKind::Memory,
            cache: Cache::None,
            prefilled: 0,
        }
    }

    fn good_audit() -> Audit {
        Audit::of(&Executions {
            lanes: vec![vec![1]],
            probes: vec![1],
            unattributed: 0,
        })
    }

    #[test]
    fn summary_takes_the_median_round_and_all_verdicts() {
        let mut slow = Traffic::sample(100, 0, 1, 900);
        slow.replayed = 100;
        let mut median = Traffic::sample(200, 0, 1, 500);
        median.replayed = 200;
        let mut fast = Traffic::sample(300, 0, 1, 300);
        fast.replayed = 300;
        let bad = Audit {
            duplicated_keys: 1,
            ..good_audit()
        };
        let record = summarize(
            row(),
            &[(fast, good_audit()), (slow, bad), (median, good_audit())],
        );
        assert_eq!(record.rps, 200.0);
        assert_eq!(record.p50_us, 500);
        assert_eq!(record.rounds_rps, vec![300.0, 100.0, 200.0]);
        assert!(!record.correct, "one bad round makes the row incorrect");
        assert!(problems(&record).is_empty());
    }

    #[test]
    fn problems_flag_errors_and_rows_that_did_not_replay() {
        let record = summarize(row(), &[(Traffic::sample(10, 990, 1, 100), good_audit())]);
        assert_eq!(record.rps, 10.0, "409s are not throughput");
        let problems = problems(&record);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("990 of 1000"));
        assert!(problems[1].contains("0 of 1000"));
    }

    #[test]
    fn json_shape() {
        let mut t = Traffic::sample(2000, 0, 2, 250);
        t.replayed = 2000;
        let http = summarize(row(), &[(t, good_audit())]);
        let memory = MemoryRecord {
            implementation: "idempotent-tower".into(),
            store: "memory".into(),
            records: 100_000,
            body_bytes: 200,
            payload_bytes: 300,
            rss_before: 1 << 20,
            rss_after: 61 << 20,
            bytes_per_record: 629,
            charged_bytes_per_record: 428,
        };
        let json = serde_json::to_value(vec![Record::Http(http), Record::Memory(memory)]).unwrap();
        let http = &json[0];
        assert_eq!(http["mode"], "http");
        assert_eq!(http["implementation"], "idempotent-tower");
        assert_eq!(http["scenario"], "replay");
        assert_eq!(http["store"], "memory");
        assert_eq!(http["rps"], 1000.0);
        assert_eq!(http["p50_us"], 250);
        assert_eq!(http["p99_us"], 250);
        assert_eq!(http["correct"], true);
        assert_eq!(http["statuses"]["201"], 2000);
        assert!(http.get("cache").is_none(), "only rows with a cache tier");
        let memory = &json[1];
        assert_eq!(memory["mode"], "memory");
        assert_eq!(memory["records"], 100_000);
        assert_eq!(memory["bytes_per_record"], 629);
    }

    #[test]
    fn limit_rows_are_medians_in_the_json_and_fractions_in_the_table() {
        let limit = LimitRecord::summarize(
            ["pgbench", "replay", "memory"],
            16,
            3,
            &[(900.0, 0.5), (4000.0, 0.9), (2000.0, 0.75)],
        );
        assert_eq!(limit.rps, 2000.0);
        assert_eq!(limit.rounds_rps, [900.0, 4000.0, 2000.0]);
        assert_eq!(limit.machine_busy, 0.75, "the median round's");
        let json = serde_json::to_value(vec![Record::Limit(limit.clone())]).unwrap();
        assert_eq!(json[0]["mode"], "limit");
        assert_eq!(json[0]["implementation"], "pgbench");
        assert_eq!(json[0]["scenario"], "replay");
        assert_eq!(json[0]["store"], "memory");
        assert_eq!(json[0]["rps"], 2000.0);
        assert_eq!(json[0]["connections"], 16);
        // The layer's replay row does 1,000 rps: half of the limit.
        let http = summarize(row(), &[(Traffic::sample(1000, 0, 1, 250), good_audit())]);
        let table = limit_table(&[limit], &[http]);
        let last = table.lines().last().unwrap();
        assert!(
            last.starts_with("| pgbench | replay | memory | 2,000 | 75 % | 1,000 | 50 % |"),
            "{table}"
        );
    }

    /// The record of a row named by its parts whose rounds had `rates`.
    fn record(
        implementation: &str,
        scenario: &str,
        store: &str,
        prefilled: u64,
        rates: &[u64],
    ) -> HttpRecord {
        let rounds: Vec<_> = rates
            .iter()
            .map(|&rps| (Traffic::sample(rps, 0, 1, 1), good_audit()))
            .collect();
        let mut record = summarize(row(), &rounds);
        record.implementation = implementation.into();
        record.scenario = scenario.into();
        record.store = store.into();
        record.prefilled = prefilled;
        record
    }

    #[test]
    fn the_goals_table_divides_the_rows_it_names_and_leaves_out_the_rest() {
        let http = |implementation: &str, scenario: &str, store: &str, rps: u64, prefilled| {
            record(implementation, scenario, store, prefilled, &[rps])
        };
        let records = [
            http("bare", "none", "none", 1000, 0),
            http("idempotent-tower", "fresh", "memory", 800, 0),
            http("idempotent-tower", "session", "memory", 760, 0),
            http("idempotent-tower", "fresh", "memory", 720, 1_000_000),
            http("idempotent-tower", "fresh", "postgres", 300, 0),
        ];
        let pgbench =
            LimitRecord::summarize(["pgbench", "fresh", "postgres"], 16, 3, &[(400.0, 0.5)]);
        let table = goals_table(
            &records,
            std::slice::from_ref(&pgbench),
            &[],
            &OtherRows::default(),
        );
        assert!(
            table.contains("| memory fresh / bare | 0.80 | ≥ 0.85 | 0.80 | 0.80 | – | – |"),
            "{table}"
        );
        // With the floor's fresh rows, the memory fresh ratio gets floor / bare and the
        // PostgreSQL fresh ratio floor / pgbench; the floor's replay row is not there.
        let mut with_floor = records.to_vec();
        with_floor.push(http("floor", "fresh", "memory", 870, 0));
        with_floor.push(http("floor", "fresh", "postgres", 340, 0));
        let table = goals_table(&with_floor, &[pgbench], &[], &OtherRows::default());
        assert!(
            table.contains("| memory fresh / bare | 0.80 | ≥ 0.85 | 0.80 | 0.80 | 0.87 | – |"),
            "{table}"
        );
        assert!(
            table.contains(
                "| PostgreSQL fresh / `pgbench` fresh | 0.75 | ≥ 0.85 | 0.75 | 0.75 | 0.85 |"
            ),
            "{table}"
        );
        assert!(
            table.contains("| memory session / fresh | 0.95 | ≥ 0.95 | 0.95 | 0.95 | – | – |"),
            "{table}"
        );
        assert!(
            table.contains("| PostgreSQL fresh / `pgbench` fresh | 0.75 | ≥ 0.85 | 0.75 |"),
            "{table}"
        );
        assert!(
            table.contains(
                "| memory fresh, 1M records before / none | 0.90 | ≥ 0.9 | 0.90 | 0.90 | – | – |"
            ),
            "{table}"
        );
        // No replay rows, no Redis rows: those ratios are left out.
        assert!(!table.contains("replay"), "{table}");
        assert!(!table.contains("Redis"), "{table}");
        assert_eq!(table.lines().count(), 2 + 4, "{table}");
    }

    #[test]
    fn a_ratio_just_below_its_goal_does_not_read_as_meeting_it() {
        let records = |replay: u64, floor: u64| {
            [
                record("bare", "none", "none", 0, &[1000]),
                record("idempotent-tower", "replay", "memory", 0, &[replay]),
                record("floor", "replay", "memory", 0, &[floor]),
            ]
        };
        // 0.947 rounds to 0.95, its goal: three decimals; the floor, at the goal, meets it.
        let table = goals_table(&records(947, 950), &[], &[], &OtherRows::default());
        assert!(
            table.contains("| memory replay / bare | 0.947 | ≥ 0.95 | 0.947 | 0.947 | 0.95 | – |"),
            "{table}"
        );
        let table = goals_table(&records(950, 9496), &[], &[], &OtherRows::default());
        assert!(
            table.contains("| memory replay / bare | 0.95 | ≥ 0.95 | 0.95 | 0.95 | 9.50 | – |"),
            "{table}"
        );
        // Below the goal by less than a thousandth: as many decimals as it takes.
        assert_eq!(shown(0.94996, 0.95), "0.94996");
        assert_eq!(shown(0.9449, 0.95), "0.94");
        assert_eq!(shown(1.0, 0.95), "1.00");
    }

    #[test]
    fn a_ratio_measured_by_turns_is_this_runs_figure_and_by_rounds_stays_beside_it() {
        let records = [
            record("bare", "none", "none", 0, &[1000, 1100, 900]),
            record("idempotent-tower", "replay", "memory", 0, &[900, 1100, 800]),
            record("idempotent-tower", "fresh", "memory", 0, &[800, 800, 800]),
            record("idempotent-tower", "session", "memory", 0, &[790, 790, 790]),
            record("floor", "replay", "memory", 0, &[1000, 1000, 1000]),
            record("floor", "fresh", "memory", 0, &[880, 880, 880]),
        ];
        let turned = |(over, under): crate::pair::Pair, ratio: f64| PairRecord {
            over: over.into(),
            under: under.into(),
            turn_ms: 100.0,
            turns: 3,
            ratio,
            ratios: vec![ratio; 3],
            over_rps: 0.0,
            under_rps: 0.0,
            failures: 0,
            not_replayed: 0,
        };
        // By rounds: replay 0.90, 1.00, 0.89 (median 0.90, as of the medians: 900 / 1000); by
        // turns 0.96, the figure that decides; its floor by turns 0.99 (1.00 by rounds). A pair
        // of other rows (fresh over replay) is no ratio of the summary's.
        let pairs = [
            turned(crate::pair::MEMORY_REPLAY, 0.96),
            turned(crate::pair::FLOOR_REPLAY, 0.99),
            turned(
                (
                    "idempotent-tower/fresh/memory",
                    "idempotent-tower/replay/memory",
                ),
                0.5,
            ),
        ];
        let table = goals_table(&records, &[], &pairs, &OtherRows::default());
        assert!(
            table.contains("| memory replay / bare | 0.96 | ≥ 0.95 | 0.90 | 0.90 | 0.99 | – |"),
            "{table}"
        );
        // Not measured by turns: by rounds in both columns, the floor's too (0.88, 0.80, 0.98).
        assert!(
            table.contains("| memory fresh / bare | 0.80 | ≥ 0.85 | 0.80 | 0.80 | 0.88 | – |"),
            "{table}"
        );
        assert!(
            table.contains("| memory session / fresh | 0.99 | ≥ 0.95 | 0.99 | 0.99 | – | – |"),
            "{table}"
        );
    }

    #[test]
    fn a_ratio_is_paired_by_round_where_both_rows_ran_the_same_rounds() {
        // The machine is slow in round 3 for every row, and in round 2 as well for the session
        // row, the floor and the PostgreSQL row: their medians are slow rounds, bare's and
        // fresh's are not.
        let records = [
            record("bare", "none", "none", 0, &[1000, 1000, 600]),
            record("idempotent-tower", "fresh", "memory", 0, &[1000, 1000, 600]),
            record("idempotent-tower", "session", "memory", 0, &[950, 570, 570]),
            record("floor", "fresh", "memory", 0, &[870, 522, 522]),
            record("idempotent-tower", "fresh", "postgres", 0, &[300, 150, 150]),
            // The prefilled row's rounds are its own: never paired with the empty store's.
            record(
                "idempotent-tower",
                "fresh",
                "memory",
                1_000_000,
                &[500, 700, 560],
            ),
        ];
        let pgbench = LimitRecord::summarize(
            ["pgbench", "fresh", "postgres"],
            16,
            3,
            &[(400.0, 0.5), (400.0, 0.5), (200.0, 0.5)],
        );
        let table = goals_table(&records, &[pgbench], &[], &OtherRows::default());
        // Paired: the median of 1.00, 1.00, 1.00; of the medians 1000 / 1000.
        assert!(
            table.contains("| memory fresh / bare | 1.00 | ≥ 0.85 | 1.00 | 1.00 | 0.87 | – |"),
            "{table}"
        );
        // Paired: the median of 0.95, 0.57, 0.95; of the medians 570 / 1000.
        assert!(
            table.contains("| memory session / fresh | 0.95 | ≥ 0.95 | 0.95 | 0.57 | – | – |"),
            "{table}"
        );
        // Against the tool of the same rounds: 0.75, 0.375, 0.75; of the medians 150 / 400.
        assert!(
            table.contains(
                "| PostgreSQL fresh / `pgbench` fresh | 0.75 | ≥ 0.85 | 0.75 | 0.38 | – |"
            ),
            "{table}"
        );
        // Paired it would be 0.70 (0.50, 0.70, 0.93): the ratio of the medians, 560 / 1000.
        assert!(
            table.contains(
                "| memory fresh, 1M records before / none | 0.56 | ≥ 0.9 | 0.56 | 0.56 | – | – |"
            ),
            "{table}"
        );
    }

    #[test]
    fn pairing_needs_the_same_rounds_on_both_sides() {
        assert_eq!(paired(&[3.0, 1.0, 2.0], &[1.0, 1.0, 1.0]), Some(2.0));
        assert_eq!(
            paired(&[2.0, 4.0], &[1.0, 1.0]),
            Some(4.0),
            "the upper one of two"
        );
        assert_eq!(
            paired(&[1.0, 2.0], &[1.0, 2.0, 3.0]),
            None,
            "a row that stopped"
        );
        assert_eq!(paired(&[], &[]), None);
        assert_eq!(paired(&[1.0], &[0.0]), None);
    }

    #[test]
    fn the_ceiling_is_the_rate_the_machine_allows_over_the_limit_rows() {
        let mut row = summarize(row(), &[(Traffic::sample(4_000, 0, 1, 1), good_audit())]);
        row.server_cpu_us = 130.0;
        row.client_cpu_us = 40.0;
        // pgbench: 6,250 operations a second with two CPUs 100 % busy, so 320 µs of machine
        // per operation; with the layer's 170 µs, the row can reach 2 s / 490 µs = 4,082 a
        // second: 0.65 of the limit.
        let limit =
            LimitRecord::summarize(["pgbench", "fresh", "postgres"], 16, 3, &[(6_250.0, 1.0)]);
        let ceiling = ceiling(&row, &limit, 2).unwrap();
        assert!((ceiling - 0.653).abs() < 0.001, "{ceiling}");
        // Half as busy: the store's part is half, the ceiling higher.
        let limit =
            LimitRecord::summarize(["pgbench", "fresh", "postgres"], 16, 3, &[(6_250.0, 0.5)]);
        assert!(super::ceiling(&row, &limit, 2).unwrap() > ceiling);
        // The CPUs unknown (a row written before they were kept): no ceiling.
        assert_eq!(super::ceiling(&row, &limit, 0), None);
        // Nothing measured: no ceiling.
        let limit = LimitRecord::summarize(["pgbench", "fresh", "postgres"], 16, 3, &[(0.0, 1.0)]);
        assert_eq!(super::ceiling(&row, &limit, 2), None);
        row.server_cpu_us = 0.0;
        row.client_cpu_us = 0.0;
        let limit =
            LimitRecord::summarize(["pgbench", "fresh", "postgres"], 16, 3, &[(6_250.0, 1.0)]);
        assert_eq!(super::ceiling(&row, &limit, 2), None);
    }

    #[test]
    fn the_summary_reads_the_relay_and_consumer_rows_from_their_files() {
        let dir =
            std::env::temp_dir().join(format!("idempotent-bench-others-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let outbox = dir.join("outbox.json");
        std::fs::write(
            &outbox,
            "{\"row\":\"relay/discard\",\"relays\":2,\"messages_per_sec\":40000.0}\n\
             not json\n\
             {\"row\":\"relay/discard\",\"relays\":1,\"messages_per_sec\":24100.0}\n\
             {\"row\":\"relay/discard\",\"relays\":1,\"messages_per_sec\":31000.0}\n\
             {\"row\":\"relay/discard\",\"relays\":1,\"messages_per_sec\":29700.0}\n",
        )
        .unwrap();
        let consumer = dir.join("consumer.json");
        std::fs::write(
            &consumer,
            r#"[{"broker":"nats","row":"bare-pg","runs":[{"rate":1.0}]},
                {"broker":"redis","row":"bare-pg","runs":[{"rate":9000.0},{"rate":8000.0},{"rate":10000.0}]},
                {"broker":"redis","row":"runtime-pg","runs":[{"rate":6300.0}]}]"#,
        )
        .unwrap();
        let others = OtherRows::read(Some(&outbox), Some(&consumer));
        assert_eq!(
            others,
            OtherRows {
                relay: Some(29_700.0),
                consumer_pg: Some(6_300.0),
                bare_pg: Some(9_000.0),
            }
        );
        let table = goals_table(&[], &[], &[], &others);
        assert!(
            table.contains(
                "| relay, discarding sink, 1 relay / 0.2's 33k messages/s | 0.90 | ≥ 0.8 | 0.90 | 0.90 | – |"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "| consumer with the PostgreSQL effect / bare-pg loop (Redis Streams) | 0.70 | ≥ 0.75 | 0.70 | 0.70 | – |"
            ),
            "{table}"
        );
        // Missing files leave the rows out.
        let none = OtherRows::read(Some(&dir.join("missing")), None);
        assert_eq!(none, OtherRows::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn json_file_keeps_the_other_mode() {
        let dir =
            std::env::temp_dir().join(format!("idempotent-bench-test-{}", std::process::id()));
        let path = dir.join("http.json");
        let http = summarize(row(), &[(Traffic::sample(1, 0, 1, 1), good_audit())]);
        let memory = MemoryRecord {
            implementation: "idempotent-tower".into(),
            store: "memory".into(),
            records: 1,
            body_bytes: 200,
            payload_bytes: 1,
            rss_before: 0,
            rss_after: 0,
            bytes_per_record: 0,
            charged_bytes_per_record: 0,
        };
        write_json(&path, vec![Record::Memory(memory.clone())]).unwrap();
        write_json(&path, vec![Record::Http(http.clone())]).unwrap();
        write_json(&path, vec![Record::Http(http.clone())]).unwrap();
        let all: Vec<Record> = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(all, vec![Record::Memory(memory), Record::Http(http)]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn table_marks_incorrect_rows() {
        let bare = HttpRecord {
            implementation: "bare".into(),
            scenario: "none".into(),
            store: "none".into(),
            correct: false,
            ..summarize(
                row(),
                &[(Traffic::sample(40_000, 0, 1, 1500), good_audit())],
            )
        };
        let ours = summarize(
            row(),
            &[(Traffic::sample(38_000, 0, 1, 1600), good_audit())],
        );
        let table = markdown_table(&[bare, ours]);
        assert!(table.contains("| bare | none | none | 40,000 | 100 % | 1,500 |"));
        assert!(table.contains("| **no** |"));
        assert!(table.contains("| idempotent-tower | replay | memory | 38,000 | 95 % |"));
    }

    #[test]
    fn cached_rows_report_their_hit_rate() {
        let cached = Row {
            store: StoreKind::Postgres,
            cache: Cache::Memory,
            ..row()
        };
        let mut t = Traffic::sample(2000, 0, 2, 250);
        t.replayed = 2000;
        t.cache = Some(CacheWindow {
            tier: "memory".into(),
            capacity: Some(272),
            entries: Some(256),
            lookups: Lookups {
                hit: 1998,
                miss: 1,
                error: 1,
            },
        });
        let record = summarize(cached, &[(t, good_audit())]);
        assert_eq!(record.store, "postgres+memcache");
        assert!(problems(&record).is_empty());
        let json = serde_json::to_value(vec![Record::Http(record.clone())]).unwrap();
        let cache = &json[0]["cache"];
        assert_eq!(cache["tier"], "memory");
        assert_eq!(cache["capacity"], 272);
        assert_eq!(cache["entries"], 256);
        assert_eq!(cache["lookups"]["hit"], 1998);
        assert_eq!(cache["lookups"]["miss"], 1);
        assert_eq!(cache["lookups"]["error"], 1);
        assert_eq!(cache["hit_rate"], 0.999);
        let back: Vec<Record> = serde_json::from_value(json).unwrap();
        assert_eq!(back, vec![Record::Http(record.clone())]);

        let plain = summarize(row(), &[(Traffic::sample(1000, 0, 1, 250), good_audit())]);
        let table = markdown_table(&[plain, record]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].ends_with("| cache hits |"), "{table}");
        assert!(lines[2].ends_with("| – |"), "{table}");
        assert!(
            lines[3].starts_with("| idempotent-tower | replay | postgres+memcache | 1,000 |")
                && lines[3].ends_with("| 99.9 % |"),
            "{table}"
        );
    }
}
