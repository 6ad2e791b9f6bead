//! Busy CPU time of the whole machine, from the first line of `/proc/stat`: what a row costs
//! everything running on the two vCPUs together (the server, the load generator or limit tool,
//! the brokers, Redis or PostgreSQL, the kernel's network work), so that a row that cannot go
//! faster because the machine is full shows it.

use std::time::Duration;

use crate::cpu::ticks_to_duration;

/// A reading of the machine's CPU counters, in clock ticks; all zero by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reading {
    busy: u64,
    total: u64,
}

impl Reading {
    /// Now; `None` where `/proc/stat` cannot be read.
    pub fn now() -> Option<Reading> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// Busy CPU time since `earlier`, summed over every CPU.
    pub fn busy_since(self, earlier: Reading) -> Duration {
        ticks_to_duration(self.busy.saturating_sub(earlier.busy))
    }

    /// The share of all CPUs' time that was busy since `earlier`, from 0 to 1.
    pub fn utilization_since(self, earlier: Reading) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.busy.saturating_sub(earlier.busy) as f64 / total as f64
    }
}

/// The machine's CPUs, as `/proc/stat` counts them (its `cpuN` lines): the CPUs whose time
/// [`Reading::utilization_since`] shares out. `None` where `/proc/stat` cannot be read.
pub fn cpus() -> Option<usize> {
    count_cpus(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn count_cpus(stat: &str) -> Option<usize> {
    let n = stat
        .lines()
        .filter(|line| {
            line.strip_prefix("cpu")
                .and_then(|rest| rest.split(' ').next())
                .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    (n > 0).then_some(n)
}

/// Busy and total ticks of the `cpu` line: everything but `idle` and `iowait` is busy;
/// `guest` and `guest_nice` are already counted in `user` and `nice`, so they are left out.
fn parse(stat: &str) -> Option<Reading> {
    let line = stat.lines().next()?;
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let values: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if values.len() < 5 {
        return None;
    }
    let total: u64 = values.iter().sum();
    let idle = values[3] + values[4];
    Some(Reading {
        busy: total - idle,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_are_the_numbered_cpu_lines() {
        let stat = "cpu  10 0 5 100 0 0 0 0 0 0\ncpu0 5 0 2 50 0 0 0 0 0 0\ncpu1 5 0 3 50 0 0 0 0 0 0\nintr 1 2\ncpufreq x\n";
        assert_eq!(count_cpus(stat), Some(2));
        assert_eq!(count_cpus("intr 1\n"), None);
    }

    #[test]
    fn stat_lines() {
        let stat = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 50 2 25 400 20 1 1 0 0 0\n";
        let reading = parse(stat).unwrap();
        assert_eq!(
            reading,
            Reading {
                busy: 160,
                total: 1000
            }
        );
        assert_eq!(parse("cpu0 1 2 3 4 5\n"), None);
        assert_eq!(parse("cpu  1 2 x 4 5\n"), None);
        assert_eq!(parse("cpu  1 2 3\n"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn differences() {
        let before = Reading {
            busy: 100,
            total: 400,
        };
        let after = Reading {
            busy: 250,
            total: 600,
        };
        assert_eq!(after.busy_since(before), Duration::from_millis(1500));
        assert!((after.utilization_since(before) - 0.75).abs() < 1e-9);
        assert_eq!(before.utilization_since(before), 0.0);
    }

    #[test]
    fn this_machine_has_counters() {
        let reading = Reading::now().expect("/proc/stat");
        assert!(reading.total >= reading.busy);
    }
}
