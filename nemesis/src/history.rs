//! The history of a run: one JSON object per line (`history.jsonl`), written as things happen,
//! so a run killed half-way leaves what it saw. The checker reads only this file: `nemesis
//! check DIR` checks a kept history again without running anything.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// What an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Kind {
    /// `POST /orders` with an `Idempotency-Key` (three steps, the completer on).
    Order,
    /// `POST /orders` in a client session (`Idempotency-Session`).
    Session,
    /// `POST /payments` with an `Idempotency-Key`, from an impatient client.
    Payment,
    /// A posting published to the broker's stream, applied by a ledger consumer and notified
    /// through the outbox and the relay.
    Posting,
}

/// One line of the history. Times (`t`) are milliseconds since the run started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    /// The first line: what was run, and the bounds the checker holds it to.
    Run {
        seed: u64,
        store: String,
        duration_ms: u64,
        /// No attempt may take longer (the store's timeout and the claim's wait, plus the
        /// retry bound).
        attempt_bound_ms: u64,
        /// Every operation must be answered within this of the last fault healing.
        finish_bound_ms: u64,
        /// The steps an order runs whose effects are lines of the effects log.
        logged_steps: Vec<String>,
        /// The steps an order runs whose effects are outbox rows (`receipt` on PostgreSQL).
        outbox_steps: Vec<String>,
    },
    /// An operation is sent for the first time.
    Invoke {
        t: u64,
        op: u64,
        kind: Kind,
        /// The key (`Order`), `session:seq` (`Session`) or posting id (`Posting`).
        key: String,
        /// A posting's amount, which its account's balance must equal at the end.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        amount: Option<i64>,
    },
    /// One attempt of an operation and how it ended: a status, or `error: …` when no answer
    /// came.
    Attempt {
        t: u64,
        op: u64,
        target: String,
        ms: u64,
        outcome: String,
    },
    /// The operation's answer, final: the client stops retrying.
    Ok {
        t: u64,
        op: u64,
        status: u16,
        /// BLAKE3 of the answer's body, hex.
        body: String,
        /// The operation the answer names (an order's 24 hex characters; a posting's id).
        id: String,
        /// Marked `Idempotent-Replayed: true`: answered from a record.
        #[serde(default)]
        replayed: bool,
    },
    /// The operation was given up without a final answer.
    Fail { t: u64, op: u64, why: String },
    /// The operation sent again after its answer, and what came back: its status, BLAKE3 of
    /// its body, and whether it was marked replayed (answered from the record) or ran again.
    Replay {
        t: u64,
        op: u64,
        status: u16,
        body: String,
        replayed: bool,
    },
    /// A fault begins.
    FaultStart {
        t: u64,
        fault: u64,
        kind: String,
        target: String,
    },
    /// A fault ends (healed, thawed, restarted).
    FaultEnd { t: u64, fault: u64 },
    /// Every fault is healed: the workload's operations must finish from here.
    Healed { t: u64 },
    /// A process of the system started.
    Spawn { t: u64, process: String, pid: u32 },
    /// Collected at the end: a line of the effects log (a step run).
    Step { step: String, key: String, pid: u32 },
    /// Collected at the end: a line of the effects log of a charge `POST /payments` made,
    /// under the operation's key.
    Charge { key: String, pid: u32 },
    /// A batch of `payments_client` (through the load balancer) ended: its summary line.
    Client {
        t: u64,
        name: String,
        exit: i32,
        sent: u64,
        succeeded: u64,
    },
    /// Collected at the end: an outbox row of a step (`receipt` on PostgreSQL).
    OutboxStep { step: String, key: String },
    /// Collected at the end: an account's balance.
    Balance { account: String, balance: i64 },
    /// Collected at the end: a notification the receiver acted on, and the key it came with.
    Notified { key: String, id: String },
    /// The end of the run (the checker's verdict follows in the report).
    End { t: u64 },
}

/// Appends events to `history.jsonl` and keeps them for the checker; shared by every task.
#[derive(Clone)]
pub(crate) struct Recorder {
    inner: Arc<Mutex<Inner>>,
    start: Instant,
}

struct Inner {
    file: BufWriter<File>,
    events: Vec<Event>,
}

impl Recorder {
    pub(crate) fn create(path: &Path) -> std::io::Result<Recorder> {
        Ok(Recorder {
            inner: Arc::new(Mutex::new(Inner {
                file: BufWriter::new(File::create(path)?),
                events: Vec::new(),
            })),
            start: Instant::now(),
        })
    }

    /// Milliseconds since the run started.
    pub(crate) fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn record(&self, event: Event) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // A history that cannot be written is not a history: the run says so at its end
        // (`flush`), and the events stay in memory for the checker.
        if let Ok(line) = serde_json::to_string(&event) {
            let _ = writeln!(inner.file, "{line}");
        }
        inner.events.push(event);
    }

    pub(crate) fn flush(&self) -> std::io::Result<()> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .file
            .flush()
    }

    /// How many events so far `matches`, without copying the history.
    pub(crate) fn count(&self, matches: impl Fn(&Event) -> bool) -> usize {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.events.iter().filter(|e| matches(e)).count()
    }

    pub(crate) fn events(&self) -> Vec<Event> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .events
            .clone()
    }
}

/// Reads a history written by [`Recorder`]: an error names the line that is not an event.
pub(crate) fn load(path: &Path) -> Result<Vec<Event>, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut events = Vec::new();
    for (n, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let event = serde_json::from_str(&line)
            .map_err(|e| format!("{}, line {}: {e}", path.display(), n + 1))?;
        events.push(event);
    }
    Ok(events)
}

/// BLAKE3 of `bytes`, hex: how a body is kept in the history.
pub(crate) fn digest(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_history_reads_back_as_written() {
        let dir = std::env::temp_dir().join(format!("nemesis-history-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("history.jsonl");
        let recorder = Recorder::create(&path).unwrap();
        let events = vec![
            Event::Invoke {
                t: 1,
                op: 7,
                kind: Kind::Session,
                key: "s-1:3".into(),
                amount: None,
            },
            Event::FaultStart {
                t: 2,
                fault: 0,
                kind: "partition".into(),
                target: "store".into(),
            },
            Event::Balance {
                account: "a".into(),
                balance: -5,
            },
        ];
        for event in &events {
            recorder.record(event.clone());
        }
        recorder.flush().unwrap();
        assert_eq!(load(&path).unwrap(), events);
        assert_eq!(recorder.events(), events);
        assert_eq!(recorder.count(|e| matches!(e, Event::Balance { .. })), 1);
        std::fs::write(&path, "{\"event\":\"nothing\"}\n").unwrap();
        let error = load(&path).unwrap_err();
        assert!(error.contains("line 1"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
