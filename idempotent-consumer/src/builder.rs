//! The [`Consumer`] builder: concurrency, batch, deliveries, backoff and timeouts, and the
//! [`Outcome`] its observer sees.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::failure::Failure;
use super::handler::Handler;
#[cfg(feature = "postgres")]
use super::handler::TxHandler;
use super::message::Message;
use super::runner::Report;
use super::source::Source;
use super::{effect, runner};

/// The runtime's settings over one [`Source`]. Build one, then [`run`](Consumer::run) it.
pub struct Consumer<S> {
    source: Arc<S>,
    settings: Settings,
}

impl<S> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    pub(crate) max_deliveries: u64,
    pub(crate) backoff: (Duration, Duration),
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) observer: Option<Observer>,
}

type Observer = Arc<dyn Fn(&Message, Outcome<'_>) + Send + Sync>;

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("max_deliveries", &self.max_deliveries)
            .field("backoff", &self.backoff)
            .field("handler_timeout", &self.handler_timeout)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// How one message ended, as an [observer](Consumer::on_outcome) sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Outcome<'a> {
    /// Applied now, and acknowledged.
    Applied,
    /// Recorded already: acknowledged without running the handler.
    Duplicate,
    /// Not applied; left for the broker to deliver again, not before `delay` where the broker
    /// can wait.
    Retried {
        /// Why it was not applied.
        failure: &'a Failure,
        /// The backoff asked of the broker.
        delay: Duration,
    },
    /// Dead-lettered now, with `failure`'s reason.
    DeadLettered {
        /// Why.
        failure: &'a Failure,
    },
}

/// Messages handled at once, by default.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Messages asked of the broker at once, at most, by default.
pub const DEFAULT_BATCH: usize = 32;
/// Deliveries after which a rejected message is dead-lettered, by default.
pub const DEFAULT_MAX_DELIVERIES: u64 = 5;
/// The first retry's delay and the longest, by default.
pub const DEFAULT_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(30));

impl<S: Source> Consumer<S> {
    /// A consumer of `source` with the default settings.
    pub fn new(source: S) -> Self {
        Consumer {
            source: Arc::new(source),
            settings: Settings {
                concurrency: DEFAULT_CONCURRENCY,
                batch: DEFAULT_BATCH,
                max_deliveries: DEFAULT_MAX_DELIVERIES,
                backoff: DEFAULT_BACKOFF,
                handler_timeout: None,
                observer: None,
            },
        }
    }

    /// The most messages handled at once (default [`DEFAULT_CONCURRENCY`]; at least 1).
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency.max(1);
        self
    }

    /// The most messages asked of the broker at once (default [`DEFAULT_BATCH`]; at least 1).
    /// At most `concurrency + batch` messages are in hand; a batch is asked for once there is
    /// room for half of one. Messages waiting for a handler slot are kept alive meanwhile.
    /// RabbitMQ's prefetch should exceed `concurrency + batch`.
    #[must_use]
    pub fn batch(mut self, batch: usize) -> Self {
        self.settings.batch = batch.max(1);
        self
    }

    /// A message the data rejects ([`Failure::Rejected`]) is dead-lettered from this delivery
    /// on, as the broker counts them (default [`DEFAULT_MAX_DELIVERIES`]; at least 1).
    #[must_use]
    pub fn max_deliveries(mut self, max_deliveries: u64) -> Self {
        self.settings.max_deliveries = max_deliveries.max(1);
        self
    }

    /// The delay before a failed message's first retry, doubled with each delivery up to
    /// `max` (default [`DEFAULT_BACKOFF`]). Where a broker cannot delay a retry (Redis
    /// Streams) its own redelivery delay applies.
    #[must_use]
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = (first, max.max(first));
        self
    }

    /// Stops a handler that runs longer than `timeout` (its claim released, or its transaction
    /// rolled back) and retries its message as [`Failure::Transient`]. Default: none, except
    /// the source's [`handling_limit`](Source::handling_limit) (RabbitMQ's consumer timeout),
    /// which always applies.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = Some(timeout);
        self
    }

    /// Calls `observer` with each message's outcome, once the broker has been answered (an
    /// application's own log lines or audit trail). It runs on the message's task: keep it
    /// quick.
    #[must_use]
    pub fn on_outcome(
        mut self,
        observer: impl Fn(&Message, Outcome<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.settings.observer = Some(Arc::new(observer));
        self
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Consumes until `shutdown` completes, running `handler` under claims of `idempotency`'s
    /// store; then stops receiving, finishes every message in hand and returns what it did.
    /// Broker failures never end it: it waits and tries again.
    pub async fn run<H: Handler>(
        self,
        idempotency: idempotent_core::Idempotency,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Report {
        let effect = effect::Claimed {
            idempotency,
            handler,
        };
        runner::run(self.source, self.settings, Arc::new(effect), shutdown).await
    }

    /// Consumes until `shutdown` completes, running `handler` inside a transaction of `pool`
    /// that claims the key and records the result through `transactional`; the message is
    /// acknowledged after the commit. Otherwise as [`run`](Self::run).
    ///
    /// Every failure of a message's transaction is answered by rolling it back whole, so its
    /// claims take no savepoint
    /// ([`Transactional::without_savepoint`](idempotent_postgres::Transactional::without_savepoint)):
    /// a message costs two round trips fewer.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn run_transactional<H: TxHandler>(
        self,
        pool: sqlx::PgPool,
        transactional: idempotent_postgres::Transactional,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Report {
        let effect = effect::InTransaction {
            pool,
            deliveries: effect::transactional::Deliveries::beside(&transactional),
            transactional: transactional.without_savepoint(),
            handler,
        };
        runner::run(self.source, self.settings, Arc::new(effect), shutdown).await
    }
}

/// The delay before retrying a message on its `deliveries`-th delivery: `first` doubled per
/// earlier delivery, at most `max`.
pub(crate) fn backoff_delay((first, max): (Duration, Duration), deliveries: u64) -> Duration {
    let doublings = u32::try_from(deliveries.saturating_sub(1))
        .unwrap_or(u32::MAX)
        .min(30);
    first.saturating_mul(1 << doublings).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The retry delay doubles from `first` up to `max`, and saturates rather than overflows
    /// at any setting and delivery count (`Consumer::backoff(Duration::MAX, Duration::MAX)`).
    #[test]
    fn backoff_delays_double_up_to_the_most_and_never_overflow() {
        let ms = Duration::from_millis;
        assert_eq!(backoff_delay((ms(10), ms(1000)), 1), ms(10));
        assert_eq!(backoff_delay((ms(10), ms(1000)), 2), ms(20));
        assert_eq!(backoff_delay((ms(10), ms(1000)), 8), ms(1000));
        assert_eq!(backoff_delay((ms(10), ms(1000)), 0), ms(10));
        for deliveries in [1, 2, 31, 32, u64::MAX] {
            assert_eq!(
                backoff_delay((Duration::MAX, Duration::MAX), deliveries),
                Duration::MAX
            );
            assert_eq!(
                backoff_delay((ms(1), Duration::MAX), deliveries),
                ms(1).saturating_mul(1 << (deliveries.saturating_sub(1).min(30)))
            );
        }
    }
}
