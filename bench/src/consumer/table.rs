//! The consumer benchmark's markdown table.

use std::collections::BTreeMap;

use super::progress::{Measured, POSTGRES_SERVICE};
use super::rows::{Broker, Mode};
use crate::table::{rounded_thousands, thousands};

/// The rows as a markdown table, each row's median round, the runtime rows beside the bare
/// loop of the same shape.
pub(crate) fn print_table(results: &BTreeMap<(Broker, Mode), Vec<Measured>>) {
    println!();
    println!(
        "| broker | row | messages | msgs/s | vs | msgs/s 10–90 % | p50 µs | p99 µs | max µs | end-to-end p50 / p99 / max µs | CPU µs/msg: consumer | broker | PostgreSQL | machine | machine busy | context switches/msg | correct |"
    );
    println!(
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"
    );
    let median = |runs: &[Measured]| -> Measured {
        let mut sorted = runs.to_vec();
        sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        sorted[sorted.len() / 2].clone()
    };
    for ((broker, mode), runs) in results {
        let m = median(runs);
        // The runtime against the bare loop of the same shape: 16 tasks, one ack each.
        let reference = match mode {
            Mode::Runtime | Mode::RuntimeDup => Some(Mode::BareTasks),
            Mode::RuntimePg | Mode::RuntimePgDup => Some(Mode::BarePg),
            _ => None,
        };
        let versus = reference
            .and_then(|r| Some((r, median(results.get(&(*broker, r))?))))
            .map_or(String::from("–"), |(r, b)| {
                format!("{:.0} % of {}", 100.0 * m.rate / b.rate, r.name())
            });
        let end_to_end = m
            .end_to_end_us
            .map_or(String::from("–"), |(p50, p99, max)| {
                format!(
                    "{} / {} / {}",
                    thousands(p50),
                    thousands(p99),
                    thousands(max)
                )
            });
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {:.0} % | {:.2} | {} |",
            broker.name(),
            mode.name(),
            m.messages,
            rounded_thousands(m.rate),
            versus,
            rounded_thousands(m.rate_10_90),
            thousands(m.p50_us),
            thousands(m.p99_us),
            thousands(m.max_us),
            end_to_end,
            m.process_cpu_us,
            m.services_cpu_us.map_or(String::from("–"), |cpu| format!(
                "{:.1}",
                cpu[*broker as usize]
            )),
            m.services_cpu_us.map_or(String::from("–"), |cpu| format!(
                "{:.1}",
                cpu[POSTGRES_SERVICE]
            )),
            m.machine_cpu_us,
            100.0 * m.machine_busy,
            m.switches_per_message,
            if m.correct { "yes" } else { "**no**" },
        );
        if let Some((calls, messages)) = m.receives {
            println!(
                "|   | (receive calls: {calls}, {:.2} messages each) | | | | | | | | | | | | | | | |",
                messages as f64 / calls.max(1) as f64
            );
        }
    }
}
