//! The limit rows: what the database itself does with the store's own statements, measured by
//! its own benchmark tool in the same run as the layer's rows, so that each shared-store row
//! can be read as a fraction of what its backend allows.
//!
//! (Longer than most files here, on purpose: each limit row drives its own tool, pgbench or
//! redis-benchmark, and the rows share their setup; splitting them would scatter one method.)
//!
//! - `pgbench/fresh/postgres`: `pgbench -M prepared` running the PostgreSQL store's claim on a
//!   new key and its completion with the token the claim returned, per transaction: one
//!   transaction is what a fresh request asks of the database.
//! - `pgbench/replay/postgres`: the claim on one of a few keys completed before the timed
//!   phase, which is all a replay asks.
//!
//! - `redis-benchmark/replay/redis`: the Redis store's claim script (`EVALSHA`) on one of a few
//!   keys completed before the row.
//! - `redis-benchmark/fresh/redis`: `redis-benchmark` sends one command per request and cannot
//!   pass the claim's token on to the completion, so the claim (on new keys) and the completion
//!   (on keys put in flight before the run, with a known token) are measured apart. Redis runs
//!   scripts one at a time, so a fresh request costs it the claim's time plus the
//!   completion's: the limit is `1 / (1 / claims + 1 / completions)` per second.
//!
//! All run with 16 connections (the PostgreSQL store's pool) on the machine the layer's rows
//! use; pgbench with two threads.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::rows::{Scenario, selects};

/// The benchmark tool of a limit row, and so its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tool {
    Pgbench,
    RedisBenchmark,
}

impl Tool {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Tool::Pgbench => "pgbench",
            Tool::RedisBenchmark => "redis-benchmark",
        }
    }

    pub(crate) fn store(self) -> &'static str {
        match self {
            Tool::Pgbench => "postgres",
            Tool::RedisBenchmark => "redis",
        }
    }
}

/// A limit row: `pgbench/fresh/postgres`, `redis-benchmark/replay/redis`, ….
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LimitRow {
    pub(crate) tool: Tool,
    pub(crate) scenario: Scenario,
}

impl LimitRow {
    pub(crate) fn parts(&self) -> [&'static str; 3] {
        [self.tool.name(), self.scenario.name(), self.tool.store()]
    }

    pub(crate) fn label(&self) -> String {
        self.parts().join("/")
    }

    /// Whether `filter` selects this row, as for the layer's rows.
    pub(crate) fn selected_by(&self, filter: &[String]) -> bool {
        selects(filter, self.parts(), &self.label())
    }
}

/// The limit rows of the stores that are available.
pub(crate) fn rows(redis: bool, postgres: bool) -> Vec<LimitRow> {
    let mut rows = Vec::new();
    for (tool, available) in [(Tool::RedisBenchmark, redis), (Tool::Pgbench, postgres)] {
        if available {
            rows.extend(
                [Scenario::Fresh, Scenario::Replay].map(|scenario| LimitRow { tool, scenario }),
            );
        }
    }
    rows
}

/// What the limit rows need, prepared once per run.
pub(crate) struct Limits {
    pub(crate) postgres: Option<Postgres>,
    pub(crate) redis: Option<Redis>,
}

impl Limits {
    /// Prepares the tools `rows` use.
    pub(crate) fn prepare(
        rows: &[LimitRow],
        backends: &crate::cli::Backends,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Limits, String> {
        let uses = |tool| rows.iter().any(|row| row.tool == tool);
        let postgres = match &backends.postgres_url {
            Some(url) if uses(Tool::Pgbench) => Some(Postgres::prepare(url, runtime)?),
            _ => None,
        };
        let redis = match &backends.redis_url {
            Some(url) if uses(Tool::RedisBenchmark) => Some(Redis::prepare(url)?),
            _ => None,
        };
        Ok(Limits { postgres, redis })
    }

    /// One round of `row`: its operations per second.
    pub(crate) fn run(&self, row: LimitRow, options: &crate::cli::Options) -> Result<f64, String> {
        match row.tool {
            Tool::Pgbench => self
                .postgres
                .as_ref()
                .ok_or("no PostgreSQL")?
                .run(row, options),
            Tool::RedisBenchmark => self.redis.as_ref().ok_or("no Redis")?.run(row, options),
        }
    }
}

/// The Redis limit rows' setup: the store's scripts loaded, the replay keys completed.
pub(crate) struct Redis {
    host: String,
    port: u16,
    claim: String,
    complete: String,
}

/// Keys put in flight before a `fresh` Redis limit row's completions.
const IN_FLIGHT_KEYS: u64 = 1_000_000;
/// The most completions one run sends: a fifth of the keys in flight, so that at most a fifth
/// (a tenth on average) of them land on a key already completed, which answers sooner.
const MAX_COMPLETIONS: u64 = IN_FLIGHT_KEYS / 5;
/// Commands each `redis-benchmark` connection keeps in flight. The store sends every command
/// over one multiplexed connection, which pipelines whatever is concurrent: without
/// pipelining, `redis-benchmark` measures Redis's per-command network overhead, which the
/// store does not pay, and falls below what the store gets.
const REDIS_PIPELINE: usize = 16;
/// Record keys of the Redis limit rows, beside the store's (`idempotent:` + 64 hex digits).
const REDIS_REPLAY_KEY: &str = "idempotent:limit:replay:";
const REDIS_FRESH_KEY: &str = "idempotent:limit:fresh:";
const REDIS_IN_FLIGHT_KEY: &str = "idempotent:limit:in-flight:";
/// The fingerprint the Redis limit rows send: 32 bytes, like the store's.
const REDIS_FINGERPRINT: &str = "ffffffffffffffffffffffffffffffff";
/// The key's label a claim keeps (see `LABEL`): 38 bytes, as the HTTP rows' claims send.
const REDIS_LABEL: &str = "L\x12aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

impl Redis {
    pub(crate) fn prepare(url: &str) -> Result<Redis, String> {
        let address = url
            .strip_prefix("redis://")
            .ok_or_else(|| format!("not a redis:// URL: {url}"))?;
        let address = address.split('/').next().unwrap_or(address);
        let (host, port) = address
            .rsplit_once(':')
            .ok_or_else(|| format!("no port in {url}"))?;
        let port: u16 = port.parse().map_err(|_| format!("bad port in {url}"))?;
        let mut redis = Redis {
            host: host.to_owned(),
            port,
            claim: String::new(),
            complete: String::new(),
        };
        let [claim, complete] = idempotent_redis::RedisStore::claim_and_complete_scripts();
        redis.claim = redis.script_load(&claim)?;
        redis.complete = redis.script_load(&complete)?;
        let payload = "x".repeat(200);
        redis.pipe((0..REPLAY_KEYS).map(|n| {
            let key = format!("{REDIS_REPLAY_KEY}{n:012}");
            vec![
                vec![
                    "HSET".into(),
                    key.clone(),
                    "s".into(),
                    "c".into(),
                    "f".into(),
                    REDIS_FINGERPRINT.into(),
                    "t".into(),
                    "1".into(),
                    "p".into(),
                    payload.clone(),
                ],
                vec!["PEXPIRE".into(), key, "3600000".into()],
            ]
        }))?;
        Ok(redis)
    }

    fn run(&self, row: LimitRow, options: &crate::cli::Options) -> Result<f64, String> {
        let seconds = seconds(options.measure) as f64;
        let claim = |prefix: &str, keys: u64, requests: u64| {
            self.benchmark(
                requests,
                keys,
                &[
                    "EVALSHA",
                    &self.claim,
                    "1",
                    &format!("{prefix}__rand_int__"),
                    REDIS_FINGERPRINT,
                    "30000",
                    "86400000",
                    "1",
                    "0",
                    REDIS_LABEL,
                ],
            )
        };
        match row.scenario {
            Scenario::Replay => {
                let rate = claim(REDIS_REPLAY_KEY, REPLAY_KEYS, 20_000)?;
                claim(REDIS_REPLAY_KEY, REPLAY_KEYS, (rate * seconds) as u64)
            }
            // Limit rows are fresh or replay (`rows`); the others would be fresh.
            Scenario::Fresh | Scenario::None | Scenario::Session => {
                let fresh_keys = 100_000_000_000;
                let rate = claim(REDIS_FRESH_KEY, fresh_keys, 20_000)?;
                let claims = claim(REDIS_FRESH_KEY, fresh_keys, (rate * seconds) as u64)?;
                self.put_in_flight()?;
                let payload = "x".repeat(200);
                let complete = [
                    "EVALSHA",
                    &self.complete,
                    "1",
                    &format!("{REDIS_IN_FLIGHT_KEY}__rand_int__"),
                    "1",
                    &payload,
                    "600000",
                ];
                let requests = ((claims * seconds) as u64).min(MAX_COMPLETIONS);
                let completions = self.benchmark(requests, IN_FLIGHT_KEYS, &complete)?;
                eprintln!(
                    "{}: claims {claims:.0}/s, completions {completions:.0}/s",
                    row.label()
                );
                Ok(1.0 / (1.0 / claims + 1.0 / completions))
            }
        }
    }

    /// Puts the in-flight keys in flight, with token `1`, for ten minutes.
    fn put_in_flight(&self) -> Result<(), String> {
        self.pipe((0..IN_FLIGHT_KEYS).map(|n| {
            let key = format!("{REDIS_IN_FLIGHT_KEY}{n:012}");
            vec![
                vec![
                    "HSET".into(),
                    key.clone(),
                    "s".into(),
                    "i".into(),
                    "f".into(),
                    REDIS_FINGERPRINT.into(),
                    "t".into(),
                    "1".into(),
                ],
                vec!["PEXPIRE".into(), key, "600000".into()],
            ]
        }))
    }

    fn cli(&self) -> Command {
        let mut command = Command::new("redis-cli");
        command.args(["-h", &self.host, "-p", &self.port.to_string()]);
        command
    }

    fn script_load(&self, script: &str) -> Result<String, String> {
        let output = self
            .cli()
            .args(["SCRIPT", "LOAD", script])
            .output()
            .map_err(|e| format!("cannot run redis-cli (from the Redis packages): {e}"))?;
        let sha = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if !output.status.success() || sha.len() != 40 {
            return Err(format!(
                "SCRIPT LOAD failed: {sha} {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        Ok(sha)
    }

    /// Sends `commands` through `redis-cli --pipe`.
    fn pipe(&self, commands: impl Iterator<Item = Vec<Vec<String>>>) -> Result<(), String> {
        let mut child = self
            .cli()
            .arg("--pipe")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run redis-cli --pipe: {e}"))?;
        {
            let stdin = child.stdin.as_mut().ok_or("no stdin")?;
            let mut out = std::io::BufWriter::new(stdin);
            for group in commands {
                for command in group {
                    out.write_all(&resp(&command)).map_err(|e| e.to_string())?;
                }
            }
            out.flush().map_err(|e| e.to_string())?;
        }
        let output = child.wait_with_output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() || !text.contains("errors: 0") {
            return Err(format!("redis-cli --pipe failed: {text}"));
        }
        Ok(())
    }

    /// `redis-benchmark` sending `command` `requests` times (at least 1,000) over 16
    /// connections, with `__rand_int__` drawn below `keys`; its requests per second.
    fn benchmark(&self, requests: u64, keys: u64, command: &[&str]) -> Result<f64, String> {
        let output = Command::new("redis-benchmark")
            .args(["-h", &self.host, "-p", &self.port.to_string(), "--csv"])
            .args(["-c", &CONNECTIONS.to_string()])
            .args(["-P", &REDIS_PIPELINE.to_string()])
            .args([
                "-n",
                &requests.max(1000).to_string(),
                "-r",
                &keys.to_string(),
            ])
            .args(command)
            .output()
            .map_err(|e| format!("cannot run redis-benchmark (from the Redis packages): {e}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "redis-benchmark failed: {stdout}{}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        csv_rps(&stdout).ok_or_else(|| format!("no rate in redis-benchmark's output: {stdout}"))
    }
}

/// A command in Redis's protocol.
fn resp(command: &[String]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", command.len()).into_bytes();
    for arg in command {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// The requests per second of `redis-benchmark --csv`: the second field of the line after the
/// header, `"EVALSHA ...","81234.56",...`.
fn csv_rps(output: &str) -> Option<f64> {
    let line = output
        .lines()
        .find(|line| !line.is_empty() && !line.starts_with("\"test\""))?;
    let field = line.split("\",\"").nth(1)?;
    field.trim_matches('"').parse().ok()
}

/// The connections of `PostgresStore::connect`'s pool: every limit row uses as many.
pub(crate) const CONNECTIONS: usize = 16;
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
/// A claimant number (the store gives each claim a random one).
const CLAIMANT: &str = "1";
/// The key's label a claim keeps for an operator (`KeyLabel`: its magic, its flags and a
/// 36-character key, as the HTTP rows' keys are), as PostgreSQL binds it.
const LABEL: &str = "decode('4c12' || repeat('61', 36), 'hex')";
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
            let store = crate::app::migrated_postgres(url).await?;
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
    fn run(&self, row: LimitRow, options: &crate::cli::Options) -> Result<f64, String> {
        let script = pgbench_script(&self.claim, &self.complete, row.scenario);
        if !options.warmup.is_zero() {
            pgbench(
                &self.url,
                &script,
                CONNECTIONS,
                seconds(options.warmup),
                &self.dir,
            )?;
        }
        pgbench(
            &self.url,
            &script,
            CONNECTIONS,
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
        .replace("$6", LABEL)
        .replace("$5", CLAIMANT)
        .replace("$4", TTL_US)
        .replace("$3", LEASE_US)
        .replace("$2", FINGERPRINT)
        .replace("$1", KEY);
    match scenario {
        Scenario::Replay => format!("\\set k random(1, {REPLAY_KEYS})\n{claim};\n"),
        Scenario::Fresh | Scenario::None | Scenario::Session => {
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

    const CLAIM: &str = "SELECT $1, $2, $3, $4, $5, $6";
    const COMPLETE: &str = "UPDATE t SET p = $3, e = $4 WHERE k = $1 AND t = $2";

    /// A limit row is picked as the layer's rows are: by its tool, and by its whole label
    /// after `=`.
    #[test]
    fn limit_rows_are_picked_by_tool_or_whole_label() {
        let pick = |item: &str| -> Vec<String> {
            rows(true, true)
                .iter()
                .filter(|row| row.selected_by(&[item.to_owned()]))
                .map(LimitRow::label)
                .collect()
        };
        assert_eq!(
            pick("pgbench"),
            ["pgbench/fresh/postgres", "pgbench/replay/postgres"]
        );
        assert_eq!(pick("=pgbench/fresh/postgres"), ["pgbench/fresh/postgres"]);
        assert!(pick("=pgbench").is_empty());
    }

    #[test]
    fn scripts_bind_the_statements_parameters() {
        let fresh = pgbench_script(CLAIM, COMPLETE, Scenario::Fresh);
        let lines: Vec<&str> = fresh.lines().collect();
        assert_eq!(lines.len(), 3, "{fresh}");
        assert!(lines[0].starts_with("\\set k random(1000001, "));
        assert!(lines[1].starts_with(&format!(
            "SELECT {KEY}, {FINGERPRINT}, {LEASE_US}, {TTL_US}, {CLAIMANT}, {LABEL}"
        )));
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
    fn redis_benchmark_output_and_the_protocol() {
        let csv =
            "\"test\",\"rps\",\"avg_latency_ms\"\n\"EVALSHA abc 1 k x\",\"81234.56\",\"0.2\"\n";
        assert_eq!(csv_rps(csv), Some(81234.56));
        assert_eq!(csv_rps("nothing"), None);
        assert_eq!(
            resp(&["HSET".into(), "k".into(), "ab".into()]),
            b"*3\r\n$4\r\nHSET\r\n$1\r\nk\r\n$2\r\nab\r\n"
        );
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
