//! Keeping a claim held: the renewal of its lease, and the bounds on each store operation.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use crate::{KeyClaim, StoreError};

/// Shortest pause between renewal attempts after a failure.
const FIRST_RENEW_BACKOFF: Duration = Duration::from_millis(20);

/// Keeps a claim's lease alive on a task of its own, so that neither work that blocks its
/// poller nor a caller that stops polling can starve it (on a runtime with more than one
/// worker thread). Dropping it stops the renewal.
pub(crate) struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Renewal {
    /// Starts renewing `claim`, whose lease began no earlier than `claimed_at` (the instant
    /// the successful claim request was sent). `None` without a tokio runtime or for a
    /// transactional claim (nothing to renew).
    pub(crate) fn start(claim: &KeyClaim, claimed_at: Instant) -> Option<Renewal> {
        claim.store()?;
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        Some(Renewal(runtime.spawn(renew(claim.clone(), claimed_at))))
    }
}

/// `at + by`, or a day later than `at` if that overflows (a lease of `Duration::MAX`).
pub(crate) fn later(at: Instant, by: Duration) -> Instant {
    at.checked_add(by)
        .unwrap_or_else(|| at + Duration::from_secs(86_400))
}

/// Renews every third of the lease. A failed or hung attempt (each is bounded by the time left
/// on the lease and by [`attempt_limit`]) is retried with backoff capped at a twelfth of the
/// lease, until the lease, as counted from the last renewal *sent* that succeeded, has ended:
/// then the claim is lost. So a store that fails fast or hangs for up to about three quarters
/// of the lease does not cost the claim. A rejected token means another owner holds the key:
/// lost at once.
async fn renew(claim: KeyClaim, claimed_at: Instant) {
    let Some(store) = claim.store().cloned() else {
        return;
    };
    let (key, token, lease) = (claim.storage_key(), claim.token(), claim.lease());
    let every = (lease / 3).max(Duration::from_millis(1));
    let longest_backoff = (lease / 12).max(FIRST_RENEW_BACKOFF);
    let mut held_until = later(claimed_at, lease);
    let mut next = later(claimed_at, every);
    let mut backoff = FIRST_RENEW_BACKOFF;
    loop {
        tokio::time::sleep_until(next.min(held_until)).await;
        let sent = Instant::now();
        if sent >= held_until {
            claim.mark_lost("its lease ended before a renewal got through");
            return;
        }
        let limit = (held_until - sent).min(attempt_limit(lease));
        match bounded(store.renew(&key, token, lease), limit).await {
            Some(Ok(())) => {
                held_until = later(sent, lease);
                next = later(sent, every);
                backoff = FIRST_RENEW_BACKOFF;
            }
            Some(Err(StoreError::TokenRejected)) => {
                if !claim.is_recording() {
                    claim.mark_lost("the store rejected its token on renewal");
                }
                return;
            }
            outcome => {
                match outcome {
                    Some(Err(error)) => tracing::warn!(
                        storage_key = %key,
                        error = &error as &dyn std::error::Error,
                        "could not renew an idempotency lease; retrying"
                    ),
                    _ => tracing::warn!(
                        storage_key = %key,
                        timeout = ?limit,
                        "renewing an idempotency lease timed out; retrying"
                    ),
                }
                next = later(Instant::now(), backoff);
                backoff = (backoff * 2).min(longest_backoff);
            }
        }
    }
}

/// How long one store operation on a claim (a renewal, a completion write) may take before it
/// is abandoned and tried again: a sixth of the lease (half the renewal period), at least
/// 10 ms. Two hung attempts in a row then still leave a third of the lease for the next.
pub(crate) fn attempt_limit(lease: Duration) -> Duration {
    (lease / 6).max(Duration::from_millis(10))
}

/// `future`, failing with `None` if it has not finished within `limit`. The timer is created
/// only if the future does not finish on its first poll, so a store that answers at once (the
/// memory store) pays nothing for the bound.
pub(crate) async fn bounded<F: Future>(future: F, limit: Duration) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
    std::future::poll_fn(|cx: &mut Context<'_>| {
        if let Poll::Ready(out) = future.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}
