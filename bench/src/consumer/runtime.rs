//! The runtime rows: `Consumer` over each broker's source with the `ledger` example's decoding,
//! and a handler that does nothing (on the memory store) or the accounts' `INSERT` (in the
//! transactional mode).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_consumer::{
    Consumer, DeadLettered, Decode, Failure, Handler, Message, Received, Report, Source,
    SourceError, TxHandler, sql_failure,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{ClaimHandle, Fingerprint, Idempotency, Key};

use super::latency::record_end_to_end;
use super::options::Options;
use super::postgres::{INSERT, Postgres};
use super::postings::Posting;
use super::progress::{Measured, Progress};

/// The runtime rows' handler: the `ledger` example's decoding (key: the posting's id;
/// fingerprint: account and amount), and either nothing (counting its runs) or the account's
/// `INSERT … ON CONFLICT DO UPDATE` in the transaction.
#[derive(Clone, Default)]
pub(crate) struct Postings {
    runs: Arc<AtomicU64>,
}

impl Decode for Postings {
    type Input = Posting;

    fn decode(&self, message: &Message) -> Result<Posting, Failure> {
        Posting::of_message(message)
    }

    fn key(&self, _: &Message, posting: &Posting) -> Result<Key, Failure> {
        Key::new(posting.id.as_str()).map_err(|e| Failure::Malformed(e.to_string()))
    }

    fn fingerprint(&self, _: &Message, posting: &Posting) -> Result<Fingerprint, Failure> {
        Fingerprint::of(&(&posting.account, posting.amount))
            .map_err(|e| Failure::Malformed(e.to_string()))
    }
}

impl Handler for Postings {
    type Output = ();

    async fn handle(&self, _: &Posting, _: &ClaimHandle) -> Result<(), Failure> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl TxHandler for Postings {
    type Output = i64;

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        posting: &Posting,
        _: &ClaimHandle,
    ) -> Result<i64, Failure> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        sqlx::query_scalar(INSERT)
            .bind(&posting.account)
            .bind(posting.amount)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| sql_failure("insert", &e))
    }
}

/// A source that counts its receive calls and what they returned (`--receive-stats`).
struct Counted<S> {
    inner: S,
    calls: Arc<AtomicU64>,
    messages: Arc<AtomicU64>,
}

impl<S: Source> Source for Counted<S> {
    type Delivery = S::Delivery;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<S::Delivery>>, SourceError> {
        let received = self.inner.receive(max).await;
        if let Ok(batch) = &received {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.messages
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
        received
    }

    async fn ack(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.inner.ack(delivery).await
    }

    async fn retry(&self, delivery: &S::Delivery, delay: Duration) -> Result<(), SourceError> {
        self.inner.retry(delivery, delay).await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &S::Delivery,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        self.inner.dead_letter(message, delivery, reason).await
    }

    async fn keep_alive(&self, delivery: &S::Delivery) -> Result<(), SourceError> {
        self.inner.keep_alive(delivery).await
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        self.inner.keep_alive_every()
    }

    fn counts_deliveries(&self) -> bool {
        self.inner.counts_deliveries()
    }

    fn handling_limit(&self) -> Option<Duration> {
        self.inner.handling_limit()
    }
}

/// Runs the runtime over `source` until `total` messages are finished.
pub(crate) async fn runtime_row<S: Source>(
    source: S,
    options: &Options,
    postgres: Option<&Postgres>,
    total: usize,
) -> (Measured, u64) {
    let handler = Postings::default();
    let runs = Arc::clone(&handler.runs);
    let counts = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let progress = Progress::start(total);
    let observer = Arc::clone(&progress);
    let stop = Arc::clone(&progress);
    let shutdown = async move { stop.wait().await };
    let report: Report = if options.receive_stats {
        let source = Counted {
            inner: source,
            calls: Arc::clone(&counts.0),
            messages: Arc::clone(&counts.1),
        };
        run_consumer(source, options, postgres, handler, observer, shutdown).await
    } else {
        run_consumer(source, options, postgres, handler, observer, shutdown).await
    };
    let mut measured = progress.measured();
    if report.source_errors > 0 {
        eprintln!(
            "consumer bench: {} broker operations failed",
            report.source_errors
        );
    }
    if options.receive_stats {
        measured.receives = Some((
            counts.0.load(Ordering::Relaxed),
            counts.1.load(Ordering::Relaxed),
        ));
    }
    (measured, runs.load(Ordering::Relaxed))
}

/// The runtime over `source`, `handler` in the transactional mode when the row has a
/// PostgreSQL effect, until `shutdown`.
async fn run_consumer<S: Source>(
    source: S,
    options: &Options,
    postgres: Option<&Postgres>,
    handler: Postings,
    progress: Arc<Progress>,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let paced = options.paced.is_some();
    let consumer = Consumer::new(source)
        .concurrency(options.concurrency)
        .on_outcome(move |message, outcome| {
            if paced {
                record_end_to_end(Posting::of_message(message).ok().and_then(|p| p.sent));
            }
            progress.outcome(outcome);
        });
    match postgres {
        None => {
            consumer
                .run(Idempotency::new(MemoryStore::new()), handler, shutdown)
                .await
        }
        Some(pg) => {
            consumer
                .run_transactional(
                    pg.pool.clone(),
                    idempotent_postgres::Transactional::new(&pg.store).namespace("consumer-bench"),
                    handler,
                    shutdown,
                )
                .await
        }
    }
}
