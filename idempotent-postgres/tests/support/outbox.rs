//! The outbox's fixture for the core's tests against a real PostgreSQL server: a migrated
//! outbox of a test's own, a recording sink, draining a relay, and reading a message's row.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::Key;
use idempotent_postgres::outbox::{BoxFuture, Outbox, Outgoing, Relay, Relayed, Sink, SinkError};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool_bounding_locks as pool;
use sqlx::postgres::PgPool;
use tokio::time::{Instant, timeout};

/// The bound on every wait in these tests; a test that reaches it has failed.
pub const BOUND: Duration = Duration::from_secs(60);

/// A pool of `connections` and a migrated outbox of the test's own, or `None` when
/// PostgreSQL is not configured (and not required).
pub async fn setup(connections: u32) -> Option<(PgPool, Outbox)> {
    let pool = pool(&postgres_url()?, connections).await;
    let outbox = outbox(&pool).await;
    Some((pool, outbox))
}

/// A migrated outbox on a table of its own.
pub async fn outbox(pool: &PgPool) -> Outbox {
    let outbox = Outbox::with_table(unique("outbox")).unwrap();
    outbox.migrate(pool).await.unwrap();
    outbox
}

/// One delivery a sink saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub id: i64,
    pub key: String,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub attempt: u32,
}

/// A sink that records what it is given, fails each message's first `fail_first` attempts
/// (or forever for payloads starting with `poison`, permanently for `refuse`; never answers
/// for `hang`), notices two deliveries of one message at the same time, and keeps the most
/// deliveries it had under way at once.
#[derive(Clone, Default)]
pub struct Recorder {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub delivered: Arc<Mutex<Vec<i64>>>,
    pub in_flight: Arc<Mutex<HashSet<i64>>>,
    pub overlapped: Arc<AtomicBool>,
    pub most_in_flight: Arc<std::sync::atomic::AtomicUsize>,
    pub fail_first: u32,
    pub hold: Duration,
}

impl Recorder {
    pub fn delivered(&self) -> Vec<i64> {
        self.delivered.lock().unwrap().clone()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Sink for Recorder {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            {
                let mut in_flight = self.in_flight.lock().unwrap();
                if !in_flight.insert(message.id) {
                    self.overlapped.store(true, Ordering::SeqCst);
                }
                self.most_in_flight
                    .fetch_max(in_flight.len(), Ordering::SeqCst);
            }
            self.seen.lock().unwrap().push(Seen {
                id: message.id,
                key: message.key.clone(),
                payload: message.payload.to_vec(),
                headers: message.headers.clone(),
                attempt: message.attempt,
            });
            if message.payload.starts_with(b"hang") {
                // Never answers: the relay is stopped (its batch dropped) in the middle of it.
                self.in_flight.lock().unwrap().remove(&message.id);
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(self.hold).await;
            self.in_flight.lock().unwrap().remove(&message.id);
            if message.payload.starts_with(b"panic") {
                panic!("a sink bug");
            }
            if message.payload.starts_with(b"refuse") {
                return Err(SinkError::permanent("refused: malformed"));
            }
            if message.payload.starts_with(b"poison") {
                return Err(SinkError::retry(format!(
                    "receiver down (attempt {})",
                    message.attempt
                )));
            }
            if message.attempt <= self.fail_first {
                return Err(SinkError::retry("receiver busy"));
            }
            self.delivered.lock().unwrap().push(message.id);
            Ok(())
        })
    }
}

/// Waits until `check` holds; fails the test with `what` after [`BOUND`].
pub async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    check: impl FnMut() -> F,
) {
    idempotent_test_kit::process::eventually(what, BOUND, check).await;
}

/// Waits until `sink` has delivered `count` messages.
pub async fn delivered_all(sink: &Recorder, count: usize) {
    let sink = sink.clone();
    eventually("every message delivered", || {
        let sink = sink.clone();
        async move { sink.delivered().len() == count }
    })
    .await;
}

/// Leaves messages `ids` as a relay that died delivering them leaves them, due now: their
/// attempt counted (`attempts`), `delivering_since` set, `delivering_alone` as `alone`.
pub async fn as_if_crashed(
    pool: &PgPool,
    outbox: &Outbox,
    ids: &[i64],
    attempts: i32,
    alone: bool,
) {
    sqlx::query(&format!(
        "UPDATE \"{}\" SET attempts = $2, delivering_since = clock_timestamp(), \
         delivering_alone = $3 WHERE id = ANY($1)",
        outbox.table()
    ))
    .bind(ids)
    .bind(attempts)
    .bind(alone)
    .execute(pool)
    .await
    .unwrap();
}

/// Runs `relay` batch after batch until a batch takes nothing and `done` holds.
pub async fn drain(relay: &Relay, done: impl Fn() -> bool) {
    let start = Instant::now();
    loop {
        let batch = relay.run_once().await.unwrap();
        if batch.taken == 0 && done() {
            return;
        }
        assert!(start.elapsed() < BOUND, "the outbox did not drain");
        if batch.taken == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The row of message `id`: `(state, attempts, last_error)`.
pub async fn row(pool: &PgPool, outbox: &Outbox, id: i64) -> (String, i32, Option<String>) {
    sqlx::query_as(&format!(
        "SELECT state, attempts, last_error FROM \"{}\" WHERE id = $1",
        outbox.table()
    ))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A relay that polls once an hour delivers a message enqueued while it waits: the `NOTIFY`
/// woke it.
pub async fn woken_by_notify(pool: &PgPool, outbox: &Outbox) {
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .poll_interval(Duration::from_secs(3600))
        .build()
        .spawn();
    // Let it run its first batch and start waiting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tx = pool.begin().await.unwrap();
    let message = Outgoing::new("hook", "wake").key(Key::new("wake").unwrap());
    outbox.enqueue(&mut tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    eventually("the NOTIFY woke the relay", || async {
        !sink.delivered().is_empty()
    })
    .await;
    timeout(BOUND, relay.stop()).await.unwrap();
}
