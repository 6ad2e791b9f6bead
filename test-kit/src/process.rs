//! Processes of a test's own: bounded waits, signals by pid, processes frozen with `SIGSTOP`
//! until continued, programs found on `PATH`, scratch directories and servers' logs printed
//! when a test fails.

use std::future::Future;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Child;

use crate::names::unique;

/// `future`, or a test failure naming `what` if it takes longer than `limit`.
pub async fn within<F: Future>(what: &str, limit: Duration, future: F) -> F::Output {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

/// Sends process `pid` the signal `name` (`TERM`, `KILL`, `STOP`, `CONT`, …) with `kill`;
/// whether it was delivered.
pub fn signal(pid: u32, name: &str) -> bool {
    std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// `SIGKILL` to every process of process group `pgid`.
pub fn kill_group(pgid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// The pids of `parent`'s children.
pub fn children(parent: u32) -> Vec<u32> {
    let output = std::process::Command::new("pgrep")
        .args(["-P", &parent.to_string()])
        .output()
        .expect("pgrep (procps)");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// Kills `child` and reaps it, bounded, without a runtime (for `Drop`: the runtime that would
/// reap it may be gone by the time it exits).
pub fn kill_and_reap(child: &mut Child) {
    let _ = child.start_kill();
    for _ in 0..500 {
        if !matches!(child.try_wait(), Ok(None)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Processes stopped with `SIGSTOP`. Continued by [`thaw`](Frozen::thaw), or when dropped (a
/// failing test), so that no other guard waits on a frozen process.
#[derive(Default)]
pub struct Frozen {
    pids: Vec<u32>,
}

impl Frozen {
    /// Nothing frozen yet.
    pub fn new() -> Frozen {
        Frozen::default()
    }

    /// Stops `pid`, asserting the signal was delivered.
    pub fn stop(&mut self, pid: u32) {
        assert!(signal(pid, "STOP"), "kill -STOP {pid}");
        self.pids.push(pid);
    }

    /// How many processes are stopped.
    pub fn len(&self) -> usize {
        self.pids.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.pids.is_empty()
    }

    /// Continues every process, the last stopped first.
    pub fn thaw(mut self) {
        for pid in std::mem::take(&mut self.pids).into_iter().rev() {
            assert!(signal(pid, "CONT"), "kill -CONT {pid}");
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &pid in self.pids.iter().rev() {
            signal(pid, "CONT");
        }
    }
}

fn executable(path: &Path) -> bool {
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `name` on `PATH`, or in `/usr/sbin` (where Debian installs servers; often not on a user's
/// `PATH`).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| executable(candidate))
}

/// Whether every one of `programs` is an executable file in `dir`.
pub fn has_programs(dir: &Path, programs: &[&str]) -> bool {
    programs
        .iter()
        .all(|program| executable(&dir.join(program)))
}

/// A new empty directory of a server's own, named after `name`; its owner removes it when
/// dropped.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(&format!("idempotent-{name}")));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The end of `path` (a server's log), at most `max` bytes of it.
pub fn tail(path: &Path, max: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&text[text.len().saturating_sub(max)..]).into_owned()
}

/// Prints the end of each log in `paths` when the test is failing (called from a `Drop`).
pub fn print_logs_on_panic(label: &str, paths: &[PathBuf]) {
    if std::thread::panicking() {
        for path in paths {
            eprintln!(
                "----- {label}: {} -----\n{}\n----- end of {label}: {} -----",
                path.display(),
                tail(path, 64 * 1024),
                path.display()
            );
        }
    }
}

/// Polls `check` until it holds, every 10 ms; a test failure naming `what` once `limit` has
/// passed.
pub async fn eventually<F: Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
