//! Several processes on one database file: concurrent claims stay exactly-once across
//! processes, and a process killed with SIGKILL leaves a claim that is taken over (with its
//! checkpoints) once its lease lapses, and its completed records on disk.
//!
//! Each test re-runs this test binary as its child processes (`--exact <its own name>`),
//! with an environment variable that makes the test play the child's part; the parent reads
//! what each child did from a file (or a pipe) and counts.

use idempotent_core::CheckpointStore;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idempotent_core::steps::{Checkpoints, encode_checkpoint};
use idempotent_core::{Claim, Fingerprint, StorageKey, Store};
use idempotent_sqlite::SqliteStore;

/// The part a child plays; unset in the parent.
const ROLE: &str = "IDEMPOTENT_SQLITE_TEST_ROLE";
const DATABASE: &str = "IDEMPOTENT_SQLITE_TEST_DATABASE";
/// When (ms since the Unix epoch) the children of the concurrency test begin claiming.
const START_AT: &str = "IDEMPOTENT_SQLITE_TEST_START_AT";
const CHILD_ID: &str = "IDEMPOTENT_SQLITE_TEST_CHILD";
/// Where the children of the concurrency test say they have claimed, so that none completes
/// before every one has claimed (each loser then sees the winner's claim in flight).
const BARRIER: &str = "IDEMPOTENT_SQLITE_TEST_BARRIER";

const CHILDREN: usize = 4;
const KEYS: u64 = 100;
/// The crashing owner's lease.
const CRASH_LEASE: Duration = Duration::from_secs(5);

fn key(n: u64) -> StorageKey {
    let mut bytes = [0xa5; 32];
    bytes[..8].copy_from_slice(&n.to_be_bytes());
    StorageKey::from_bytes(bytes)
}

fn child_fingerprint(child: usize) -> Fingerprint {
    Fingerprint::from_bytes(format!("child {child}").as_bytes())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// This test binary, running only `test` with `role`.
fn child_command(test: &str, role: &str, database: &Path) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary's path"));
    command
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DATABASE, database)
        .stdin(Stdio::null());
    command
}

/// Waits for `child` at most `limit`; kills it past that.
fn wait(mut child: Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait for a child") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a child process ran longer than {limit:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn open(path: &Path) -> SqliteStore {
    SqliteStore::builder(path)
        // Contention between the processes is the point here, not the busy timeout.
        .busy_timeout(Duration::from_secs(30))
        .reap_every(None)
        .build()
        .await
        .expect("open the shared database")
}

/// `CHILDREN` processes open one new database file at once (creating it, switching it to
/// WAL and migrating it concurrently), then all claim the same `KEYS` keys at the same
/// moment, every key from many tasks of each process. Exactly one claim per key wins, every
/// other one sees the winner's fingerprint, and what each winner completed is what the key
/// replays afterwards.
#[test]
fn concurrent_claims_across_processes_win_once_per_key() {
    const TEST: &str = "concurrent_claims_across_processes_win_once_per_key";
    if std::env::var(ROLE).as_deref() == Ok("claimer") {
        return claimer();
    }
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("shared.db");
    let start_at = now_ms() + 2_000;
    let children: Vec<(PathBuf, Child)> = (0..CHILDREN)
        .map(|id| {
            let out = dir.path().join(format!("child-{id}.out"));
            let child = child_command(TEST, "claimer", &database)
                .env(START_AT, start_at.to_string())
                .env(CHILD_ID, id.to_string())
                .env(BARRIER, dir.path())
                .stdout(std::fs::File::create(&out).unwrap())
                .spawn()
                .expect("spawn a claiming process");
            (out, child)
        })
        .collect();
    // (key, child, token) of every win, and (key, child, fingerprint seen) of every loss.
    let mut wins = Vec::new();
    let mut losses = Vec::new();
    for (id, (out, child)) in children.into_iter().enumerate() {
        let status = wait(child, Duration::from_secs(120));
        let output = std::fs::read_to_string(&out).unwrap();
        assert!(status.success(), "child {id} failed: {status}\n{output}");
        assert!(
            output.lines().any(|l| l == "CHILD DONE"),
            "child {id} did not finish:\n{output}"
        );
        for line in output.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["CLAIM", n, "WON", token] => {
                    wins.push((n.parse::<u64>().unwrap(), id, token.parse::<u64>().unwrap()))
                }
                ["CLAIM", n, "LOST", seen] => {
                    losses.push((n.parse::<u64>().unwrap(), id, seen.to_string()))
                }
                ["CLAIM", ..] => panic!("child {id}: unexpected claim outcome {line:?}"),
                _ => {}
            }
        }
    }
    assert_eq!(
        wins.len() + losses.len(),
        CHILDREN * KEYS as usize,
        "every claim of every child answered"
    );
    assert_eq!(wins.len(), KEYS as usize, "exactly one win per key in all");
    let mut tokens: Vec<u64> = wins.iter().map(|&(_, _, token)| token).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), wins.len(), "no token issued twice");
    let winners: Vec<usize> = (0..CHILDREN)
        .map(|id| wins.iter().filter(|w| w.1 == id).count())
        .collect();
    eprintln!("wins per process: {winners:?}");
    for n in 0..KEYS {
        let won: Vec<_> = wins.iter().filter(|w| w.0 == n).collect();
        assert_eq!(won.len(), 1, "key {n}: wins {won:?}");
        let winner = won[0].1;
        let lost: Vec<_> = losses.iter().filter(|l| l.0 == n).collect();
        assert_eq!(
            lost.len(),
            CHILDREN - 1,
            "key {n}: every other process lost"
        );
        let expected = hex(child_fingerprint(winner).as_bytes());
        assert!(
            lost.iter().all(|l| l.2 == expected),
            "key {n}: a loser saw another fingerprint than the winner's: {lost:?}"
        );
    }
    // What the winners completed is on disk, for a process that opens the file afterwards.
    runtime().block_on(async {
        let store = open(&database).await;
        for &(n, winner, _) in &wins {
            match store
                .claim(
                    &key(n),
                    &Fingerprint::from_bytes(b"the parent"),
                    Duration::from_secs(5),
                    Duration::from_secs(5),
                )
                .await
            {
                Ok(Claim::Completed {
                    fingerprint,
                    payload,
                    ..
                }) => {
                    assert_eq!(fingerprint, child_fingerprint(winner), "key {n}");
                    assert_eq!(payload, format!("completed by child {winner}"), "key {n}");
                }
                other => panic!("key {n}: expected the winner's completion, got {other:?}"),
            }
        }
    });
}

/// The child's part: claim every key at once at `START_AT`, then complete the keys won.
fn claimer() {
    let database = PathBuf::from(std::env::var(DATABASE).unwrap());
    let start_at: u64 = std::env::var(START_AT).unwrap().parse().unwrap();
    let id: usize = std::env::var(CHILD_ID).unwrap().parse().unwrap();
    let fingerprint = child_fingerprint(id);
    runtime().block_on(async move {
        let store = open(&database).await;
        tokio::time::sleep(Duration::from_millis(start_at.saturating_sub(now_ms()))).await;
        // Each child goes through the keys from another place, so that they meet on every
        // key rather than following each other.
        let claims: Vec<_> = (0..KEYS)
            .map(|i| (i + id as u64 * KEYS / CHILDREN as u64) % KEYS)
            .map(|n| {
                let store = store.clone();
                tokio::spawn(async move {
                    let lease = Duration::from_secs(60);
                    (n, store.claim(&key(n), &fingerprint, lease, lease).await)
                })
            })
            .collect();
        let mut won = Vec::new();
        // The test harness has written "test <name> ... " without a newline.
        let mut out = String::from("\n");
        for claim in claims {
            match claim.await.unwrap() {
                (n, Ok(Claim::Claimed(token))) => {
                    out.push_str(&format!("CLAIM {n} WON {}\n", token.get()));
                    won.push((n, token));
                }
                (n, Ok(Claim::InFlight { fingerprint, .. })) => {
                    out.push_str(&format!("CLAIM {n} LOST {}\n", hex(fingerprint.as_bytes())));
                }
                (n, other) => out.push_str(&format!("CLAIM {n} FAILED {other:?}\n")),
            }
        }
        // Wait until every child has claimed every key before completing any.
        let barrier = PathBuf::from(std::env::var(BARRIER).unwrap());
        std::fs::write(barrier.join(format!("claimed-{id}")), b"").unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while (0..CHILDREN).any(|other| !barrier.join(format!("claimed-{other}")).exists()) {
            assert!(
                Instant::now() < deadline,
                "the other children never claimed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (n, token) in won {
            store
                .complete(
                    &key(n),
                    token,
                    Bytes::from(format!("completed by child {id}")),
                    Duration::from_secs(60),
                )
                .await
                .expect("the winner completes");
        }
        out.push_str("CHILD DONE\n");
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(out.as_bytes()).unwrap();
        stdout.flush().unwrap();
    });
}

const CRASHED: u64 = 1;
const COMPLETED: u64 = 2;

/// A child claims a key, saves a checkpoint and its request, completes another key, and is
/// killed with SIGKILL before it completes the first. The parent, reopening the file: the
/// completed record is there; the claim stays in flight until its lease lapses, is then
/// listed as abandoned, and the same request takes it over (its lifetime going on) with the
/// checkpoint readable; it completes, and a further claim replays that.
#[test]
fn a_killed_owner_is_taken_over_with_its_checkpoint_and_its_completions_stay() {
    const TEST: &str = "a_killed_owner_is_taken_over_with_its_checkpoint_and_its_completions_stay";
    if std::env::var(ROLE).as_deref() == Ok("crasher") {
        return crasher();
    }
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("crash.db");
    // The file and its tables exist before the child starts.
    runtime().block_on(async { drop(open(&database).await) });
    let mut child = child_command(TEST, "crasher", &database)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the process to kill");
    let stdout = child.stdout.take().unwrap();
    let (lines, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let _ = lines.send(line);
        }
    });
    let token = loop {
        match ready.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                // The harness's "test <name> ... " may begin the line.
                if let Some((_, token)) = line.split_once("READY ") {
                    break token.trim().parse::<u64>().unwrap();
                }
            }
            Err(error) => {
                let _ = child.kill();
                panic!("the child never got ready: {error}");
            }
        }
    };
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL the child");
    let status = child.wait().unwrap();
    {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "killed by SIGKILL: {status}");
    }

    runtime().block_on(async {
        let store = open(&database).await;
        let request = Fingerprint::from_bytes(b"the crashed request");
        let lease = Duration::from_secs(30);
        // Completed just before the kill: on disk.
        match store
            .claim(&key(COMPLETED), &request, lease, lease)
            .await
            .unwrap()
        {
            Claim::Completed {
                fingerprint,
                payload,
                ..
            } => {
                assert_eq!(fingerprint, request);
                assert_eq!(payload, "completed before the kill");
            }
            other => panic!("the completion made before the kill is lost: {other:?}"),
        }
        // Its lease still runs: in flight, for this request and any other.
        assert!(
            killed_at.elapsed() < CRASH_LEASE - Duration::from_secs(1),
            "too slow to see the lease running"
        );
        for f in [request, Fingerprint::from_bytes(b"another request")] {
            match store.claim(&key(CRASHED), &f, lease, lease).await.unwrap() {
                Claim::InFlight {
                    fingerprint,
                    retry_after,
                } => {
                    assert_eq!(fingerprint, request);
                    assert!(retry_after > Duration::ZERO && retry_after <= CRASH_LEASE);
                }
                other => panic!("expected the killed owner's lease, got {other:?}"),
            }
        }
        // Once it lapses the operation is abandoned, with its request.
        let deadline = Instant::now() + CRASH_LEASE + Duration::from_secs(10);
        let listed = loop {
            let found = store.abandoned(Duration::ZERO, 10, None).await.unwrap();
            if let Some(found) = found.into_iter().find(|a| a.key == key(CRASHED)) {
                break found;
            }
            assert!(Instant::now() < deadline, "the lease never lapsed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(listed.fingerprint, request);
        assert_eq!(listed.request, "the crashed request's bytes");
        // Another request is still refused; the same one takes it over.
        match store
            .claim(
                &key(CRASHED),
                &Fingerprint::from_bytes(b"another"),
                lease,
                lease,
            )
            .await
            .unwrap()
        {
            Claim::InFlight {
                fingerprint,
                retry_after,
            } => assert_eq!((fingerprint, retry_after), (request, Duration::ZERO)),
            other => panic!("another request took the abandoned key: {other:?}"),
        }
        let taken = store
            .claim(&key(CRASHED), &request, lease, lease)
            .await
            .unwrap();
        let Claim::TakenOver {
            token: new,
            lifetime,
        } = taken
        else {
            panic!("expected a takeover, got {taken:?}");
        };
        assert_eq!(lifetime.get(), token, "the killed owner's lifetime goes on");
        assert!(new.get() > token);
        let steps = Checkpoints::decode(store.load_steps(&key(CRASHED), new).await.unwrap())
            .expect("the checkpoint decodes");
        assert_eq!(
            steps.get("reserve").map(|v| v.as_ref()),
            Some(&b"\"r-1\""[..]),
            "the checkpoint saved before the kill"
        );
        store
            .complete(
                &key(CRASHED),
                new,
                Bytes::from_static(b"finished by the successor"),
                lease,
            )
            .await
            .unwrap();
        drop(store);
        // And a process opening the file after that replays it.
        let store = open(&database).await;
        match store
            .claim(&key(CRASHED), &request, lease, lease)
            .await
            .unwrap()
        {
            Claim::Completed { payload, .. } => {
                assert_eq!(payload, "finished by the successor")
            }
            other => panic!("expected the successor's completion, got {other:?}"),
        }
    });
}

/// The child's part: claim, checkpoint, keep the request, complete another key, say READY
/// with the claim's token, and wait to be killed.
fn crasher() {
    let database = PathBuf::from(std::env::var(DATABASE).unwrap());
    runtime().block_on(async move {
        let store = open(&database).await;
        let request = Fingerprint::from_bytes(b"the crashed request");
        let ttl = Duration::from_secs(60);
        let Ok(Claim::Claimed(token)) =
            store.claim(&key(CRASHED), &request, CRASH_LEASE, ttl).await
        else {
            panic!("the child's claim did not win");
        };
        store
            .save_step(
                &key(CRASHED),
                token,
                encode_checkpoint("reserve", b"\"r-1\""),
            )
            .await
            .unwrap();
        store
            .save_request(
                &key(CRASHED),
                token,
                Bytes::from_static(b"the crashed request's bytes"),
            )
            .await
            .unwrap();
        let Ok(Claim::Claimed(done)) = store
            .claim(&key(COMPLETED), &request, CRASH_LEASE, ttl)
            .await
        else {
            panic!("the child's second claim did not win");
        };
        store
            .complete(
                &key(COMPLETED),
                done,
                Bytes::from_static(b"completed before the kill"),
                ttl,
            )
            .await
            .unwrap();
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "\nREADY {}", token.get()).unwrap();
        stdout.flush().unwrap();
        drop(stdout);
        // Killed here.
        tokio::time::sleep(Duration::from_secs(600)).await;
        panic!("the child was not killed");
    });
}
