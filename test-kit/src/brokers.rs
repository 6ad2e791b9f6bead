//! Message brokers of a test's own, for tests that kill them and start them again: a private
//! `nats-server` with JetStream (file store), a private RabbitMQ node, or a private
//! Kafka-protocol broker (`nisshi`, SQLite storage), each in a temporary directory on free
//! loopback ports that no other process takes while it is down
//! ([`restartable_port`]). [`kill`](PrivateNats::kill) is `SIGKILL` (for RabbitMQ, to the
//! node's whole process group); [`restart`](PrivateNats::restart) starts the broker again
//! on the same port with the same data; dropping one kills it and removes its directory.
//!
//! The constructors return `None` when the broker is not installed, as
//! [`installed`] decides (scripts/services.sh installs both from
//! Debian packages). No client library is used: a broker is ready when its port answers
//! with the protocol's greeting (NATS: an `INFO` announcing JetStream; RabbitMQ: a
//! `connection.start` frame, and the node's log saying its boot is complete, or else
//! `rabbitmqctl await_startup`). [`PrivateRabbit::rabbitmqctl`] runs the broker's own CLI
//! against the node, [`shared_rabbitmqctl`] against the shared node.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

use crate::backend::{NISSHI, RABBITMQCTL, installed};
use crate::names::restartable_port;
use crate::process::{
    find_program, has_programs, kill_and_reap, kill_group, print_logs_on_panic, scratch_dir, tail,
    within,
};

/// How long a broker may take to start (RabbitMQ takes seconds; more on a loaded machine).
const START_LIMIT: Duration = Duration::from_secs(90);
/// How long a killed broker's processes may take to disappear.
const EXIT_LIMIT: Duration = Duration::from_secs(10);

// ----- installed or not -----

/// The directory of RabbitMQ's own scripts (`rabbitmq-server`, `rabbitmqctl`). Debian's
/// `/usr/sbin` ones are wrappers that, run as root, switch to the rabbitmq user (its home, its
/// Erlang cookie) and refuse other users: the real ones are in `/usr/lib/rabbitmq/bin`.
/// Elsewhere (a generic-unix install), the directory of the `rabbitmq-server` on `PATH`.
fn rabbitmq_scripts() -> Option<PathBuf> {
    let on_path = find_program("rabbitmq-server").and_then(|p| Some(p.parent()?.to_owned()));
    [Some(PathBuf::from("/usr/lib/rabbitmq/bin")), on_path]
        .into_iter()
        .flatten()
        .find(|dir| has_programs(dir, &["rabbitmq-server", "rabbitmqctl"]))
}

// ----- shared pieces -----

/// `path` opened for appending (a log that a restart continues), for a child's stdout/stderr.
fn append(path: &Path) -> (Stdio, Stdio) {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let clone = file.try_clone().expect("clone a file handle");
    (Stdio::from(file), Stdio::from(clone))
}

/// Whether a thread of process group `pgid` still runs. Zombies do not count (this machine's
/// init may never reap an orphan), but a killed multi-threaded process (the Erlang VM) whose
/// main thread is already a zombie still holds its ports and files until its other threads are
/// gone: threads are what is looked at.
fn group_alive(pgid: u32) -> bool {
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return false;
    };
    processes.filter_map(Result::ok).any(|process| {
        if !process
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            return false;
        }
        let Ok(threads) = std::fs::read_dir(process.path().join("task")) else {
            return false;
        };
        threads.filter_map(Result::ok).any(|thread| {
            let Ok(stat) = std::fs::read_to_string(thread.path().join("stat")) else {
                return false;
            };
            // `pid (comm) state ppid pgrp ...`; comm may hold spaces and parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.len() > 2
                && !matches!(fields[0], "Z" | "X")
                && fields[2].parse::<u32>().is_ok_and(|group| group == pgid)
        })
    })
}

/// Whether loopback `port` can be bound (no listener holds it).
fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Panics with `logs` if `child` has exited (a broker that could not start).
fn assert_running(child: &mut Child, what: &str, logs: &[PathBuf]) {
    if let Ok(Some(status)) = child.try_wait() {
        let text: Vec<String> = logs
            .iter()
            .map(|path| format!("--- {} ---\n{}", path.display(), tail(path, 16 * 1024)))
            .collect();
        panic!(
            "{what} exited ({status}) while starting:\n{}",
            text.join("\n")
        );
    }
}

/// Whether something accepts TCP connections on loopback `port` right now.
pub async fn accepts(port: u16) -> bool {
    matches!(
        timeout(
            Duration::from_secs(1),
            TcpStream::connect(("127.0.0.1", port))
        )
        .await,
        Ok(Ok(_))
    )
}

// ----- NATS -----

/// A private `nats-server` with JetStream, its file store in a directory of its own, on a free
/// loopback port. Killed (`SIGKILL`) and removed when dropped.
pub struct PrivateNats {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// The server, while it runs.
    child: Option<Child>,
}

impl PrivateNats {
    /// Starts one and waits until it greets clients with JetStream enabled; `None` when
    /// `nats-server` is not installed (see the module's documentation).
    pub async fn start() -> Option<PrivateNats> {
        let bin = installed("nats-server", find_program("nats-server"))?;
        let mut nats = PrivateNats {
            bin,
            dir: scratch_dir("nats"),
            port: restartable_port(),
            child: None,
        };
        nats.spawn().await;
        Some(nats)
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port on loopback.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (`-sd`), kept across restarts.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.join("store")
    }

    /// The server's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    /// `SIGKILL`s the server and waits until it is gone (its port then refuses connections).
    pub async fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.start_kill();
        within(
            "nats-server to exit after SIGKILL",
            EXIT_LIMIT,
            child.wait(),
        )
        .await
        .expect("wait for nats-server");
    }

    /// Starts the server again on the same port with the same store (killing it first if it
    /// runs), and waits until it is ready.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    fn log(&self) -> PathBuf {
        self.dir.join("nats.log")
    }

    fn stderr(&self) -> PathBuf {
        self.dir.join("stderr.log")
    }

    async fn spawn(&mut self) {
        let (stdout, stderr) = append(&self.stderr());
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.store_dir())
            .arg("-l")
            .arg(self.log())
            .arg("-P")
            .arg(self.dir.join("nats.pid"))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let logs = [self.log(), self.stderr()];
        let deadline = Instant::now() + START_LIMIT;
        loop {
            assert_running(self.child.as_mut().unwrap(), "nats-server", &logs);
            if self.greets_with_jetstream().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not start on port {} within {START_LIMIT:?}",
                self.port
            );
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the server greets a client with an `INFO` announcing JetStream (which it
    /// enables, recovering its streams, before it opens the client port).
    async fn greets_with_jetstream(&self) -> bool {
        let greeting = async {
            let stream = TcpStream::connect(("127.0.0.1", self.port)).await.ok()?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).await.ok()?;
            Some(line)
        };
        timeout(Duration::from_secs(2), greeting)
            .await
            .ok()
            .flatten()
            .is_some_and(|line| line.starts_with("INFO ") && line.contains("\"jetstream\":true"))
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        print_logs_on_panic("nats-server", &[self.log(), self.stderr()]);
        if let Some(child) = self.child.as_mut() {
            kill_and_reap(child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ----- Kafka -----

/// The Kafka-protocol broker's binary: `IDEMPOTENT_TEST_NISSHI` (which scripts/services.sh
/// sets to the one it built into its cache), else `nisshi` on `PATH`.
pub fn nisshi_program() -> Option<PathBuf> {
    std::env::var_os(NISSHI)
        .map(PathBuf::from)
        .filter(|path| path.is_file())
        .or_else(|| find_program("nisshi"))
}

/// A private Kafka-protocol broker (`nisshi broker`) on a free loopback port, its log kept
/// in an SQLite file in its own directory, so that a `SIGKILL` and a restart keep every record
/// it acknowledged, and the consumer groups' offsets. Killed and removed when dropped.
pub struct PrivateKafka {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PrivateKafka {
    /// Starts one and waits until it accepts connections; `None` when `nisshi` is not
    /// installed (scripts/services.sh builds it into a cache).
    pub async fn start() -> Option<PrivateKafka> {
        let bin = installed("nisshi (the Kafka-protocol broker)", nisshi_program())?;
        let mut kafka = PrivateKafka {
            bin,
            dir: scratch_dir("kafka"),
            port: restartable_port(),
            child: None,
        };
        kafka.spawn().await;
        Some(kafka)
    }

    /// `127.0.0.1:PORT`, as Kafka clients take their bootstrap servers.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `kafka://127.0.0.1:PORT`, as the examples take it.
    pub fn url(&self) -> String {
        format!("kafka://127.0.0.1:{}", self.port)
    }

    /// The broker's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    /// `SIGKILL`s the broker and waits until it is gone.
    pub async fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.start_kill();
        within("nisshi to exit after SIGKILL", EXIT_LIMIT, child.wait())
            .await
            .expect("wait for nisshi");
    }

    /// Starts the broker again on the same port with the same storage (killing it first if
    /// it runs), and waits until it is ready.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    fn log(&self) -> PathBuf {
        self.dir.join("nisshi.log")
    }

    async fn spawn(&mut self) {
        let (stdout, stderr) = append(&self.log());
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new(&self.bin)
            .arg("broker")
            .args(["--kafka-listener-url", &listener])
            .args(["--kafka-advertised-listener-url", &listener])
            .args(["--storage-engine", "sqlite://kafka.db"])
            .args(["--group-initial-rebalance-delay", "0s"])
            .current_dir(&self.dir)
            .env_remove("STORAGE_ENGINE")
            .env_remove("LISTENER_URL")
            .env_remove("ADVERTISED_LISTENER_URL")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let logs = [self.log()];
        let deadline = Instant::now() + START_LIMIT;
        loop {
            assert_running(self.child.as_mut().unwrap(), "nisshi", &logs);
            if accepts(self.port).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nisshi did not start on port {} within {START_LIMIT:?}",
                self.port
            );
            sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        print_logs_on_panic("nisshi", &[self.log()]);
        if let Some(child) = self.child.as_mut() {
            kill_and_reap(child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ----- RabbitMQ -----

/// A private RabbitMQ node: its own node name (`rabbit-PORT@localhost`), AMQP port and
/// distribution port (free loopback ports), data (Mnesia, quorum queues) and log directories,
/// config and Erlang cookie (its `HOME` is its directory: the user's is not touched), no
/// plugins. The `rabbitmq-server` script runs as the leader of a process group that holds the
/// Erlang VM, so that a kill hits the whole node. Killed and removed when dropped.
pub struct PrivateRabbit {
    scripts: PathBuf,
    dir: PathBuf,
    port: u16,
    dist_port: u16,
    node: String,
    /// The `rabbitmq-server` script, leader of the node's process group, while it runs.
    child: Option<Child>,
    /// That process group's id (the script's pid), while it runs.
    pgid: Option<u32>,
}

impl PrivateRabbit {
    /// Starts one and waits until it accepts AMQP connections and has booted; `None` when
    /// RabbitMQ is not installed (see the module's documentation).
    pub async fn start() -> Option<PrivateRabbit> {
        Self::start_with_config("").await
    }

    /// [`start`](Self::start), with `config` (lines of `rabbitmq.conf`, such as
    /// `max_message_size = 8192`) added to the node's configuration file.
    pub async fn start_with_config(config: &str) -> Option<PrivateRabbit> {
        let scripts = installed("rabbitmq-server", rabbitmq_scripts())?;
        let port = restartable_port();
        let mut rabbit = PrivateRabbit {
            scripts,
            dir: scratch_dir("rabbitmq"),
            port,
            dist_port: restartable_port(),
            node: format!("rabbit-{port}@localhost"),
            child: None,
            pgid: None,
        };
        rabbit.write_files(config);
        rabbit.spawn().await;
        Some(rabbit)
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f` (the default user, allowed from loopback).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The client port on loopback.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The node's name, for `rabbitmqctl -n` (see [`rabbitmqctl`](Self::rabbitmqctl)).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The Erlang VM's pid (from the node's pid file), while it runs.
    pub fn beam_pid(&self) -> Option<u32> {
        self.child.as_ref()?;
        std::fs::read_to_string(self.dir.join("rabbit.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Runs `rabbitmqctl -n NODE args...` with the node's cookie and environment (bounded);
    /// its output, whatever its exit status.
    pub async fn rabbitmqctl(&self, args: &[&str]) -> Output {
        let mut command = Command::new(self.scripts.join("rabbitmqctl"));
        self.environment(&mut command);
        command
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        within(
            &format!("rabbitmqctl {}", args.join(" ")),
            START_LIMIT,
            command.output(),
        )
        .await
        .expect("run rabbitmqctl")
    }

    /// `SIGKILL`s the node's whole process group (the script and the Erlang VM) and waits
    /// until none of it runs (its ports then refuse connections; quorum queues stay on disk).
    pub async fn kill(&mut self) {
        let (Some(mut child), Some(pgid)) = (self.child.take(), self.pgid.take()) else {
            return;
        };
        kill_group(pgid);
        within(
            "rabbitmq-server to exit after SIGKILL",
            EXIT_LIMIT,
            child.wait(),
        )
        .await
        .expect("wait for rabbitmq-server");
        let deadline = Instant::now() + EXIT_LIMIT;
        while group_alive(pgid) || !port_free(self.port) || !port_free(self.dist_port) {
            assert!(
                Instant::now() < deadline,
                "RabbitMQ (process group {pgid}, ports {} and {}) still runs {EXIT_LIMIT:?} \
                 after SIGKILL",
                self.port,
                self.dist_port
            );
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the node again with the same node name, ports, data and environment (killing it
    /// first if it runs), and waits until it accepts AMQP connections and has booted.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    fn log(&self) -> PathBuf {
        self.dir.join("log").join("rabbit.log")
    }

    fn stdout(&self) -> PathBuf {
        self.dir.join("stdout.log")
    }

    /// The cookie, an empty plugin list, an empty `rabbitmq-env.conf` (so that
    /// `/etc/rabbitmq`'s is not read) and a config file ending with `config`.
    fn write_files(&self, config: &str) {
        std::fs::create_dir_all(self.dir.join("mnesia")).unwrap();
        std::fs::create_dir_all(self.dir.join("log")).unwrap();
        let cookie: String = (0..20).map(|_| fastrand::uppercase()).collect();
        let mut file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o400)
            .open(self.dir.join(".erlang.cookie"))
            .expect("write the Erlang cookie");
        file.write_all(cookie.as_bytes()).unwrap();
        std::fs::write(self.dir.join("enabled_plugins"), "[].\n").unwrap();
        File::create(self.dir.join("rabbitmq-env.conf")).unwrap();
        // The listener, node name and ports come from the environment.
        std::fs::write(
            self.dir.join("rabbitmq.conf"),
            format!("loopback_users.guest = true\n{config}\n"),
        )
        .unwrap();
    }

    /// The environment of the node and of `rabbitmqctl`: none of the caller's `RABBITMQ_*`.
    fn environment(&self, command: &mut Command) {
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("RABBITMQ_") {
                command.env_remove(name);
            }
        }
        let path = |name: &str| self.dir.join(name);
        command
            .env("HOME", &self.dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_LOGS", self.log())
            .env("RABBITMQ_PID_FILE", path("rabbit.pid"))
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            // rabbitmqctl's own distribution port: any free one, not one of 35672-35682
            // (parallel tests run many).
            .env("RABBITMQ_CTL_DIST_PORT_MIN", "0")
            .env("RABBITMQ_CTL_DIST_PORT_MAX", "0")
            // epmd, if this node starts it, listens on loopback only.
            .env("ERL_EPMD_ADDRESS", "127.0.0.1");
    }

    async fn spawn(&mut self) {
        // Where this boot's part of the log (which a restart continues) begins.
        let log_start = std::fs::metadata(self.log()).map_or(0, |m| m.len());
        let (stdout, stderr) = append(&self.stdout());
        let mut command = Command::new(self.scripts.join("rabbitmq-server"));
        self.environment(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            // A process group of its own, led by the script, holding the Erlang VM: what
            // `kill` and `Drop` kill.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.scripts.display()));
        self.pgid = child.id();
        self.child = Some(child);
        let logs = [self.stdout(), self.log()];
        let deadline = Instant::now() + START_LIMIT;
        // Ready when the AMQP listener answers and the node has logged the end of its boot
        // (some 50 ms later). Should that line not come (another log format), `rabbitmqctl
        // await_startup` decides: it is not the first choice because it costs half a second
        // or more (an Erlang VM of its own), and it fails at once while the node is not yet
        // registered with epmd.
        let mut greeted: Option<Instant> = None;
        loop {
            assert_running(self.child.as_mut().unwrap(), "rabbitmq-server", &logs);
            if greeted.is_none() && amqp_greets(self.port).await {
                greeted = Some(Instant::now());
            }
            if let Some(greeted) = greeted {
                if self.logged_since(log_start, "Server startup complete") {
                    return;
                }
                if greeted.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ did not accept AMQP connections on port {} within {START_LIMIT:?}",
                self.port
            );
            sleep(Duration::from_millis(25)).await;
        }
        let output = self
            .rabbitmqctl(&["-q", "await_startup", "--timeout", "60"])
            .await;
        assert!(
            output.status.success(),
            "rabbitmqctl await_startup failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Whether the node's log holds `needle` after its first `start` bytes.
    fn logged_since(&self, start: u64, needle: &str) -> bool {
        let text = std::fs::read(self.log()).unwrap_or_default();
        let start = usize::try_from(start).unwrap_or(usize::MAX).min(text.len());
        String::from_utf8_lossy(&text[start..]).contains(needle)
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        print_logs_on_panic("RabbitMQ", &[self.stdout(), self.log()]);
        if let Some(pgid) = self.pgid.take() {
            kill_group(pgid);
            if let Some(child) = self.child.as_mut() {
                kill_and_reap(child);
            }
            // Bounded: the directory goes only once the node no longer writes to it.
            for _ in 0..500 {
                if !group_alive(pgid) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether RabbitMQ's AMQP listener on loopback `port` answers a protocol header with a
/// `connection.start` method frame (type 1).
async fn amqp_greets(port: u16) -> bool {
    let greeting = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        let mut frame_type = [0u8; 1];
        stream.read_exact(&mut frame_type).await.ok()?;
        Some(frame_type[0])
    };
    timeout(Duration::from_secs(2), greeting).await == Ok(Some(1))
}

/// Runs `rabbitmqctl args...` against the shared RabbitMQ node; its output. The command is
/// `IDEMPOTENT_TEST_RABBITMQCTL` (split on spaces, e.g. `rabbitmqctl -n rabbit@localhost`),
/// else `$SERVICES_DIR/rabbitmq/rabbitmqctl` (what `scripts/services.sh` writes), else
/// `rabbitmqctl`.
pub fn shared_rabbitmqctl(args: &[&str]) -> String {
    let command = std::env::var(RABBITMQCTL)
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| {
            let dir = std::env::var("SERVICES_DIR").ok()?;
            let path = format!("{dir}/rabbitmq/rabbitmqctl");
            Path::new(&path).exists().then_some(path)
        })
        .unwrap_or_else(|| "rabbitmqctl".to_owned());
    let mut words = command.split_whitespace();
    let program = words.next().unwrap_or("rabbitmqctl");
    let how = format!("set {RABBITMQCTL} to a rabbitmqctl command for the test node");
    let output = std::process::Command::new(program)
        .args(words)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{command}`: {e}; {how}"));
    assert!(
        output.status.success(),
        "`{command} {}` failed ({}): {}{}; {how}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
