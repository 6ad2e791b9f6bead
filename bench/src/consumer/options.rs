//! The consumer benchmark's command line: `--help`'s text, the options and their defaults, and
//! which rows they select.

use super::rows::{Broker, Mode};

/// Messages a bare loop asks of the broker at once by default (the runtime's default batch).
const BATCH: usize = 32;

const USAGE: &str = "\
consumer: the consumer runtime's throughput on Redis Streams, NATS JetStream, RabbitMQ and
Kafka

  --redis-url URL      (or IDEMPOTENT_TEST_REDIS_URL; without one, no Redis rows)
  --nats-url URL       (or IDEMPOTENT_TEST_NATS_URL)
  --amqp-url URL       (or IDEMPOTENT_TEST_AMQP_URL)
  --kafka-url URL      kafka://HOST:PORT[,HOST:PORT] (or IDEMPOTENT_TEST_KAFKA_URL)
  --postgres-url URL   (or IDEMPOTENT_TEST_POSTGRES_URL; without one, no PostgreSQL rows)
  --messages N         the backlog of every row (default 20000)
  --duplicates N       copies mixed into the -dup rows' backlog (default 2000)
  --concurrency N      handlers at once (default 16)
  --rounds N           rounds over every row; each row reports its median round (default 1)
  --only LIST          comma-separated brokers (redis, nats, rabbitmq, kafka) and rows (bare,
                       bare-tasks, runtime, runtime-dup, bare-pg, runtime-pg, runtime-pg-dup)
  --receive-stats      wrap the runtime's sources to count receive calls and their sizes
                       (the runtime rows only; a diagnostic, not the measured setup)
  --parts              measure the per-message pieces the runtime adds, in process, and exit
  --paced RATE         instead of a backlog, publish RATE messages a second for
                       --paced-seconds (default 4) while the consumer runs, and report the
                       latencies (from receipt and from publication to the ack's answer);
                       rows bare-tasks and runtime unless --only says otherwise
  --services LIST      redis=PID,nats=PID,rabbitmq=PGID,kafka=PID,postgres=PID (or
                       CONSUMER_BENCH_SERVICES): also report each server's CPU time per
                       message (the process, its children and its process group)
  --bare-batch N       messages the bare loops ask for at once (default 32; a diagnostic)
  --kafka-buffer N     records the Kafka source holds for the runtime before it pauses its
                       partitions (default: the source's, 512; a diagnostic)
  --out FILE           also write the rows as JSON to FILE
";

/// What the command line asks for.
pub(crate) struct Options {
    pub(crate) redis: Option<String>,
    pub(crate) nats: Option<String>,
    pub(crate) amqp: Option<String>,
    pub(crate) kafka: Option<String>,
    pub(crate) postgres: Option<String>,
    pub(crate) messages: usize,
    pub(crate) duplicates: usize,
    pub(crate) concurrency: usize,
    pub(crate) rounds: usize,
    pub(crate) only: Vec<String>,
    pub(crate) receive_stats: bool,
    pub(crate) parts: bool,
    pub(crate) paced: Option<u64>,
    pub(crate) paced_seconds: u64,
    pub(crate) services: Option<String>,
    pub(crate) bare_batch: usize,
    pub(crate) kafka_buffer: Option<usize>,
    pub(crate) out: Option<String>,
}

impl Options {
    /// The options of this process's command line and environment.
    pub(crate) fn parse() -> Result<Options, String> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut options = Options {
            redis: env("IDEMPOTENT_TEST_REDIS_URL"),
            nats: env("IDEMPOTENT_TEST_NATS_URL"),
            amqp: env("IDEMPOTENT_TEST_AMQP_URL"),
            kafka: env("IDEMPOTENT_TEST_KAFKA_URL"),
            postgres: env("IDEMPOTENT_TEST_POSTGRES_URL"),
            messages: 20_000,
            duplicates: 2_000,
            concurrency: 16,
            rounds: 1,
            only: Vec::new(),
            receive_stats: false,
            parts: false,
            paced: None,
            paced_seconds: 4,
            services: env("CONSUMER_BENCH_SERVICES"),
            bare_batch: BATCH,
            kafka_buffer: None,
            out: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || args.next().ok_or(format!("{arg} needs a value"));
            let number = |text: String| -> Result<usize, String> {
                text.parse().map_err(|e| format!("{arg}: {e}"))
            };
            match arg.as_str() {
                "--redis-url" => options.redis = Some(value()?),
                "--nats-url" => options.nats = Some(value()?),
                "--amqp-url" => options.amqp = Some(value()?),
                "--kafka-url" => options.kafka = Some(value()?),
                "--postgres-url" => options.postgres = Some(value()?),
                "--messages" => options.messages = number(value()?)?.max(10),
                "--duplicates" => options.duplicates = number(value()?)?,
                "--concurrency" => options.concurrency = number(value()?)?.max(1),
                "--rounds" => options.rounds = number(value()?)?.max(1),
                "--only" => {
                    options.only = value()?.split(',').map(|s| s.trim().to_owned()).collect()
                }
                "--receive-stats" => options.receive_stats = true,
                "--parts" => options.parts = true,
                "--paced" => options.paced = Some((number(value()?)? as u64).max(1)),
                "--paced-seconds" => options.paced_seconds = (number(value()?)? as u64).max(1),
                "--out" => options.out = Some(value()?),
                "--services" => options.services = Some(value()?),
                "--bare-batch" => options.bare_batch = number(value()?)?.max(1),
                "--kafka-buffer" => options.kafka_buffer = Some(number(value()?)?.max(1)),
                "--help" | "-h" => {
                    print!("{USAGE}");
                    std::process::exit(0);
                }
                other => return Err(format!("unknown argument {other}\n\n{USAGE}")),
            }
        }
        Ok(options)
    }

    /// The URL of `broker`'s server, if it was given.
    pub(crate) fn url(&self, broker: Broker) -> Option<String> {
        match broker {
            Broker::Redis => self.redis.clone(),
            Broker::Nats => self.nats.clone(),
            Broker::RabbitMq => self.amqp.clone(),
            Broker::Kafka => self.kafka.clone(),
        }
    }

    /// Handlers at once in `mode`'s rows: one in `bare`, `--concurrency` in the others.
    pub(crate) fn concurrency(&self, mode: Mode) -> usize {
        match mode {
            Mode::Bare => 1,
            _ => self.concurrency,
        }
    }

    /// Messages `mode`'s rows ask of the broker at once.
    pub(crate) fn batch(&self, mode: Mode) -> usize {
        if mode.runtime() {
            idempotent_consumer::DEFAULT_BATCH
        } else {
            self.bare_batch
        }
    }

    /// Whether `--only` (or `--paced`, without it) selects the row of `broker` and `mode`.
    pub(crate) fn selects(&self, broker: Broker, mode: Mode) -> bool {
        let brokers: Vec<&String> = self
            .only
            .iter()
            .filter(|o| Broker::ALL.iter().any(|b| b.name() == o.as_str()))
            .collect();
        let modes: Vec<&String> = self
            .only
            .iter()
            .filter(|o| Mode::ALL.iter().any(|m| m.name() == o.as_str()))
            .collect();
        let mode_selected = match (modes.is_empty(), self.paced) {
            (false, _) => modes.iter().any(|m| *m == mode.name()),
            (true, Some(_)) => matches!(mode, Mode::BareTasks | Mode::Runtime),
            (true, None) => true,
        };
        (brokers.is_empty() || brokers.iter().any(|b| *b == broker.name())) && mode_selected
    }
}
