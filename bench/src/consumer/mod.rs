//! The consumer benchmark that `src/bin/consumer.rs` runs (its header says what each row
//! measures): the options and rows, the postings, each broker's runtime source and bare loop,
//! one row's run, what it measures, and the table.

mod bare;
mod broker;
mod latency;
mod options;
mod parts;
mod postgres;
mod postings;
mod progress;
mod row;
mod rows;
mod runtime;
mod table;

use std::collections::BTreeMap;

use self::options::Options;
use self::postgres::Postgres;
use self::progress::Measured;
use self::rows::{Broker, Mode};

/// Runs what the command line asks: `--help`, `--parts`, or every selected row for
/// `--rounds` rounds, printing one JSON object per row and then the table. Exits the process
/// with status 2 on a bad argument and 1 when a row was not exactly once. To be awaited on the
/// main thread of a multi-thread runtime of two workers (the runtime's tasks then run on
/// those, the consumer loops on the main thread).
pub async fn run() {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("consumer bench: {message}");
            std::process::exit(2);
        }
    };
    if options.parts {
        // On a worker thread, where the runtime's tasks run (the main thread is no worker).
        tokio::spawn(parts::parts()).await.unwrap();
        return;
    }
    metrics::set_global_recorder(latency::DurationRecorder).expect("no other recorder");
    if let Some(list) = &options.services
        && let Err(message) = progress::watch_services(list)
    {
        eprintln!("consumer bench: {message}");
        std::process::exit(2);
    }
    let postgres = match &options.postgres {
        Some(url) => Some(Postgres::connect(url, options.concurrency).await),
        None => None,
    };
    let mut results: BTreeMap<(Broker, Mode), Vec<Measured>> = BTreeMap::new();
    for round in 0..options.rounds {
        for broker in Broker::ALL {
            for mode in Mode::ALL {
                if !options.selects(broker, mode) {
                    continue;
                }
                eprintln!(
                    "==> round {}/{}: {} {}",
                    round + 1,
                    options.rounds,
                    broker.name(),
                    mode.name()
                );
                let Some(measured) =
                    row::row(broker, mode, round, &options, postgres.as_ref()).await
                else {
                    continue;
                };
                let json = serde_json::json!({
                    "broker": broker.name(),
                    "row": mode.name(),
                    "round": round + 1,
                    "concurrency": options.concurrency(mode),
                    "batch": options.batch(mode),
                    "paced": options.paced,
                    "result": measured,
                });
                println!("{json}");
                results.entry((broker, mode)).or_default().push(measured);
            }
        }
    }
    table::print_table(&results);
    if let Some(path) = &options.out {
        let rows: Vec<_> = results
            .iter()
            .map(|((broker, mode), runs)| {
                serde_json::json!({"broker": broker.name(), "row": mode.name(), "runs": runs})
            })
            .collect();
        std::fs::write(path, serde_json::to_vec_pretty(&rows).unwrap()).unwrap();
    }
    if results.values().flatten().any(|m| !m.correct) {
        eprintln!("consumer bench: some rows were not exactly once (see `correct`)");
        std::process::exit(1);
    }
}
