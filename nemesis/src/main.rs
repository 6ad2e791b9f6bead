//! `nemesis`: the whole system under random faults, a checker over what it recorded, and a
//! timeline. See `RELIABILITY.md`.
//!
//! ```text
//! nemesis run --store redis|postgres|redis-cluster|sqlite [--seed N] [--duration SECS] [--max-ops N]
//!             [--concurrent N] [--out DIR] [--bin-dir DIR]
//! nemesis check DIR
//! ```
//!
//! Exit status: 0 no anomaly, 1 anomalies (listed), 2 bad arguments, 3 the run could not be
//! carried out (a server missing, no root for network namespaces...).

mod check;
mod faults;
mod history;
mod notify;
mod proxy;
mod run;
mod svg;
mod system;
mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use run::{Options, StoreKind};

const USAGE: &str =
    "usage: nemesis run --store redis|postgres|redis-cluster|sqlite [--seed N] [--duration SECS] \
[--max-ops N] [--concurrent N] [--out DIR] [--bin-dir DIR]
       nemesis check DIR";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check") if args.len() == 2 => {
            let dir = PathBuf::from(&args[1]);
            match history::load(&dir.join("history.jsonl")) {
                Ok(events) => verdict(&events, &dir, None),
                Err(error) => {
                    eprintln!("nemesis: {error}");
                    ExitCode::from(3)
                }
            }
        }
        Some("run") => match options(&args[1..]) {
            Ok(options) => run_and_check(&options),
            Err(error) => {
                eprintln!("nemesis: {error}\n{USAGE}");
                ExitCode::from(2)
            }
        },
        Some("--help" | "-h") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn options(args: &[String]) -> Result<Options, String> {
    let mut store = None;
    let mut seed = None;
    let mut duration = Duration::from_secs(120);
    let mut max_ops = u64::MAX;
    let mut concurrent = 1;
    let mut out = None;
    let mut bin_dir = None;
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        let number = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--store" => {
                store = Some(match value()?.as_str() {
                    "redis" => StoreKind::Redis,
                    "postgres" => StoreKind::Postgres,
                    "redis-cluster" => StoreKind::RedisCluster,
                    "sqlite" => StoreKind::Sqlite,
                    other => {
                        return Err(format!(
                            "--store {other:?}: redis, postgres, redis-cluster or sqlite"
                        ));
                    }
                })
            }
            "--seed" => seed = Some(number(value()?)?),
            "--duration" => {
                let secs = number(value()?)?;
                if !(1..=86_400).contains(&secs) {
                    return Err(format!("--duration {secs}: 1 to 86400 seconds"));
                }
                duration = Duration::from_secs(secs);
            }
            "--max-ops" => max_ops = number(value()?)?,
            "--concurrent" => {
                concurrent = usize::try_from(number(value()?)?).unwrap_or(usize::MAX);
                if !(1..=4).contains(&concurrent) {
                    return Err(format!("--concurrent {concurrent}: 1 to 4 faults at once"));
                }
            }
            "--out" => out = Some(PathBuf::from(value()?)),
            "--bin-dir" => bin_dir = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let store = store.ok_or("--store is required")?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs())
    });
    let out = out.unwrap_or_else(|| {
        PathBuf::from("target/nemesis").join(format!("{}-{seed}", store.name()))
    });
    Ok(Options {
        store,
        seed,
        duration,
        max_ops,
        concurrent,
        out,
        bin_dir,
    })
}

fn run_and_check(options: &Options) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("nemesis: no runtime: {error}");
            return ExitCode::from(3);
        }
    };
    // The files of an earlier run are replaced; a directory holding anything else is refused.
    if let Err(error) = clear_earlier_run(&options.out) {
        eprintln!("nemesis: --out {}: {error}", options.out.display());
        return ExitCode::from(2);
    }
    // The run in a task of its own: a panic in it (the test kit's fixtures panic when a server
    // will not start) is an infrastructure failure, and SIGINT or SIGTERM stops it. Either
    // way the runtime drops every task, and with them the servers, the processes (killed) and
    // the network namespaces (deleted).
    let task_options = options.clone();
    let outcome = runtime.block_on(async move {
        let run = tokio::spawn(async move { run::run(&task_options).await });
        let abort = run.abort_handle();
        tokio::select! {
            joined = run => Some(joined),
            () = stop_signal() => {
                abort.abort();
                None
            }
        }
    });
    match outcome {
        Some(Ok(Ok(events))) => verdict(&events, &options.out, Some(options.seed)),
        Some(Ok(Err(error))) => {
            eprintln!("nemesis: the run could not be carried out: {error}");
            ExitCode::from(3)
        }
        Some(Err(error)) => {
            eprintln!("nemesis: the run failed: {error}");
            ExitCode::from(3)
        }
        None => {
            eprintln!("nemesis: stopped by a signal; its servers and namespaces are removed");
            ExitCode::from(3)
        }
    }
}

/// Removes what an earlier run wrote into `dir` (its history, report, timeline, effects log,
/// SQLite store and process logs), if that is all `dir` holds; an error, touching nothing,
/// if it holds anything else.
fn clear_earlier_run(dir: &std::path::Path) -> Result<(), String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = [
            "history.jsonl",
            "report.txt",
            "timeline.svg",
            "store.sqlite",
            "store.sqlite-wal",
            "store.sqlite-shm",
        ]
        .contains(&name.as_str())
            || name.ends_with(".log");
        if !ours || !entry.file_type().is_ok_and(|t| t.is_file()) {
            return Err(format!(
                "holds {name:?}, which no run writes; choose an empty or new directory"
            ));
        }
        files.push(entry.path());
    }
    for file in files {
        std::fs::remove_file(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    }
    Ok(())
}

/// SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let terminate = async {
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// Checks `events`, prints the report, writes it and the timeline into `dir`; the exit
/// status: 0 without anomaly, 1 with.
fn verdict(events: &[history::Event], dir: &std::path::Path, seed: Option<u64>) -> ExitCode {
    let report = check::check(events);
    print!("{report}");
    let title = events
        .iter()
        .find_map(|e| match e {
            history::Event::Run { store, seed, .. } => Some(format!("{store}, seed {seed}")),
            _ => None,
        })
        .unwrap_or_default();
    let picture = dir.join("timeline.svg");
    for (path, text) in [
        (dir.join("report.txt"), report.to_string()),
        (picture.clone(), svg::timeline(events, &report, &title)),
    ] {
        if let Err(error) = std::fs::write(&path, text) {
            eprintln!("nemesis: {}: {error}", path.display());
        }
    }
    println!(
        "history: {}; timeline: {}",
        dir.join("history.jsonl").display(),
        picture.display()
    );
    if let Some(seed) = seed {
        println!("the same schedule again: --seed {seed}");
    }
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
