//! Redis's own background work, kept out of the rows' timed windows.
//!
//! A Redis with an append-only file rewrites it (`BGREWRITEAOF`) when it has grown by
//! `auto-aof-rewrite-percentage` (100 %) since the last rewrite: a child process that reads the
//! whole dataset and writes it out, for a second or more. The fresh rows grow a small dataset
//! fast, so Redis rewrote every few seconds, and on a machine of two CPUs the child took one of
//! them from whichever row was running: rounds of the same row on Redis came out bimodal (in
//! one run, `floor/fresh/redis` between 20,000 and 35,000 requests a second, with five
//! rewrites in 25 seconds; 30,500 to 34,700 with none). The rows that share the machine's CPUs
//! with Redis lose the most, the `redis-benchmark` rows the least (Redis alone is their limit).
//!
//! So for the length of a run the benchmark turns Redis's automatic rewrite off
//! ([`RedisQuiet::start`], restored by [`RedisQuiet::finish`]) and rewrites the file itself
//! between rows ([`RedisQuiet::settle`]): before each row it waits for a rewrite or snapshot in
//! progress to end, and when the file has grown by [`REWRITE_AFTER`] since its last rewrite, it
//! rewrites it and waits. The file keeps being written (`appendfsync` as configured) during the
//! rows: that cost is the store's and stays in them.

use std::time::{Duration, Instant};

/// The growth of the append-only file, since its last rewrite, past which it is rewritten
/// before the next row: bounds the file's size on disk to about this over the dataset.
pub(crate) const REWRITE_AFTER: u64 = 1 << 30;

/// The longest a rewrite (or a snapshot) is waited for.
const REWRITE_LIMIT: Duration = Duration::from_secs(600);

/// Redis's automatic rewrite, turned off for the run, on each of the run's Redis servers (the
/// nodes of a Redis Cluster each have their own file).
pub(crate) struct RedisQuiet {
    nodes: Vec<Node>,
}

struct Node {
    url: String,
    /// `auto-aof-rewrite-percentage` as it was, restored at the end; `None` where the server
    /// refused `CONFIG` (its rewrites are then only waited for).
    percentage: Option<String>,
}

impl RedisQuiet {
    /// Turns the automatic rewrite of the append-only file off on each server of `urls` (one
    /// URL, or a cluster's, comma-separated), noting its setting. A server that refuses
    /// `CONFIG` is named on standard error and left as it is.
    pub(crate) async fn start(urls: &str) -> Result<RedisQuiet, String> {
        let mut nodes = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|url| !url.is_empty()) {
            let mut connection = connect(url).await?;
            let percentage = match turn_off(&mut connection).await {
                Ok(percentage) => Some(percentage),
                Err(message) => {
                    eprintln!(
                        "Redis at {url}: its automatic rewrites stay on ({message}); rounds that \
                         one falls in are slower"
                    );
                    None
                }
            };
            nodes.push(Node {
                url: url.to_owned(),
                percentage,
            });
        }
        Ok(RedisQuiet { nodes })
    }

    /// Before a row: on each server, waits for a rewrite or snapshot in progress, and rewrites
    /// the file (and waits) if it has grown by [`REWRITE_AFTER`] since its last rewrite.
    pub(crate) async fn settle(&self) -> Result<(), String> {
        self.settle_after(REWRITE_AFTER).await
    }

    /// [`settle`](Self::settle), rewriting a file that has grown by `bytes`.
    async fn settle_after(&self, bytes: u64) -> Result<(), String> {
        for node in &self.nodes {
            let mut connection = connect(&node.url).await?;
            let info = wait_for_rewrite(&mut connection).await?;
            let grown = info_field(&info, "aof_current_size")
                .unwrap_or(0)
                .saturating_sub(info_field(&info, "aof_base_size").unwrap_or(0));
            if info_field(&info, "aof_enabled") == Some(1) && grown >= bytes {
                let started = Instant::now();
                rewrite(&mut connection).await?;
                eprintln!(
                    "Redis at {}: append-only file rewritten between rows ({} MiB grown since \
                     its last rewrite; {:.1} s)",
                    node.url,
                    grown >> 20,
                    started.elapsed().as_secs_f64()
                );
            }
        }
        Ok(())
    }

    /// Restores the automatic rewrite's setting on each server.
    pub(crate) async fn finish(self) -> Result<(), String> {
        for node in self.nodes {
            if let Some(percentage) = node.percentage {
                let mut connection = connect(&node.url).await?;
                set_percentage(&mut connection, &percentage).await?;
            }
        }
        Ok(())
    }
}

/// Sets `auto-aof-rewrite-percentage` to 0; the setting it had.
async fn turn_off(connection: &mut redis::aio::MultiplexedConnection) -> Result<String, String> {
    let percentage = read_percentage(connection).await?;
    set_percentage(connection, "0").await?;
    Ok(percentage)
}

/// `auto-aof-rewrite-percentage` as the server has it.
async fn read_percentage(
    connection: &mut redis::aio::MultiplexedConnection,
) -> Result<String, String> {
    let setting: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("auto-aof-rewrite-percentage")
        .query_async(connection)
        .await
        .map_err(|e| format!("CONFIG GET auto-aof-rewrite-percentage: {e}"))?;
    setting
        .get(1)
        .cloned()
        .ok_or_else(|| "CONFIG GET auto-aof-rewrite-percentage: no value".to_owned())
}

async fn connect(url: &str) -> Result<redis::aio::MultiplexedConnection, String> {
    redis::Client::open(url)
        .map_err(|e| format!("Redis at {url}: {e}"))?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))
}

async fn set_percentage(
    connection: &mut redis::aio::MultiplexedConnection,
    percentage: &str,
) -> Result<(), String> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("auto-aof-rewrite-percentage")
        .arg(percentage)
        .exec_async(connection)
        .await
        .map_err(|e| format!("CONFIG SET auto-aof-rewrite-percentage {percentage}: {e}"))
}

/// Rewrites the append-only file now and waits for the rewrite to end (after one Redis may
/// have begun on its own, which it finishes first).
pub(crate) async fn rewrite(
    connection: &mut redis::aio::MultiplexedConnection,
) -> Result<(), String> {
    wait_for_rewrite(connection).await?;
    redis::cmd("BGREWRITEAOF")
        .exec_async(connection)
        .await
        .map_err(|e| format!("Redis BGREWRITEAOF: {e}"))?;
    wait_for_rewrite(connection).await?;
    Ok(())
}

/// Waits until Redis has no append-only-file rewrite or snapshot running or scheduled; its
/// `INFO persistence` then.
pub(crate) async fn wait_for_rewrite(
    connection: &mut redis::aio::MultiplexedConnection,
) -> Result<String, String> {
    let deadline = Instant::now() + REWRITE_LIMIT;
    loop {
        let info = persistence_info(connection).await?;
        let busy = [
            "aof_rewrite_in_progress",
            "aof_rewrite_scheduled",
            "rdb_bgsave_in_progress",
        ]
        .iter()
        .any(|field| info_field(&info, field).unwrap_or(0) != 0);
        if !busy {
            return Ok(info);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "Redis: still rewriting its append-only file after {REWRITE_LIMIT:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Redis's `INFO persistence`.
async fn persistence_info(
    connection: &mut redis::aio::MultiplexedConnection,
) -> Result<String, String> {
    redis::cmd("INFO")
        .arg("persistence")
        .query_async(connection)
        .await
        .map_err(|e| format!("Redis INFO: {e}"))
}

/// An integer field of Redis's `INFO` output.
pub(crate) fn info_field(info: &str, name: &str) -> Option<u64> {
    info.lines()
        .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
        .and_then(|value| value.parse().ok())
}

#[cfg(test)]
mod tests {
    use idempotent_test_kit::redis::PrivateRedis;

    use super::*;

    async fn percentage(connection: &mut redis::aio::MultiplexedConnection) -> String {
        read_percentage(connection).await.unwrap()
    }

    async fn persistence(connection: &mut redis::aio::MultiplexedConnection, field: &str) -> u64 {
        let info = persistence_info(connection).await.unwrap();
        info_field(&info, field).unwrap_or_else(|| panic!("no {field} in {info}"))
    }

    /// A run turns the automatic rewrite off and restores the setting it found; between rows,
    /// a file grown past the bound is rewritten (and waited for), one that has not is left.
    #[tokio::test]
    async fn a_run_rewrites_the_file_between_rows_only_and_restores_the_setting() {
        let Some(server) = PrivateRedis::start("bench-quiet").await else {
            return;
        };
        let url = server.url();
        let mut connection = connect(&url).await.unwrap();
        // Turning the file on writes it (a rewrite); then a setting of the operator's own.
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("appendonly")
            .arg("yes")
            .exec_async(&mut connection)
            .await
            .unwrap();
        wait_for_rewrite(&mut connection).await.unwrap();
        set_percentage(&mut connection, "37").await.unwrap();

        let quiet = RedisQuiet::start(&url).await.unwrap();
        assert_eq!(percentage(&mut connection).await, "0");

        let rewrites = persistence(&mut connection, "aof_rewrites").await;
        let value = "v".repeat(1024);
        for i in 0..2_000 {
            redis::cmd("SET")
                .arg(format!("k{i}"))
                .arg(&value)
                .exec_async(&mut connection)
                .await
                .unwrap();
        }
        let grown = |current: u64, base: u64| current.saturating_sub(base);
        let before = grown(
            persistence(&mut connection, "aof_current_size").await,
            persistence(&mut connection, "aof_base_size").await,
        );
        assert!(before >= 2_000 * 1024, "{before}");

        // Not grown by 1 GiB: left as it is.
        quiet.settle().await.unwrap();
        assert_eq!(persistence(&mut connection, "aof_rewrites").await, rewrites);

        // Grown by 1 MiB: rewritten, and the rewrite has ended when `settle` returns.
        quiet.settle_after(1 << 20).await.unwrap();
        assert_eq!(
            persistence(&mut connection, "aof_rewrites").await,
            rewrites + 1
        );
        assert_eq!(
            persistence(&mut connection, "aof_rewrite_in_progress").await,
            0
        );
        let after = grown(
            persistence(&mut connection, "aof_current_size").await,
            persistence(&mut connection, "aof_base_size").await,
        );
        assert!(after < 1 << 20, "{after}");

        quiet.finish().await.unwrap();
        assert_eq!(percentage(&mut connection).await, "37");
    }

    /// Each server of a cluster's list is quieted and restored; one whose user may not run
    /// `CONFIG` is left as it is, and the run goes on.
    #[tokio::test]
    async fn each_server_of_a_list_is_quieted_and_one_without_config_is_left() {
        let (Some(first), Some(second)) = (
            PrivateRedis::start("bench-quiet-a").await,
            PrivateRedis::start("bench-quiet-b").await,
        ) else {
            return;
        };
        let mut second_admin = connect(&second.url()).await.unwrap();
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("bench")
            .arg("on")
            .arg(">secret")
            .arg("~*")
            .arg("+@all")
            .arg("-config")
            .exec_async(&mut second_admin)
            .await
            .unwrap();
        let limited = second
            .url()
            .replacen("redis://", "redis://bench:secret@", 1);
        let urls = format!("{}, {}", first.url(), second.url());
        let quiet = RedisQuiet::start(&urls).await.unwrap();
        let mut first_admin = connect(&first.url()).await.unwrap();
        assert_eq!(percentage(&mut first_admin).await, "0");
        assert_eq!(percentage(&mut second_admin).await, "0");
        quiet.settle().await.unwrap();
        quiet.finish().await.unwrap();
        assert_eq!(percentage(&mut first_admin).await, "100");
        assert_eq!(percentage(&mut second_admin).await, "100");

        let quiet = RedisQuiet::start(&format!("{},{limited}", first.url()))
            .await
            .unwrap();
        assert_eq!(percentage(&mut first_admin).await, "0");
        assert_eq!(percentage(&mut second_admin).await, "100");
        quiet.settle().await.unwrap();
        quiet.finish().await.unwrap();
        assert_eq!(percentage(&mut first_admin).await, "100");
    }

    #[test]
    fn info_fields() {
        let info = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\n";
        assert_eq!(info_field(info, "used_memory"), Some(1_048_576));
        assert_eq!(info_field(info, "used_memory_rss"), None);
        assert_eq!(info_field(info, "used_memory_human"), None);
    }
}
