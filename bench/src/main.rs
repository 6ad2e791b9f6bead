//! The HTTP benchmark of `idempotent-tower` against a bare handler and the peer crates, and the
//! memory footprint of the memory store. Run it with `scripts/bench.sh [--quick]`; the results
//! and how to read them are in `BENCHMARKS.md`.
//!
//! - **Server**: one trivial axum handler (`POST /payments`: a small JSON body in, `201` with a
//!   small JSON body out) that counts its executions per idempotency key. Each row puts one
//!   middleware in front of it and serves it on a loopback port, on a tokio runtime of its own
//!   (2 worker threads by default).
//! - **Load**: one generator for every row: hyper HTTP/1.1 client connections with keep-alive
//!   (64 by default), each sending its next request when the previous response is read, for a
//!   warm-up and then a timed phase. `rps` counts 2xx responses only; `p50_us`/`p99_us` are
//!   their latencies. The generator runs in the same process, on its own runtime, and shares
//!   the machine's cores with the server.
//! - **Scenarios**: `fresh` sends a new key with every request; `replay` has each connection
//!   cycle over its own few keys, created before the warm-up; `bare` (scenario `none`) sends
//!   the same requests as `fresh` to a server without idempotency.
//! - **Exactly once**: after the timed phase, each round sends probe keys as concurrent
//!   duplicates (the handler holds a probe key for 25 ms so that they overlap) and then once
//!   more as a retry. `correct` says that the handler ran exactly once per distinct key over the
//!   whole row; without deduplication (`bare`) or with a race, it is `false`.
//! - **Checks**: a row whose timed phase had a non-2xx response or a connection error, or a
//!   `replay` row whose responses were not all marked as replays, is reported and makes the
//!   program exit with status 1.
//! - **Floor**: `floor/{fresh,replay}/{memory,redis,postgres}` put the least a layer can do and
//!   answer each key once in front of the handler (`floor.rs`: a sharded map of keys in memory,
//!   or the store's own claim and completion; the response kept): what a layer that does nothing
//!   else reaches on this machine, over bare and over the limit rows, in the same rounds.
//! - **Limits**: with PostgreSQL, the rows `pgbench/fresh/postgres` and
//!   `pgbench/replay/postgres` run the PostgreSQL store's own claim and completion statements
//!   under `pgbench -M prepared`; with Redis, `redis-benchmark/{fresh,replay}/redis` run the
//!   Redis store's own scripts with `EVALSHA` on random keys; in the same rounds as the layer's
//!   rows. The table shows each `idempotent-tower` row on a shared store as a fraction of its
//!   limit (see `limit.rs`).
//! - **Cache tiers**: the `idempotent-tower` rows again with a cache tier in front of the
//!   store (`Cached::new(store, tier)`): the in-process tier in front of Redis and of
//!   PostgreSQL (`redis+memcache`, `postgres+memcache`), sized to hold every key a row
//!   replays (connections x replay keys, plus the probe keys), and Redis in front of
//!   PostgreSQL (`postgres+rediscache`, on the Redis rows' server under a key prefix of its
//!   own). Each reports the tier's hit rate: `hit / (hit + miss + error)` of its lookups in the
//!   timed phase (`cache.rs`).
//! - **Client sessions**: the rows `idempotent-tower/session/{memory,redis,postgres}` send
//!   `Idempotency-Session` instead of a key: each connection is a session of its own, whose
//!   requests are numbered 1, 2, 3, … and acknowledge the answer before (`ack = seq − 1`); the
//!   probe is a session of its own too, each probe request acknowledging the one before.
//! - **Memory**: resident bytes per record of a `MemoryStore` filled through
//!   `IdempotencyLayer` with 200-byte responses, from `/proc/self/statm`, one child process
//!   per record count.
//! - **Sessions**: the bytes each store holds for N requests in one client session against N
//!   requests with a key each, in process (`sessions.rs`).
//! - **Steps**: what a step of an operation costs (one checkpoint written) on each store, and
//!   what resuming an operation from its checkpoints costs against a plain retry, in process
//!   (`steps.rs`; not part of `all`).
//!
//! The peer crates (`idempotent` 2.0, `axum-idempotent` 0.6) are compiled in only with
//! `RUSTFLAGS="--cfg idempotent_bench_peers"` and `cargo --ignore-rust-version` (`idempotent`
//! 2.0 declares rust-version 1.98); without them their rows are skipped.

mod app;
mod background;
mod cache;
mod cli;
mod fixture;
mod floor;
mod limit;
mod load;
mod measure;
mod memory;
mod pair;
#[cfg(idempotent_bench_peers)]
mod peers;
mod report;
mod rows;
mod scale;
mod sessions;
mod steps;

use std::process::ExitCode;

use cli::{Mode, Options};
use idempotent_bench::machine;
use measure::{Audit, Traffic};
use report::{HttpRecord, LimitRecord, Record};
use rows::{Implementation, Row, StoreKind};

fn main() -> ExitCode {
    let options = match cli::parse(std::env::args().skip(1), |name| std::env::var(name).ok()) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("idempotent-bench: {message}");
            return ExitCode::from(2);
        }
    };
    let result = match options.mode {
        Mode::Help => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Mode::MemoryChild { records } => {
            return match memory::child(records) {
                Ok(record) => {
                    println!("{}", serde_json::to_string(&record).expect("serializable"));
                    ExitCode::SUCCESS
                }
                Err(message) => {
                    eprintln!("idempotent-bench memory-child: {message}");
                    ExitCode::FAILURE
                }
            };
        }
        Mode::Http => http(&options),
        Mode::Memory => memory_mode(&options),
        Mode::Sessions => sessions_mode(&options),
        Mode::Steps => steps_mode(&options),
        Mode::Summary {
            ref outbox,
            ref consumer,
        } => summary(&options, outbox, consumer),
        Mode::All => http(&options).and_then(|http_ok| {
            let memory_ok = memory_mode(&options)?;
            Ok(sessions_mode(&options)? && memory_ok && http_ok)
        }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("idempotent-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Prints the summary's ratios from the files of one `scripts/bench.sh --quick` run: the HTTP
/// rows' JSON (`--out`), the outbox binary's output and the consumer binary's `--out` file.
fn summary(
    options: &Options,
    outbox: &Option<std::path::PathBuf>,
    consumer: &Option<std::path::PathBuf>,
) -> Result<bool, String> {
    let all = report::read_json(&options.out)?;
    let (mut records, mut limits, mut pairs) = (Vec::new(), Vec::new(), Vec::new());
    for record in all {
        match record {
            Record::Http(record) => records.push(record),
            Record::Limit(limit) => limits.push(limit),
            Record::Pair(pair) => pairs.push(pair),
            _ => {}
        }
    }
    let others = report::OtherRows::read(outbox.as_deref(), consumer.as_deref());
    println!(
        "The summary's ratios (BENCHMARKS.md), this run:\n\n{}",
        report::goals_table(&records, &limits, &pairs, &others)
    );
    Ok(true)
}

/// Runs the HTTP rows, prints the table, writes the JSON; `Ok(false)` when a row is not to be
/// trusted.
fn http(options: &Options) -> Result<bool, String> {
    let backends = &options.backends;
    let rows: Vec<Row> = rows::all_rows(
        backends.redis_url.is_some(),
        backends.postgres_url.is_some(),
    )
    .into_iter()
    .filter(|row| row.selected_by(&options.only))
    .collect();
    let (rows, skipped): (Vec<Row>, Vec<Row>) = rows
        .into_iter()
        .partition(|row| row.implementation.is_compiled_in());
    for row in &skipped {
        eprintln!(
            "skipping {}: the peer crates are not compiled in (build with RUSTFLAGS=\"--cfg \
             idempotent_bench_peers\" and --ignore-rust-version, as scripts/bench.sh does)",
            row.label()
        );
    }
    let limit_rows: Vec<limit::LimitRow> = limit::rows(
        backends.redis_url.is_some(),
        backends.postgres_url.is_some(),
    )
    .into_iter()
    .filter(|row| row.selected_by(&options.only))
    .collect();
    let prefilled_rows: Vec<Vec<Row>> = options
        .prefill
        .iter()
        .map(|&records| {
            rows::prefilled_rows(
                records,
                backends.redis_url.is_some(),
                backends.postgres_url.is_some(),
            )
            .into_iter()
            .filter(|row| row.selected_by(&options.only))
            .collect()
        })
        .collect();
    if rows.is_empty() && limit_rows.is_empty() && prefilled_rows.iter().all(Vec::is_empty) {
        return Err("no rows selected".into());
    }
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.client_threads)
        .thread_name(load::CLIENT_THREAD)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the client runtime: {e}"))?;

    let limits = limit::Limits::prepare(&limit_rows, backends, &client)?;
    // Redis's automatic rewrite of its append-only file off for the run, the file rewritten
    // between rows instead (`background.rs`).
    // Without it (Redis unreachable now), the rows run as before: the Redis rows fail on
    // their own if Redis stays so.
    let quiet = backends.redis_url.as_ref().and_then(|url| {
        client
            .block_on(background::RedisQuiet::start(url))
            .inspect_err(|message| {
                eprintln!("Redis's rewrites not kept out of the rows: {message}")
            })
            .ok()
    });
    let between = Between {
        quiet: quiet.as_ref(),
        client: &client,
    };

    // Round-major order: a slow minute of the machine spreads over all rows.
    let mut results: Vec<Vec<(Traffic, Audit)>> = vec![Vec::new(); rows.len()];
    let mut limit_results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); limit_rows.len()];
    let mut failed = Vec::new();
    let mut failed_limits = Vec::new();
    for round in 1..=options.rounds {
        run_round(&rows, &mut results, &mut failed, round, options, &between);
        for (row, rounds) in limit_rows.iter().zip(&mut limit_results) {
            if failed_limits.iter().any(|(r, _)| r == row) {
                continue;
            }
            between.settle();
            let before = machine::Reading::now();
            match limits.run(*row, options) {
                Ok(rate) => {
                    let busy = match (before, machine::Reading::now()) {
                        (Some(before), Some(after)) => after.utilization_since(before),
                        _ => 0.0,
                    };
                    eprintln!(
                        "round {round}/{}: {:<40} {rate:>9.0} ops/s  machine busy {:>3.0} %",
                        options.rounds,
                        row.label(),
                        100.0 * busy
                    );
                    rounds.push((rate, busy));
                }
                Err(message) => {
                    eprintln!("{}: {message}", row.label());
                    failed_limits.push((*row, message));
                }
            }
        }
    }

    // The summary's ratios of two HTTP rows again, by turns (`pair.rs`), before the prefilled
    // rows fill the shared stores. A pair whose row failed in the rounds is left out.
    let mut pairs = Vec::new();
    let mut failed_pairs = Vec::new();
    if options.turns > 0 {
        let turns = load::Turns {
            slice: options.turn,
            warmup: pair::WARMUP_TURNS,
            timed: options.turns,
        };
        for (over, under) in pair::selected(&rows) {
            if failed.iter().any(|(r, _)| *r == over || *r == under) {
                continue;
            }
            between.settle();
            match pair::run((over, under), turns, options, &client) {
                Ok(record) => {
                    eprintln!(
                        "by turns: {} / {}: {:.3} (median of {} pairs of {} ms turns; \
                         {:.0} and {:.0} rps in their turns)",
                        record.over,
                        record.under,
                        record.ratio,
                        record.ratios.len(),
                        record.turn_ms,
                        record.over_rps,
                        record.under_rps,
                    );
                    pairs.push(record);
                }
                Err(message) => {
                    let name = format!("{} / {} by turns", over.label(), under.label());
                    eprintln!("{name}: {message}");
                    failed_pairs.push((name, message));
                }
            }
        }
    }

    // The prefilled rows, after the others: the shared stores keep their prefilled records
    // from one count to the next, and the other rows are measured without them.
    let mut shared = scale::Shared::new(backends);
    let mut fills = Vec::new();
    let mut prefilled_results: Vec<(Row, Vec<(Traffic, Audit)>)> = Vec::new();
    for (&records, rows) in options.prefill.iter().zip(prefilled_rows) {
        let mut rows = rows;
        for store in [StoreKind::Redis, StoreKind::Postgres] {
            if !rows.iter().any(|row| row.store == store) {
                continue;
            }
            let filled = client.block_on(async {
                match store {
                    StoreKind::Redis => shared.redis(records).await,
                    _ => shared.postgres(records).await,
                }
            });
            match filled {
                Ok(fill) => {
                    eprintln!(
                        "prefill: {} holds {} prefilled records ({:.1} s to add them), {} \
                         entries, {} bytes",
                        fill.store, fill.records, fill.fill_seconds, fill.entries, fill.store_bytes
                    );
                    fills.push(fill);
                }
                Err(message) => {
                    eprintln!("prefill {}: {message}", store.name());
                    for row in rows.iter().filter(|row| row.store == store) {
                        failed.push((*row, message.clone()));
                    }
                    rows.retain(|row| row.store != store);
                }
            }
        }
        let mut results: Vec<Vec<(Traffic, Audit)>> = vec![Vec::new(); rows.len()];
        for round in 1..=options.rounds {
            run_round(&rows, &mut results, &mut failed, round, options, &between);
        }
        prefilled_results.extend(rows.into_iter().zip(results));
    }
    if let Some(quiet) = quiet
        && let Err(message) = client.block_on(quiet.finish())
    {
        eprintln!("Redis's automatic rewrite of its append-only file not restored: {message}");
    }

    let records: Vec<HttpRecord> = rows
        .iter()
        .zip(&results)
        .chain(prefilled_results.iter().map(|(row, rounds)| (row, rounds)))
        .filter(|(_, rounds)| !rounds.is_empty())
        .map(|(row, rounds)| report::summarize(*row, rounds))
        .collect();
    let limit_records: Vec<LimitRecord> = limit_rows
        .iter()
        .zip(&limit_results)
        .filter(|(_, rounds)| !rounds.is_empty())
        .map(|(row, rounds)| {
            LimitRecord::summarize(
                row.parts(),
                limit::CONNECTIONS,
                limit::seconds(options.measure),
                rounds,
            )
        })
        .collect();
    let (usual, prefilled): (Vec<HttpRecord>, Vec<HttpRecord>) =
        records.iter().cloned().partition(|r| r.prefilled == 0);
    println!("{}", report::markdown_table(&usual));
    if !limit_records.is_empty() {
        println!("{}", report::limit_table(&limit_records, &records));
    }
    if !prefilled.is_empty() {
        println!("{}", report::prefilled_table(&records, &fills));
    }
    println!(
        "The summary's ratios (BENCHMARKS.md):\n\n{}",
        report::goals_table(
            &records,
            &limit_records,
            &pairs,
            &report::OtherRows::default()
        )
    );
    if !skipped.is_empty() {
        println!(
            "Not run: {} (peer crates not compiled in).\n",
            skipped
                .iter()
                .map(Row::label)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    report::write_json(
        &options.out,
        records
            .iter()
            .cloned()
            .map(Record::Http)
            .chain(limit_records.into_iter().map(Record::Limit))
            .chain(fills.into_iter().map(Record::Prefill))
            .chain(pairs.iter().cloned().map(Record::Pair))
            .collect(),
    )
    .map_err(|e| format!("cannot write {}: {e}", options.out.display()))?;
    eprintln!("wrote {}", options.out.display());

    let problems: Vec<String> = records
        .iter()
        .flat_map(report::problems)
        .chain(pairs.iter().flat_map(pair::PairRecord::problems))
        .collect();
    for problem in &problems {
        eprintln!("PROBLEM: {problem}");
    }
    for (row, message) in &failed {
        eprintln!("FAILED: {}: {message}", row.label());
    }
    for (row, message) in &failed_limits {
        eprintln!("FAILED: {}: {message}", row.label());
    }
    for (name, message) in &failed_pairs {
        eprintln!("FAILED: {name}: {message}");
    }
    Ok(problems.is_empty()
        && failed.is_empty()
        && failed_limits.is_empty()
        && failed_pairs.is_empty())
}

/// What is done between two rows: Redis's background work settled (see `background.rs`).
struct Between<'a> {
    quiet: Option<&'a background::RedisQuiet>,
    client: &'a tokio::runtime::Runtime,
}

impl Between<'_> {
    /// Settles Redis before a row. A failure is told, not the row's: a Redis row fails on its
    /// own if Redis is gone, and the other rows do not need it.
    fn settle(&self) {
        if let Some(quiet) = self.quiet
            && let Err(message) = self.client.block_on(quiet.settle())
        {
            eprintln!("Redis not settled before the next row: {message}");
        }
    }
}

/// Round `round` of every row of `rows` that has not failed: its outcome goes to `results`
/// (one list per row), or the row to `failed`.
fn run_round(
    rows: &[Row],
    results: &mut [Vec<(Traffic, Audit)>],
    failed: &mut Vec<(Row, String)>,
    round: usize,
    options: &Options,
    between: &Between<'_>,
) {
    for (row, rounds) in rows.iter().zip(results) {
        if failed.iter().any(|(r, _)| r == row) {
            continue;
        }
        between.settle();
        match run_logged(*row, round, options, between.client) {
            Ok(outcome) => rounds.push(outcome),
            Err(message) => failed.push((*row, message)),
        }
    }
}

/// [`run_row`], with a line on standard error for the round.
fn run_logged(
    row: Row,
    round: usize,
    options: &Options,
    client: &tokio::runtime::Runtime,
) -> Result<(Traffic, Audit), String> {
    match run_row(row, options, client) {
        Ok((traffic, audit)) => {
            let cache = match &traffic.cache {
                Some(cache) => format!(
                    "  cache {}: {} hits {} misses {} errors{}",
                    cache.tier,
                    cache.lookups.hit,
                    cache.lookups.miss,
                    cache.lookups.error,
                    cache
                        .entries
                        .map(|n| format!(", {n} entries"))
                        .unwrap_or_default(),
                ),
                None => String::new(),
            };
            eprintln!(
                "round {round}/{}: {:<44} {:>9.0} rps  p50 {:>6} µs  p99 {:>6} µs  \
                 server {:>5.1} µs/req  client {:>5.1} µs/req  machine {:>5.1} µs/req \
                 ({:>3.0} % busy)  executions {} keys {} duplicated {}{cache}",
                options.rounds,
                row.label(),
                traffic.rps(),
                traffic.latencies.quantile_us(0.5),
                traffic.latencies.quantile_us(0.99),
                traffic.server_us_per_request(),
                traffic.client_us_per_request(),
                traffic.machine_us_per_request(),
                100.0 * traffic.machine_busy,
                audit.executions,
                audit.distinct_keys,
                audit.duplicated_keys,
            );
            Ok((traffic, audit))
        }
        Err(message) => {
            eprintln!("{}: {message}", row.label());
            Err(message)
        }
    }
}

/// One round of one row: start its server, drive it, probe it, audit it, stop it.
fn run_row(
    row: Row,
    options: &Options,
    client: &tokio::runtime::Runtime,
) -> Result<(Traffic, Audit), String> {
    let server = start_server(row, options)?;
    let plan = plan(row, &server, options);
    let outcome = client.block_on(async {
        let traffic = load::run(&plan).await?;
        load::probe(
            server.addr,
            plan.session,
            row.scenario,
            options.probe_keys,
            options.probe_duplicates,
        )
        .await?;
        Ok::<_, String>(traffic)
    });
    let audit = Audit::of(&server.tally.executions());
    server.stop();
    Ok((outcome?, audit))
}

/// `row`'s server, as `options` size it.
fn start_server(row: Row, options: &Options) -> Result<app::Server, String> {
    let cache_entries =
        cache::memory_entries(options.connections, options.replay_keys, options.probe_keys);
    app::Server::start(
        row,
        options.connections,
        options.server_threads,
        &options.backends,
        cache_entries,
    )
}

/// The load of `row` on `server`, as `options` say.
fn plan(row: Row, server: &app::Server, options: &Options) -> load::Plan {
    load::Plan {
        addr: server.addr,
        connections: options.connections,
        warmup: options.warmup,
        measure: options.measure,
        scenario: row.scenario,
        replay_keys: options.replay_keys,
        session: row.implementation == Implementation::AxumIdempotent,
        cache: server.cache.clone(),
    }
}

fn memory_mode(options: &Options) -> Result<bool, String> {
    let records = memory::run(&options.records)?;
    println!("{}", report::memory_table(&records));
    report::write_json(
        &options.out,
        records.into_iter().map(Record::Memory).collect(),
    )
    .map_err(|e| format!("cannot write {}: {e}", options.out.display()))?;
    eprintln!("wrote {}", options.out.display());
    Ok(true)
}

fn sessions_mode(options: &Options) -> Result<bool, String> {
    let records = sessions::run(options)?;
    println!("{}", sessions::table(&records));
    report::write_json(
        &options.out,
        records.into_iter().map(Record::Sessions).collect(),
    )
    .map_err(|e| format!("cannot write {}: {e}", options.out.display()))?;
    eprintln!("wrote {}", options.out.display());
    Ok(true)
}

fn steps_mode(options: &Options) -> Result<bool, String> {
    let records = steps::run(options)?;
    println!("{}", steps::table(&records));
    steps::write_json(&options.out, &records)
        .map_err(|e| format!("cannot write {}: {e}", options.out.display()))?;
    eprintln!("wrote {}", options.out.display());
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rows::{Cache, Scenario, StoreKind};

    /// One short round of two rows through the real server and load generator: our layer
    /// replays and runs each key once; the bare handler runs the probe's duplicates.
    #[test]
    fn a_short_round_audits_both_ways() {
        let args = [
            "http",
            "--warmup",
            "0",
            "--duration",
            "0.2",
            "--connections",
            "4",
        ];
        let mut options = cli::parse(args.map(String::from), |_| None).unwrap();
        options.probe_keys = 2;
        options.probe_duplicates = 3;
        let client = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();

        let replay = Row {
            implementation: Implementation::Tower,
            scenario: Scenario::Replay,
            store: StoreKind::Memory,
            cache: Cache::None,
            prefilled: 0,
        };
        let (traffic, audit) = run_row(replay, &options, &client).unwrap();
        assert!(traffic.cache.is_none());
        assert!(traffic.successes() > 0);
        assert_eq!(traffic.failures(), 0);
        assert_eq!(
            traffic.replayed,
            traffic.successes(),
            "every timed request replays"
        );
        // 4 connections x 4 replay keys, plus the probe keys, once each.
        assert_eq!(audit.distinct_keys, 16 + 2);
        assert!(audit.exactly_once(), "{audit:?}");

        let bare = Row {
            implementation: Implementation::Bare,
            scenario: Scenario::None,
            store: StoreKind::None,
            cache: Cache::None,
            prefilled: 0,
        };
        let (traffic, audit) = run_row(bare, &options, &client).unwrap();
        assert_eq!(traffic.replayed, 0);
        assert_eq!(
            audit.duplicated_keys, 2,
            "each probe key ran once per duplicate"
        );
        assert_eq!(audit.executions - audit.distinct_keys, 2 * 3);
        assert!(!audit.exactly_once());
    }

    /// Two rows by turns through their real servers: each row's connections send only in its
    /// turns, every timed pair of turns gives a ratio, and the replay row's answers are all
    /// replays.
    #[test]
    fn two_rows_take_turns_through_their_servers() {
        let args = [
            "http",
            "--connections",
            "4",
            "--turns",
            "6",
            "--turn-ms",
            "20",
        ];
        let options = cli::parse(args.map(String::from), |_| None).unwrap();
        let client = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let rows: Vec<Row> = rows::all_rows(false, false)
            .into_iter()
            .filter(|row| {
                row.selected_by(&[
                    "=bare/none/none".into(),
                    "=idempotent-tower/replay/memory".into(),
                ])
            })
            .collect();
        let [(over, under)] = pair::selected(&rows)[..] else {
            panic!("one pair of these rows: {rows:?}");
        };
        let turns = load::Turns {
            slice: options.turn,
            warmup: 1,
            timed: options.turns,
        };
        let record = pair::run((over, under), turns, &options, &client).unwrap();
        assert_eq!(
            (record.over.as_str(), record.under.as_str()),
            pair::MEMORY_REPLAY
        );
        assert_eq!(record.ratios.len(), 6, "{record:?}");
        assert!(record.ratio > 0.0 && record.over_rps > 0.0 && record.under_rps > 0.0);
        assert!(record.problems().is_empty(), "{:?}", record.problems());
    }

    /// A session row: each connection's session numbers its requests and acknowledges each
    /// answer; every request runs once, none replays, and the probe's session runs each of its
    /// requests once although they come as concurrent duplicates.
    #[test]
    fn a_session_row_runs_each_request_once() {
        let args = [
            "http",
            "--warmup",
            "0.1",
            "--duration",
            "0.2",
            "--connections",
            "4",
        ];
        let mut options = cli::parse(args.map(String::from), |_| None).unwrap();
        options.probe_keys = 3;
        options.probe_duplicates = 3;
        let client = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let row = Row {
            implementation: Implementation::Tower,
            scenario: Scenario::Session,
            store: StoreKind::Memory,
            cache: Cache::None,
            prefilled: 0,
        };
        let (traffic, audit) = run_row(row, &options, &client).unwrap();
        assert!(traffic.successes() > 0);
        assert_eq!(traffic.failures(), 0, "{:?}", traffic.statuses);
        assert_eq!(traffic.replayed, 0);
        assert!(audit.exactly_once(), "{audit:?}");
        assert_eq!(audit.probe_keys, 3);
        assert_eq!(audit.executions, audit.distinct_keys);
    }

    /// The in-process tier in front of a store (the memory store here, to need no server):
    /// fresh requests only miss; after the first replay of each key, replays hit; the tier
    /// ends up holding each connection's replay keys.
    #[test]
    fn a_cached_row_counts_its_tier() {
        let args = [
            "http",
            "--warmup",
            "0.1",
            "--duration",
            "0.2",
            "--connections",
            "4",
        ];
        let mut options = cli::parse(args.map(String::from), |_| None).unwrap();
        options.probe_keys = 2;
        options.probe_duplicates = 3;
        let client = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let row = |scenario| Row {
            implementation: Implementation::Tower,
            scenario,
            store: StoreKind::Memory,
            cache: Cache::Memory,
            prefilled: 0,
        };

        let (traffic, audit) = run_row(row(Scenario::Replay), &options, &client).unwrap();
        assert_eq!(traffic.failures(), 0);
        assert_eq!(traffic.replayed, traffic.successes());
        assert!(audit.exactly_once(), "{audit:?}");
        let cache = traffic.cache.expect("the row's tier");
        assert_eq!(cache.tier, "memory");
        assert_eq!(cache.capacity, Some(4 * 4 + 2));
        assert_eq!(cache.entries, Some(4 * 4), "each connection's replay keys");
        assert_eq!(cache.lookups.error, 0);
        assert!(cache.lookups.hit > 0, "{cache:?}");
        assert!(
            cache.lookups.miss <= 4 * 4,
            "at most the first replay of each key misses: {cache:?}"
        );

        let (traffic, audit) = run_row(row(Scenario::Fresh), &options, &client).unwrap();
        assert_eq!(traffic.failures(), 0);
        assert!(audit.exactly_once(), "{audit:?}");
        let cache = traffic.cache.expect("the row's tier");
        assert_eq!(cache.lookups.hit, 0, "a new key is never in the tier");
        assert!(cache.lookups.miss > 0, "{cache:?}");
        assert_eq!(
            cache.entries,
            Some(0),
            "claims and completions do not fill it"
        );
    }
}
