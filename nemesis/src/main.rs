//! `nemesis`: the whole system under random faults, a checker over what it recorded, and a
//! timeline. See `RELIABILITY.md`.

mod check;
mod history;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check") if args.len() == 2 => {
            let dir = PathBuf::from(&args[1]);
            match history::load(&dir.join("history.jsonl")) {
                Ok(events) => {
                    let report = check::check(&events);
                    print!("{report}");
                    if report.ok() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
                Err(error) => {
                    eprintln!("nemesis: {error}");
                    ExitCode::from(3)
                }
            }
        }
        _ => {
            eprintln!("usage: nemesis check DIR");
            ExitCode::from(2)
        }
    }
}
