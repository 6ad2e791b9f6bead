//! Running the `ledger` (and `relay`) examples as real processes, for the ledger's end-to-end
//! tests: a process wrapper that waits for the ready line, keeps the process's stderr (printed
//! if the test fails) and kills it with `SIGKILL` or stops it with `SIGTERM`; the postings a
//! workload publishes and the balances they must leave; a seeded generator and a polling
//! deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// A small deterministic generator, so a failing run can be repeated from its printed seed.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock (never 0); print it.
    pub fn from_clock() -> Rng {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Rng(nanos | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One posting of a workload: `amount` to `account`, under the idempotency key `id`.
#[derive(Clone, Debug)]
pub struct Posting {
    pub id: String,
    pub account: String,
    pub amount: i64,
}

impl Posting {
    /// The `i`-th distinct posting over `accounts` accounts: id `pay-i`, an amount between
    /// -1000 and 1000.
    pub fn nth(i: u64, accounts: u64) -> Posting {
        Posting {
            id: format!("pay-{i}"),
            account: format!("acct-{}", i % accounts),
            amount: ((i * 7919) % 2001) as i64 - 1000,
        }
    }
}

/// `distinct` postings over `accounts` accounts with duplicates, in publication order: every
/// eighth published again right after itself (a producer's retry), another eighth again at
/// least 100 entries after its original (a redelivery far from it), at a place `rng` picks.
pub fn postings(distinct: u64, accounts: u64, rng: &mut Rng) -> Vec<Posting> {
    let mut postings = Vec::new();
    let mut far = Vec::new();
    for i in 0..distinct {
        postings.push(Posting::nth(i, accounts));
        if i % 8 == 0 {
            postings.push(Posting::nth(i, accounts));
        }
        if i % 8 == 4 {
            far.push(i);
        }
    }
    for i in far {
        let id = format!("pay-{i}");
        let first = postings.iter().position(|p| p.id == id).unwrap();
        let from = (first + 100).min(postings.len());
        let at = from + rng.below((postings.len() - from + 1) as u64) as usize;
        postings.insert(at, Posting::nth(i, accounts));
    }
    postings
}

/// What a ledger that applies each id once must hold after `postings`: each account's balance,
/// the sum of its postings over distinct ids; and those ids.
pub fn expected_balances<'a>(
    postings: impl IntoIterator<Item = &'a Posting>,
) -> (BTreeMap<String, i64>, BTreeSet<String>) {
    let mut balances = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for posting in postings {
        if seen.insert(posting.id.clone()) {
            *balances.entry(posting.account.clone()).or_default() += posting.amount;
        }
    }
    (balances, seen)
}

/// Fails the test with `what` once `within` has passed; waits between checks.
pub struct Deadline {
    at: tokio::time::Instant,
    what: String,
}

impl Deadline {
    pub fn after(within: Duration, what: impl Into<String>) -> Deadline {
        Deadline {
            at: tokio::time::Instant::now() + within,
            what: what.into(),
        }
    }

    pub async fn tick(&self) {
        assert!(
            tokio::time::Instant::now() < self.at,
            "timed out: {}",
            self.what
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A running `ledger` (or `relay`) process; killed when dropped, and its stderr printed if the
/// test fails.
pub struct Consumer {
    child: Child,
    pub name: String,
    stdout: Option<Lines<BufReader<ChildStdout>>>,
    log: Arc<Mutex<String>>,
    /// How the line the process prints once it works starts.
    ready_line: &'static str,
}

impl Consumer {
    /// Starts the process without waiting for it to be ready.
    pub fn spawn(env: &[(&str, String)], name: impl Into<String>) -> Consumer {
        Consumer::spawn_example("ledger", "consuming ", env, name.into())
    }

    /// Starts a `relay` process and waits until it relays.
    pub async fn relay(env: &[(&str, String)], name: impl Into<String>) -> Consumer {
        let mut relay = Consumer::spawn_example("relay", "relaying to ", env, name.into());
        relay.ready().await;
        relay
    }

    pub fn spawn_example(
        example: &str,
        ready_line: &'static str,
        env: &[(&str, String)],
        name: String,
    ) -> Consumer {
        let mut child = Command::new(super::example_binary(example))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("CONSUMER", &name)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the ledger example");
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = Arc::clone(&log);
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                let mut log = sink.lock().unwrap_or_else(PoisonError::into_inner);
                log.push_str(&line);
                log.push('\n');
            }
        });
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Consumer {
            child,
            name,
            stdout: Some(stdout),
            log,
            ready_line,
        }
    }

    pub async fn start(env: &[(&str, String)], name: impl Into<String>) -> Consumer {
        let mut consumer = Consumer::spawn(env, name);
        consumer.ready().await;
        consumer
    }

    /// Waits for the line the consumer prints once it consumes.
    pub async fn ready(&mut self) {
        let mut lines = self.stdout.take().expect("not waited for yet");
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the consumer did not start within 30 s")
            .unwrap();
        let Some(line) = line else {
            let status = self.child.wait().await.unwrap();
            panic!("{} exited before it was ready: {status}", self.name);
        };
        let ready = match self.ready_line {
            "consuming " => line.ends_with(&format!(" as {}", self.name)),
            _ => true,
        };
        assert!(line.starts_with(self.ready_line) && ready, "{line}");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub async fn wait_for_log(&self, needle: &str, within: Duration) {
        let deadline = Deadline::after(within, format!("{} never logged {needle:?}", self.name));
        while !self.log().contains(needle) {
            deadline.tick().await;
        }
    }

    /// Its exit status if it has exited, `None` while it runs.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait on a consumer")
    }

    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running consumer");
        assert!(
            idempotent_test_kit::process::signal(pid, signal),
            "kill -{signal} {pid}"
        );
    }

    pub async fn kill(&mut self) {
        self.signal("KILL");
        let _ = self.child.wait().await;
    }

    /// SIGTERM: the consumer finishes the entry in hand and exits 0.
    pub async fn stop(&mut self) {
        self.signal("TERM");
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("the consumer did not stop on SIGTERM")
            .unwrap();
        assert!(status.success(), "{}: {status}", self.name);
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "----- {} stderr -----\n{}----- end of {} stderr -----",
                self.name,
                self.log(),
                self.name
            );
        }
    }
}
