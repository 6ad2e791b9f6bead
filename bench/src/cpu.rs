//! CPU time from `/proc/*/stat`: of this process's threads by name (the HTTP server's and the
//! load generator's cost per request, which other load on the machine does not change the way
//! it changes throughput), of this process as a whole, and of every process (the brokers' and
//! databases' servers, with their children and process groups).

use std::collections::BTreeMap;
use std::time::Duration;

/// Clock ticks per second of `utime`/`stime` and `/proc/stat` (`USER_HZ`, 100 on Linux).
pub const TICKS_PER_SECOND: u64 = 100;

/// `ticks` clock ticks as a duration.
pub fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
}

/// User plus system time of every thread of this process named `name`, by thread id.
pub fn threads_cpu(name: &str) -> Threads {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Threads::default();
    };
    Threads(
        tasks
            .flatten()
            .filter_map(|task| {
                let tid = task.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
                let stat = Stat::parse(&stat)?;
                (stat.comm == name).then_some((tid, stat.ticks))
            })
            .collect(),
    )
}

/// CPU ticks of some threads, by thread id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Threads(BTreeMap<u32, u64>);

impl Threads {
    /// CPU time spent since `earlier` by the threads alive now. A thread that ended in between
    /// (a runtime's idle blocking thread) takes its time with it, and would otherwise make the
    /// sum go down.
    pub fn since(&self, earlier: &Threads) -> Duration {
        let ticks: u64 = self
            .0
            .iter()
            .map(|(tid, ticks)| ticks.saturating_sub(earlier.0.get(tid).copied().unwrap_or(0)))
            .sum();
        ticks_to_duration(ticks)
    }
}

/// User plus system ticks of this process (its threads, ended ones too); 0 where
/// `/proc/self/stat` cannot be read.
pub fn process_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| Stat::parse(&stat))
        .map_or(0, |stat| stat.ticks)
}

/// Every process on the machine, by process id.
pub fn processes() -> Vec<(u32, Stat)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            Some((pid, Stat::parse(&stat)?))
        })
        .collect()
}

/// What the benchmarks read of a process's or thread's `stat` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// The process or thread name.
    pub comm: String,
    /// The parent process.
    pub ppid: u32,
    /// The process group.
    pub pgrp: u32,
    /// `utime + stime`, in clock ticks.
    pub ticks: u64,
}

impl Stat {
    /// Parses a `stat` line. The name is in parentheses and may itself contain spaces and
    /// parentheses, so the fields are counted after the last `)`.
    pub fn parse(stat: &str) -> Option<Stat> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let comm = stat.get(open + 1..close)?.to_owned();
        let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
        let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
        Some(Stat {
            comm,
            ppid: u32::try_from(number(1)?).ok()?,
            pgrp: u32::try_from(number(2)?).ok()?,
            ticks: number(11)? + number(12)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines() {
        let stat = "4242 (bench-server) S 1 4242 4242 0 -1 4194368 120 0 0 0 250 31 0 0 20 0 3 0";
        let parsed = Stat::parse(stat).unwrap();
        assert_eq!((parsed.comm.as_str(), parsed.ticks), ("bench-server", 281));
        assert_eq!((parsed.ppid, parsed.pgrp), (1, 4242));
        let odd = "7 (a) b (c)) R 1 7 7 0 -1 0 0 0 0 0 5 6 0 0";
        let parsed = Stat::parse(odd).unwrap();
        assert_eq!((parsed.comm.as_str(), parsed.ticks), ("a) b (c)", 11));
        assert_eq!(Stat::parse("7 (x) R 1"), None);
    }

    #[test]
    fn threads_that_end_do_not_count_against_the_others() {
        let before = Threads([(1, 100), (2, 500)].into());
        let after = Threads([(1, 150), (3, 20)].into());
        assert_eq!(after.since(&before), Duration::from_millis(700));
    }

    #[test]
    fn this_thread_is_counted() {
        let name = std::thread::current()
            .name()
            .map(|n| n.chars().take(15).collect::<String>());
        // Spin until the thread has a tick of its own: on a busy machine 30 ms of wall time
        // may hold less than one tick of this thread's CPU, so spin on (for at most 10 s).
        let start = std::time::Instant::now();
        let mut x = 0u64;
        let counted = || {
            name.as_ref()
                .is_none_or(|name| threads_cpu(name).since(&Threads::default()) > Duration::ZERO)
        };
        while start.elapsed() < Duration::from_millis(30)
            || (!counted() && start.elapsed() < Duration::from_secs(10))
        {
            for _ in 0..10_000 {
                x = x.wrapping_add(std::hint::black_box(1));
            }
        }
        assert!(x > 0);
        assert!(
            counted(),
            "no CPU tick counted for this thread in 10 s of spinning"
        );
        assert!(process_ticks() > 0);
        let me = std::process::id();
        assert!(processes().iter().any(|(pid, _)| *pid == me));
    }
}
