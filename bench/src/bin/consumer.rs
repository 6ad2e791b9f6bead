//! The consumer runtime's throughput on Redis Streams, NATS JetStream, RabbitMQ and Kafka,
//! against each broker's own limit measured in the same run by the simplest consumer written
//! directly on the broker's client crate.
//!
//! Each row pre-publishes a backlog (`--messages`, default 20,000, postings like the `ledger`
//! example's: `id`, `account` among 1,000, `amount`) to a stream, queue or topic of its own
//! (Kafka: three partitions, each record keyed by its account), then consumes it and is timed
//! from the consumer's start to the last acknowledgement. Rows, per broker:
//!
//! - `bare`: the broker's own loop with a no-op handler, one message at a time: Redis
//!   `XREADGROUP … COUNT 32` then one `XACK` of the whole batch; NATS a durable pull consumer's
//!   `fetch` of 32, each message acknowledged; RabbitMQ `basic.consume` with prefetch 64, each
//!   delivery `basic.ack`ed (Redis reads on one connection and acknowledges on another: a
//!   blocking read holds up every later command on its connection); Kafka an rdkafka
//!   `StreamConsumer` in a group of its own, up to 32 messages taken from what it has fetched,
//!   their offsets stored at once and committed every 200 ms;
//! - `bare-tasks`: the same loop handing each message to one of `--concurrency` (16) spawned
//!   tasks that acknowledge it one by one (Redis: one `XACK` per message; Kafka: its offset
//!   stored when its task ends, so a partition's offsets can be stored out of order: not a
//!   crash-correct consumer, the client's limit): the runtime's shape, without decoding, claims
//!   or records;
//! - `runtime`: `Consumer::new(source).run(Idempotency::new(MemoryStore::new()), handler, …)`
//!   with a handler that decodes the posting and does nothing (a claim and a completion in the
//!   memory store per message); `runtime-dup`: the same with `--duplicates` (2,000) copies mixed
//!   in, each published at least 1,000 messages after its original;
//! - `bare-pg`: `bare-tasks` whose handler decodes the posting and runs `BEGIN; INSERT INTO
//!   accounts … ON CONFLICT DO UPDATE; COMMIT` before the ack: the effect without the runtime;
//! - `runtime-pg`: `Consumer::run_transactional` with that `INSERT` as the handler (the claim
//!   and the completion in the same transaction); `runtime-pg-dup`: with the duplicates.
//!
//! Each row reports messages per second over the whole backlog and between its 10th and 90th
//! percent (the tail shows in the difference), the p50, p99 and max from a message's receipt
//! to the broker's answer to its ack (the runtime's `idempotency.message.duration`, caught by a
//! recorder of its own; the bare loops time the same span), CPU per message of this process,
//! of each server (`--services`, which `scripts/bench_consumer.sh` sets) and of the whole
//! machine, context switches per message, and whether every posting was applied exactly once.
//! The consumer loops run on the main thread (in `#[tokio::main]`, as in the `ledger` example),
//! the handlers on the runtime's two worker threads.
//!
//! Diagnostics: `--paced RATE` publishes while the consumer runs and reports the latencies
//! (also from publication); `--receive-stats` counts the runtime's receive calls and their
//! sizes; `--bare-batch N` changes what the bare loops ask for at once; `--parts` times the
//! pieces the runtime adds per message, in process.
//!
//! ```sh
//! bash scripts/bench_consumer.sh            # starts the five servers, builds, runs
//! target/release/consumer --help
//! ```
//!
//! It prints one JSON object per row, then a table. The numbers are in BENCHMARKS.md. The
//! benchmark itself is the library's `consumer` module (`src/consumer/`).

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    idempotent_bench::consumer::run().await;
}
