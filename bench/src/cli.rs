//! Command-line options, and where the shared stores are.

use std::path::PathBuf;
use std::time::Duration;

pub(crate) const USAGE: &str = "\
usage: idempotent-bench [all|http|memory|sessions|steps|summary] [options]

  all (default)       the HTTP rows, then the memory mode, then the sessions mode
  http                the HTTP rows: bare, idempotent-tower, the peers, Redis/PostgreSQL rows
                      (also behind a cache tier; the session rows send Idempotency-Session)
  memory              resident bytes per record of MemoryStore (100k, 1M and 10M records;
                      100k and 1M with --quick)
  sessions            bytes each store holds for N requests in one client session against N
                      requests with a key each, in process (N = 100, 1k, 10k, 100k; up to 10k
                      with --quick); --only memory,redis,postgres picks stores
  steps               what a step of an operation costs (one checkpoint written), in process:
                      operations of 0, 1, 3 and 8 steps on fresh keys, atomic steps on
                      PostgreSQL, and an operation resumed after 3 steps against a plain
                      retry (not part of `all`; --in-flight callers, --rounds, --warmup,
                      --duration; --only memory,redis,postgres picks stores)
  summary             the summary's ratios (BENCHMARKS.md) from the files of one run: the
                      HTTP rows' JSON (--out), `--outbox FILE` (the outbox binary's output)
                      and `--consumer FILE` (the consumer binary's --out); scripts/bench.sh
                      --quick prints it last. A ratio of two HTTP rows is the one measured
                      by turns (--turns); another ratio of two rows of the same rounds is the
                      median of their ratios round by round; the ratio by rounds and the
                      ratio of the medians are beside it

options:
  --quick             short run: 3 rounds (each row its median), 1 s warm-up, 2 s timed per
                      row, prefill 1M only, memory mode up to 1M records
  --rounds N          rounds over all rows; each row reports its median round (default 3)
  --warmup SECS       untimed seconds before each timed phase (default 3)
  --duration SECS     timed seconds per row and round (default 10)
  --turns N           after the rounds, each of the summary's ratios of two HTTP rows
                      measured again with both rows' loads taking turns: N timed turns of
                      each row (after 5 untimed), the order swapped from pair to pair; the
                      summary's figure (default 100; 0 for none)
  --turn-ms MS        how long a turn lasts, in milliseconds (default 50)
  --connections N     load-generator connections, HTTP/1.1 keep-alive (default 64)
  --replay-keys N     keys per connection in the replay scenario (default 4)
  --server-threads N  tokio worker threads of the server (default 2)
  --client-threads N  tokio worker threads of the load generator (default 2)
  --only LIST         rows to run, comma-separated: an implementation (or `pgbench`,
                      `redis-benchmark` for the limit rows), scenario or store name, or a
                      label prefix such as idempotent-tower/replay; `cache`, `memcache`,
                      `rediscache` or a store with its tier (`postgres+rediscache`) for
                      the rows with a cache tier in front of the store; `=LABEL` for
                      the one row of that whole label (=idempotent-tower/fresh/redis)
  --redis-url URL     add idempotent-tower rows on Redis, and the redis-benchmark limit rows
                      (default $IDEMPOTENT_TEST_REDIS_URL)
  --redis-replicas N  replicas that must acknowledge each claim and record on Redis
                      (RedisStoreBuilder::replicas; default 0); several comma-separated
                      --redis-url URLs are a Redis Cluster. While the rows run, each
                      server's automatic rewrite of its append-only file is off and the
                      file is rewritten between rows (restored at the end)
  --postgres-url URL  add idempotent-tower rows on PostgreSQL, and the pgbench limit rows
                      (default $IDEMPOTENT_TEST_POSTGRES_URL)
  --prefill LIST      the idempotent-tower rows again with this many records already in
                      each store, comma-separated (default 1000000,10000000; `none` for none)
  --records LIST      memory mode record counts (default 100000,1000000,10000000)
  --requests LIST     sessions mode request counts (default 100,1000,10000,100000)
  --in-flight N       sessions and steps modes: requests in flight at once, at most 64
                      (default 16)
  --ack POLICY        sessions mode: `trailing` (default), request seq acknowledges
                      seq - in-flight; `lowest`, every answer held (lowest unanswered - 1)
  --out PATH          JSON output (default target/bench/http.json); objects of the mode
                      not run are kept. The steps mode writes its own file (default
                      target/bench/steps.json)
";

/// Where the shared stores are.
#[derive(Debug, Clone, Default)]
pub(crate) struct Backends {
    pub(crate) redis_url: Option<String>,
    pub(crate) postgres_url: Option<String>,
    /// Replicas that must acknowledge each claim and record on Redis
    /// (`RedisStoreBuilder::replicas`).
    pub(crate) redis_replicas: usize,
}

/// The most timed turns of each row, and the longest turn, that `--turns` and `--turn-ms`
/// take: more would only be a typo (an hour of turns).
const MAX_TURNS: usize = 10_000;
const MAX_TURN_MS: u64 = 10_000;

/// Rounds with `--quick`: each row reports its median round, so that one slow or fast round
/// on a shared machine does not decide a row (single rounds moved by a third between runs).
pub(crate) const QUICK_ROUNDS: usize = 3;

/// The sessions mode: requests per run, by default and with `--quick`.
pub(crate) const REQUESTS: [u64; 4] = [100, 1_000, 10_000, 100_000];
pub(crate) const QUICK_REQUESTS: [u64; 3] = [100, 1_000, 10_000];
/// Requests in flight at once, by default.
pub(crate) const IN_FLIGHT: usize = 16;

/// Which `ack` a client's requests carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckPolicy {
    /// Request `seq` acknowledges `seq - in_flight`: the answers the client held when it sent
    /// it (it sends `seq` only once it holds every answer up to `seq - in_flight`). The store
    /// then holds the last `in_flight` answers, whatever order they came in.
    Trailing,
    /// Request `seq` acknowledges every answer the client holds: the lowest unanswered
    /// number − 1. What the store holds at the end depends on the order the last answers came
    /// in (1 to `in_flight` of them).
    Lowest,
}

impl AckPolicy {
    pub(crate) fn name(self) -> &'static str {
        match self {
            AckPolicy::Trailing => "trailing",
            AckPolicy::Lowest => "lowest",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<AckPolicy> {
        match name {
            "trailing" => Some(AckPolicy::Trailing),
            "lowest" => Some(AckPolicy::Lowest),
            _ => None,
        }
    }
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    All,
    Http,
    Memory,
    /// The bytes a store holds for one client session against keys (`sessions.rs`).
    Sessions,
    /// What a step of an operation costs, and resuming from checkpoints (`steps.rs`).
    Steps,
    /// One memory measurement, printed as JSON (run by the memory mode in a child process).
    MemoryChild {
        records: u64,
    },
    /// The summary's ratios from the files of a run (`--out`, `--outbox`, `--consumer`).
    Summary {
        outbox: Option<PathBuf>,
        consumer: Option<PathBuf>,
    },
    Help,
}

#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) mode: Mode,
    pub(crate) rounds: usize,
    pub(crate) warmup: Duration,
    pub(crate) measure: Duration,
    pub(crate) connections: usize,
    pub(crate) replay_keys: usize,
    /// Probe keys per round, and concurrent duplicates of each.
    pub(crate) probe_keys: usize,
    pub(crate) probe_duplicates: usize,
    pub(crate) server_threads: usize,
    pub(crate) client_threads: usize,
    pub(crate) only: Vec<String>,
    pub(crate) backends: Backends,
    pub(crate) records: Vec<u64>,
    /// Records put in each store before the prefilled rows (`scale.rs`), one set of rows per
    /// count.
    pub(crate) prefill: Vec<u64>,
    /// The sessions mode: requests per run, requests in flight, and which ack they carry.
    pub(crate) requests: Vec<u64>,
    pub(crate) in_flight: usize,
    pub(crate) ack: AckPolicy,
    /// Timed turns of each row of the summary's pairs of HTTP rows (`pair.rs`; 0 for none),
    /// and how long a turn lasts.
    pub(crate) turns: usize,
    pub(crate) turn: Duration,
    pub(crate) out: PathBuf,
}

/// Parses the arguments (without the program name); `env` reads environment variables.
pub(crate) fn parse(
    args: impl IntoIterator<Item = String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Options, String> {
    let nonempty = |v: Option<String>| v.filter(|v| !v.is_empty());
    let mut options = Options {
        mode: Mode::All,
        rounds: 3,
        warmup: Duration::from_secs(3),
        measure: Duration::from_secs(10),
        connections: 64,
        replay_keys: 4,
        probe_keys: 16,
        probe_duplicates: 8,
        server_threads: 2,
        client_threads: 2,
        only: Vec::new(),
        backends: Backends {
            redis_url: nonempty(env("IDEMPOTENT_TEST_REDIS_URL")),
            postgres_url: nonempty(env("IDEMPOTENT_TEST_POSTGRES_URL")),
            redis_replicas: 0,
        },
        records: vec![100_000, 1_000_000, 10_000_000],
        prefill: vec![1_000_000, 10_000_000],
        requests: REQUESTS.to_vec(),
        in_flight: IN_FLIGHT,
        ack: AckPolicy::Trailing,
        turns: 100,
        turn: Duration::from_millis(50),
        out: PathBuf::from("target/bench/http.json"),
    };
    let (mut rounds, mut warmup, mut measure) = (None, None, None);
    let (mut records, mut prefill, mut requests) = (None, None, None);
    let mut quick = false;
    let mut out = None;
    let mut child_records = None;
    let mut args = args.into_iter();
    let mut first = true;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .ok_or_else(|| format!("{name} needs a value\n\n{USAGE}"))
        };
        match arg.as_str() {
            "all" | "http" | "memory" | "sessions" | "steps" | "summary" | "memory-child"
                if first =>
            {
                options.mode = match arg.as_str() {
                    "all" => Mode::All,
                    "http" => Mode::Http,
                    "memory" => Mode::Memory,
                    "sessions" => Mode::Sessions,
                    "steps" => Mode::Steps,
                    "summary" => Mode::Summary {
                        outbox: None,
                        consumer: None,
                    },
                    _ => Mode::MemoryChild { records: 0 },
                }
            }
            "-h" | "--help" => options.mode = Mode::Help,
            "--quick" => quick = true,
            "--rounds" => rounds = Some(number(&arg, &value(&arg)?)?),
            "--warmup" => warmup = Some(seconds(&arg, &value(&arg)?)?),
            "--duration" => measure = Some(seconds(&arg, &value(&arg)?)?),
            "--connections" => options.connections = number(&arg, &value(&arg)?)?,
            "--replay-keys" => options.replay_keys = number(&arg, &value(&arg)?)?,
            "--server-threads" => options.server_threads = number(&arg, &value(&arg)?)?,
            "--client-threads" => options.client_threads = number(&arg, &value(&arg)?)?,
            "--only" => {
                options.only = value(&arg)?
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            }
            "--redis-url" => options.backends.redis_url = nonempty(Some(value(&arg)?)),
            "--redis-replicas" => {
                let n = value(&arg)?;
                options.backends.redis_replicas = n
                    .parse()
                    .map_err(|_| format!("--redis-replicas {n:?} is not a number\n\n{USAGE}"))?;
            }
            "--postgres-url" => options.backends.postgres_url = nonempty(Some(value(&arg)?)),
            "--records" => {
                let list = counts(&arg, &value(&arg)?)?;
                child_records = list.first().copied();
                records = Some(list);
            }
            "--prefill" => {
                let list = value(&arg)?;
                prefill = Some(if list == "none" {
                    Vec::new()
                } else {
                    counts(&arg, &list)?
                });
            }
            "--requests" => requests = Some(counts(&arg, &value(&arg)?)?),
            "--in-flight" => options.in_flight = number(&arg, &value(&arg)?)?,
            "--turns" => {
                let n = value(&arg)?;
                options.turns = match n.as_str() {
                    "0" => 0,
                    n => number(&arg, n)?,
                };
                if options.turns > MAX_TURNS {
                    return Err(format!("--turns takes at most {MAX_TURNS}, not {n}"));
                }
            }
            "--turn-ms" => {
                let ms: u64 = number(&arg, &value(&arg)?)?;
                if ms > MAX_TURN_MS {
                    return Err(format!("--turn-ms takes at most {MAX_TURN_MS}, not {ms}"));
                }
                options.turn = Duration::from_millis(ms);
            }
            "--ack" => {
                let name = value(&arg)?;
                options.ack = AckPolicy::parse(&name).ok_or_else(|| {
                    format!("--ack takes `trailing` or `lowest`, not {name:?}\n\n{USAGE}")
                })?;
            }
            "--out" => out = Some(PathBuf::from(value(&arg)?)),
            "--outbox" | "--consumer" => {
                let path = PathBuf::from(value(&arg)?);
                match &mut options.mode {
                    Mode::Summary { outbox, .. } if arg == "--outbox" => *outbox = Some(path),
                    Mode::Summary { consumer, .. } => *consumer = Some(path),
                    _ => return Err(format!("{arg} is an option of `summary`\n\n{USAGE}")),
                }
            }
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
        first = false;
    }
    if quick {
        options.rounds = QUICK_ROUNDS;
        options.warmup = Duration::from_secs(1);
        options.measure = Duration::from_secs(2);
        options.records = vec![100_000, 1_000_000];
        options.prefill = vec![1_000_000];
        options.requests = QUICK_REQUESTS.to_vec();
    }
    options.requests = requests.unwrap_or(options.requests);
    options.records = records.unwrap_or(options.records);
    options.prefill = prefill.unwrap_or(options.prefill);
    options.rounds = rounds.unwrap_or(options.rounds);
    options.warmup = warmup.unwrap_or(options.warmup);
    options.measure = measure.unwrap_or(options.measure);
    options.out = out.unwrap_or(match options.mode {
        Mode::Steps => PathBuf::from("target/bench/steps.json"),
        _ => options.out,
    });
    if let Mode::MemoryChild { .. } = options.mode {
        let records = child_records.ok_or("memory-child needs --records N")?;
        options.mode = Mode::MemoryChild { records };
    }
    if options.measure.is_zero() {
        return Err("--duration must be more than 0".into());
    }
    Ok(options)
}

fn number<T: std::str::FromStr + PartialOrd + Default>(
    name: &str,
    value: &str,
) -> Result<T, String> {
    match value.parse::<T>() {
        Ok(n) if n > T::default() => Ok(n),
        _ => Err(format!(
            "{name} takes a positive whole number, not {value:?}"
        )),
    }
}

/// A comma-separated list of positive counts.
fn counts(name: &str, list: &str) -> Result<Vec<u64>, String> {
    list.split(',')
        .map(|n| number::<u64>(name, n.trim()))
        .collect()
}

fn seconds(name: &str, value: &str) -> Result<Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{name} takes a number of seconds, not {value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_args(args: &[&str]) -> Result<Options, String> {
        parse(args.iter().map(|s| s.to_string()), |name| match name {
            "IDEMPOTENT_TEST_REDIS_URL" => Some("redis://127.0.0.1:6379".into()),
            "IDEMPOTENT_TEST_POSTGRES_URL" => Some(String::new()),
            _ => None,
        })
    }

    #[test]
    fn defaults_are_the_full_run() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(o.mode, Mode::All);
        assert_eq!((o.rounds, o.connections), (3, 64));
        assert_eq!(o.measure, Duration::from_secs(10));
        assert_eq!(
            o.backends.redis_url.as_deref(),
            Some("redis://127.0.0.1:6379")
        );
        assert_eq!(
            o.backends.postgres_url, None,
            "an empty variable means none"
        );
        assert_eq!(o.records, [100_000, 1_000_000, 10_000_000]);
        assert_eq!(o.prefill, [1_000_000, 10_000_000]);
        assert_eq!(o.requests, [100, 1_000, 10_000, 100_000]);
        assert_eq!(o.in_flight, 16);
        assert_eq!(o.ack, AckPolicy::Trailing);
    }

    #[test]
    fn sessions_mode() {
        let o = parse_args(&["sessions", "--quick"]).unwrap();
        assert_eq!(o.mode, Mode::Sessions);
        assert_eq!(o.requests, [100, 1_000, 10_000]);
        let o = parse_args(&[
            "sessions",
            "--requests",
            "50,5000",
            "--quick",
            "--in-flight",
            "4",
            "--ack",
            "lowest",
        ])
        .unwrap();
        assert_eq!(o.requests, [50, 5_000], "an explicit list beats --quick");
        assert_eq!((o.in_flight, o.ack), (4, AckPolicy::Lowest));
        assert!(parse_args(&["--ack", "prompt"]).is_err());
        assert!(parse_args(&["--in-flight", "0"]).is_err());
        assert!(parse_args(&["--requests", "0"]).is_err());
    }

    #[test]
    fn steps_mode() {
        let o = parse_args(&["steps", "--quick", "--only", "redis"]).unwrap();
        assert_eq!(o.mode, Mode::Steps);
        assert_eq!((o.rounds, o.in_flight), (QUICK_ROUNDS, 16));
        assert_eq!(o.out, PathBuf::from("target/bench/steps.json"));
        let o = parse_args(&["steps", "--out", "x.json", "--in-flight", "4"]).unwrap();
        assert_eq!((o.out, o.in_flight), (PathBuf::from("x.json"), 4));
        assert_eq!(
            parse_args(&["sessions"]).unwrap().out,
            PathBuf::from("target/bench/http.json")
        );
    }

    #[test]
    fn prefill_and_records() {
        let o = parse_args(&["--quick"]).unwrap();
        assert_eq!(o.records, [100_000, 1_000_000]);
        assert_eq!(o.prefill, [1_000_000]);
        let o = parse_args(&["--prefill", "5000, 20000", "--quick", "--records", "7"]).unwrap();
        assert_eq!(o.prefill, [5_000, 20_000], "an explicit list beats --quick");
        assert_eq!(o.records, [7]);
        assert!(
            parse_args(&["--prefill", "none"])
                .unwrap()
                .prefill
                .is_empty()
        );
        assert!(parse_args(&["--prefill", "0"]).is_err());
        assert!(parse_args(&["--prefill", "1,x"]).is_err());
    }

    #[test]
    fn summary_reads_the_files_it_is_given() {
        let o = parse_args(&[
            "summary",
            "--out",
            "h.json",
            "--outbox",
            "o.json",
            "--consumer",
            "c.json",
        ])
        .unwrap();
        assert_eq!(o.out, PathBuf::from("h.json"));
        assert_eq!(
            o.mode,
            Mode::Summary {
                outbox: Some(PathBuf::from("o.json")),
                consumer: Some(PathBuf::from("c.json")),
            }
        );
        let e = parse_args(&["http", "--outbox", "o.json"]).unwrap_err();
        assert!(e.contains("--outbox is an option of `summary`"), "{e}");
    }

    #[test]
    fn turns_default_to_100_of_50_ms_and_are_bounded() {
        let o = parse_args(&["http"]).unwrap();
        assert_eq!((o.turns, o.turn), (100, Duration::from_millis(50)));
        let o = parse_args(&["http", "--turns", "0"]).unwrap();
        assert_eq!(o.turns, 0);
        let o = parse_args(&["--turns", "40", "--turn-ms", "20"]).unwrap();
        assert_eq!((o.turns, o.turn), (40, Duration::from_millis(20)));
        for bad in [
            &["--turns", "-1"][..],
            &["--turns", "x"],
            &["--turns", "10001"],
            &["--turn-ms", "0"],
            &["--turn-ms", "10001"],
            &["--turns"],
        ] {
            assert!(parse_args(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn quick_and_overrides() {
        let o = parse_args(&["http", "--quick", "--duration", "1.5"]).unwrap();
        assert_eq!(o.mode, Mode::Http);
        assert_eq!(o.rounds, QUICK_ROUNDS);
        assert_eq!(o.warmup, Duration::from_secs(1));
        assert_eq!(o.measure, Duration::from_millis(1500));
        let o = parse_args(&[
            "--only",
            "bare, idempotent-tower/replay",
            "--postgres-url",
            "postgres://x",
        ])
        .unwrap();
        assert_eq!(o.only, ["bare", "idempotent-tower/replay"]);
        assert_eq!(o.backends.postgres_url.as_deref(), Some("postgres://x"));
    }

    #[test]
    fn child_mode_and_errors() {
        let o = parse_args(&["memory-child", "--records", "1000"]).unwrap();
        assert_eq!(o.mode, Mode::MemoryChild { records: 1000 });
        assert!(parse_args(&["memory-child"]).is_err());
        assert!(parse_args(&["--connections", "0"]).is_err());
        assert!(parse_args(&["--connections"]).is_err());
        assert!(parse_args(&["--bogus"]).is_err());
        assert!(
            parse_args(&["--quick", "http"]).is_err(),
            "the mode comes first"
        );
        assert!(parse_args(&["--duration", "0"]).is_err());
    }
}
