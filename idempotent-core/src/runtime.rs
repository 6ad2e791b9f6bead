//! The runtime: claim → run → complete or release, or replay.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::claim::{ClaimHandle, ClaimSlot, Renewal, Seed, attempt_limit, bounded, later};
use crate::envelope::{self, Stored};
use crate::shutdown::{Detached, Drain, Drained};
use crate::store::{BoxFuture, DynStore};
use crate::{Claim, Error, FencingToken, Fingerprint, Key, Scope, StorageKey, Store, StoreError};

/// Default time a completed record is kept: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default lease of an in-flight claim: 30 seconds, renewed every third of it while the work runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default largest result retained for replay: 1 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1 << 20;

/// Default bound on retrying a result that could not be recorded: 60 seconds. See
/// [`IdempotencyBuilder::record_retry`].
pub const DEFAULT_RECORD_RETRY: Duration = Duration::from_secs(60);

/// What a call does when it finds its key claimed by a call still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InFlightPolicy {
    /// Fail at once with [`Error::InFlight`] (HTTP 409 with `Retry-After`). The default.
    #[default]
    Reject,
    /// Wait up to `max` for the running call to finish, then replay its result. If it released
    /// its claim (it failed transiently), this call claims the key and runs the work itself. If
    /// `max` passes first, fail with [`Error::InFlight`].
    ///
    /// Every `max` is accepted (see [`limits`](crate::limits)): zero answers at once, like
    /// [`Reject`](Self::Reject), and [`Duration::MAX`] (or any `max` too far away for the clock)
    /// waits with no deadline, until the running call finishes, releases its claim or lets its
    /// lease end.
    Wait {
        /// The longest this call waits.
        max: Duration,
    },
}

/// Whether the runtime keeps a fresh result for replay or forgets the call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retain {
    /// Keep these result bytes: retries replay them until the TTL ends.
    Store(Bytes),
    /// Forget the call: the next retry runs the work again (a transient failure).
    Release,
    /// Record that the call completed but keep no result (it could not be captured, e.g. a
    /// streamed response too large to buffer): retries fail with [`Error::ResultNotRetained`]
    /// instead of running the work again.
    CompleteWithoutResult,
}

/// The result of [`Idempotency::execute`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution<V> {
    /// The work ran in this call and returned this value.
    Fresh(V),
    /// An earlier call with the same key completed; these are the bytes it retained.
    Replayed(Bytes),
}

/// The result of [`Idempotency::run`]: the value, and whether it was computed now or replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The work ran in this call.
    Fresh(T),
    /// An earlier call with the same key ran the work; this is its result.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// True if the value was replayed from an earlier call.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }

    /// The value, fresh or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }

    /// A reference to the value.
    pub fn get(&self) -> &T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }
}

/// One idempotent call: its key, scope, fingerprint, and per-call overrides of the runtime's
/// defaults.
///
/// ```
/// use idempotent_core::{Call, Fingerprint, InFlightPolicy, Scope};
/// use std::time::Duration;
///
/// let call = Call::new("order-42".parse()?)
///     .scope(Scope::new().tenant("acme").operation("charge"))
///     .fingerprint(Fingerprint::of(&("EUR", 1999u64))?)
///     .ttl(Duration::from_secs(3600))
///     .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(5) });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Call {
    key: Key,
    scope: Scope,
    fingerprint: Option<Fingerprint>,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    in_flight: Option<InFlightPolicy>,
    max_result_bytes: Option<usize>,
}

impl Call {
    /// A call with `key`, the empty scope and the empty fingerprint.
    pub fn new(key: Key) -> Self {
        Call {
            key,
            scope: Scope::new(),
            fingerprint: None,
            ttl: None,
            lease: None,
            in_flight: None,
            max_result_bytes: None,
        }
    }

    /// Who the key belongs to.
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// What the request means; a retry with the same key and another fingerprint fails with
    /// [`Error::FingerprintMismatch`]. Default: [`Fingerprint::empty`].
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// How long a completed result is replayed (default: the runtime's).
    ///
    /// # Panics
    ///
    /// If `ttl` is outside [`limits::MIN_TTL`](crate::limits::MIN_TTL) to
    /// [`limits::MAX_TTL`](crate::limits::MAX_TTL) (1 ms to 365 days). Check a value read from
    /// outside the program with [`limits::check_ttl`](crate::limits::check_ttl) first.
    #[track_caller]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(crate::limits::require(crate::limits::Setting::Ttl, ttl));
        self
    }

    /// How long a claim lives without renewal (default: the runtime's).
    ///
    /// # Panics
    ///
    /// If `lease` is outside [`limits::MIN_LEASE`](crate::limits::MIN_LEASE) to
    /// [`limits::MAX_LEASE`](crate::limits::MAX_LEASE) (100 ms to 365 days). Check a value
    /// read from outside the program with [`limits::check_lease`](crate::limits::check_lease)
    /// first.
    #[track_caller]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(crate::limits::require(crate::limits::Setting::Lease, lease));
        self
    }

    /// What to do when the key is in flight (default: the runtime's). Every
    /// [`InFlightPolicy::Wait`] `max` is accepted.
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.in_flight = Some(policy);
        self
    }

    /// The largest result retained for replay for this call (default: the runtime's
    /// [`max_result_bytes`](IdempotencyBuilder::max_result_bytes)). A caller that bounds its
    /// results itself, as the HTTP layer bounds response bodies, sets it so that one limit
    /// decides.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = Some(max);
        self
    }

    /// The key.
    pub fn key(&self) -> &Key {
        &self.key
    }
}

/// The idempotency runtime: a store plus defaults. Cheap to clone; clones share the store.
///
/// ```
/// use idempotent_core::{Call, Idempotency, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_core::Error> {
/// let idempotency = Idempotency::new(MemoryStore::new());
/// let call = Call::new("charge-1".parse()?);
///
/// let first = idempotency.run(&call, async { "charged 10 EUR".to_string() }).await?;
/// let retry = idempotency.run(&call, async { "charged twice!".to_string() }).await?;
///
/// assert!(!first.is_replayed());
/// assert!(retry.is_replayed());
/// assert_eq!(retry.into_inner(), "charged 10 EUR");
/// # Ok(())
/// # }
/// ```
///
/// # Semantics
///
/// 1. **Claim** the call's storage key. A completed record with the same fingerprint is
///    replayed; with a different fingerprint the call fails with
///    [`Error::FingerprintMismatch`]. A record in flight is answered per the
///    [`InFlightPolicy`]; a record that cannot be decoded fails with [`Error::CorruptRecord`].
/// 2. **Run** the work, with its [`ClaimHandle`](crate::ClaimHandle) as
///    [`ClaimHandle::current`](crate::ClaimHandle::current). Once the work first waits, the
///    lease is renewed every third of its length on a task of its own (so, on a runtime with
///    more than one worker thread, work that blocks its thread or a caller that stops polling
///    cannot starve it). A renewal that fails or hangs
///    (each attempt is abandoned after a sixth of the lease) is retried with backoff until the
///    lease, counted from the last renewal sent that succeeded, has ended: then the claim is
///    *lost* and the handle says so ([`ClaimHandle::lost`](crate::ClaimHandle::lost)). A
///    rejected token (another owner took over) is a loss at once. The work is not stopped:
///    it decides, with the handle, what to do.
/// 3. **Classify** the output: [`Retain::Store`] completes the record (retries replay it),
///    [`Retain::Release`] deletes the claim (the next retry runs again). A result larger than
///    the maximum result size, or one the store has no room for, is recorded as "not
///    retained": retries fail with [`Error::ResultNotRetained`] rather than running the work
///    again. A result that [`run`](Self::run) cannot serialize is recorded the same way.
/// 4. **Cancellation and panics**: if the call's future is dropped or the work panics, the claim
///    is released in the background, so the key is never locked beyond the work's life. If it
///    is dropped after the work has run, while its result is being recorded, the recording
///    finishes in the background: a retry replays the result instead of running the work again.
/// 5. **Store failures** before the work runs fail the call with [`Error::Store`] (fail closed).
///    After the work ran, the call returns its fresh value at once; if the record could not be
///    written (the store was unreachable, full or slow), the write is retried with backoff in
///    the background for up to [`IdempotencyBuilder::record_retry`] while the lease is kept
///    alive, so duplicates are answered [`Error::InFlight`] and then replay the result. It
///    stops early when the store rejects the token (the claim was lost). Only a process crash,
///    an outage longer than the lease, or the bound, lets the claim lapse with its lease. See
///    the crate's *Failure model* for what protects the effect then.
///
/// Requires a tokio runtime with the time driver enabled.
#[derive(Clone)]
pub struct Idempotency {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn DynStore>,
    namespace: Box<[u8]>,
    ttl: Duration,
    lease: Duration,
    in_flight: InFlightPolicy,
    max_result_bytes: usize,
    record_retry: Duration,
    drain: Arc<Drain>,
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("namespace", &String::from_utf8_lossy(&self.inner.namespace))
            .field("ttl", &self.inner.ttl)
            .field("lease", &self.inner.lease)
            .field("in_flight", &self.inner.in_flight)
            .field("max_result_bytes", &self.inner.max_result_bytes)
            .field("record_retry", &self.inner.record_retry)
            .finish_non_exhaustive()
    }
}

/// Configures an [`Idempotency`]. Created by [`Idempotency::builder`].
#[must_use]
pub struct IdempotencyBuilder {
    store: Arc<dyn DynStore>,
    namespace: Box<[u8]>,
    ttl: Duration,
    lease: Duration,
    in_flight: InFlightPolicy,
    max_result_bytes: usize,
    record_retry: Duration,
}

impl fmt::Debug for IdempotencyBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyBuilder").finish_non_exhaustive()
    }
}

impl IdempotencyBuilder {
    /// Separates this application's records from other applications sharing the store
    /// (default: empty). Part of every storage key: changing it forgets every record.
    pub fn namespace(mut self, namespace: impl AsRef<[u8]>) -> Self {
        self.namespace = namespace.as_ref().into();
        self
    }

    /// How long completed results are replayed (default [`DEFAULT_TTL`]).
    ///
    /// # Panics
    ///
    /// If `ttl` is outside [`limits::MIN_TTL`](crate::limits::MIN_TTL) to
    /// [`limits::MAX_TTL`](crate::limits::MAX_TTL) (1 ms to 365 days): a setting written in
    /// the program is checked where it is written. Check a value read from outside the program
    /// with [`limits::check_ttl`](crate::limits::check_ttl) first.
    #[track_caller]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = crate::limits::require(crate::limits::Setting::Ttl, ttl);
        self
    }

    /// How long a claim lives without renewal (default [`DEFAULT_LEASE`]). After a crash, the
    /// key stays locked this long.
    ///
    /// # Panics
    ///
    /// If `lease` is outside [`limits::MIN_LEASE`](crate::limits::MIN_LEASE) to
    /// [`limits::MAX_LEASE`](crate::limits::MAX_LEASE) (100 ms to 365 days): a shorter lease
    /// would lapse while its owner still runs. Check a value read from outside the program with
    /// [`limits::check_lease`](crate::limits::check_lease) first.
    #[track_caller]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = crate::limits::require(crate::limits::Setting::Lease, lease);
        self
    }

    /// What a call does when its key is in flight (default [`InFlightPolicy::Reject`]). Every
    /// [`InFlightPolicy::Wait`] `max` is accepted, [`Duration::MAX`] included.
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.in_flight = policy;
        self
    }

    /// The largest result retained for replay (default [`DEFAULT_MAX_RESULT_BYTES`]), in
    /// encoded bytes; a larger one is recorded as "not retained". A call can override it
    /// ([`Call::max_result_bytes`]); the HTTP and gRPC layer does, with its own response
    /// limit, so that behind it only the layer's `max_response_body` counts.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = max;
        self
    }

    /// How long a result that could not be recorded (the store was unreachable, full or
    /// slow when the work finished) keeps being retried (default [`DEFAULT_RECORD_RETRY`]).
    ///
    /// Meanwhile the claim's lease is kept alive, so duplicates are answered "in flight"
    /// rather than run again, and they replay the result once it is written. Retrying stops
    /// early when the store rejects the claim's token (another owner took over). At the bound
    /// it gives up and stops renewing: the claim ends with its lease, and a retry after that
    /// runs the work again (protect the effect downstream, see the crate's *Failure model*).
    /// Each pending write holds its result in memory until it is written or given up.
    ///
    /// # Panics
    ///
    /// If `bound` is longer than
    /// [`limits::MAX_RECORD_RETRY`](crate::limits::MAX_RECORD_RETRY) (365 days). Zero is
    /// accepted: one more attempt, then give up. Check a value read from outside the program
    /// with [`limits::check_record_retry`](crate::limits::check_record_retry) first.
    #[track_caller]
    pub fn record_retry(mut self, bound: Duration) -> Self {
        self.record_retry = crate::limits::require(crate::limits::Setting::RecordRetry, bound);
        self
    }

    /// Builds the runtime.
    pub fn build(self) -> Idempotency {
        Idempotency {
            inner: Arc::new(Inner {
                store: self.store,
                namespace: self.namespace,
                ttl: self.ttl,
                lease: self.lease,
                in_flight: self.in_flight,
                max_result_bytes: self.max_result_bytes,
                record_retry: self.record_retry,
                drain: Arc::default(),
            }),
        }
    }
}

/// The longest retry hint given for a call in flight. The owner's lease bounds how long the
/// key can stay locked, but work usually finishes long before its lease ends, so clients are
/// told to come back soon rather than when the lease would end.
pub const MAX_IN_FLIGHT_RETRY_HINT: Duration = Duration::from_secs(1);

const FIRST_WAIT_POLL: Duration = Duration::from_millis(5);
const LAST_WAIT_POLL: Duration = Duration::from_millis(200);

impl Idempotency {
    /// A runtime over `store` with the defaults.
    pub fn new(store: impl Store) -> Self {
        Self::builder(store).build()
    }

    /// Configures a runtime over `store`.
    pub fn builder(store: impl Store) -> IdempotencyBuilder {
        IdempotencyBuilder {
            store: Arc::new(store),
            namespace: Box::default(),
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            in_flight: InFlightPolicy::Reject,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            record_retry: DEFAULT_RECORD_RETRY,
        }
    }

    /// Shuts the runtime (and every clone of it) down gracefully, for a process that is about
    /// to exit (SIGTERM in a rolling deploy):
    ///
    /// 1. At once, every new call fails with [`Error::ShuttingDown`] without touching the
    ///    store (the HTTP and gRPC layers answer `503 shutting_down` with `Retry-After`, gRPC
    ///    `UNAVAILABLE`), so clients retry on another instance.
    /// 2. Calls in flight go on: their work finishes and their outcome is recorded (or their
    ///    claim released), including results still being written in the background after a
    ///    store failure. Waits for them up to `grace`.
    /// 3. At `grace`, work still waiting is stopped: its future is dropped at its current
    ///    await point, its claim is released (so a retry elsewhere runs at once rather than
    ///    after the lease) and its caller gets [`Error::ShuttingDown`]. Up to five more seconds
    ///    are given to those releases. Stopping work half-way may leave its effect half-done
    ///    and lets a retry run it again: protect the effect downstream (see the *Failure
    ///    model*), or call [`ClaimHandle::finish_on_shutdown`](crate::ClaimHandle::finish_on_shutdown)
    ///    once the effect has happened, and the work is left to finish.
    ///
    /// A duplicate waiting for another owner ([`InFlightPolicy::Wait`]) has nothing in flight
    /// of its own: it stops waiting as soon as shutdown begins (within its next poll of the
    /// store, at most 200 ms) and fails with [`Error::ShuttingDown`].
    ///
    /// Returns within `grace` plus five seconds (a `grace` too long for the clock waits as
    /// long as calls run) with what was left undone ([`Drained`]): calls still unfinished
    /// then (an outcome the store has not accepted yet, work that asked to finish) keep their
    /// claims until their leases end. A call counts from before its claim is sent, so a claim
    /// still on its way to the store is waited for too. Shutdown cannot be undone; calling it
    /// again waits again. The PostgreSQL transactional mode is not counted: its work runs
    /// inside the caller's transaction, which the caller ends.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idempotent_core::{Call, Error, Idempotency, MemoryStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let idempotency = Idempotency::new(MemoryStore::new());
    /// let drained = idempotency.shutdown(Duration::from_secs(20)).await;
    /// assert!(drained.is_clean());
    /// let late = idempotency.run(&Call::new("k".parse().unwrap()), async { 1 }).await;
    /// assert!(matches!(late, Err(Error::ShuttingDown)));
    /// # }
    /// ```
    pub async fn shutdown(&self, grace: Duration) -> Drained {
        self.inner.drain.drain(grace).await
    }

    /// Whether [`shutdown`](Self::shutdown) has begun: new calls are refused.
    pub fn is_shutting_down(&self) -> bool {
        !self.inner.drain.is_open()
    }

    /// The storage key `call` maps to in this runtime's namespace.
    pub fn storage_key(&self, call: &Call) -> StorageKey {
        StorageKey::derive(&self.inner.namespace, &call.scope, &call.key)
    }

    /// Runs `work` at most once per key, retaining its result as JSON for replay.
    ///
    /// Every result is stored. To decide per result (release transient failures), use
    /// [`run_with`](Self::run_with).
    pub async fn run<T, F>(&self, call: &Call, work: F) -> Result<Outcome<T>, Error>
    where
        F: Future<Output = T>,
        T: Serialize + DeserializeOwned,
    {
        self.run_with(call, work, |_| true).await
    }

    /// Like [`run`](Self::run), but a result for which `retain` returns false is not stored: the
    /// claim is released and the next retry runs the work again.
    pub async fn run_with<T, F>(
        &self,
        call: &Call,
        work: F,
        retain: impl FnOnce(&T) -> bool,
    ) -> Result<Outcome<T>, Error>
    where
        F: Future<Output = T>,
        T: Serialize + DeserializeOwned,
    {
        let mut encode_error = None;
        let execution = self
            .execute(call, work, |value| {
                if !retain(value) {
                    return Retain::Release;
                }
                match serde_json::to_vec(value) {
                    Ok(bytes) => Retain::Store(Bytes::from(bytes)),
                    // The work ran: record that it did, so a retry is refused with
                    // `ResultNotRetained` instead of running it again.
                    Err(e) => {
                        encode_error = Some(e);
                        Retain::CompleteWithoutResult
                    }
                }
            })
            .await?;
        if let Some(e) = encode_error {
            return Err(Error::Payload(e.into()));
        }
        match execution {
            Execution::Fresh(value) => Ok(Outcome::Fresh(value)),
            Execution::Replayed(bytes) => serde_json::from_slice(&bytes)
                .map(Outcome::Replayed)
                .map_err(|e| Error::Payload(e.into())),
        }
    }

    /// The byte-level primitive under [`run`](Self::run): runs `work` at most once per key;
    /// `classify` turns its output into the bytes to retain, or releases the claim.
    pub async fn execute<V, F>(
        &self,
        call: &Call,
        work: F,
        classify: impl FnOnce(&V) -> Retain,
    ) -> Result<Execution<V>, Error>
    where
        F: Future<Output = V>,
    {
        let inner = &*self.inner;
        // Counted in flight from before its claim until its outcome is recorded, so that a
        // shutdown waits for a claim still on its way to the store; refused without touching
        // the store once shutdown has begun.
        let Some(active) = inner.drain.enter() else {
            return Err(Error::ShuttingDown);
        };
        let key = self.storage_key(call);
        let fingerprint = call.fingerprint.unwrap_or_else(Fingerprint::empty);
        let lease = call.lease.unwrap_or(inner.lease);
        let ttl = call.ttl.unwrap_or(inner.ttl);
        let (token, claimed_at) = match self
            .acquire(
                &key,
                &fingerprint,
                lease,
                call.in_flight.unwrap_or(inner.in_flight),
            )
            .await?
        {
            Acquired::Owner(token, claimed_at) => (token, claimed_at),
            Acquired::Replay(bytes) => {
                tracing::debug!(storage_key = %key, "idempotent call replayed");
                return Ok(Execution::Replayed(bytes));
            }
        };
        tracing::debug!(storage_key = %key, token = token.get(), "idempotent call claimed");

        let slot = ClaimSlot::leased(Seed {
            store: Arc::clone(&inner.store),
            key,
            token,
            lease,
        });
        // The lease is renewed on a task of its own, started only once the work first returns
        // pending: work that finishes at once costs nothing.
        let mut renewal: Option<Renewal> = None;
        let (value, slot) = {
            let renewal = &mut renewal;
            let mut stopping = inner.drain.stopping();
            let watched = async move {
                let mut work = std::pin::pin!(work);
                std::future::poll_fn(|cx| {
                    let polled = work.as_mut().poll(cx);
                    if polled.is_pending() {
                        if renewal.is_none() {
                            *renewal = ClaimSlot::start_renewal(claimed_at.instant());
                        }
                        // A graceful shutdown's deadline stops work that is still waiting,
                        // unless the work asked to finish.
                        if stopping.poll_stop(cx).is_ready()
                            && !ClaimHandle::current().is_some_and(|c| c.finishes_on_shutdown())
                        {
                            return Poll::Ready(None);
                        }
                    }
                    polled.map(Some)
                })
                .await
            };
            let mut scoped = std::pin::pin!(slot.scope(watched));
            let value = scoped.as_mut().await;
            (value, scoped.as_mut().take_value())
        };
        let slot = slot.expect("the runtime takes the claim's slot back once, after the work");
        let Some(value) = value else {
            drop(renewal);
            active.stopped();
            tracing::warn!(storage_key = %key, "idempotent call stopped by shutdown; its claim is released");
            FinishOnDrop::with(slot.release(), active.detach()).await;
            return Err(Error::ShuttingDown);
        };
        let mut slot = slot;
        let result = match classify(&value) {
            Retain::Store(result) => Some(result),
            Retain::CompleteWithoutResult => None,
            Retain::Release => {
                drop(renewal);
                // Finished in the background if the caller stops waiting, like a record.
                FinishOnDrop::with(slot.release(), active.detach()).await;
                return Ok(Execution::Fresh(value));
            }
        };
        slot.disarm();
        let payload = Self::payload(
            &key,
            result,
            call.max_result_bytes.unwrap_or(inner.max_result_bytes),
        );
        // The first write is polled here; only if the store does not answer at once (or
        // fails) does the call build the machinery that finishes it if the caller goes away
        // and retries it if it failed.
        if let Some(claim) = slot.existing() {
            claim.start_recording();
        }
        let mut first = self.write(key, token, payload.envelope(), ttl);
        let first = match std::future::poll_fn(|cx| Poll::Ready(first.as_mut().poll(cx))).await {
            Poll::Ready(Ok(())) => {
                if let Some(claim) = slot.existing() {
                    claim.mark_completed();
                }
                drop(active);
                tracing::debug!(storage_key = %key, "idempotent call completed");
                return Ok(Execution::Fresh(value));
            }
            Poll::Ready(Err(error)) => First::Failed(error),
            Poll::Pending => First::InFlight(first),
        };
        let claim = slot.handle();
        claim.start_recording();
        let recording = Recording {
            claim,
            claimed_at,
            renewal,
            payload,
            ttl,
            active: active.detach(),
        };
        let this = self.clone();
        FinishOnDrop(Some(Box::pin(async move {
            this.record(recording, first).await
        })))
        .await;
        Ok(Execution::Fresh(value))
    }

    /// What to write for a result: itself, or "ran, not retained" when there is none or it
    /// is larger than the runtime keeps.
    fn payload(key: &StorageKey, result: Option<Bytes>, max: usize) -> Payload {
        match result {
            Some(result) if result.len() <= max => Payload::Value(result),
            Some(result) => {
                tracing::warn!(
                    storage_key = %key,
                    bytes = result.len(),
                    max,
                    "idempotent result too large to retain; retries will get result_not_retained"
                );
                Payload::NotRetained
            }
            None => Payload::NotRetained,
        }
    }

    /// One `complete` of the record of `key` held with `token`, owning what it needs.
    fn write(
        &self,
        key: StorageKey,
        token: FencingToken,
        envelope: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        let store = Arc::clone(&self.inner.store);
        Box::pin(async move { store.complete(&key, token, envelope, ttl).await })
    }

    async fn acquire(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        policy: InFlightPolicy,
    ) -> Result<Acquired, Error> {
        let store = &*self.inner.store;
        let mut answer = ClaimAnswer::new(policy);
        loop {
            // The lease is counted from when the successful claim was sent, so it never ends
            // later than the store's. A claim the store answers within its first poll (an
            // in-process store) needs no clock read: it happened now, and the work reads the
            // clock only if it waits (see `ClaimedAt`).
            let mut claiming = store.claim(key, fingerprint, lease);
            let mut sent = ClaimedAt::Now;
            let claim = std::future::poll_fn(|cx| {
                let polled = claiming.as_mut().poll(cx);
                if polled.is_pending() && matches!(sent, ClaimedAt::Now) {
                    sent = ClaimedAt::At(tokio::time::Instant::now());
                }
                polled
            })
            .await?;
            match answer.step(key, fingerprint, claim)? {
                Step::Owner(token) => return Ok(Acquired::Owner(token, sent)),
                Step::Replay(bytes) => return Ok(Acquired::Replay(bytes)),
                // Once shutdown has begun, a duplicate stops waiting for another owner: its
                // client retries elsewhere rather than holding the shutdown up.
                Step::Wait(_) if !self.inner.drain.is_open() => {
                    return Err(Error::ShuttingDown);
                }
                Step::Wait(wait) => store.wait_for_change(key, wait).await,
            }
        }
    }

    /// Finishes recording the outcome after a first write that did not succeed at once: waits
    /// for it (bounded), falls back to the small "not retained" record if the result does not
    /// fit, and if the store still fails, retries on a task of its own (the caller gets its
    /// value now) while the lease is kept alive, so duplicates are answered "in flight" and
    /// then replayed, never run again. It gives up when the store rejects the token (the claim
    /// is provably lost) or after the runtime's record retry bound. Runs inside
    /// [`FinishOnDrop`]: once the work has run, abandoning the write would leave the claim to
    /// lapse and a retry to run the work again.
    async fn record(&self, recording: Recording, first: First) {
        let Recording {
            claim,
            claimed_at,
            renewal,
            payload,
            ttl,
            active,
        } = recording;
        let key = claim.storage_key();
        let limit = first_record_limit(claim.lease());
        let outcome = match first {
            First::InFlight(write) => match bounded(write, limit).await {
                Some(outcome) => RecordError::from_store(outcome),
                None => Err(RecordError::TimedOut(limit)),
            },
            First::Failed(error) => RecordError::from_store(Err(error)),
        };
        let outcome = self
            .or_not_retained(outcome, &claim, &payload, ttl, limit)
            .await;
        let error = match outcome {
            Ok(()) => {
                claim.mark_completed();
                return;
            }
            Err(RecordError::Lost) => {
                claim.mark_lost("the store rejected its token when the result was recorded");
                tracing::warn!(
                    storage_key = %key,
                    token = claim.token().get(),
                    "idempotent call ran but the store refused its record (the claim was lost): the record of the owner that holds the key now stands"
                );
                return;
            }
            Err(error) => error,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        tracing::warn!(
            storage_key = %key,
            error = %error,
            "idempotent call ran but its result could not be recorded yet; retrying while its claim is kept alive"
        );
        // Without a renewal yet, the work finished without waiting and the claim came at most
        // one attempt (two bounded writes: the result, then the small record) ago.
        let renewal =
            renewal.or_else(|| Renewal::start(&claim, claimed_at.instant_within(limit * 2)));
        let this = self.clone();
        runtime.spawn(async move {
            this.record_with_retries(claim, payload, ttl, renewal).await;
            drop(active);
        });
    }

    async fn record_with_retries(
        &self,
        claim: ClaimHandle,
        payload: Payload,
        ttl: Duration,
        renewal: Option<Renewal>,
    ) {
        let key = claim.storage_key();
        // A write that takes longer than its limit is abandoned and tried again with twice the
        // limit, so a hung connection is given up while a store that is merely slow still
        // gets the time it needs.
        let mut limit = first_record_limit(claim.lease());
        let deadline = later(tokio::time::Instant::now(), self.inner.record_retry);
        let mut backoff = FIRST_RECORD_BACKOFF;
        let mut attempts = 1u32;
        loop {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(LAST_RECORD_BACKOFF);
            limit = (limit * 2).min(self.inner.record_retry.max(limit));
            attempts += 1;
            let error = match self.complete_once(&claim, &payload, ttl, limit).await {
                Ok(()) => {
                    tracing::info!(storage_key = %key, attempts, "idempotent result recorded after retries");
                    return;
                }
                // An earlier attempt may have landed with its reply lost, or another owner
                // took over after the lease lapsed: either way nothing is left to write.
                Err(RecordError::Lost) => {
                    tracing::warn!(storage_key = %key, attempts, "the store rejected the claim's token while the result was being recorded again: an earlier attempt landed, or the claim was lost");
                    claim.mark_lost(
                        "the store rejected its token when the result was recorded again",
                    );
                    return;
                }
                Err(error) => error,
            };
            if tokio::time::Instant::now() >= deadline {
                drop(renewal);
                tracing::error!(
                    storage_key = %key,
                    attempts,
                    error = %error,
                    "idempotent call ran but its result could not be recorded; gave up, the claim ends with its lease and a later retry may run the work again"
                );
                return;
            }
        }
    }

    /// One attempt at completing the record.
    async fn complete_once(
        &self,
        claim: &ClaimHandle,
        payload: &Payload,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        let outcome = self
            .complete_bounded(claim, payload.envelope(), ttl, limit)
            .await;
        self.or_not_retained(outcome, claim, payload, ttl, limit)
            .await
    }

    /// A result the store has no room for is replaced by the small "ran, result not retained"
    /// record, so that a retry is refused rather than run again (a store full of live records
    /// may stay full). Any other outcome stands.
    async fn or_not_retained(
        &self,
        outcome: Result<(), RecordError>,
        claim: &ClaimHandle,
        payload: &Payload,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        match outcome {
            Err(RecordError::Store(StoreError::Capacity { what }))
                if matches!(payload, Payload::Value(_)) =>
            {
                tracing::warn!(storage_key = %claim.storage_key(), what, "idempotency store full; recording the call without its result");
                self.complete_bounded(claim, envelope::encode_not_retained(), ttl, limit)
                    .await
            }
            other => other,
        }
    }

    /// One `complete`, abandoned after `limit`.
    async fn complete_bounded(
        &self,
        claim: &ClaimHandle,
        bytes: Bytes,
        ttl: Duration,
        limit: Duration,
    ) -> Result<(), RecordError> {
        let key = claim.storage_key();
        let outcome = bounded(
            self.inner.store.complete(&key, claim.token(), bytes, ttl),
            limit,
        )
        .await;
        match outcome {
            Some(outcome) => {
                let outcome = RecordError::from_store(outcome);
                if outcome.is_ok() {
                    claim.mark_completed();
                    tracing::debug!(storage_key = %key, "idempotent call completed");
                }
                outcome
            }
            None => Err(RecordError::TimedOut(limit)),
        }
    }
}

/// Everything needed to record a call's outcome once its work has run.
struct Recording {
    claim: ClaimHandle,
    claimed_at: ClaimedAt,
    renewal: Option<Renewal>,
    payload: Payload,
    ttl: Duration,
    /// Counts the call in flight until its outcome is recorded (see graceful shutdown).
    active: Detached,
}

/// The first write of a record that did not succeed at once.
enum First {
    /// The store has not answered yet.
    InFlight(BoxFuture<'static, Result<(), StoreError>>),
    /// The store answered with this error.
    Failed(StoreError),
}

enum Payload {
    /// The result, to be written in an envelope.
    Value(Bytes),
    /// The call ran; its result is not kept.
    NotRetained,
}

impl Payload {
    /// The bytes to store: encoded per attempt, so that a call does not copy the envelope
    /// in case a retry needs it again.
    fn envelope(&self) -> Bytes {
        match self {
            Payload::Value(result) => envelope::encode_value(result),
            Payload::NotRetained => envelope::encode_not_retained(),
        }
    }
}

enum RecordError {
    Lost,
    Store(StoreError),
    TimedOut(Duration),
}

impl RecordError {
    fn from_store(outcome: Result<(), StoreError>) -> Result<(), RecordError> {
        match outcome {
            Ok(()) => Ok(()),
            Err(StoreError::TokenRejected) => Err(RecordError::Lost),
            Err(error) => Err(RecordError::Store(error)),
        }
    }
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Lost => f.write_str("the claim was lost"),
            RecordError::Store(error) => match std::error::Error::source(error) {
                Some(source) => write!(f, "{error}: {source}"),
                None => write!(f, "{error}"),
            },
            RecordError::TimedOut(limit) => write!(f, "the store did not answer within {limit:?}"),
        }
    }
}

/// How long the first attempt at writing a record may take: a third of the lease (the renewal
/// period; the lease is renewed meanwhile), at least 10 ms.
fn first_record_limit(lease: Duration) -> Duration {
    (lease / 3).max(attempt_limit(lease))
}

const FIRST_RECORD_BACKOFF: Duration = Duration::from_millis(20);
const LAST_RECORD_BACKOFF: Duration = Duration::from_secs(2);

/// A store write polled in place, finished on a spawned task if dropped before it completes.
struct FinishOnDrop(Option<BoxFuture<'static, ()>>);

impl FinishOnDrop {
    /// `write`, with the call counted in flight until it is done.
    fn with(write: impl Future<Output = ()> + Send + 'static, active: Detached) -> Self {
        FinishOnDrop(Some(Box::pin(async move {
            write.await;
            drop(active);
        })))
    }
}

impl Future for FinishOnDrop {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(write) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        ready!(write.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(())
    }
}

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        let Some(write) = self.0.take() else { return };
        if std::thread::panicking() {
            return;
        }
        // Without a runtime the write is lost; the claim then ends with its lease.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(write);
        }
    }
}

/// What a call does next with a store's answer to its claim.
pub(crate) enum Step {
    /// The call owns the key: run the work.
    Owner(FencingToken),
    /// An earlier call completed: replay these result bytes.
    Replay(Bytes),
    /// The key is in flight and the call waits: claim again after at most this long.
    Wait(Duration),
}

/// How a call answers what its claims find, under its in-flight policy. Every claim loop (the
/// runtime's, and the PostgreSQL transactional mode's) decides through this one, so they agree
/// on fingerprint checks, corrupt records, retry hints and how long to wait.
pub(crate) struct ClaimAnswer {
    deadline: Deadline,
    poll: Duration,
}

/// Until when a call waits for a key in flight.
#[derive(Clone, Copy)]
enum Deadline {
    /// It does not wait ([`InFlightPolicy::Reject`]).
    Now,
    /// Until this instant.
    At(tokio::time::Instant),
    /// With no deadline: the policy's `max` is past what the clock can represent.
    Never,
}

impl ClaimAnswer {
    pub(crate) fn new(policy: InFlightPolicy) -> Self {
        ClaimAnswer {
            deadline: match policy {
                InFlightPolicy::Reject => Deadline::Now,
                InFlightPolicy::Wait { max } => tokio::time::Instant::now()
                    .checked_add(max)
                    .map_or(Deadline::Never, Deadline::At),
            },
            poll: FIRST_WAIT_POLL,
        }
    }

    /// The next step for a call with `fingerprint` whose claim on `key` found `claim`.
    pub(crate) fn step(
        &mut self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        claim: Claim,
    ) -> Result<Step, Error> {
        let (recorded, found) = match claim {
            Claim::Claimed(token) => return Ok(Step::Owner(token)),
            Claim::Completed {
                fingerprint,
                payload,
            } => (fingerprint, Ok(payload)),
            Claim::InFlight {
                fingerprint,
                retry_after,
            } => (fingerprint, Err(retry_after)),
        };
        if recorded != *fingerprint {
            tracing::info!(storage_key = %key, "idempotency key reused with a different fingerprint");
            return Err(Error::FingerprintMismatch);
        }
        match found {
            Ok(payload) => match envelope::decode(&payload) {
                Ok(Stored::Value(bytes)) => Ok(Step::Replay(bytes)),
                Ok(Stored::NotRetained) => Err(Error::ResultNotRetained),
                Err(e) => {
                    tracing::error!(storage_key = %key, error = %e, "corrupt idempotency record");
                    Err(Error::CorruptRecord(e.into()))
                }
            },
            Err(retry_after) => {
                let hint = retry_after.min(MAX_IN_FLIGHT_RETRY_HINT);
                let now = tokio::time::Instant::now();
                let left = match self.deadline {
                    Deadline::Now => None,
                    Deadline::At(deadline) => deadline
                        .checked_duration_since(now)
                        .filter(|left| !left.is_zero()),
                    Deadline::Never => Some(Duration::MAX),
                };
                let Some(left) = left else {
                    tracing::debug!(storage_key = %key, "idempotent call in flight");
                    return Err(Error::InFlight { retry_after: hint });
                };
                let wait = self.poll.min(left).min(retry_after.max(FIRST_WAIT_POLL));
                self.poll = (self.poll * 2).min(LAST_WAIT_POLL);
                Ok(Step::Wait(wait))
            }
        }
    }
}

/// When the winning claim was sent.
#[derive(Clone, Copy)]
enum ClaimedAt {
    /// The store answered within the claim's first poll: the claim happened while this call
    /// ran without yielding, so the first clock read after it (when the work first waits)
    /// stands for it, late by at most the work's first synchronous stretch.
    Now,
    /// The store answered later; the request went out at this instant.
    At(tokio::time::Instant),
}

impl ClaimedAt {
    /// The instant, read as late as `elapsed` after the claim at most.
    fn instant_within(self, elapsed: Duration) -> tokio::time::Instant {
        match self {
            ClaimedAt::Now => {
                let now = tokio::time::Instant::now();
                now.checked_sub(elapsed).unwrap_or(now)
            }
            ClaimedAt::At(at) => at,
        }
    }

    /// The instant, read when the work first waits.
    fn instant(self) -> tokio::time::Instant {
        self.instant_within(Duration::ZERO)
    }
}

enum Acquired {
    /// The call owns the key with this token; its claim was sent then.
    Owner(FencingToken, ClaimedAt),
    Replay(Bytes),
}
