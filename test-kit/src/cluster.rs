//! The test Redis Cluster (three primaries, three replicas, started by `scripts/services.sh`;
//! its nodes' URLs in `IDEMPOTENT_TEST_REDIS_CLUSTER_URLS`): the nodes' roles, slots and
//! pids, a coordinated failover, a node killed and started again, and waiting until the
//! cluster is whole. The tests that move its primaries take turns ([`Cluster::turn`]).

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::backend::{REDIS_CLUSTER_DIR, redis_cluster_urls};
use crate::redis::try_connect;

/// One test at a time moves the cluster's primaries, within a test binary.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The test cluster: its nodes' URLs and ports.
pub struct Cluster {
    urls: String,
    ports: Vec<u16>,
}

/// What a node says of itself (`ROLE`).
pub struct Role {
    /// `master` or `slave`.
    pub kind: String,
    /// A replica's primary's port, and whether its link to it is up.
    pub primary: Option<(u16, bool)>,
}

impl Cluster {
    /// The cluster of the environment, or `None` when it is not configured (see
    /// [`backend_url`](crate::backend::backend_url)).
    pub fn from_env() -> Option<Cluster> {
        let urls = redis_cluster_urls()?;
        let ports = urls
            .split(',')
            .map(|url| url.rsplit(':').next().unwrap().parse().unwrap())
            .collect();
        Some(Cluster { urls, ports })
    }

    /// Waits until no other test of this binary moves the primaries; hold the guard while
    /// the test does.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'static, ()> {
        TURN.lock().await
    }

    /// The nodes' URLs, comma-separated (a store's URL for the whole cluster).
    pub fn urls(&self) -> &str {
        &self.urls
    }

    /// The nodes' ports.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// A connection to the node on `port`.
    pub async fn node(port: u16) -> MultiplexedConnection {
        Cluster::try_node(port)
            .await
            .unwrap_or_else(|| panic!("the node on {port} cannot be reached"))
    }

    /// A connection to the node on `port`, or `None` when it is down.
    pub async fn try_node(port: u16) -> Option<MultiplexedConnection> {
        try_connect(&format!("redis://127.0.0.1:{port}")).await
    }

    /// `ROLE` of the node on `port`, or `None` when it cannot be asked (it is down).
    pub async fn ask_role(port: u16) -> Option<Role> {
        let mut connection = Cluster::try_node(port).await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut connection).await.ok()?;
        let text = |value: &redis::Value| match value {
            redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
            _ => None,
        };
        let kind = text(role.first()?)?;
        let primary = match role.as_slice() {
            [_, _, redis::Value::Int(port), state, ..] if kind == "slave" => Some((
                u16::try_from(*port).ok()?,
                text(state).as_deref() == Some("connected"),
            )),
            _ => None,
        };
        Some(Role { kind, primary })
    }

    /// `ROLE` of the node on `port`: `master` or `slave`.
    pub async fn role(port: u16) -> String {
        Cluster::ask_role(port)
            .await
            .unwrap_or_else(|| panic!("the node on {port} does not answer ROLE"))
            .kind
    }

    /// The ports of the nodes that are up with the role `kind` (`master` or `slave`).
    pub async fn with_role(&self, kind: &str) -> Vec<u16> {
        let mut found = Vec::new();
        for &port in &self.ports {
            if Cluster::ask_role(port)
                .await
                .is_some_and(|role| role.kind == kind)
            {
                found.push(port);
            }
        }
        found
    }

    /// The port of the primary serving `slot` (nodes that are down are passed over).
    pub async fn primary_of_slot(&self, slot: u16) -> u16 {
        for &port in &self.ports {
            let Some(mut connection) = Cluster::try_node(port).await else {
                continue;
            };
            let nodes: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async(&mut connection)
                .await
                .unwrap();
            let myself = nodes.lines().find(|line| line.contains("myself")).unwrap();
            let serves = myself.contains("master")
                && myself.split(' ').skip(8).any(|range| {
                    let (start, end) = range.split_once('-').unwrap_or((range, range));
                    match (start.parse::<u16>(), end.parse::<u16>()) {
                        (Ok(start), Ok(end)) => (start..=end).contains(&slot),
                        _ => false,
                    }
                });
            if serves {
                return port;
            }
        }
        panic!("no primary serves slot {slot}");
    }

    /// The slot of the Redis key `key`, as the node on `port` computes it.
    pub async fn slot_of(port: u16, key: &str) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut Cluster::node(port).await)
            .await
            .unwrap()
    }

    /// The port of the replica of the primary on `primary`, as the replica itself reports it
    /// (`ROLE`: its primary's port, and a connected link), waiting for one to be in sync.
    pub async fn replica_of(&self, primary: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            for &port in self.ports.iter().filter(|&&port| port != primary) {
                if let Some(Role {
                    primary: Some((of, true)),
                    ..
                }) = Cluster::ask_role(port).await
                    && of == primary
                {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the primary on {primary} has no replica in sync"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Makes the replica on `replica` take over from its primary (`CLUSTER FAILOVER`, a
    /// coordinated switchover) and waits until it has. Redis gives a switchover five seconds
    /// and then abandons it (a primary still busy with a replica's resync, say): asked again
    /// until it happens.
    pub async fn failover_to(replica: u16) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let _: String = redis::cmd("CLUSTER")
                .arg("FAILOVER")
                .query_async(&mut Cluster::node(replica).await)
                .await
                .unwrap();
            let attempt = Instant::now() + Duration::from_secs(10);
            while Cluster::role(replica).await != "master" && Instant::now() < attempt {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if Cluster::role(replica).await == "master" {
                return;
            }
            assert!(Instant::now() < deadline, "the replica did not take over");
        }
    }

    /// Waits until every node sees all slots served and every replica is in sync with its
    /// primary (a replica that never synced cannot take over).
    pub async fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        // A node that is down or still loading its data (just restarted) is waited for.
        async fn settled(port: u16) -> Option<bool> {
            let mut connection = Cluster::try_node(port).await?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut connection)
                .await
                .ok()?;
            let replication: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut connection)
                .await
                .ok()?;
            let in_sync = replication.contains("role:master")
                || replication.contains("master_link_status:up");
            Some(info.contains("cluster_state:ok") && in_sync)
        }
        for &port in &self.ports {
            while settled(port).await != Some(true) {
                assert!(Instant::now() < deadline, "the cluster did not settle");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The pid of the node on `port`, from its pid file.
    pub fn node_pid(port: u16) -> u32 {
        std::fs::read_to_string(format!("{}/{port}/redis.pid", cluster_dir()))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// `SIGKILL`s the node on `port`: it is started again by [`restart`](Self::restart), or
    /// when the guard is dropped (a test that fails midway still leaves the whole cluster to
    /// the next one).
    pub fn kill(port: u16) -> Killed {
        let pid = Cluster::node_pid(port);
        let killed = Killed(Some(port));
        assert!(crate::process::signal(pid, "KILL"), "kill -KILL {pid}");
        killed
    }

    /// Starts the killed node again and waits until it has rejoined, as a replica, and the
    /// cluster is whole.
    pub async fn restart(&self, mut killed: Killed) {
        let port = killed.0.take().expect("a killed node");
        let status = tokio::process::Command::new("bash")
            .arg(start_script(port))
            .status()
            .await
            .unwrap();
        assert!(status.success(), "restart the killed node");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.with_role("slave").await.len() != 3 {
            assert!(Instant::now() < deadline, "the killed node did not rejoin");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.wait_until_ok().await;
    }
}

/// A node killed by the test: started again when dropped.
pub struct Killed(Option<u16>);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(port) = self.0.take() {
            let _ = std::process::Command::new("bash")
                .arg(start_script(port))
                .status();
        }
    }
}

fn cluster_dir() -> String {
    std::env::var(REDIS_CLUSTER_DIR).expect("set by scripts/services.sh")
}

/// The start script of the node on `port`, written by `scripts/services.sh`.
fn start_script(port: u16) -> String {
    format!("{}/{port}/start.sh", cluster_dir())
}
