//! Graceful shutdown: stop taking new calls, let the running ones finish and record their
//! outcome, stop what is still running at a deadline.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use metrics::Gauge;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

const OPEN: u8 = 0;
const DRAINING: u8 = 1;
const STOPPING: u8 = 2;

/// How long [`Drain::drain`] waits, after the deadline, for the calls it stopped to release
/// their claims: each release is bounded by a sixth of its lease, 5 s with the default lease.
const RELEASE_GRACE: Duration = Duration::from_secs(5);

/// The shutdown state a runtime and its clones share, and the count of calls in flight.
#[derive(Default)]
pub(crate) struct Drain {
    state: AtomicU8,
    active: AtomicUsize,
    stopped: AtomicUsize,
    /// Notified when the last active call ends during a drain.
    idle: Notify,
    /// Notified when running work must stop.
    stop: Notify,
}

/// What a graceful shutdown achieved: see [`Idempotency::shutdown`](crate::Idempotency::shutdown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Calls whose work was still running at the deadline and was stopped (its future dropped,
    /// its claim released): their clients got [`Error::ShuttingDown`](crate::Error::ShuttingDown)
    /// and their retries run the work again.
    pub stopped: usize,
    /// Calls still not finished when `shutdown` returned: outcomes still being recorded (the
    /// store was slow or down) or claims still being released. Their claims end with their
    /// leases.
    pub remaining: usize,
}

impl Drained {
    /// Whether every call finished within the deadline: nothing was stopped and nothing is left.
    pub fn is_clean(&self) -> bool {
        self.stopped == 0 && self.remaining == 0
    }
}

impl Drain {
    /// Counts a new call in, or `None` once shutdown has begun.
    #[inline]
    pub(crate) fn enter(self: &Arc<Self>) -> Option<Active<'_>> {
        // SeqCst on both sides: either `drain` sees this call counted, or this call sees the
        // drain and backs out.
        self.active.fetch_add(1, Ordering::SeqCst);
        let active = Active {
            drain: self,
            owner: None,
        };
        if self.state.load(Ordering::SeqCst) != OPEN {
            return None;
        }
        Some(active)
    }

    /// Counts one call out.
    #[inline]
    fn end(&self) {
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1
            && self.state.load(Ordering::SeqCst) != OPEN
        {
            self.idle.notify_waiters();
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.state.load(Ordering::Relaxed) == OPEN
    }

    /// Refuses new calls, waits up to `grace` for the active ones to end, then tells the work
    /// still running to stop and waits a little for it to release its claims.
    pub(crate) async fn drain(&self, grace: Duration) -> Drained {
        // Never moves back: a second shutdown while one is stopping work keeps stopping it.
        let _ = self
            .state
            .compare_exchange(OPEN, DRAINING, Ordering::SeqCst, Ordering::SeqCst);
        let finished = self.idle_within(grace).await;
        if !finished {
            self.state.store(STOPPING, Ordering::SeqCst);
            self.stop.notify_waiters();
            self.idle_within(RELEASE_GRACE).await;
        }
        Drained {
            stopped: self.stopped.load(Ordering::SeqCst),
            remaining: self.active.load(Ordering::SeqCst),
        }
    }

    /// Waits until no call is active, at most `limit` (a `limit` too far away for the clock
    /// waits as long as it takes); whether none is.
    async fn idle_within(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now().checked_add(limit);
        loop {
            let idle = self.idle.notified();
            let mut idle = std::pin::pin!(idle);
            idle.as_mut().enable();
            if self.active.load(Ordering::SeqCst) == 0 {
                return true;
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, idle).await.is_err() {
                        return self.active.load(Ordering::SeqCst) == 0;
                    }
                }
                None => idle.await,
            }
        }
    }

    /// A signal that resolves once running work must stop; checked only by work that waits.
    pub(crate) fn stopping(&self) -> Stopping<'_> {
        Stopping {
            drain: self,
            notified: None,
        }
    }
}

/// One call counted in flight, borrowing the drain; ends when dropped. A call that finishes
/// in place never clones the drain's `Arc`; one that hands its outcome to a task
/// [detaches](Self::detach) its count first. Once the call owns its claim it also counts in
/// the [`idempotency.claims.in_flight`](crate::metrics) gauge, until it ends.
pub(crate) struct Active<'a> {
    drain: &'a Arc<Drain>,
    owner: Option<Gauge>,
}

impl Active<'_> {
    /// Records that this call's work was stopped by the shutdown.
    pub(crate) fn stopped(&self) {
        self.drain.stopped.fetch_add(1, Ordering::SeqCst);
    }

    /// Counts this call in `gauge` as an owner until it ends.
    #[inline]
    pub(crate) fn own(&mut self, gauge: &Gauge) {
        gauge.increment(1.0);
        self.owner = Some(gauge.clone());
    }

    /// The same count, owned, for a task that outlives the call.
    pub(crate) fn into_owned(mut self) -> ActiveOwned {
        let owned = ActiveOwned {
            drain: Arc::clone(self.drain),
            owner: self.owner.take(),
        };
        std::mem::forget(self);
        owned
    }
}

impl Drop for Active<'_> {
    #[inline]
    fn drop(&mut self) {
        end_call(self.drain, self.owner.as_ref());
    }
}

/// Ends one call's count: out of the owners' gauge, if it was in it, and out of the drain.
#[inline]
fn end_call(drain: &Drain, owner: Option<&Gauge>) {
    if let Some(gauge) = owner {
        gauge.decrement(1.0);
    }
    drain.end();
}

impl fmt::Debug for Active<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Active")
    }
}

/// A call's count in flight, owned by a task that finishes its outcome; ends when dropped.
pub(crate) struct ActiveOwned {
    drain: Arc<Drain>,
    owner: Option<Gauge>,
}

impl Drop for ActiveOwned {
    fn drop(&mut self) {
        end_call(&self.drain, self.owner.as_ref());
    }
}

impl fmt::Debug for ActiveOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ActiveOwned")
    }
}

/// Polled next to work that waits: ready once the shutdown's deadline has passed. Registers
/// with the drain only when first polled, so work that never waits pays nothing.
pub(crate) struct Stopping<'a> {
    drain: &'a Drain,
    notified: Option<Pin<Box<Notified<'a>>>>,
}

impl Stopping<'_> {
    pub(crate) fn poll_stop(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let drain = self.drain;
        let notified = self.notified.get_or_insert_with(|| {
            let mut notified = Box::pin(drain.stop.notified());
            notified.as_mut().enable();
            notified
        });
        if drain.state.load(Ordering::SeqCst) == STOPPING {
            return Poll::Ready(());
        }
        notified.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_drain_refuses_new_calls_and_waits_for_active_ones() {
        let drain = Arc::new(Drain::default());
        let active = drain.enter().expect("open");
        let waiter = {
            let drain = Arc::clone(&drain);
            tokio::spawn(async move { drain.drain(Duration::from_secs(10)).await })
        };
        tokio::task::yield_now().await;
        assert!(
            drain.enter().is_none(),
            "a draining runtime takes no new call"
        );
        assert!(!waiter.is_finished());
        drop(active);
        let drained = waiter.await.unwrap();
        assert!(drained.is_clean(), "{drained:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_deadline_waiting_work_is_told_to_stop() {
        let drain = Arc::new(Drain::default());
        let worker = {
            let drain = Arc::clone(&drain);
            tokio::spawn(async move {
                let active = drain.enter().expect("open");
                let mut stopping = drain.stopping();
                std::future::poll_fn(|cx| stopping.poll_stop(cx)).await;
                active.stopped();
                drop(active);
            })
        };
        while drain.active.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let drained = drain.drain(Duration::from_secs(3)).await;
        worker.await.unwrap();
        assert_eq!(
            drained,
            Drained {
                stopped: 1,
                remaining: 0
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_never_ends_is_reported_as_remaining() {
        let drain = Arc::new(Drain::default());
        let _stuck = drain.enter().expect("open").into_owned();
        let drained = drain.drain(Duration::from_secs(1)).await;
        assert_eq!(
            drained,
            Drained {
                stopped: 0,
                remaining: 1
            }
        );
        assert!(!drained.is_clean());
    }
}
