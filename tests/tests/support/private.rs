//! Store servers of a test's own, for tests that disturb them: a private `redis-server` or
//! PostgreSQL server in a temporary directory, frozen with `SIGSTOP` / `SIGCONT` or (Redis)
//! reconfigured, or killed with `SIGKILL` and restarted, while the app uses it, and removed
//! when dropped.
//!
//! Starting one assumes its binaries are installed: whether a test runs without them (it says
//! so loudly) or fails (backends required) is the test's decision, made before it starts one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use super::{signal, within};

/// Processes stopped with `SIGSTOP`. Continued by [`thaw`](Frozen::thaw), or when dropped (a
/// failing test), so that no other guard waits on a frozen process.
pub struct Frozen {
    pids: Vec<u32>,
}

impl Frozen {
    fn new() -> Frozen {
        Frozen { pids: Vec::new() }
    }

    pub fn stop(&mut self, pid: u32) {
        assert!(signal(pid, "STOP"), "kill -STOP {pid}");
        self.pids.push(pid);
    }

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

static NAMES: AtomicU64 = AtomicU64::new(0);

/// A directory of this test's own, removed by its owner's `Drop`.
fn private_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idempotent-private-{name}-{}-{}",
        std::process::id(),
        NAMES.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The contents of `path` (a server's log) when a test fails, if any.
fn print_log_on_panic(label: &str, path: &Path) {
    if std::thread::panicking() {
        let log = std::fs::read_to_string(path).unwrap_or_default();
        eprintln!("----- {label} -----\n{log}----- end of {label} -----");
    }
}

/// A private `redis-server` with `maxmemory-policy noeviction`, its pid in a pid file. Killed
/// (by pid, `SIGKILL`, also if frozen) and removed when dropped.
pub struct PrivateRedis {
    child: Child,
    port: u16,
    dir: PathBuf,
    durable: bool,
}

impl PrivateRedis {
    /// Starts `redis-server` (which must be on `PATH`) in a directory named after `name`, and
    /// waits until it answers. No persistence.
    pub async fn start(name: &str) -> PrivateRedis {
        PrivateRedis::launch(name, false).await
    }

    /// Like [`start`](Self::start), with the append-only file on and fsynced before each
    /// reply (`appendfsync always`): whatever it acknowledged survives a `SIGKILL` and a
    /// [`restart`](Self::restart).
    pub async fn start_durable(name: &str) -> PrivateRedis {
        PrivateRedis::launch(name, true).await
    }

    async fn launch(name: &str, durable: bool) -> PrivateRedis {
        let dir = private_dir(&format!("redis-{name}"));
        let port = free_port();
        let child = PrivateRedis::spawn(&dir, port, durable);
        let redis = PrivateRedis {
            child,
            port,
            dir,
            durable,
        };
        redis.wait_ready().await;
        redis
    }

    fn spawn(dir: &Path, port: u16, durable: bool) -> Child {
        // A pid file left by a killed server would pass for the new one's.
        let _ = std::fs::remove_file(dir.join("redis.pid"));
        let persistence: &[&str] = if durable {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(persistence)
            .args(["--maxmemory-policy", "noeviction", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--pidfile")
            .arg(dir.join("redis.pid"))
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server: it must be on PATH (scripts/test.sh installs it)")
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(self.ping().await && self.dir.join("redis.pid").exists()) {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {} within 10 s",
                self.port
            );
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// `SIGKILL`s the server and waits until it has exited (its port then refuses
    /// connections).
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        within(
            "redis-server to exit after SIGKILL",
            Duration::from_secs(10),
            self.child.wait(),
        )
        .await
        .expect("wait for redis-server");
    }

    /// Starts the server again on the same port, with the same directory and settings
    /// (killing it first if it runs), and waits until it answers: a durable one has loaded
    /// its append-only file by then.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.child = PrivateRedis::spawn(&self.dir, self.port, self.durable);
        self.wait_ready().await;
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's pid, from its pid file.
    pub fn pid(&self) -> u32 {
        let text = std::fs::read_to_string(self.dir.join("redis.pid")).expect("redis pid file");
        text.trim().parse().expect("a pid in the pid file")
    }

    async fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(Ok(mut c)) = tokio::time::timeout(
            Duration::from_secs(1),
            client.get_multiplexed_async_connection(),
        )
        .await
        else {
            return false;
        };
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .is_ok()
    }

    /// `CONFIG SET name value`, bounded.
    pub async fn config_set(&self, name: &str, value: &str) {
        let client = redis::Client::open(self.url()).unwrap();
        within(
            &format!("CONFIG SET {name} {value}"),
            Duration::from_secs(5),
            async {
                let mut c = client.get_multiplexed_async_connection().await.unwrap();
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg(name)
                    .arg(value)
                    .query_async::<()>(&mut c)
                    .await
                    .unwrap_or_else(|e| panic!("CONFIG SET {name} {value}: {e}"));
            },
        )
        .await;
    }

    /// Stops the server's process: it keeps its connections but answers nothing.
    pub fn freeze(&self) -> Frozen {
        let mut frozen = Frozen::new();
        frozen.stop(self.pid());
        frozen
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        print_log_on_panic("redis-server log", &self.dir.join("redis.log"));
        // SIGKILL also ends a stopped process. Reaped here (bounded): the runtime that would
        // reap it may be gone by the time it exits.
        let _ = self.child.start_kill();
        for _ in 0..500 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory holding PostgreSQL's server binaries, if installed: `IDEMPOTENT_TEST_PG_BIN`,
/// or the newest `/usr/lib/postgresql/*/bin`.
pub fn postgres_bin() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("IDEMPOTENT_TEST_PG_BIN") {
        return Some(PathBuf::from(bin));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    found.sort();
    found.pop()
}

/// A private PostgreSQL server (as the postgres user when the tests run as root), in a
/// directory of its own. Continued, stopped (`pg_ctl -m immediate`) and removed when dropped.
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres_user: bool,
}

impl PrivatePostgres {
    /// Creates a cluster with the server binaries in `bin` (see [`postgres_bin`]) and starts
    /// it, waiting until it accepts connections.
    pub async fn start(bin: PathBuf) -> PrivatePostgres {
        let as_postgres_user = Command::new("id")
            .arg("-u")
            .output()
            .await
            .is_ok_and(|out| out.stdout.starts_with(b"0\n"));
        let server = PrivatePostgres {
            bin,
            dir: private_dir("postgres"),
            port: free_port(),
            as_postgres_user,
        };
        // PostgreSQL refuses to run as root: it runs as the postgres user, in a directory it
        // owns.
        if as_postgres_user {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&server.dir))
            .await;
        }
        run(server.command("initdb").arg("-D").arg(server.data()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
        ]))
        .await;
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            server.port,
            server.dir.display()
        );
        run(server
            .command("pg_ctl")
            .arg("-D")
            .arg(server.data())
            .arg("-l")
            .arg(server.log())
            .args(["-w", "-t", "60", "-o", &options, "start"]))
        .await;
        server
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut command = if self.as_postgres_user {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        };
        command.stdout(Stdio::null()).kill_on_drop(true);
        command
    }

    /// The postmaster's pid, the first line of `postmaster.pid`.
    fn postmaster(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// Stops the postmaster, then every process it started (backends, checkpointer, WAL
    /// writer...): the server keeps its connections but answers nothing.
    pub fn freeze(&self) -> Frozen {
        let postmaster = self.postmaster().expect("postmaster.pid");
        let mut frozen = Frozen::new();
        frozen.stop(postmaster);
        // Listed once the postmaster is stopped: it can start no more.
        for child in children(postmaster) {
            frozen.stop(child);
        }
        assert!(frozen.pids.len() > 1, "no PostgreSQL backends to freeze");
        frozen
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        print_log_on_panic("PostgreSQL log", &self.log());
        // A failing test may leave it stopped: `pg_ctl stop` would wait on it.
        if let Some(postmaster) = self.postmaster() {
            signal(postmaster, "CONT");
            for child in children(postmaster) {
                signal(child, "CONT");
            }
        }
        let pg_ctl = self.bin.join("pg_ctl");
        let mut stop = if self.as_postgres_user {
            let mut stop = std::process::Command::new("runuser");
            stop.args(["-u", "postgres", "--"]).arg(&pg_ctl);
            stop
        } else {
            std::process::Command::new(&pg_ctl)
        };
        let _ = stop
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-t", "30", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The pids of `parent`'s children.
fn children(parent: u32) -> Vec<u32> {
    let output = std::process::Command::new("pgrep")
        .args(["-P", &parent.to_string()])
        .output()
        .expect("pgrep (procps)");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

async fn run(command: &mut Command) {
    let output = within(
        &format!("{command:?}"),
        Duration::from_secs(90),
        command.output(),
    )
    .await
    .expect("run a PostgreSQL tool");
    assert!(output.status.success(), "{command:?} failed: {output:?}");
}
