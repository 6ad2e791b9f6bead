//! Redis for tests: connections to a server by URL (the shared one is
//! [`redis_url`](crate::backend::redis_url)), and private `redis-server`s in a directory of
//! their own, for tests that freeze, reconfigure, kill or restart them.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use crate::backend::installed;
use crate::names::restartable_port;
use crate::netns::Netns;
use crate::process::{
    Frozen, find_program, kill_and_reap, print_logs_on_panic, scratch_dir, signal, within,
};

/// A connection to the server at `url`, or `None` if none answers within a second.
pub async fn try_connect(url: &str) -> Option<MultiplexedConnection> {
    let client = redis::Client::open(url).ok()?;
    tokio::time::timeout(
        Duration::from_secs(1),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()
}

/// A connection to the server at `url`.
pub async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}; is redis-server running?"))
}

/// A private `redis-server` with `maxmemory-policy noeviction`, its pid in a pid file, on a
/// free loopback port. Killed (by pid, `SIGKILL`, also if frozen) and removed when dropped.
pub struct PrivateRedis {
    /// The server, while it runs.
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    durable: bool,
    /// The address it listens on.
    host: Ipv4Addr,
    /// The network namespace it runs in, if not the host's.
    netns: Option<String>,
}

impl PrivateRedis {
    /// Starts `redis-server` in a directory named after `name`, and waits until it answers. No
    /// persistence. `None` when `redis-server` is not installed (see
    /// [`installed`]).
    pub async fn start(name: &str) -> Option<PrivateRedis> {
        PrivateRedis::launch(name, false, None).await
    }

    /// Like [`start`](Self::start), in the network namespace `netns`, listening on its
    /// address ([`Netns::address`]): [`Netns::cut`] partitions it from the host.
    pub async fn start_in(name: &str, netns: &Netns) -> Option<PrivateRedis> {
        PrivateRedis::launch(name, false, Some(netns)).await
    }

    /// Like [`start`](Self::start), with the append-only file on and fsynced before each
    /// reply (`appendfsync always`): whatever it acknowledged survives a `SIGKILL` and a
    /// [`restart`](Self::restart).
    pub async fn start_durable(name: &str) -> Option<PrivateRedis> {
        PrivateRedis::launch(name, true, None).await
    }

    /// Like [`start_durable`](Self::start_durable), in the network namespace `netns`,
    /// listening on its address: a broker that keeps its streams across
    /// [`restart`](Self::restart) and that [`Netns::cut`] partitions from the host.
    pub async fn start_durable_in(name: &str, netns: &Netns) -> Option<PrivateRedis> {
        PrivateRedis::launch(name, true, Some(netns)).await
    }

    async fn launch(name: &str, durable: bool, netns: Option<&Netns>) -> Option<PrivateRedis> {
        installed("redis-server", find_program("redis-server"))?;
        let mut redis = PrivateRedis {
            child: None,
            port: restartable_port(),
            dir: scratch_dir(&format!("redis-{name}")),
            durable,
            host: netns.map_or(Ipv4Addr::LOCALHOST, Netns::address),
            netns: netns.map(|netns| netns.name().to_owned()),
        };
        redis.spawn().await;
        Some(redis)
    }

    async fn spawn(&mut self) {
        // A pid file left by a killed server would pass for the new one's.
        let _ = std::fs::remove_file(self.pid_file());
        let persistence: &[&str] = if self.durable {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        // `ip netns exec` executes the server in place: the child's pid is the server's.
        let mut command = match &self.netns {
            None => Command::new("redis-server"),
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", netns, "redis-server"]);
                command
            }
        };
        let child = command
            .args(["--port", &self.port.to_string()])
            .args(["--bind", &self.host.to_string()])
            // On a namespace's address the host is not a loopback client.
            .args(["--protected-mode", "no"])
            .args(["--save", ""])
            .args(persistence)
            .args(["--maxmemory-policy", "noeviction", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--pidfile")
            .arg(self.pid_file())
            .arg("--logfile")
            .arg(self.log())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(self.ping().await && self.pid_file().exists()) {
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
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.start_kill();
        within(
            "redis-server to exit after SIGKILL",
            Duration::from_secs(10),
            child.wait(),
        )
        .await
        .expect("wait for redis-server");
    }

    /// Stops the server cleanly (`SIGTERM`: a durable one flushes its append-only file) and
    /// waits until it has exited.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id().expect("running redis-server");
        assert!(signal(pid, "TERM"), "kill -TERM {pid}");
        within(
            "redis-server to exit after SIGTERM",
            Duration::from_secs(10),
            child.wait(),
        )
        .await
        .expect("wait for redis-server");
    }

    /// Starts the server again on the same port, with the same directory and settings
    /// (killing it first if it runs), and waits until it answers: a durable one has loaded
    /// its append-only file by then.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    /// `redis://127.0.0.1:PORT` (in a namespace, its address instead of 127.0.0.1).
    pub fn url(&self) -> String {
        format!("redis://{}:{}", self.host, self.port)
    }

    /// A new connection to the server.
    pub async fn connection(&self) -> MultiplexedConnection {
        connect(&self.url()).await
    }

    /// The server's pid, from its pid file.
    pub fn pid(&self) -> u32 {
        let text = std::fs::read_to_string(self.pid_file()).expect("redis pid file");
        text.trim().parse().expect("a pid in the pid file")
    }

    /// `CONFIG SET name value`, bounded.
    pub async fn config_set(&self, name: &str, value: &str) {
        within(
            &format!("CONFIG SET {name} {value}"),
            Duration::from_secs(5),
            async {
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg(name)
                    .arg(value)
                    .query_async::<()>(&mut self.connection().await)
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

    async fn ping(&self) -> bool {
        let Some(mut connection) = try_connect(&self.url()).await else {
            return false;
        };
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
            .is_ok()
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.join("redis.pid")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("redis.log")
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        print_logs_on_panic("redis-server", &[self.log()]);
        // SIGKILL also ends a stopped process.
        if let Some(child) = self.child.as_mut() {
            kill_and_reap(child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
