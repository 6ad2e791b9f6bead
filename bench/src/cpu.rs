//! CPU time of this process's threads by name, from `/proc/self/task/*/stat`: the server's and
//! the load generator's cost per request, which other load on the machine does not change the
//! way it changes throughput.

use std::collections::BTreeMap;
use std::time::Duration;

/// Clock ticks per second of `utime`/`stime` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: u64 = 100;

/// User plus system time of every thread of this process named `name`, by thread id.
pub(crate) fn threads_cpu(name: &str) -> Threads {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Threads::default();
    };
    Threads(
        tasks
            .flatten()
            .filter_map(|task| {
                let tid = task.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
                let (comm, ticks) = parse_stat(&stat)?;
                (comm == name).then_some((tid, ticks))
            })
            .collect(),
    )
}

/// CPU ticks of some threads, by thread id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Threads(BTreeMap<u32, u64>);

impl Threads {
    /// CPU time spent since `earlier` by the threads alive now. A thread that ended in between
    /// (a runtime's idle blocking thread) takes its time with it, and would otherwise make the
    /// sum go down.
    pub(crate) fn since(&self, earlier: &Threads) -> Duration {
        let ticks: u64 = self
            .0
            .iter()
            .map(|(tid, ticks)| ticks.saturating_sub(earlier.0.get(tid).copied().unwrap_or(0)))
            .sum();
        Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
    }
}

/// The thread name and `utime + stime` of a `stat` line. The name is in parentheses and may
/// itself contain spaces and parentheses, so the fields are counted after the last `)`.
fn parse_stat(stat: &str) -> Option<(String, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let mut fields = stat.get(close + 1..)?.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((comm, utime + stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines() {
        let stat = "4242 (bench-server) S 1 4242 4242 0 -1 4194368 120 0 0 0 250 31 0 0 20 0 3 0";
        assert_eq!(parse_stat(stat), Some(("bench-server".into(), 281)));
        let odd = "7 (a) b (c)) R 1 7 7 0 -1 0 0 0 0 0 5 6 0 0";
        assert_eq!(parse_stat(odd), Some(("a) b (c)".into(), 11)));
        assert_eq!(parse_stat("7 (x) R 1"), None);
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
        // Spin a little so that the thread has at least one tick.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        if let Some(name) = name {
            assert!(threads_cpu(&name).since(&Threads::default()) > Duration::ZERO);
        }
    }
}
