//! The running claim as the work sees it: its fencing token, its downstream operation key, and
//! whether it is still held; and the renewal that keeps it held.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::DynStore;
use crate::{Error, FencingToken, Key, StorageKey, StoreError};

tokio::task_local! {
    static CURRENT: ClaimHandle;
}

/// The claim a running call holds on its key, as the work sees it.
///
/// A claim protects the *record*: of any number of duplicates, one runs. It cannot by itself
/// protect the *effect* when the store stalls past the lease and a second owner takes over while
/// the first still runs. This handle gives the work what it needs to make the effect
/// exactly-once anyway:
///
/// - [`operation_key`](Self::operation_key): a key that is the same for every owner and attempt
///   of this operation. Pass it to the system you call (a payment provider's `Idempotency-Key`,
///   a deduplicating consumer, an outbox row): a stalled owner and its successor then cause one
///   effect.
/// - [`token`](Self::token): the claim's [`FencingToken`], strictly increasing per key across
///   owners. A resource that refuses writes whose token is below the highest it has seen (see
///   `postgres::Fence` with the `postgres` feature) refuses the stale owner.
/// - [`lost`](Self::lost) / [`is_lost`](Self::is_lost): the claim is gone (its lease ended
///   without renewal, or the store said another owner holds the key). [`check`](Self::check)
///   asks the store (one round trip) before an irreversible step.
///
/// Where the work gets it:
///
/// - inside work run by [`Idempotency::run`](crate::Idempotency::run),
///   [`run_with`](crate::Idempotency::run_with) or
///   [`execute`](crate::Idempotency::execute): [`ClaimHandle::current`];
/// - in an `#[idempotent]` function: `claim = name` binds it in the body;
/// - in a handler behind `idempotent_tower::IdempotencyLayer`: a request extension
///   (`Extension<ClaimHandle>` in axum, `request.extensions().get::<ClaimHandle>()` in tonic);
/// - in the PostgreSQL transactional mode: `PendingRecord::claim`.
///
/// [`current`](Self::current) is a task-local: a task spawned by the work does not inherit it;
/// clone the handle into it. Clones are cheap and share the claim.
///
/// ```
/// use idempotent_core::{Call, ClaimHandle, Idempotency, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_core::Error> {
/// let idempotency = Idempotency::new(MemoryStore::new());
/// let call = Call::new("charge-1".parse()?);
/// let receipt = idempotency
///     .run(&call, async {
///         let claim = ClaimHandle::current().expect("inside run");
///         // Ask the store before the irreversible step.
///         if claim.check().await.is_err() {
///             return None; // lost (or unknown): do not charge
///         }
///         // The same key for every attempt of this operation: the provider charges once.
///         let provider_key = claim.operation_key();
///         Some(format!("charged with idempotency key {}", provider_key.as_str()))
///     })
///     .await?;
/// # let charge = receipt;
/// # let _ = charge;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ClaimHandle {
    state: Arc<ClaimState>,
}

struct ClaimState {
    key: StorageKey,
    token: FencingToken,
    lease: Duration,
    /// `None` in the transactional mode: there the claim is a row of the caller's open
    /// transaction, held by the database until the transaction ends.
    store: Option<Arc<dyn DynStore>>,
    lost: AtomicBool,
    /// Set while the result is being written: a renewal the store rejects then is answered
    /// by that write's outcome (the record is no longer in flight because it completed, or the
    /// write fails too and reports the loss), not by the renewal.
    recording: AtomicBool,
    notify: Notify,
}

impl fmt::Debug for ClaimHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimHandle")
            .field("storage_key", &self.state.key)
            .field("token", &self.state.token)
            .field("lease", &self.state.lease)
            .field("transactional", &self.state.store.is_none())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl ClaimHandle {
    pub(crate) fn leased(
        store: Arc<dyn DynStore>,
        key: StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Self {
        Self::with_store(Some(store), key, token, lease)
    }

    /// A claim held by an open database transaction: it cannot be lost while the transaction
    /// is open, and nothing of it survives if the transaction does not commit.
    #[cfg(feature = "postgres")]
    pub(crate) fn transactional(key: StorageKey, token: FencingToken, lease: Duration) -> Self {
        Self::with_store(None, key, token, lease)
    }

    fn with_store(
        store: Option<Arc<dyn DynStore>>,
        key: StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Self {
        ClaimHandle {
            state: Arc::new(ClaimState {
                key,
                token,
                lease,
                store,
                lost: AtomicBool::new(false),
                recording: AtomicBool::new(false),
                notify: Notify::new(),
            }),
        }
    }

    /// The claim of the call whose work is running on this task, if any.
    ///
    /// Set while the runtime polls the work of [`Idempotency::run`](crate::Idempotency::run),
    /// [`run_with`](crate::Idempotency::run_with) and
    /// [`execute`](crate::Idempotency::execute) (and so inside `#[idempotent]` functions and
    /// behind the tower layer). `None` elsewhere, including in tasks the work spawns.
    pub fn current() -> Option<ClaimHandle> {
        CURRENT.try_with(ClaimHandle::clone).ok()
    }

    /// Runs `work` with `self` as [`current`](Self::current).
    pub(crate) fn scope<F: Future>(
        self,
        work: F,
    ) -> tokio::task::futures::TaskLocalFuture<ClaimHandle, F> {
        CURRENT.scope(self, work)
    }

    /// The claim's fencing token: strictly increasing per storage key across owners, takeovers
    /// and expiry (the exact guarantee per store is in the crate's failure model).
    pub fn token(&self) -> FencingToken {
        self.state.token
    }

    /// The storage key the claim is on.
    pub fn storage_key(&self) -> StorageKey {
        self.state.key
    }

    /// The key to pass downstream for this operation: see
    /// [`StorageKey::operation_key`]. Identical for every owner and attempt of the operation.
    pub fn operation_key(&self) -> Key {
        self.state.key.operation_key()
    }

    /// The claim's lease: how long it lives without renewal.
    pub fn lease(&self) -> Duration {
        self.state.lease
    }

    /// True once the claim is known to be lost: its lease ended before a renewal got through,
    /// or the store rejected its token (another owner holds the key). Never becomes false
    /// again.
    pub fn is_lost(&self) -> bool {
        self.state.lost.load(Ordering::Acquire)
    }

    /// Completes when the claim is lost (at once if it already is); never completes while it is
    /// held. Owns a clone of the handle, so it can be moved into a task or a `select!`.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let state = Arc::clone(&self.state);
        async move {
            loop {
                let notified = state.notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                if state.lost.load(Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        }
    }

    /// Asks the store whether the claim is still held, extending its lease if it is: one round
    /// trip. Call it right before an irreversible step.
    ///
    /// - `Ok(())`: the store confirmed this claim's token and renewed the lease.
    /// - [`Error::ClaimLost`]: another owner holds the key, or the lease ended. Do not perform
    ///   the step.
    /// - [`Error::Store`]: the store did not answer; whether the claim is held is unknown.
    ///
    /// In the PostgreSQL transactional mode the claim is a row of the caller's open transaction
    /// and cannot be lost before it ends: this returns `Ok(())` without a round trip.
    pub async fn check(&self) -> Result<(), Error> {
        if self.is_lost() {
            return Err(Error::ClaimLost);
        }
        let Some(store) = &self.state.store else {
            return Ok(());
        };
        match store
            .renew(&self.state.key, self.state.token, self.state.lease)
            .await
        {
            Ok(()) => Ok(()),
            Err(StoreError::TokenRejected) => {
                self.mark_lost("the store rejected its token");
                Err(Error::ClaimLost)
            }
            Err(error) => Err(Error::Store(error)),
        }
    }

    pub(crate) fn set_recording(&self, recording: bool) {
        self.state.recording.store(recording, Ordering::Release);
    }

    pub(crate) fn mark_lost(&self, why: &'static str) {
        if !self.state.lost.swap(true, Ordering::AcqRel) {
            tracing::error!(
                storage_key = %self.state.key,
                token = self.state.token.get(),
                why,
                "idempotent call lost its claim while running: another owner may run the same operation; \
                 pass the operation key downstream or fence the resource with the token"
            );
            self.state.notify.notify_waiters();
        }
    }
}

/// Shortest pause between renewal attempts after a failure.
const FIRST_RENEW_BACKOFF: Duration = Duration::from_millis(20);

/// Keeps a claim's lease alive on a task of its own, so that neither work that blocks its
/// poller nor a caller that stops polling can starve it. Dropping it stops the renewal.
pub(crate) struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Renewal {
    /// Starts renewing `claim`, whose lease began no earlier than `claimed_at` (the instant
    /// the claim request was sent). `None` without a tokio runtime or for a transactional
    /// claim (nothing to renew).
    pub(crate) fn start(claim: &ClaimHandle, claimed_at: Instant) -> Option<Renewal> {
        claim.state.store.as_ref()?;
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        Some(Renewal(runtime.spawn(renew(claim.clone(), claimed_at))))
    }
}

/// Renews every third of the lease. A failed or hung attempt (each is bounded by the time left
/// on the lease and by [`attempt_limit`]) is retried with backoff until the lease, as counted from
/// the last renewal *sent* that succeeded, has ended: then the claim is lost. A rejected token
/// means another owner holds the key: lost at once.
async fn renew(claim: ClaimHandle, claimed_at: Instant) {
    let Some(store) = claim.state.store.clone() else {
        return;
    };
    let (key, token, lease) = (claim.state.key, claim.state.token, claim.state.lease);
    let every = (lease / 3).max(Duration::from_millis(1));
    let mut held_until = claimed_at + lease;
    let mut next = claimed_at + every;
    let mut backoff = FIRST_RENEW_BACKOFF;
    loop {
        tokio::time::sleep_until(next.min(held_until)).await;
        let sent = Instant::now();
        if sent >= held_until {
            claim.mark_lost("its lease ended before a renewal got through");
            return;
        }
        let limit = (held_until - sent).min(attempt_limit(lease));
        match tokio::time::timeout(limit, store.renew(&key, token, lease)).await {
            Ok(Ok(())) => {
                held_until = sent + lease;
                next = sent + every;
                backoff = FIRST_RENEW_BACKOFF;
            }
            Ok(Err(StoreError::TokenRejected)) => {
                if !claim.state.recording.load(Ordering::Acquire) {
                    claim.mark_lost("the store rejected its token on renewal");
                }
                return;
            }
            outcome => {
                match outcome {
                    Ok(Err(error)) => tracing::warn!(
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
                next = Instant::now() + backoff;
                backoff = (backoff * 2).min(every);
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
