//! PostgreSQL for tests: pools on the shared server (`IDEMPOTENT_TEST_POSTGRES_URL`), a
//! database of a test's own on it, and private servers in a directory of their own, for tests
//! that freeze, stop or restart them.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::str::FromStr as _;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::process::Command;

use crate::backend::{PG_BIN, installed, postgres_url};
use crate::names::restartable_port;
use crate::netns::Netns;
use crate::process::{
    Frozen, children, has_programs, print_logs_on_panic, scratch_dir, signal, within,
};

/// How long a test waits for a connection from a pool before it fails.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// A pool of at most `connections` on `url`, each wait for a connection bounded.
pub async fn pool(url: &str, connections: u32) -> PgPool {
    connect(url, connections, PgConnectOptions::from_str(url).unwrap()).await
}

/// Like [`pool`], with every lock wait bounded on the server too (`lock_timeout`, 30 s): a
/// test whose transactions contend fails rather than hangs.
pub async fn pool_bounding_locks(url: &str, connections: u32) -> PgPool {
    let options = PgConnectOptions::from_str(url)
        .unwrap()
        .options([("lock_timeout", "30s")]);
    connect(url, connections, options).await
}

async fn connect(url: &str, connections: u32, options: PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}; is PostgreSQL running?"))
}

/// A pool of at most `connections` on the shared server, or `None` when it is not configured
/// (see [`backend_url`](crate::backend::backend_url)).
pub async fn shared_pool(connections: u32) -> Option<PgPool> {
    let url = postgres_url()?;
    Some(pool(&url, connections).await)
}

/// A database of one test's own on the shared server, created afresh.
pub struct Database {
    /// A pool on the server's own database, which created this one.
    pub admin: PgPool,
    /// Its name.
    pub name: String,
    /// Its URL.
    pub url: String,
}

impl Database {
    /// Creates the database `name` afresh (dropping one left by an earlier run); `None` when
    /// the shared server is not configured (see [`backend_url`](crate::backend::backend_url)).
    pub async fn create(name: &str) -> Option<Database> {
        let server = postgres_url()?;
        let admin = pool(&server, 2).await;
        for statement in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::query(&statement).execute(&admin).await.unwrap();
        }
        let url = format!("{}/{name}", server.rsplit_once('/').unwrap().0);
        Some(Database {
            admin,
            name: name.to_owned(),
            url,
        })
    }

    /// A new pool on the database.
    pub async fn pool(&self) -> PgPool {
        PgPool::connect(&self.url).await.unwrap()
    }

    /// Drops the database, closing whatever connections are left on it.
    pub async fn drop_database(self) {
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&self.admin)
        .await
        .unwrap();
    }
}

/// The directory of PostgreSQL's server binaries, if installed: `IDEMPOTENT_TEST_PG_BIN` when
/// set, else the newest `/usr/lib/postgresql/*/bin` (where Debian installs them).
pub fn postgres_bin() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os(PG_BIN).filter(|bin| !bin.is_empty()) {
        return Some(PathBuf::from(bin));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .filter(|bin| has_programs(bin, &["initdb", "pg_ctl"]))
        .collect();
    found.sort();
    found.pop()
}

/// A private PostgreSQL server (as the postgres user when the tests run as root), in a
/// directory of its own, on a free loopback port. Continued, stopped (`pg_ctl -m immediate`)
/// and removed when dropped.
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres_user: bool,
    /// The address it listens on.
    host: Ipv4Addr,
    /// The network namespace it runs in, if not the host's.
    netns: Option<String>,
}

impl PrivatePostgres {
    /// Creates a cluster and starts it, waiting until it accepts connections; `None` when
    /// PostgreSQL's server binaries are not installed (see [`postgres_bin`] and
    /// [`installed`]).
    pub async fn start() -> Option<PrivatePostgres> {
        PrivatePostgres::launch(None).await
    }

    /// Like [`start`](Self::start), in the network namespace `netns`, listening on its
    /// address ([`Netns::address`]): [`Netns::cut`] partitions it from the host.
    pub async fn start_in(netns: &Netns) -> Option<PrivatePostgres> {
        PrivatePostgres::launch(Some(netns)).await
    }

    async fn launch(netns: Option<&Netns>) -> Option<PrivatePostgres> {
        let bin = installed(
            "PostgreSQL's server binaries (initdb, pg_ctl; IDEMPOTENT_TEST_PG_BIN or \
             /usr/lib/postgresql/*/bin)",
            postgres_bin(),
        )?;
        let as_postgres_user = Command::new("id")
            .arg("-u")
            .output()
            .await
            .is_ok_and(|out| out.stdout.starts_with(b"0\n"));
        let server = PrivatePostgres {
            bin,
            dir: scratch_dir("postgres"),
            port: restartable_port(),
            as_postgres_user,
            host: netns.map_or(Ipv4Addr::LOCALHOST, Netns::address),
            netns: netns.map(|netns| netns.name().to_owned()),
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
        if netns.is_some() {
            // The host reaches a server in a namespace over the veth pair, not loopback.
            let hba = server.data().join("pg_hba.conf");
            let mut rules = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
            rules.push_str("\nhost all all 10.200.0.0/16 trust\n");
            std::fs::write(&hba, rules).expect("write pg_hba.conf");
        }
        server.start_again().await;
        Some(server)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres` (in a namespace, its address instead of
    /// 127.0.0.1).
    pub fn url(&self) -> String {
        format!("postgres://postgres@{}:{}/postgres", self.host, self.port)
    }

    /// Stops the server (`pg_ctl stop -m fast`: sessions are ended, committed data kept) and
    /// waits until it has; its port then refuses connections.
    pub async fn stop(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "stop"]))
        .await;
    }

    /// Starts the stopped server again on the same port with the same data, and waits until it
    /// accepts connections.
    pub async fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses={} -c fsync=off",
            self.port,
            self.dir.display(),
            self.host
        );
        // In the namespace: the server listens on its address, and `pg_ctl -w` checks it there.
        let mut start = Command::from(self.std_command_in(self.netns.as_deref(), "pg_ctl"));
        start.stdout(Stdio::null()).kill_on_drop(true);
        run(start
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(["-w", "-t", "60", "-o", &options, "start"]))
        .await;
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
        assert!(frozen.len() > 1, "no PostgreSQL backends to freeze");
        frozen
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::from(self.std_command(program));
        command.stdout(Stdio::null()).kill_on_drop(true);
        command
    }

    /// `program` of the server's binaries, as the postgres user when the tests run as root.
    /// In the host's network namespace: stopping the server needs none (signals by pid).
    fn std_command(&self, program: &str) -> std::process::Command {
        self.std_command_in(None, program)
    }

    /// [`std_command`](Self::std_command) in the network namespace `netns` if given.
    fn std_command_in(&self, netns: Option<&str>, program: &str) -> std::process::Command {
        let program = self.bin.join(program);
        let mut command = match netns {
            None if self.as_postgres_user => std::process::Command::new("runuser"),
            None => std::process::Command::new(&program),
            Some(netns) => {
                let mut command = std::process::Command::new("ip");
                command.args(["netns", "exec", netns]);
                if self.as_postgres_user {
                    command.arg("runuser");
                } else {
                    command.arg(&program);
                }
                command
            }
        };
        if self.as_postgres_user {
            command.args(["-u", "postgres", "--"]).arg(program);
        }
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
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        print_logs_on_panic("PostgreSQL", &[self.log()]);
        // A failing test may leave it stopped: `pg_ctl stop` would wait on it.
        if let Some(postmaster) = self.postmaster() {
            signal(postmaster, "CONT");
            for child in children(postmaster) {
                signal(child, "CONT");
            }
        }
        let _ = self
            .std_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-t", "30", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs a PostgreSQL tool, bounded, asserting it succeeded.
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
