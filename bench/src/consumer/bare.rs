//! The bare loops: the simplest correct consumer of each broker written directly on its client
//! crate, the limit each runtime row is read against.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Semaphore;

use super::latency::{record_end_to_end, record_latency};
use super::postgres::apply;
use super::postings::Posting;
use super::progress::{Measured, Progress};

/// How long a receive waits for a first message, everywhere.
pub(crate) const RECEIVE_WAIT: Duration = Duration::from_secs(1);

/// A broker as the bare loops use it, directly on its client crate.
pub(crate) trait Bare: Send + Sync + 'static {
    type Item: Send + Sync + 'static;

    /// Up to `max` messages, waiting up to [`RECEIVE_WAIT`] for a first one.
    fn receive(&self, max: usize) -> impl Future<Output = Vec<Self::Item>> + Send;

    /// The posting an item carries (for the PostgreSQL effect).
    fn posting(item: &Self::Item) -> Posting;

    /// Acknowledges one message.
    fn ack(&self, item: &Self::Item) -> impl Future<Output = ()> + Send;

    /// Acknowledges a batch, handled one at a time (by default each message on its own).
    fn ack_all(&self, items: &[Self::Item]) -> impl Future<Output = ()> + Send {
        async move {
            for item in items {
                self.ack(item).await;
            }
        }
    }
}

/// A row of a bare loop: how many messages, handled how.
pub(crate) struct BareRow {
    pub(crate) total: usize,
    /// 1: one message at a time, acknowledged per batch, no effect; more: each message on a
    /// spawned task, within this many, with the effect, acknowledged on its own.
    pub(crate) concurrency: usize,
    /// The pool of the PostgreSQL effect, if the row has it.
    pub(crate) postgres: Option<PgPool>,
    pub(crate) paced: bool,
    /// Messages asked of the broker at once.
    pub(crate) batch: usize,
}

impl BareRow {
    /// Consumes the row's messages from `broker`.
    pub(crate) async fn run<B: Bare>(self, broker: B) -> Measured {
        let BareRow {
            total,
            concurrency,
            postgres,
            paced,
            batch,
        } = self;
        let broker = Arc::new(broker);
        let progress = Progress::start(total);
        // A message's latencies, once the broker answered its ack.
        let answered = move |item: &B::Item, received: Instant| {
            record_latency(received.elapsed());
            if paced {
                record_end_to_end(B::posting(item).sent);
            }
        };
        if concurrency == 1 && postgres.is_none() {
            let mut done = 0;
            while done < total {
                let items = broker.receive(batch.min(total - done)).await;
                let received = Instant::now();
                for item in &items {
                    std::hint::black_box(item);
                }
                broker.ack_all(&items).await;
                for item in &items {
                    answered(item, received);
                }
                done += items.len();
                progress.finished_many(items.len() as u64);
            }
        } else {
            let slots = Arc::new(Semaphore::new(concurrency));
            let mut received = 0;
            while received < total {
                let items = broker.receive(batch.min(total - received)).await;
                received += items.len();
                for item in items {
                    let permit = Arc::clone(&slots).acquire_owned().await.unwrap();
                    let (broker, progress, pool) =
                        (Arc::clone(&broker), Arc::clone(&progress), postgres.clone());
                    tokio::spawn(async move {
                        let started = Instant::now();
                        if let Some(pool) = &pool {
                            apply(pool, &B::posting(&item)).await;
                        } else {
                            std::hint::black_box(&item);
                        }
                        broker.ack(&item).await;
                        answered(&item, started);
                        progress.finished_one();
                        drop(permit);
                    });
                }
            }
        }
        progress.wait().await;
        progress.measured()
    }
}
