//! The checker: reads a history and says whether every operation took effect exactly once.
//!
//! What it holds the run to (each a kind of [`Anomaly`]):
//! - every operation sent got a final answer, within `finish_bound_ms` of the last fault
//!   healing, and the answer is the one its request deserves (`201` for an order);
//! - no attempt took longer than `attempt_bound_ms` (a request hanging on a cut-off store is
//!   an anomaly, not patience);
//! - an order's steps: each step of each answered order ran under one step key (a step that
//!   runs again after a fault must run under the same key, so a downstream that deduplicates by
//!   it makes one effect), every step ran, and every step run belongs to an answered order;
//!   on PostgreSQL one receipt row per order;
//! - a posting: its account's balance is its amount exactly (twice the amount is a double
//!   apply), the receiver acted on its notification once, and no account or notification
//!   exists without a posting;
//! - every answer sent again came back byte for byte, marked replayed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::history::{Event, Kind};

/// The faults that can keep an answered operation's record from being written.
const RECORD_FAULTS: [&str; 5] = [
    "freeze-store",
    "partition-store",
    "pause-instance",
    "kill-instance",
    "failover-store",
];

/// How long after its answer such a fault can still keep the record from being written: the
/// lease (2 s) the claim outlives the answer by at most, and the write's first retries.
const RECORD_WINDOW_MS: u64 = 5_000;

/// The account a posting is applied to: one per posting, so that a double apply shows.
pub(crate) fn account_of(posting: &str) -> String {
    format!("acct-{posting}")
}

/// Something the history shows that must not happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Anomaly {
    /// Sent, never answered.
    Unfinished { op: u64, key: String, why: String },
    /// Answered later than the bound after the last fault healed.
    Late {
        op: u64,
        key: String,
        after_heal_ms: u64,
    },
    /// An attempt that took longer than the bound.
    SlowAttempt { op: u64, key: String, ms: u64 },
    /// A final answer that is not the one the request deserves.
    WrongAnswer { op: u64, key: String, status: u16 },
    /// Two operations whose answers name one operation.
    SharedOperation { id: String, ops: Vec<u64> },
    /// An effect that should exist does not.
    MissingEffect { op: u64, key: String, what: String },
    /// An effect made more than once.
    DuplicateEffect { op: u64, key: String, what: String },
    /// An effect of no operation.
    OrphanEffect { what: String },
    /// An answer sent again that came back different, or not marked replayed.
    ReplayMismatch { op: u64, key: String, what: String },
    /// A batch of `payments_client` that did not succeed in every payment.
    ClientFailed {
        name: String,
        exit: i32,
        sent: u64,
        succeeded: u64,
    },
    /// A history that cannot be judged whole: it ends before its run did, an operation is
    /// answered twice, or events name an operation never sent.
    History { what: String },
    /// Charges made (distinct operation keys) against payments answered: more is a payment
    /// charged under two operations, fewer a payment answered without its charge.
    ChargeCount { charged: u64, answered: u64 },
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Anomaly::Unfinished { op, key, why } => {
                write!(f, "unfinished: op {op} ({key}) was never answered: {why}")
            }
            Anomaly::Late {
                op,
                key,
                after_heal_ms,
            } => write!(
                f,
                "late: op {op} ({key}) answered {after_heal_ms} ms after the faults healed"
            ),
            Anomaly::SlowAttempt { op, key, ms } => {
                write!(
                    f,
                    "slow attempt: op {op} ({key}) waited {ms} ms for one answer"
                )
            }
            Anomaly::WrongAnswer { op, key, status } => {
                write!(f, "wrong answer: op {op} ({key}) ended with {status}")
            }
            Anomaly::SharedOperation { id, ops } => {
                write!(
                    f,
                    "shared operation: ops {ops:?} were answered as one ({id})"
                )
            }
            Anomaly::MissingEffect { op, key, what } => {
                write!(f, "missing effect: op {op} ({key}): {what}")
            }
            Anomaly::DuplicateEffect { op, key, what } => {
                write!(f, "duplicate effect: op {op} ({key}): {what}")
            }
            Anomaly::OrphanEffect { what } => write!(f, "effect without an operation: {what}"),
            Anomaly::ReplayMismatch { op, key, what } => {
                write!(f, "replay mismatch: op {op} ({key}): {what}")
            }
            Anomaly::ClientFailed {
                name,
                exit,
                sent,
                succeeded,
            } => write!(
                f,
                "client failed: {name} exited {exit} with {succeeded} of {sent} payments"
            ),
            Anomaly::History { what } => write!(f, "history: {what}"),
            Anomaly::ChargeCount { charged, answered } => write!(
                f,
                "charge count: {charged} payments charged (distinct operations), {answered} answered"
            ),
        }
    }
}

/// What the checker counted, and what it found wrong.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Operations sent, by kind.
    pub(crate) sent: BTreeMap<Kind, u64>,
    /// Operations answered, by kind.
    pub(crate) answered: BTreeMap<Kind, u64>,
    /// Attempts in all.
    pub(crate) attempts: u64,
    /// Faults injected, by kind.
    pub(crate) faults: BTreeMap<String, u64>,
    /// Step runs logged, and how many of them ran a step again (same key, after a fault).
    pub(crate) step_runs: u64,
    pub(crate) step_reruns: u64,
    /// Answers sent again and compared.
    pub(crate) replays: u64,
    /// Of them, operations that ran again under their operation key because their record was
    /// never written (see [`check`]).
    pub(crate) replays_rerun: u64,
    /// Charges made (distinct operation keys), and payments answered `201` (this process's
    /// clients and the `payments_client` batches).
    pub(crate) charges: u64,
    pub(crate) payments_answered: u64,
    /// The longest attempt, and the longest that overlapped a fault.
    pub(crate) worst_attempt_ms: u64,
    pub(crate) worst_attempt_in_fault_ms: u64,
    /// The longest attempt that overlapped a fault of each kind.
    pub(crate) worst_attempt_by_fault: BTreeMap<String, u64>,
    pub(crate) anomalies: Vec<Anomaly>,
}

impl Report {
    pub(crate) fn ok(&self) -> bool {
        self.anomalies.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kinds = |counts: &BTreeMap<Kind, u64>| {
            counts
                .iter()
                .map(|(kind, n)| format!("{kind:?} {n}").to_lowercase())
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(f, "operations sent: {}", kinds(&self.sent))?;
        writeln!(f, "operations answered: {}", kinds(&self.answered))?;
        writeln!(f, "attempts: {}", self.attempts)?;
        let faults = self
            .faults
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        writeln!(
            f,
            "faults: {}",
            if faults.is_empty() { "none" } else { &faults }
        )?;
        writeln!(
            f,
            "step runs: {} ({} again under the same key after a fault)",
            self.step_runs, self.step_reruns
        )?;
        writeln!(
            f,
            "replays compared: {} ({} ran again under their operation key: the record's write refused)",
            self.replays, self.replays_rerun
        )?;
        writeln!(
            f,
            "payments: {} answered, {} charged",
            self.payments_answered, self.charges
        )?;
        writeln!(
            f,
            "worst attempt: {} ms; worst during a fault: {} ms",
            self.worst_attempt_ms, self.worst_attempt_in_fault_ms
        )?;
        let by_fault = self
            .worst_attempt_by_fault
            .iter()
            .map(|(kind, ms)| format!("{kind} {ms} ms"))
            .collect::<Vec<_>>()
            .join(", ");
        if !by_fault.is_empty() {
            writeln!(f, "worst attempt during each kind of fault: {by_fault}")?;
        }
        writeln!(f, "anomalies: {}", self.anomalies.len())?;
        for anomaly in &self.anomalies {
            writeln!(f, "  {anomaly}")?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Op {
    kind: Option<Kind>,
    key: String,
    amount: Option<i64>,
    /// When, the status, the body's digest, the id it names, whether it was replayed.
    answer: Option<(u64, u16, String, String, bool)>,
    /// When its latest attempt began.
    attempt_began: u64,
    /// When the attempt that got its answer began.
    answer_began: u64,
    /// The instances its attempts went to until it was answered.
    answered_through: BTreeSet<String>,
    failed: Option<String>,
}

/// Checks `events` (a whole history).
pub(crate) fn check(events: &[Event]) -> Report {
    let mut report = Report::default();
    let mut attempt_bound = u64::MAX;
    let mut finish_bound = u64::MAX;
    let mut logged_steps: Vec<String> = Vec::new();
    let mut outbox_steps: Vec<String> = Vec::new();
    let mut ops: BTreeMap<u64, Op> = BTreeMap::new();
    let mut healed = None;
    // Each fault: when it began and ended, its kind and target.
    let mut faults: BTreeMap<u64, (u64, Option<u64>, &str, &str)> = BTreeMap::new();
    let mut charges = BTreeSet::new();
    let mut clients = Vec::new();
    let mut malformed = Vec::new();
    let mut ended = false;
    let mut store = String::new();
    let mut attempts = Vec::new();
    let mut steps = Vec::new();
    let mut outbox = Vec::new();
    let mut balances = BTreeMap::new();
    let mut notified: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut replays = Vec::new();
    for event in events {
        match event {
            Event::Run {
                store: run_store,
                attempt_bound_ms,
                finish_bound_ms,
                logged_steps: logged,
                outbox_steps: rows,
                ..
            } => {
                store.clone_from(run_store);
                attempt_bound = *attempt_bound_ms;
                finish_bound = *finish_bound_ms;
                logged_steps.clone_from(logged);
                outbox_steps.clone_from(rows);
            }
            Event::Invoke {
                op,
                kind,
                key,
                amount,
                ..
            } => {
                let entry = ops.entry(*op).or_default();
                entry.kind = Some(*kind);
                entry.key.clone_from(key);
                entry.amount = *amount;
                *report.sent.entry(*kind).or_default() += 1;
            }
            Event::Attempt {
                t, op, ms, target, ..
            } => {
                let o = ops.entry(*op).or_default();
                o.attempt_began = t.saturating_sub(*ms);
                if o.answer.is_none() {
                    o.answered_through.insert(target.clone());
                }
                report.attempts += 1;
                attempts.push((*op, t.saturating_sub(*ms), *t, *ms, target.as_str()));
            }
            Event::Ok {
                t,
                op,
                status,
                body,
                id,
                replayed,
            } => {
                let answer = (*t, *status, body.clone(), id.clone(), *replayed);
                let o = ops.entry(*op).or_default();
                if o.answer.is_some() {
                    malformed.push(format!("op {op} answered twice"));
                }
                o.answer = Some(answer);
                o.answer_began = o.attempt_began;
            }
            Event::Fail { op, why, .. } => {
                ops.entry(*op).or_default().failed = Some(why.clone());
            }
            Event::Replay { op, .. } => {
                ops.entry(*op).or_default();
                replays.push(event);
            }
            Event::FaultStart {
                t,
                fault,
                kind,
                target,
            } => {
                faults.insert(*fault, (*t, None, kind.as_str(), target.as_str()));
                *report.faults.entry(kind.clone()).or_default() += 1;
            }
            Event::FaultEnd { t, fault } => {
                if let Some((_, end, _, _)) = faults.get_mut(fault) {
                    *end = Some(*t);
                }
            }
            Event::Charge { key, .. } => {
                charges.insert(key.as_str());
            }
            Event::Client {
                name,
                exit,
                sent,
                succeeded,
                ..
            } => clients.push((name, *exit, *sent, *succeeded)),
            Event::Healed { t } => healed = Some(*t),
            Event::Step { step, key, .. } => steps.push((step.as_str(), key.as_str())),
            Event::OutboxStep { step, key } => outbox.push((step.as_str(), key.as_str())),
            Event::Balance { account, balance } => {
                balances.insert(account.as_str(), *balance);
            }
            Event::Notified { key, id } => {
                notified.entry(id.as_str()).or_default().push(key.as_str())
            }
            Event::End { .. } => ended = true,
            Event::Spawn { .. } => {}
        }
    }
    let key_of = |op: u64| ops.get(&op).map(|o| o.key.clone()).unwrap_or_default();

    // A history that cannot be judged whole says so.
    if !ended {
        malformed.push("it ends before its run did (no end event)".to_owned());
    }
    for (op, o) in &ops {
        if o.kind.is_none() {
            malformed.push(format!("events of op {op}, which was never sent"));
        }
    }
    for what in malformed {
        report.anomalies.push(Anomaly::History { what });
    }

    // Every operation answered, in time, as it deserves.
    for (&op, o) in &ops {
        let Some(kind) = o.kind else { continue };
        let Some((t, status, ..)) = &o.answer else {
            let why = o.failed.clone().unwrap_or_else(|| "no answer".into());
            report.anomalies.push(Anomaly::Unfinished {
                op,
                key: o.key.clone(),
                why,
            });
            continue;
        };
        *report.answered.entry(kind).or_default() += 1;
        if let Some(healed) = healed
            && t.saturating_sub(healed) > finish_bound
        {
            report.anomalies.push(Anomaly::Late {
                op,
                key: o.key.clone(),
                after_heal_ms: t - healed,
            });
        }
        if kind == Kind::Payment && *status == 201 {
            report.payments_answered += 1;
        }
        if matches!(kind, Kind::Order | Kind::Session | Kind::Payment) && *status != 201 {
            report.anomalies.push(Anomaly::WrongAnswer {
                op,
                key: o.key.clone(),
                status: *status,
            });
        }
    }

    // No attempt past the bound (not counting the time it waited on an instance that was
    // paused: a paused process answers nothing, which is the fault); the worst, and the worst
    // while a fault was on.
    for &(op, start, end, ms, target) in &attempts {
        report.worst_attempt_ms = report.worst_attempt_ms.max(ms);
        let during = |fault: &&(u64, Option<u64>, &str, &str)| {
            start <= fault.1.unwrap_or(u64::MAX) && fault.0 <= end
        };
        for &(_, _, kind, _) in faults.values().filter(during) {
            report.worst_attempt_in_fault_ms = report.worst_attempt_in_fault_ms.max(ms);
            let worst = report
                .worst_attempt_by_fault
                .entry(kind.to_owned())
                .or_default();
            *worst = (*worst).max(ms);
        }
        // Time spent waiting on a paused instance is the fault's, not the system's.
        let paused: u64 = faults
            .values()
            .filter(|&&(_, _, kind, paused)| kind == "pause-instance" && paused == target)
            .map(|&(from, to, _, _)| {
                let to = to.unwrap_or(u64::MAX);
                end.min(to).saturating_sub(start.max(from))
            })
            .sum();
        if ms.saturating_sub(paused) > attempt_bound {
            report.anomalies.push(Anomaly::SlowAttempt {
                op,
                key: key_of(op),
                ms,
            });
        }
    }

    check_orders(
        &ops,
        &logged_steps,
        &outbox_steps,
        &steps,
        &outbox,
        &mut report,
    );
    // Payments: each batch of payments_client succeeded, and the charges made are the
    // payments answered (the provider deduplicates by operation key, so a payment that ran
    // again under its key is one charge; under another key, two).
    for (name, exit, sent, succeeded) in clients {
        report.payments_answered += succeeded;
        if exit != 0 || succeeded != sent {
            report.anomalies.push(Anomaly::ClientFailed {
                name: name.clone(),
                exit,
                sent,
                succeeded,
            });
        }
    }
    report.charges = charges.len() as u64;
    if report.charges != report.payments_answered {
        report.anomalies.push(Anomaly::ChargeCount {
            charged: report.charges,
            answered: report.payments_answered,
        });
    }
    check_postings(&ops, &balances, &notified, &mut report);

    // Replays. Once an answer came back replayed, the operation's record exists and is final:
    // every later answer must be that one, replayed. Before that, the answers the client saw
    // may not have been recorded: an operation runs again under its operation key when its
    // claim was lost before its record was written (the store cut off, frozen or locked past
    // the lease after the work ran, or the instance killed before the write landed: the
    // caller had its answer, the write was refused or never made), and the run that gets
    // recorded may be one no client saw (a request a paused instance read when it
    // continued). That needs such a fault during the answer or in the few seconds after it
    // (`RECORD_WINDOW_MS`). An order answers the same whichever run (its ids come from the
    // operation key); a payment may name another charge id (the example's provider lives in
    // each process; a real one answers the first charge again, and the charge count holds it
    // to one charge). Every answered order and payment must in the end come back replayed
    // from its record.
    // A store's fault can keep any record from being written; an instance's, only the
    // records of the operations it handled (on SQLite, any: a paused instance holds the
    // file's write lock).
    let record_faults: Vec<(u64, u64, &str, &str)> = faults
        .values()
        .filter(|f| RECORD_FAULTS.contains(&f.2))
        .map(|f| (f.0, f.1.unwrap_or(u64::MAX), f.2, f.3))
        .collect();
    let store_wide = |kind: &str| !kind.ends_with("-instance") || store == "sqlite";
    let mut seen: BTreeMap<u64, (String, Option<String>, bool)> = ops
        .iter()
        .filter_map(|(&op, o)| {
            let (t, _, body, _, replayed) = o.answer.as_ref()?;
            let explained = record_faults.iter().any(|&(from, to, kind, target)| {
                from <= t + RECORD_WINDOW_MS
                    && o.answer_began <= to
                    && (store_wide(kind) || o.answered_through.contains(target))
            });
            Some((
                op,
                (body.clone(), replayed.then(|| body.clone()), explained),
            ))
        })
        .collect();
    let sent_again: BTreeSet<u64> = replays
        .iter()
        .filter_map(|e| match e {
            Event::Replay { op, .. } => Some(*op),
            _ => None,
        })
        .collect();
    for event in replays {
        let Event::Replay {
            op,
            status,
            body,
            replayed,
            ..
        } = event
        else {
            continue;
        };
        report.replays += 1;
        let first = ops.get(op).and_then(|o| o.answer.as_ref()).map(|a| a.1);
        let payment = ops.get(op).and_then(|o| o.kind) == Some(Kind::Payment);
        let Some((last, recorded, explained)) = seen.get_mut(op) else {
            continue;
        };
        let rerun = recorded.is_none() && (!*replayed || body != last);
        let what = match (recorded.as_ref(), *replayed) {
            _ if first != Some(*status) => Some(format!("answered {status}, first {first:?}")),
            (Some(record), true) if body != record => {
                Some("replayed another body than it replayed before".to_owned())
            }
            (Some(_), false) => {
                Some("ran again after its answer was replayed from its record".to_owned())
            }
            _ if rerun && !*explained => Some(
                "ran again, or replayed another body, with no fault to keep its record from \
                 being written"
                    .to_owned(),
            ),
            _ if rerun && body != last && !payment => Some("answered another body".to_owned()),
            _ => None,
        };
        if let Some(what) = what {
            // Reported once: the answers after it are judged against the one before it.
            report.anomalies.push(Anomaly::ReplayMismatch {
                op: *op,
                key: key_of(*op),
                what,
            });
            continue;
        }
        if rerun {
            report.replays_rerun += 1;
        }
        last.clone_from(body);
        if *replayed && recorded.is_none() {
            *recorded = Some(body.clone());
        }
    }
    for (op, (_, recorded, _)) in &seen {
        let o = &ops[op];
        let answered = o.answer.as_ref().is_some_and(|a| a.1 == 201);
        let keyed = matches!(o.kind, Some(Kind::Order | Kind::Payment));
        if recorded.is_none() && answered && (keyed || sent_again.contains(op)) {
            report.anomalies.push(Anomaly::ReplayMismatch {
                op: *op,
                key: o.key.clone(),
                what: "never came back replayed from a record".to_owned(),
            });
        }
    }
    report
}

/// The orders' steps against the orders' answers (an answer names its operation by the first
/// 24 characters of the operation key, which every step key begins with).
fn check_orders(
    ops: &BTreeMap<u64, Op>,
    logged_steps: &[String],
    outbox_steps: &[String],
    steps: &[(&str, &str)],
    outbox: &[(&str, &str)],
    report: &mut Report,
) {
    let mut by_id: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (&op, o) in ops {
        if let (Some(Kind::Order | Kind::Session), Some((_, 201, _, id, _))) = (o.kind, &o.answer) {
            by_id.entry(id.as_str()).or_default().push(op);
        }
    }
    for (id, sharing) in &by_id {
        if sharing.len() > 1 {
            report.anomalies.push(Anomaly::SharedOperation {
                id: (*id).to_owned(),
                ops: sharing.clone(),
            });
        }
    }
    // id -> step -> the step keys it ran under, and how many runs.
    let mut runs: BTreeMap<&str, BTreeMap<&str, (BTreeSet<&str>, u64)>> = BTreeMap::new();
    let all = steps
        .iter()
        .map(|s| (s, true))
        .chain(outbox.iter().map(|s| (s, false)));
    for (&(step, key), logged) in all {
        if logged {
            report.step_runs += 1;
        }
        let id = key.get(..24).unwrap_or(key);
        if !by_id.contains_key(id) {
            let source = if logged { "effects log" } else { "outbox" };
            report.anomalies.push(Anomaly::OrphanEffect {
                what: format!("{source}: step {step} under {key}"),
            });
            continue;
        }
        let entry = runs.entry(id).or_default().entry(step).or_default();
        entry.0.insert(key);
        entry.1 += 1;
    }
    for (id, sharing) in &by_id {
        let op = sharing[0];
        let key = ops[&op].key.clone();
        let ran = runs.get(id);
        let expected = logged_steps.iter().map(|s| (s, true));
        let expected = expected.chain(outbox_steps.iter().map(|s| (s, false)));
        let mut operation_keys = BTreeSet::new();
        for (step, logged) in expected {
            let Some((keys, count)) = ran.and_then(|r| r.get(step.as_str())) else {
                report.anomalies.push(Anomaly::MissingEffect {
                    op,
                    key: key.clone(),
                    what: format!("step {step} never ran"),
                });
                continue;
            };
            if keys.len() > 1 {
                report.anomalies.push(Anomaly::DuplicateEffect {
                    op,
                    key: key.clone(),
                    what: format!("step {step} ran under {} keys: {keys:?}", keys.len()),
                });
            } else if !logged && *count > 1 {
                report.anomalies.push(Anomaly::DuplicateEffect {
                    op,
                    key: key.clone(),
                    what: format!("{count} outbox rows of step {step}"),
                });
            }
            if logged {
                report.step_reruns += count - 1;
            }
            for k in keys {
                let operation = k
                    .strip_suffix(step.as_str())
                    .and_then(|k| k.strip_suffix('.'));
                operation_keys.insert(operation.unwrap_or(k));
            }
        }
        if operation_keys.len() > 1 {
            report.anomalies.push(Anomaly::DuplicateEffect {
                op,
                key,
                what: format!("its steps ran under {operation_keys:?}"),
            });
        }
    }
}

/// The postings against the balances and the notifications.
fn check_postings(
    ops: &BTreeMap<u64, Op>,
    balances: &BTreeMap<&str, i64>,
    notified: &BTreeMap<&str, Vec<&str>>,
    report: &mut Report,
) {
    let mut postings = BTreeMap::new();
    for (&op, o) in ops {
        if o.kind == Some(Kind::Posting) {
            postings.insert(
                o.key.as_str(),
                (op, o.amount.unwrap_or(0), o.answer.is_some()),
            );
        }
    }
    let accounts: BTreeMap<String, &str> = postings
        .keys()
        .map(|posting| (account_of(posting), *posting))
        .collect();
    for (account, balance) in balances {
        if !accounts.contains_key(*account) {
            report.anomalies.push(Anomaly::OrphanEffect {
                what: format!("account {account} holds {balance}"),
            });
        }
    }
    for id in notified.keys() {
        if !postings.contains_key(id) {
            report.anomalies.push(Anomaly::OrphanEffect {
                what: format!("a notification of {id}"),
            });
        }
    }
    for (posting, &(op, amount, answered)) in &postings {
        let key = (*posting).to_owned();
        let balance = balances.get(account_of(posting).as_str()).copied();
        match balance {
            Some(b) if b == amount => {}
            // A posting never published for sure may be missing; one published must not be.
            None if !answered => {}
            None | Some(0) => report.anomalies.push(Anomaly::MissingEffect {
                op,
                key: key.clone(),
                what: format!("balance {balance:?}, posting {amount}"),
            }),
            Some(b) if amount != 0 && b % amount == 0 => {
                report.anomalies.push(Anomaly::DuplicateEffect {
                    op,
                    key: key.clone(),
                    what: format!(
                        "applied {} times (balance {b}, posting {amount})",
                        b / amount
                    ),
                })
            }
            Some(b) => report.anomalies.push(Anomaly::MissingEffect {
                op,
                key: key.clone(),
                what: format!("balance {b}, posting {amount}"),
            }),
        }
        match notified.get(posting).map_or(0, Vec::len) {
            1 => {}
            0 if balance.is_none() => {}
            0 => report.anomalies.push(Anomaly::MissingEffect {
                op,
                key,
                what: "applied, never notified".into(),
            }),
            n => report.anomalies.push(Anomaly::DuplicateEffect {
                op,
                key,
                what: format!("notified {n} times, under {:?}", notified[posting]),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP_KEY: &str = "0123456789abcdef0123456789abcdef";
    const OTHER_KEY: &str = "fedcba9876543210fedcba9876543210";

    fn run() -> Event {
        Event::Run {
            seed: 1,
            store: "redis".into(),
            duration_ms: 1000,
            attempt_bound_ms: 500,
            finish_bound_ms: 1000,
            logged_steps: vec!["reserve".into(), "charge".into()],
            outbox_steps: vec![],
        }
    }

    fn order(op: u64, key: &str, operation: &str) -> Vec<Event> {
        vec![
            Event::Invoke {
                t: 1,
                op,
                kind: Kind::Order,
                key: key.into(),
                amount: None,
            },
            Event::Attempt {
                t: 20,
                op,
                target: "a".into(),
                ms: 10,
                outcome: "201".into(),
            },
            Event::Ok {
                t: 20,
                op,
                status: 201,
                body: "b".into(),
                id: operation[..24].into(),
                replayed: false,
            },
            step("reserve", operation, 10),
            step("charge", operation, 10),
        ]
    }

    fn step(step: &str, operation: &str, pid: u32) -> Event {
        Event::Step {
            step: step.into(),
            key: format!("{operation}.{step}"),
            pid,
        }
    }

    fn posting(op: u64, id: &str, amount: i64) -> Vec<Event> {
        vec![
            Event::Invoke {
                t: 1,
                op,
                kind: Kind::Posting,
                key: id.into(),
                amount: Some(amount),
            },
            Event::Ok {
                t: 2,
                op,
                status: 0,
                body: String::new(),
                id: id.into(),
                replayed: false,
            },
        ]
    }

    fn clean() -> Vec<Event> {
        let mut events = vec![run()];
        events.extend(order(1, "k1", OP_KEY));
        events.extend(posting(2, "p1", 7));
        events.push(Event::Balance {
            account: account_of("p1"),
            balance: 7,
        });
        events.push(Event::Notified {
            key: "n1".into(),
            id: "p1".into(),
        });
        events.push(Event::Replay {
            t: 30,
            op: 1,
            status: 201,
            body: "b".into(),
            replayed: true,
        });
        events.push(Event::End { t: 50 });
        events
    }

    fn anomalies(events: &[Event]) -> Vec<String> {
        check(events)
            .anomalies
            .iter()
            .map(|a| a.to_string())
            .collect()
    }

    #[test]
    fn a_clean_history_has_no_anomaly() {
        let report = check(&clean());
        assert!(report.ok(), "{report}");
        assert_eq!(report.sent[&Kind::Order], 1);
        assert_eq!(report.answered[&Kind::Posting], 1);
        assert_eq!(report.step_runs, 2);
        assert_eq!(report.replays, 1);
    }

    #[test]
    fn a_step_run_again_under_its_key_is_not_an_anomaly_but_is_counted() {
        let mut events = clean();
        events.push(step("reserve", OP_KEY, 11));
        let report = check(&events);
        assert!(report.ok(), "{report}");
        assert_eq!(report.step_reruns, 1);
    }

    #[test]
    fn a_step_under_a_second_key_is_a_duplicate_effect() {
        let mut events = clean();
        events.push(step("charge", &format!("{}ffffffff", &OP_KEY[..24]), 11));
        let found = anomalies(&events);
        assert!(
            found
                .iter()
                .any(|a| a.starts_with("duplicate effect") && a.contains("charge")),
            "{found:?}"
        );
    }

    #[test]
    fn a_step_that_never_ran_is_a_missing_effect() {
        let events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::Step { step, .. } if step == "charge"))
            .collect();
        assert_eq!(
            anomalies(&events),
            ["missing effect: op 1 (k1): step charge never ran"]
        );
    }

    #[test]
    fn a_step_of_no_answered_order_is_an_orphan() {
        let mut events = clean();
        events.push(step("reserve", OTHER_KEY, 10));
        let found = anomalies(&events);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("effect without an operation"),
            "{found:?}"
        );
    }

    #[test]
    fn an_operation_never_answered_is_unfinished() {
        let mut events = clean();
        events.push(Event::Invoke {
            t: 3,
            op: 3,
            kind: Kind::Order,
            key: "k3".into(),
            amount: None,
        });
        events.push(Event::Fail {
            t: 900,
            op: 3,
            why: "gave up".into(),
        });
        assert_eq!(
            anomalies(&events),
            ["unfinished: op 3 (k3) was never answered: gave up"]
        );
    }

    #[test]
    fn an_answer_long_after_the_heal_is_late() {
        let mut events = clean();
        events.push(Event::Healed { t: 5 });
        for event in &mut events {
            if let Event::Ok { t, op: 1, .. } = event {
                *t = 5 + 1001;
            }
        }
        assert_eq!(
            anomalies(&events),
            ["late: op 1 (k1) answered 1001 ms after the faults healed"]
        );
    }

    #[test]
    fn an_attempt_past_the_bound_is_slow_and_the_worst_in_a_fault_is_reported() {
        let mut events = clean();
        events.push(Event::FaultStart {
            t: 100,
            fault: 0,
            kind: "freeze".into(),
            target: "store".into(),
        });
        events.push(Event::Attempt {
            t: 700,
            op: 1,
            target: "a".into(),
            ms: 600,
            outcome: "error: timeout".into(),
        });
        events.push(Event::FaultEnd { t: 650, fault: 0 });
        let report = check(&events);
        assert_eq!(report.worst_attempt_in_fault_ms, 600);
        assert_eq!(report.worst_attempt_by_fault["freeze"], 600);
        assert_eq!(report.faults["freeze"], 1);
        let found: Vec<String> = report.anomalies.iter().map(|a| a.to_string()).collect();
        assert_eq!(
            found,
            ["slow attempt: op 1 (k1) waited 600 ms for one answer"]
        );
    }

    #[test]
    fn an_order_answered_with_an_error_is_a_wrong_answer() {
        let mut events = clean();
        for event in &mut events {
            if let Event::Ok { op: 1, status, .. } = event {
                *status = 500;
            }
        }
        let found = anomalies(&events);
        assert!(found.contains(&"wrong answer: op 1 (k1) ended with 500".to_owned()));
    }

    #[test]
    fn two_orders_answered_as_one_share_an_operation() {
        let mut events = clean();
        events.extend(order(5, "k5", OP_KEY));
        let found = anomalies(&events);
        assert!(
            found.iter().any(|a| a.starts_with("shared operation")),
            "{found:?}"
        );
    }

    #[test]
    fn a_posting_applied_twice_is_a_duplicate_and_one_never_applied_is_missing() {
        let mut events = clean();
        for event in &mut events {
            if let Event::Balance { balance, .. } = event {
                *balance = 14;
            }
        }
        assert_eq!(
            anomalies(&events),
            ["duplicate effect: op 2 (p1): applied 2 times (balance 14, posting 7)"]
        );
        let events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::Balance { .. } | Event::Notified { .. }))
            .collect();
        assert_eq!(
            anomalies(&events),
            ["missing effect: op 2 (p1): balance None, posting 7"]
        );
    }

    #[test]
    fn a_notification_twice_or_of_nothing_is_caught() {
        let mut events = clean();
        events.push(Event::Notified {
            key: "n2".into(),
            id: "p1".into(),
        });
        events.push(Event::Notified {
            key: "n3".into(),
            id: "p9".into(),
        });
        events.push(Event::Balance {
            account: account_of("p9"),
            balance: 1,
        });
        let found = anomalies(&events);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.iter().any(|a| a.contains("notified 2 times")));
        assert!(found.iter().any(|a| a.contains("a notification of p9")));
        assert!(found.iter().any(|a| a.contains("account acct-p9 holds 1")));
    }

    fn replayed(op: u64, body: &str, replayed: bool) -> Event {
        Event::Replay {
            t: 40,
            op,
            status: 201,
            body: body.into(),
            replayed,
        }
    }

    #[test]
    fn a_replay_of_another_body_or_a_run_after_a_replay_is_a_mismatch() {
        for (again, what) in [
            (
                replayed(1, "x", true),
                "replayed another body than it replayed before",
            ),
            (
                replayed(1, "b", false),
                "ran again after its answer was replayed from its record",
            ),
        ] {
            let mut events = clean();
            events.push(again);
            assert_eq!(
                anomalies(&events),
                [format!("replay mismatch: op 1 (k1): {what}")]
            );
        }
    }

    fn fault(t: u64, kind: &str, target: &str) -> [Event; 2] {
        [
            Event::FaultStart {
                t,
                fault: t,
                kind: kind.into(),
                target: target.into(),
            },
            Event::FaultEnd {
                t: t + 1000,
                fault: t,
            },
        ]
    }

    #[test]
    fn an_order_run_again_before_its_record_must_answer_the_same() {
        // The order's first answer during a store freeze, then its run again (its record
        // never written): the same body is counted, another is an anomaly.
        let mut events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::Replay { .. }))
            .collect();
        events.extend(fault(15, "freeze-store", "store"));
        // The replays' own attempts, long after the fault, do not move the answer's time.
        events.push(Event::Attempt {
            t: 90_000,
            op: 1,
            target: "payments-1".into(),
            ms: 5,
            outcome: "201".into(),
        });
        events.push(replayed(1, "b", false));
        events.push(replayed(1, "b", true));
        let report = check(&events);
        assert!(report.ok(), "{report}");
        assert_eq!(report.replays_rerun, 1);
        events.insert(events.len() - 1, replayed(1, "x", false));
        assert_eq!(
            anomalies(&events),
            ["replay mismatch: op 1 (k1): answered another body"]
        );
    }

    #[test]
    fn a_run_again_needs_a_fault_near_its_answer() {
        // No fault, or one that ended before the answering attempt began or began more than
        // five seconds after the answer: the record should have been written.
        for faults in [
            vec![],
            fault(0, "kill-instance", "payments-0")[..1].to_vec(),
            fault(5_021, "partition-store", "store").to_vec(),
        ] {
            let mut events: Vec<Event> = clean()
                .into_iter()
                .filter(|e| !matches!(e, Event::Replay { .. }))
                .collect();
            if let Some(Event::FaultStart { t: 0, .. }) = faults.first() {
                // Ended at 5, before the attempt began at 10.
                events.extend(faults);
                events.push(Event::FaultEnd { t: 5, fault: 0 });
            } else {
                events.extend(faults);
            }
            events.push(replayed(1, "b", false));
            events.push(replayed(1, "b", true));
            assert_eq!(
                anomalies(&events),
                [
                    "replay mismatch: op 1 (k1): ran again, or replayed another body, with no \
                  fault to keep its record from being written"
                ]
            );
        }
    }

    #[test]
    fn an_instance_fault_explains_only_the_operations_that_instance_handled() {
        // Op 1 went to payments-0 only: a pause of payments-1 does not explain its run again,
        // but on SQLite (a paused instance holds the file's write lock) it does.
        for (store, explained) in [("redis", false), ("sqlite", true)] {
            let mut events: Vec<Event> = clean()
                .into_iter()
                .filter(|e| !matches!(e, Event::Replay { .. }))
                .collect();
            if let Event::Run { store: s, .. } = &mut events[0] {
                *s = store.into();
            }
            events.extend(fault(15, "pause-instance", "payments-1"));
            events.push(replayed(1, "b", false));
            events.push(replayed(1, "b", true));
            assert_eq!(check(&events).ok(), explained, "{store}");
        }
    }

    #[test]
    fn a_history_that_cannot_be_judged_whole_is_an_anomaly() {
        let mut events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::End { .. }))
            .collect();
        events.push(Event::Ok {
            t: 60,
            op: 1,
            status: 201,
            body: "b".into(),
            id: OP_KEY[..24].into(),
            replayed: true,
        });
        events.push(replayed(77, "b", true));
        let found = anomalies(&events);
        for what in [
            "history: it ends before its run did (no end event)",
            "history: op 1 answered twice",
            "history: events of op 77, which was never sent",
        ] {
            assert!(found.contains(&what.to_owned()), "{what}: {found:?}");
        }
    }

    #[test]
    fn a_session_answer_sent_again_must_end_replayed() {
        let mut events = clean();
        events.extend([
            Event::Invoke {
                t: 1,
                op: 4,
                kind: Kind::Session,
                key: "s:1".into(),
                amount: None,
            },
            Event::Ok {
                t: 20,
                op: 4,
                status: 201,
                body: "b".into(),
                id: OTHER_KEY[..24].into(),
                replayed: false,
            },
            step("reserve", OTHER_KEY, 10),
            step("charge", OTHER_KEY, 10),
        ]);
        // Not sent again (acknowledged by the next request): nothing to judge.
        assert!(anomalies(&events).is_empty());
        events.extend(fault(15, "freeze-store", "store"));
        events.push(replayed(4, "b", false));
        assert_eq!(
            anomalies(&events),
            ["replay mismatch: op 4 (s:1): never came back replayed from a record"]
        );
    }

    #[test]
    fn an_answered_order_never_replayed_from_a_record_is_an_anomaly() {
        // A store that keeps nothing: every replay runs again.
        let mut events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::Replay { .. }))
            .collect();
        events.extend(fault(15, "freeze-store", "store"));
        events.push(replayed(1, "b", false));
        assert_eq!(
            anomalies(&events),
            ["replay mismatch: op 1 (k1): never came back replayed from a record"]
        );
        // Nor a replay that never got an answer.
        let events: Vec<Event> = clean()
            .into_iter()
            .filter(|e| !matches!(e, Event::Replay { .. }))
            .collect();
        assert_eq!(
            anomalies(&events),
            ["replay mismatch: op 1 (k1): never came back replayed from a record"]
        );
    }

    #[test]
    fn a_payment_run_again_before_its_record_may_name_another_charge_then_replays_it() {
        let mut events = clean();
        events.extend([
            Event::Invoke {
                t: 1,
                op: 9,
                kind: Kind::Payment,
                key: "y9".into(),
                amount: None,
            },
            Event::Attempt {
                t: 20,
                op: 9,
                target: "payments-1".into(),
                ms: 10,
                outcome: "201".into(),
            },
            Event::Ok {
                t: 20,
                op: 9,
                status: 201,
                body: "first".into(),
                id: String::new(),
                replayed: false,
            },
            Event::Charge {
                key: OP_KEY.into(),
                pid: 10,
            },
        ]);
        events.extend(fault(12, "pause-instance", "payments-1"));
        events.push(replayed(9, "second", false));
        events.push(replayed(9, "second", true));
        let report = check(&events);
        assert!(report.ok(), "{report}");
        assert_eq!(report.replays_rerun, 1);
        events.push(replayed(9, "first", true));
        assert_eq!(
            anomalies(&events),
            ["replay mismatch: op 9 (y9): replayed another body than it replayed before"]
        );
        // A run no client saw recorded: the first replay names another charge; counted.
        let mut events: Vec<Event> = events
            .into_iter()
            .filter(|e| !matches!(e, Event::Replay { op: 9, .. }))
            .collect();
        events.push(replayed(9, "unseen", true));
        events.push(replayed(9, "unseen", true));
        let report = check(&events);
        assert!(report.ok(), "{report}");
        assert_eq!(report.replays_rerun, 1);
    }

    #[test]
    fn only_the_time_beyond_a_pause_of_its_instance_counts_against_an_attempt() {
        let attempt = |ms: u64| Event::Attempt {
            t: 10_000 + ms,
            op: 1,
            target: "payments-0".into(),
            ms,
            outcome: "201".into(),
        };
        let mut events = clean();
        // Paused from 10 s to 15 s: 5 s of the attempt are the pause's.
        events.push(Event::FaultStart {
            t: 10_000,
            fault: 7,
            kind: "pause-instance".into(),
            target: "payments-0".into(),
        });
        events.push(Event::FaultEnd {
            t: 15_000,
            fault: 7,
        });
        events.push(attempt(5_500));
        assert!(anomalies(&events).is_empty());
        events.push(attempt(5_501));
        assert_eq!(
            anomalies(&events),
            ["slow attempt: op 1 (k1) waited 5501 ms for one answer"]
        );
    }

    #[test]
    fn charges_are_the_payments_answered() {
        let mut events = clean();
        events.push(Event::Client {
            t: 5,
            name: "c".into(),
            exit: 0,
            sent: 2,
            succeeded: 2,
        });
        events.push(Event::Charge {
            key: OP_KEY.into(),
            pid: 1,
        });
        assert_eq!(
            anomalies(&events),
            ["charge count: 1 payments charged (distinct operations), 2 answered"]
        );
        for key in [OP_KEY, OTHER_KEY, OTHER_KEY] {
            events.push(Event::Charge {
                key: key.into(),
                pid: 2,
            });
        }
        assert!(anomalies(&events).is_empty());
        events.push(Event::Client {
            t: 6,
            name: "d".into(),
            exit: 1,
            sent: 2,
            succeeded: 1,
        });
        let found = anomalies(&events);
        assert!(found.contains(&"client failed: d exited 1 with 1 of 2 payments".to_owned()));
    }

    #[test]
    fn outbox_steps_are_one_row_each() {
        let mut events = clean();
        events[0] = Event::Run {
            seed: 1,
            store: "postgres".into(),
            duration_ms: 1000,
            attempt_bound_ms: 500,
            finish_bound_ms: 1000,
            logged_steps: vec!["reserve".into(), "charge".into()],
            outbox_steps: vec!["receipt".into()],
        };
        assert_eq!(
            anomalies(&events),
            ["missing effect: op 1 (k1): step receipt never ran"]
        );
        let row = Event::OutboxStep {
            step: "receipt".into(),
            key: format!("{OP_KEY}.receipt"),
        };
        events.push(row.clone());
        assert!(anomalies(&events).is_empty());
        events.push(row);
        assert_eq!(
            anomalies(&events),
            ["duplicate effect: op 1 (k1): 2 outbox rows of step receipt"]
        );
    }
}
