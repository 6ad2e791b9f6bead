//! The transactional outbox's costs on a real PostgreSQL server:
//!
//! - **enqueue**: transactions per second of the transactional mode with one account update
//!   (`BEGIN`, claim, `UPDATE`, complete, `COMMIT`), without and with one `Outbox::enqueue`
//!   in the same transaction, from `--tasks` concurrent tasks (default 16) for `--duration`
//!   seconds (default 10) after a 2-second warm-up, each on a fresh key;
//! - **relay**: messages per second that 1, 2 and 4 relays drain from an outbox prefilled
//!   with `--messages` messages (default 20,000) and analyzed, with a sink that does nothing
//!   (the relay's own cost: its batches' SQL) and with `HttpSink` POSTing to a bare axum
//!   handler on loopback (the cost of a delivery through the client layer).
//!
//! ```sh
//! cargo run --release -p idempotent-bench --bin outbox -- --postgres-url postgres://…
//! ```
//!
//! With `--quick`, only the relay row that BENCHMARKS.md's summary compares with 0.2 (one relay,
//! the discarding sink), as `scripts/bench.sh --quick` runs it. `--batch N` gives the relays a
//! batch size other than their default (`RelayBuilder::batch_size`); the rows say which
//! (`"batch": null` for the default). `--relays N` runs the `--quick` row with N relays (it
//! needs `--quick`: the full run has rows of 1, 2 and 4). Each relay has its default
//! `RelayBuilder::concurrent_batches` (2 since 0.4).
//!
//! It prints one JSON object per row. The numbers and the machine are in BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::{Call, Key};
use idempotent_postgres::outbox::{BoxFuture, Outbox, Outgoing, Relay, Relayed, Sink, SinkError};
use idempotent_postgres::{PostgresStore, TransactionalClaim};
use idempotent_tower::client::HttpSink;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

struct Options {
    url: String,
    tasks: usize,
    duration: Duration,
    messages: usize,
    /// The relays' batch size (`RelayBuilder::batch_size`); `None`: its default.
    batch: Option<u32>,
    /// Relays of the `--quick` row (default 1, the row the summary compares with 0.2).
    relays: usize,
    quick: bool,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        url: std::env::var("IDEMPOTENT_TEST_POSTGRES_URL").unwrap_or_default(),
        tasks: 16,
        duration: Duration::from_secs(10),
        messages: 20_000,
        batch: None,
        relays: 1,
        quick: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--postgres-url" => options.url = value()?,
            "--tasks" => options.tasks = value()?.parse().map_err(|e| format!("--tasks: {e}"))?,
            "--duration" => {
                let secs: u64 = value()?.parse().map_err(|e| format!("--duration: {e}"))?;
                options.duration = Duration::from_secs(secs);
            }
            "--messages" => {
                options.messages = value()?.parse().map_err(|e| format!("--messages: {e}"))?
            }
            "--batch" => {
                let size: u32 = value()?.parse().map_err(|e| format!("--batch: {e}"))?;
                if size == 0 {
                    return Err("--batch: at least 1".into());
                }
                options.batch = Some(size);
            }
            "--relays" => {
                options.relays = value()?.parse().map_err(|e| format!("--relays: {e}"))?;
                if options.relays == 0 {
                    return Err("--relays: at least 1".into());
                }
            }
            "--quick" => options.quick = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if options.url.is_empty() {
        return Err("give --postgres-url or IDEMPOTENT_TEST_POSTGRES_URL".into());
    }
    if options.relays != 1 && !options.quick {
        return Err("--relays: only with --quick (the full run has rows of 1, 2 and 4)".into());
    }
    Ok(options)
}

/// A sink that accepts every message at once.
struct Discard;

impl Sink for Discard {
    fn deliver<'a>(&'a self, _: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Transactions per second of the transactional mode, with `enqueue` messages each.
async fn enqueue_row(pool: &PgPool, options: &Options, outbox: &Outbox, with_message: bool) {
    let store = PostgresStore::new(pool.clone());
    let transactional = idempotent_postgres::Transactional::new(&store).namespace("outbox-bench");
    let counted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let timing = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..options.tasks)
        .map(|task| {
            let (pool, transactional, outbox) =
                (pool.clone(), transactional.clone(), outbox.clone());
            let (counted, stop, timing) = (counted.clone(), stop.clone(), timing.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = Key::new(format!(
                        "b-{}-{with_message}-{task}-{n}",
                        std::process::id()
                    ))
                    .unwrap();
                    let mut tx = pool.begin().await.unwrap();
                    let TransactionalClaim::Run(pending) = transactional
                        .claim::<i64>(&Call::new(key), &mut tx)
                        .await
                        .unwrap()
                    else {
                        panic!("a fresh key replayed");
                    };
                    sqlx::query(
                        "UPDATE outbox_bench_accounts SET balance = balance + 1 WHERE id = $1",
                    )
                    .bind((task % 64) as i32)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                    if with_message {
                        let message =
                            Outgoing::new("notifications", r#"{"id":"pay-1","amount":1}"#)
                                .claim(&pending.claim())
                                .header("content-type", "application/json");
                        outbox.enqueue(&mut tx, &message).await.unwrap();
                    }
                    pending.complete(&mut tx, &1i64).await.unwrap();
                    tx.commit().await.unwrap();
                    if timing.load(Ordering::Relaxed) {
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    timing.store(true, Ordering::Relaxed);
    let start = Instant::now();
    tokio::time::sleep(options.duration).await;
    let done = counted.load(Ordering::Relaxed);
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    println!(
        "{}",
        serde_json::json!({
            "row": if with_message { "enqueue/transaction+message" } else { "enqueue/transaction" },
            "tasks": options.tasks,
            "tx_per_sec": (done as f64 / elapsed.as_secs_f64()).round(),
        })
    );
}

/// Messages per second that `relays` relays drain, each to `sink`.
async fn relay_row<S: Sink + Clone>(
    pool: &PgPool,
    options: &Options,
    relays: usize,
    label: &str,
    sink: S,
) {
    let outbox = Outbox::with_table(format!("outbox_bench_{}", std::process::id())).unwrap();
    outbox.migrate(pool).await.unwrap();
    sqlx::query(&format!("TRUNCATE \"{}\"", outbox.table()))
        .execute(pool)
        .await
        .unwrap();
    // Prefilled in transactions of 1,000, before any relay starts.
    for chunk in 0..options.messages.div_ceil(1000) {
        let mut tx = pool.begin().await.unwrap();
        for n in chunk * 1000..((chunk + 1) * 1000).min(options.messages) {
            let message = Outgoing::new("notifications", r#"{"id":"pay-1","amount":1}"#)
                .key(Key::new(format!("m-{n}")).unwrap())
                .header("content-type", "application/json");
            outbox.enqueue(&mut tx, &message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    // Statistics, as autovacuum keeps them on a live table: without them, PostgreSQL plans the
    // batch query over the 20,000 new rows badly (about 8 ms a batch instead of 1).
    sqlx::query(&format!("ANALYZE \"{}\"", outbox.table()))
        .execute(pool)
        .await
        .unwrap();
    let start = Instant::now();
    let running: Vec<_> = (0..relays)
        .map(|_| {
            let builder =
                Relay::builder(pool.clone(), outbox.clone()).sink("notifications", sink.clone());
            match options.batch {
                Some(size) => builder.batch_size(size),
                None => builder,
            }
            .build()
            .spawn()
        })
        .collect();
    // Polled through the pending messages' index, which empties as they are delivered: a
    // `count(*)` of the delivered ones every 20 ms took about 4 ms of PostgreSQL's CPU each
    // (a fifth of a CPU on this two-CPU machine), taken from the relay it measures.
    let drained = format!(
        "SELECT NOT EXISTS (SELECT 1 FROM \"{}\" WHERE state = 'pending')",
        outbox.table()
    );
    while !sqlx::query_scalar::<_, bool>(&drained)
        .fetch_one(pool)
        .await
        .unwrap()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = start.elapsed();
    let count = format!(
        "SELECT count(*) FROM \"{}\" WHERE state = 'delivered'",
        outbox.table()
    );
    let delivered: i64 = sqlx::query_scalar(&count).fetch_one(pool).await.unwrap();
    assert_eq!(
        delivered as usize, options.messages,
        "every message delivered"
    );
    for relay in running {
        relay.stop().await;
    }
    sqlx::query(&format!("DROP TABLE \"{}\"", outbox.table()))
        .execute(pool)
        .await
        .unwrap();
    println!(
        "{}",
        serde_json::json!({
            "row": format!("relay/{label}"),
            "relays": relays,
            "batch": options.batch,
            "messages": options.messages,
            "messages_per_sec": (options.messages as f64 / elapsed.as_secs_f64()).round(),
        })
    );
}

/// A bare handler answering 201 to every POST, on loopback: the HTTP sink's receiver.
async fn receiver() -> String {
    let app = axum::Router::new().route(
        "/notify",
        axum::routing::post(|| async { http::StatusCode::CREATED }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/notify", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[derive(Clone)]
struct Http(Arc<HttpSink>);

impl Sink for Http {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        self.0.deliver(message)
    }
}

#[derive(Clone)]
struct Nothing(Arc<Discard>);

impl Sink for Nothing {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        self.0.deliver(message)
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = match options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("outbox bench: {message}");
            std::process::exit(2);
        }
    };
    let pool = PgPoolOptions::new()
        .max_connections(options.tasks as u32 + 16)
        .connect(&options.url)
        .await
        .expect("connect to PostgreSQL");
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS outbox_bench_accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO outbox_bench_accounts SELECT g, 0 FROM generate_series(0, 63) g ON CONFLICT DO NOTHING")
        .execute(&pool)
        .await
        .unwrap();
    let discard = async |relays| {
        relay_row(
            &pool,
            &options,
            relays,
            "discard",
            Nothing(Arc::new(Discard)),
        )
        .await
    };
    if options.quick {
        discard(options.relays).await;
        return;
    }
    let outbox =
        Outbox::with_table(format!("outbox_bench_enqueue_{}", std::process::id())).unwrap();
    outbox.migrate(&pool).await.unwrap();
    enqueue_row(&pool, &options, &outbox, false).await;
    enqueue_row(&pool, &options, &outbox, true).await;
    sqlx::query(&format!("DROP TABLE \"{}\"", outbox.table()))
        .execute(&pool)
        .await
        .unwrap();
    let url = receiver().await;
    for relays in [1, 2, 4] {
        discard(relays).await;
    }
    let http = Http(Arc::new(HttpSink::new(&url).unwrap()));
    for relays in [1, 2, 4] {
        relay_row(&pool, &options, relays, "http", http.clone()).await;
    }
}
