//! What a row measures as it runs: its progress (the times it passed 10 %, 90 % and 100 % of
//! its messages, retries and dead letters) and the CPU time it cost this process, each server
//! (`--services`) and the machine, summed up in [`Measured`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use idempotent_consumer::Outcome;
use tokio::sync::Notify;

use super::latency::{END_TO_END, LATENCY};
use crate::cpu::{self, ticks_to_duration};
use crate::machine;

/// The servers whose CPU time is read (`--services`): the process with that id, its children
/// (PostgreSQL's backends) and the members of its process group (RabbitMQ's Erlang VM), by
/// service: Redis, NATS, RabbitMQ, Kafka (the brokers in `Broker`'s order, so that a broker's
/// discriminant is its index), PostgreSQL.
static SERVICES: OnceLock<[Option<u32>; SERVICE_COUNT]> = OnceLock::new();
const SERVICE_COUNT: usize = 5;
const SERVICE_NAMES: [&str; SERVICE_COUNT] = ["redis", "nats", "rabbitmq", "kafka", "postgres"];
/// PostgreSQL's index among the services.
pub(crate) const POSTGRES_SERVICE: usize = 4;

/// Reads the CPU time of the servers in `list` (`redis=PID,nats=PID,rabbitmq=PGID,kafka=PID,
/// postgres=PID`) from now on.
pub(crate) fn watch_services(list: &str) -> Result<(), String> {
    let mut roots = [None; SERVICE_COUNT];
    for item in list.split(',').filter(|i| !i.is_empty()) {
        let parsed = item.split_once('=').and_then(|(name, pid)| {
            let i = SERVICE_NAMES.iter().position(|n| *n == name)?;
            Some((i, pid.trim().parse().ok()?))
        });
        match parsed {
            Some((i, pid)) => roots[i] = Some(pid),
            None => return Err(format!("--services: cannot read {item:?}")),
        }
    }
    let _ = SERVICES.set(roots);
    Ok(())
}

/// CPU counters: this process's user + system ticks, the machine's busy and total ticks.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    process: u64,
    machine: machine::Reading,
    /// The servers' ticks, in the order of [`SERVICES`].
    services: [u64; SERVICE_COUNT],
    /// Context switches of this process's threads (voluntary and not).
    switches: u64,
}

impl Cpu {
    fn now() -> Cpu {
        let process = cpu::process_ticks();
        let machine = machine::Reading::now().unwrap_or_default();
        let mut services = [0; SERVICE_COUNT];
        if let Some(roots) = SERVICES.get() {
            for (pid, stat) in cpu::processes() {
                for (i, root) in roots.iter().enumerate() {
                    if root.is_some_and(|r| r == pid || r == stat.ppid || r == stat.pgrp) {
                        services[i] += stat.ticks;
                    }
                }
            }
        }
        Cpu {
            process,
            machine,
            services,
            switches: context_switches(),
        }
    }
}

/// Context switches of this process's live threads, from `/proc/self/task/*/status`.
fn context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|line| line.contains("ctxt_switches:"))
                .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// A row's progress: messages finished (acknowledged, or duplicates acknowledged), the times
/// it passed 10 %, 90 % and 100 %, and the CPU counters at the end.
pub(crate) struct Progress {
    total: u64,
    start: Instant,
    cpu_start: Cpu,
    done: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    marks: Mutex<[Option<Instant>; 3]>,
    cpu_end: Mutex<Option<Cpu>>,
    finished: Notify,
}

impl Progress {
    /// Starts counting a row of `total` messages, now.
    pub(crate) fn start(total: usize) -> Arc<Progress> {
        Arc::new(Progress {
            total: total as u64,
            cpu_start: Cpu::now(),
            start: Instant::now(),
            done: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            marks: Mutex::new([None; 3]),
            cpu_end: Mutex::new(None),
            finished: Notify::new(),
        })
    }

    /// One message finished.
    pub(crate) fn finished_one(&self) {
        self.finished_many(1);
    }

    /// `n` messages finished.
    pub(crate) fn finished_many(&self, n: u64) {
        let before = self.done.fetch_add(n, Ordering::Relaxed);
        let after = before + n;
        let now = Instant::now();
        let mut marks = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, share) in [(0, 1), (1, 9)] {
            let at = self.total * share / 10;
            if before < at && after >= at {
                marks[i] = Some(now);
            }
        }
        if before < self.total && after >= self.total {
            marks[2] = Some(now);
            drop(marks);
            *self.cpu_end.lock().unwrap_or_else(PoisonError::into_inner) = Some(Cpu::now());
            self.finished.notify_one();
        }
    }

    /// The runtime's observer.
    pub(crate) fn outcome(&self, outcome: Outcome<'_>) {
        match outcome {
            Outcome::Applied | Outcome::Duplicate => self.finished_one(),
            Outcome::Retried { .. } => {
                self.retried.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::DeadLettered { failure } => {
                eprintln!("consumer bench: a message was dead-lettered: {failure}");
                self.dead_lettered.fetch_add(1, Ordering::Relaxed);
                self.finished_one();
            }
            _ => {}
        }
    }

    /// Waits until the row's last message finished.
    pub(crate) async fn wait(&self) {
        self.finished.notified().await;
    }

    /// What the row measured; its `effects`, `correct` and `receives` are left for the row
    /// to fill in.
    pub(crate) fn measured(&self) -> Measured {
        let marks = *self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        let end = marks[2].expect("the row finished");
        let cpu_end = self
            .cpu_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or_else(Cpu::now);
        let elapsed = end - self.start;
        let middle = match (marks[0], marks[1]) {
            (Some(a), Some(b)) if b > a => {
                (self.total * 9 / 10 - self.total / 10) as f64 / (b - a).as_secs_f64()
            }
            _ => f64::NAN,
        };
        let latency = LATENCY.lock().unwrap_or_else(PoisonError::into_inner);
        let per_message_us = |cpu: Duration| cpu.as_micros() as f64 / self.total as f64;
        let ticks = |t: u64| per_message_us(ticks_to_duration(t));
        Measured {
            messages: self.total,
            seconds: elapsed.as_secs_f64(),
            rate: self.total as f64 / elapsed.as_secs_f64(),
            rate_10_90: middle,
            p50_us: latency.value_at_quantile(0.5),
            p99_us: latency.value_at_quantile(0.99),
            max_us: latency.max(),
            end_to_end_us: {
                let e2e = END_TO_END.lock().unwrap_or_else(PoisonError::into_inner);
                (!e2e.is_empty()).then(|| {
                    (
                        e2e.value_at_quantile(0.5),
                        e2e.value_at_quantile(0.99),
                        e2e.max(),
                    )
                })
            },
            process_cpu_us: ticks(cpu_end.process.saturating_sub(self.cpu_start.process)),
            machine_cpu_us: per_message_us(cpu_end.machine.busy_since(self.cpu_start.machine)),
            switches_per_message: cpu_end.switches.saturating_sub(self.cpu_start.switches) as f64
                / self.total as f64,
            services_cpu_us: SERVICES.get().map(|_| {
                let mut out = [0.0; SERVICE_COUNT];
                for (i, value) in out.iter_mut().enumerate() {
                    *value = ticks(cpu_end.services[i].saturating_sub(self.cpu_start.services[i]));
                }
                out
            }),
            machine_busy: cpu_end.machine.utilization_since(self.cpu_start.machine),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            effects: 0,
            correct: false,
            receives: None,
        }
    }
}

/// What a row measured: one JSON object's `result`, one line of the table.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Measured {
    pub(crate) messages: u64,
    pub(crate) seconds: f64,
    pub(crate) rate: f64,
    pub(crate) rate_10_90: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) max_us: u64,
    /// With `--paced`: p50, p99 and max from publication to the ack's answer.
    pub(crate) end_to_end_us: Option<(u64, u64, u64)>,
    pub(crate) process_cpu_us: f64,
    pub(crate) machine_cpu_us: f64,
    /// With `--services`: the CPU time of Redis, NATS, RabbitMQ, Kafka and PostgreSQL per
    /// message.
    pub(crate) services_cpu_us: Option<[f64; SERVICE_COUNT]>,
    /// This process's context switches per message.
    pub(crate) switches_per_message: f64,
    pub(crate) machine_busy: f64,
    pub(crate) retried: u64,
    pub(crate) dead_lettered: u64,
    /// Handler runs (memory rows), or the postings the accounts add up to (PostgreSQL rows).
    pub(crate) effects: u64,
    pub(crate) correct: bool,
    /// With `--receive-stats`: receive calls and the messages they returned.
    pub(crate) receives: Option<(u64, u64)>,
}
