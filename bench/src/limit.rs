//! The limit rows: what the database itself does with the store's own statements, measured by
//! its own benchmark tool in the same run as the layer's rows, so that each shared-store row
//! can be read as a fraction of what its backend allows.
//!
//! - `pgbench/fresh/postgres`: `pgbench -M prepared` running the PostgreSQL store's claim on a
//!   new key and its completion with the token the claim returned, per transaction: one
//!   transaction is what a fresh request asks of the database.
//! - `pgbench/replay/postgres`: the claim on one of a few keys completed before the timed
//!   phase, which is all a replay asks.
//!
//! Both run with as many connections as the store's pool has (16) and two pgbench threads, on
//! the machine the layer's rows use.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::rows::{Scenario, selects};

/// A limit row: `pgbench/fresh/postgres` or `pgbench/replay/postgres`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LimitRow {
    pub(crate) scenario: Scenario,
}

impl LimitRow {
    pub(crate) const TOOL: &'static str = "pgbench";
    pub(crate) const STORE: &'static str = "postgres";

    pub(crate) fn label(&self) -> String {
        format!("{}/{}/{}", Self::TOOL, self.scenario.name(), Self::STORE)
    }

    /// Whether `filter` selects this row, as for the layer's rows.
    pub(crate) fn selected_by(&self, filter: &[String]) -> bool {
        selects(filter, [Self::TOOL, self.scenario.name(), Self::STORE])
    }
}

/// The limit rows, when PostgreSQL is available.
pub(crate) fn rows(postgres: bool) -> Vec<LimitRow> {
    if !postgres {
        return Vec::new();
    }
    [Scenario::Fresh, Scenario::Replay]
        .map(|scenario| LimitRow { scenario })
        .to_vec()
}

/// The connections of `PostgresStore::connect`'s pool: the limit rows use as many.
pub(crate) const POSTGRES_CONNECTIONS: usize = 16;
/// Keys completed before a `replay` limit row; its claims pick among them.
const REPLAY_KEYS: u64 = 1000;
/// The first key of the `fresh` limit rows' key space, above the replay keys.
const FIRST_FRESH_KEY: u64 = 1_000_001;
/// The fingerprint every limit-row claim carries: 32 zero bytes.
const FINGERPRINT: &str =
    "'\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea";
/// The payload a `fresh` limit row completes with: 200 bytes, about a recorded response of the
/// layer's rows.
const PAYLOAD: &str = "decode(repeat('ab', 200), 'hex')";
/// The lease and TTL the store sends, in microseconds (the runtime's defaults).
const LEASE_US: &str = "30000000";
const TTL_US: &str = "86400000000";
/// A key as the store binds it (32 bytes), from pgbench's integer variable `k`.
const KEY: &str = "decode(lpad(to_hex(:k::int8), 64, '0'), 'hex')";

/// The PostgreSQL limit rows' setup: the store's statements and a directory for the scripts.
pub(crate) struct Postgres {
    url: String,
    claim: String,
    complete: String,
    dir: std::path::PathBuf,
}

impl Postgres {
    /// Reads the store's statements, creates its table if needed and completes the replay
    /// keys.
    pub(crate) fn prepare(url: &str, runtime: &tokio::runtime::Runtime) -> Result<Self, String> {
        let (claim, complete, table) = runtime.block_on(async {
            let store = idempotent_core::postgres::PostgresStore::connect(url)
                .await
                .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e}"))?;
            store
                .migrate()
                .await
                .map_err(|e| format!("cannot migrate PostgreSQL at {url}: {e}"))?;
            let [claim, complete] = store.claim_and_complete_sql();
            Ok::<_, String>((
                claim.to_owned(),
                complete.to_owned(),
                store.table().to_owned(),
            ))
        })?;
        let dir = std::env::temp_dir().join(format!("idempotent-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        pgbench_once(url, &replay_seed(&table), &dir)?;
        Ok(Postgres {
            url: url.to_owned(),
            claim,
            complete,
            dir,
        })
    }

    /// One round of `row`: a warm-up run, then the timed one; its transactions per second.
    pub(crate) fn run(&self, row: LimitRow, options: &crate::cli::Options) -> Result<f64, String> {
        let script = pgbench_script(&self.claim, &self.complete, row.scenario);
        if !options.warmup.is_zero() {
            pgbench(
                &self.url,
                &script,
                POSTGRES_CONNECTIONS,
                seconds(options.warmup),
                &self.dir,
            )?;
        }
        pgbench(
            &self.url,
            &script,
            POSTGRES_CONNECTIONS,
            seconds(options.measure),
            &self.dir,
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The pgbench script of a limit row, from the store's claim and completion statements.
pub(crate) fn pgbench_script(claim: &str, complete: &str, scenario: Scenario) -> String {
    let claim = claim
        .replace("$3", LEASE_US)
        .replace("$2", FINGERPRINT)
        .replace("$1", KEY);
    match scenario {
        Scenario::Replay => format!("\\set k random(1, {REPLAY_KEYS})\n{claim};\n"),
        Scenario::Fresh | Scenario::None => {
            let complete = complete
                .replace("$4", TTL_US)
                .replace("$3", PAYLOAD)
                .replace("$2", ":token")
                .replace("$1", KEY);
            // `\gset` stores the claim's columns in variables: `token` is the new claim's.
            format!(
                "\\set k random({FIRST_FRESH_KEY}, 4611686018427387903)\n{claim} \\gset\n{complete};\n"
            )
        }
    }
}

/// The statement that completes the replay keys before a `replay` limit row, in `table`
/// (quoted as the store quotes it). Token 1: a replayed claim never reads it.
pub(crate) fn replay_seed(table: &str) -> String {
    format!(
        "INSERT INTO {table} (storage_key, state, fingerprint, token, payload, expires_at) \
         SELECT decode(lpad(to_hex(i), 64, '0'), 'hex'), 'completed', {FINGERPRINT}, 1, \
         {PAYLOAD}, clock_timestamp() + interval '1 day' \
         FROM generate_series(1, {REPLAY_KEYS}) AS i \
         ON CONFLICT (storage_key) DO UPDATE SET state = 'completed', \
         expires_at = excluded.expires_at, payload = excluded.payload;\n"
    )
}

/// Runs `script` with pgbench against `url` for `seconds` (at least one), and returns its
/// transactions per second.
pub(crate) fn pgbench(
    url: &str,
    script: &str,
    connections: usize,
    seconds: u64,
    dir: &Path,
) -> Result<f64, String> {
    let path = dir.join("limit.sql");
    std::fs::File::create(&path)
        .and_then(|mut file| file.write_all(script.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let output = Command::new("pgbench")
        .args(["--no-vacuum", "--protocol=prepared", "--jobs=2"])
        .arg(format!("--client={connections}"))
        .arg(format!("--time={}", seconds.max(1)))
        .arg(format!("--file={}", path.display()))
        .arg(url)
        .output()
        .map_err(|e| format!("cannot run pgbench (from the PostgreSQL packages): {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("pgbench failed ({}): {stderr}", output.status));
    }
    let failed = failed_transactions(&stdout);
    if failed != 0 {
        return Err(format!(
            "pgbench: {failed} transactions failed: {stdout}{stderr}"
        ));
    }
    tps(&stdout).ok_or_else(|| format!("no tps in pgbench's output: {stdout}"))
}

/// Runs `script` once, on one connection: the replay keys' seed.
pub(crate) fn pgbench_once(url: &str, script: &str, dir: &Path) -> Result<(), String> {
    let path = dir.join("seed.sql");
    std::fs::write(&path, script).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let output = Command::new("pgbench")
        .args(["--no-vacuum", "--client=1", "--transactions=1"])
        .arg(format!("--file={}", path.display()))
        .arg(url)
        .output()
        .map_err(|e| format!("cannot run pgbench (from the PostgreSQL packages): {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() || failed_transactions(&stdout) != 0 {
        return Err(format!(
            "pgbench seed failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// `tps = 12345.678901 (without initial connection time)`.
fn tps(output: &str) -> Option<f64> {
    output
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
}

/// `number of failed transactions: 3 (0.001%)`; zero when the line is absent.
fn failed_transactions(output: &str) -> u64 {
    output
        .lines()
        .find_map(|line| line.strip_prefix("number of failed transactions: "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or(0)
}

/// How long a limit row runs: the rows' warm-up and timed phase, in whole seconds.
pub(crate) fn seconds(duration: Duration) -> u64 {
    duration.as_secs().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLAIM: &str = "SELECT $1, $2, $3";
    const COMPLETE: &str = "UPDATE t SET p = $3, e = $4 WHERE k = $1 AND t = $2";

    #[test]
    fn scripts_bind_the_statements_parameters() {
        let fresh = pgbench_script(CLAIM, COMPLETE, Scenario::Fresh);
        let lines: Vec<&str> = fresh.lines().collect();
        assert_eq!(lines.len(), 3, "{fresh}");
        assert!(lines[0].starts_with("\\set k random(1000001, "));
        assert!(lines[1].starts_with(&format!("SELECT {KEY}, {FINGERPRINT}, {LEASE_US}")));
        assert!(lines[1].ends_with(" \\gset"));
        assert_eq!(
            lines[2],
            format!("UPDATE t SET p = {PAYLOAD}, e = {TTL_US} WHERE k = {KEY} AND t = :token;")
        );
        let replay = pgbench_script(CLAIM, COMPLETE, Scenario::Replay);
        assert_eq!(replay.lines().count(), 2);
        assert!(replay.starts_with("\\set k random(1, 1000)\n"));
        assert!(replay.ends_with(";\n") && !replay.contains("UPDATE"));
    }

    #[test]
    fn pgbench_output_is_read() {
        let output = "number of transactions actually processed: 1000\n\
                      number of failed transactions: 0 (0.000%)\n\
                      latency average = 1.2 ms\n\
                      tps = 8123.456789 (without initial connection time)\n";
        assert_eq!(tps(output), Some(8123.456789));
        assert_eq!(failed_transactions(output), 0);
        assert_eq!(
            failed_transactions("number of failed transactions: 7 (1%)"),
            7
        );
        assert_eq!(tps("nothing"), None);
    }
}
