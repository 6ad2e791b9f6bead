//! A relay's batch of large payloads holds each payload once, measured against a real
//! PostgreSQL server (started by `scripts/test.sh`) in a child process whose allocator gives
//! every large allocation its own mapping, so that the resident set follows the live payloads.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).

use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_postgres::outbox::{BoxFuture, Outbox, Relay, Relayed, Sink, SinkError};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Set in the child process that measures.
const CHILD_VAR: &str = "IDEMPOTENT_TEST_OUTBOX_MEMORY_CHILD";
/// Payloads in the batch, and the size of each.
const PAYLOADS: usize = 8;
const PAYLOAD_SIZE: usize = 8 << 20;

/// The resident set of this process, in bytes.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Waits until every message of the batch is being delivered, then notes the resident set:
/// everything the batch holds while its sinks run.
struct Measure {
    arrived: Arc<tokio::sync::Barrier>,
    peak: Arc<AtomicU64>,
}

impl Sink for Measure {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            assert_eq!(message.payload.len(), PAYLOAD_SIZE);
            self.arrived.wait().await;
            self.peak.fetch_max(resident(), Ordering::SeqCst);
            Ok(())
        })
    }
}

// Regression: a batch held every payload twice while it delivered: once in the rows the batch
// statement returned (kept until the end of the batch) and once in the messages copied out of
// them. A batch of 32 messages of 16 MiB held 1 GiB instead of 512 MiB.
#[test]
fn a_batch_of_large_payloads_holds_each_payload_once() {
    let Some(url) = postgres_url() else {
        return;
    };
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        // The measure relies on glibc's malloc and /proc.
        return;
    }
    if std::env::var_os(CHILD_VAR).is_some() {
        return measure(&url);
    }
    // glibc maps each allocation of 64 KiB or more on its own and unmaps it when freed, so
    // the resident set rises and falls with the payloads held.
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_batch_of_large_payloads_holds_each_payload_once",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("MALLOC_MMAP_THRESHOLD_", "65536")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(Some(child));
    let started = std::time::Instant::now();
    while child.0.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the measuring process did not finish within 120 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "the measuring process failed:\n{stdout}\n{stderr}"
    );
}

/// The measuring process, killed (by its pid) if the test ends before it does.
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn measure(url: &str) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let options = PgConnectOptions::from_str(url).unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        let outbox = Outbox::with_table(unique("outbox")).unwrap();
        outbox.migrate(&pool).await.unwrap();
        // Written by the server, so that this process never held the payloads before.
        sqlx::query(&format!(
            "INSERT INTO \"{}\" (destination, message_key, payload, header_names, \
             header_values, available_at) \
             SELECT 'hook', 'big-' || n, convert_to(repeat(chr(64 + n), $1), 'UTF8'), '{{}}', \
             '{{}}', clock_timestamp() FROM generate_series(1, $2) n",
            outbox.table()
        ))
        .bind(PAYLOAD_SIZE as i32)
        .bind(PAYLOADS as i32)
        .execute(&pool)
        .await
        .unwrap();
        let peak = Arc::new(AtomicU64::new(0));
        let relay = Relay::builder(pool.clone(), outbox.clone())
            .sink(
                "hook",
                Measure {
                    arrived: Arc::new(tokio::sync::Barrier::new(PAYLOADS)),
                    peak: Arc::clone(&peak),
                },
            )
            .batch_size(PAYLOADS as u32)
            .max_batch_bytes((PAYLOADS * PAYLOAD_SIZE) as u64)
            .delivery_timeout(Duration::from_secs(60))
            .build();
        let before = resident();
        let batch = relay.run_once().await.unwrap();
        assert_eq!(batch.delivered, PAYLOADS);
        let held = peak.load(Ordering::SeqCst).saturating_sub(before);
        let payloads = (PAYLOADS * PAYLOAD_SIZE) as u64;
        eprintln!(
            "held {} MiB while delivering {} MiB of payloads",
            held >> 20,
            payloads >> 20
        );
        // Once, plus what the connection's read buffer still holds: well under twice.
        assert!(
            held < payloads * 3 / 2,
            "held {} MiB while delivering {} MiB of payloads",
            held >> 20,
            payloads >> 20
        );
        sqlx::query(&format!("DROP TABLE \"{}\"", outbox.table()))
            .execute(&pool)
            .await
            .unwrap();
    });
}
