//! The runtime: claim → run → complete or release, or replay.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::capability::{
    Admits, Capabilities, Erased, Full, KeepsCheckpoints, KeysAndCheckpoints, KeysAndSessions,
    KeysOnly, ServesSessions,
};
use crate::envelope::Integrity;
use crate::metrics::{ProtocolLabel, RequestOutcome, StoreMetrics};
use crate::shutdown::{Drain, Drained};
use crate::store::{DynCheckpoints, DynSessions, DynStore};
use crate::{Call, CheckpointStore, Defaults, SessionStore, StorageKey, Store};

/// Default bound on retrying a result that could not be recorded: 60 seconds. See
/// [`IdempotencyBuilder::record_retry`].
pub const DEFAULT_RECORD_RETRY: Duration = Duration::from_secs(60);

/// The longest the runtime waits for the store to answer a claim: 5 seconds (or a sixth of
/// the lease, if shorter, but at least one second). A store that does not answer in time
/// (frozen, or its connections hung) fails the call with [`Error::Store`](crate::Error::Store) (HTTP
/// `503 store_unavailable`) and nothing runs. Redis and PostgreSQL give back a claim that
/// reaches them later, as soon as they answer again, so the retry does not wait for its
/// lease; they keep trying for five seconds after the store first answers, and for ten
/// minutes in all, with at most 10,000 claims being given back at once: a claim that lands
/// outside those bounds holds its key until its lease ends, as does one sent to a custom
/// store.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(5);

#[doc = include_str!("../docs/runtime.md")]
pub struct Idempotency<C = Full> {
    pub(crate) inner: Arc<Inner>,
    capabilities: PhantomData<fn() -> C>,
}

impl<C> Clone for Idempotency<C> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: Arc::clone(&self.inner),
            capabilities: PhantomData,
        }
    }
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn DynStore>,
    /// The store's sessions, where the runtime's capabilities include them.
    pub(crate) sessions: Option<Arc<dyn DynSessions>>,
    /// The store's checkpoints, where the runtime's capabilities include them.
    pub(crate) checkpoints: Option<Arc<dyn DynCheckpoints>>,
    pub(crate) namespace: Box<[u8]>,
    pub(crate) defaults: Defaults,
    pub(crate) record_retry: Duration,
    /// Whether records keep their key in clear ([`IdempotencyBuilder::keys_in_clear`]).
    pub(crate) keys_in_clear: bool,
    pub(crate) drain: Arc<Drain>,
    /// Whether results are checksummed: not on a store that keeps them in this process.
    pub(crate) integrity: Integrity,
}

impl Inner {
    /// This runtime's metrics, which its store's wrapper holds.
    pub(crate) fn metrics(&self) -> &StoreMetrics {
        self.store.metrics()
    }
}

impl<C> fmt::Debug for Idempotency<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("namespace", &String::from_utf8_lossy(&self.inner.namespace))
            .field("defaults", &self.inner.defaults)
            .field("record_retry", &self.inner.record_retry)
            .finish_non_exhaustive()
    }
}

/// Configures an [`Idempotency`]. Created by [`Idempotency::builder`].
#[must_use]
pub struct IdempotencyBuilder<C = Full> {
    store: Erased,
    capabilities: PhantomData<fn() -> C>,
    namespace: Box<[u8]>,
    defaults: Defaults,
    record_retry: Duration,
    keys_in_clear: bool,
}

impl<C> fmt::Debug for IdempotencyBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyBuilder").finish_non_exhaustive()
    }
}

impl<C: Capabilities> IdempotencyBuilder<C> {
    /// Separates this application's records from other applications sharing the store
    /// (default: empty). Part of every storage key: changing it forgets every record.
    pub fn namespace(mut self, namespace: impl AsRef<[u8]>) -> Self {
        self.namespace = namespace.as_ref().into();
        self
    }

    /// The settings of every call that does not override them with its
    /// [`CallOptions`](crate::CallOptions) (default [`Defaults::new`]): TTL, lease, in-flight
    /// policy and largest retained result.
    pub fn defaults(mut self, defaults: Defaults) -> Self {
        self.defaults = defaults;
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
    /// At most [`limits::MAX_RECORD_RETRY`](crate::limits::MAX_RECORD_RETRY) (365 days): a
    /// longer `bound` (`Duration::MAX`) is clamped to it, with a warning. Zero is accepted: one
    /// more attempt, then give up. Refuse a value read from outside the program with
    /// [`limits::check_record_retry`](crate::limits::check_record_retry) instead.
    pub fn record_retry(mut self, bound: Duration) -> Self {
        self.record_retry = crate::limits::clamped(crate::limits::Setting::RecordRetry, bound);
        self
    }

    /// Whether each record keeps its key as the client sent it (up to
    /// [`KeyLabel::MAX_KEY_LEN`](crate::inspect::KeyLabel::MAX_KEY_LEN) bytes), so that an
    /// operator listing records ([`inspect`](crate::inspect)) can recognise them (default
    /// `true`). With `false`, a record keeps only which scope parts were set: an operator can
    /// still find a record by the key a customer quotes (its digest is derived again), but a
    /// listing shows digests only. Keys are the client's and may carry what it put in them;
    /// turn this off when they must not be stored.
    pub fn keys_in_clear(mut self, keep: bool) -> Self {
        self.keys_in_clear = keep;
        self
    }

    /// Builds the runtime.
    pub fn build(self) -> Idempotency<C> {
        let Erased {
            keys,
            sessions,
            checkpoints,
        } = self.store;
        Idempotency {
            inner: Arc::new(Inner {
                integrity: if keys.keeps_records_in_process() {
                    Integrity::InProcess
                } else {
                    Integrity::Checksummed
                },
                store: keys,
                sessions,
                checkpoints,
                namespace: self.namespace,
                defaults: self.defaults,
                record_retry: self.record_retry,
                keys_in_clear: self.keys_in_clear,
                drain: Arc::default(),
            }),
            capabilities: PhantomData,
        }
    }
}

impl Idempotency {
    /// A runtime over `store`, which keeps keys, client sessions and checkpoints (every store
    /// of this family does), with the defaults. Its [metrics](crate::metrics) are registered
    /// with the recorder installed now. A store with less: [`keys_only`](Idempotency::keys_only),
    /// [`with_sessions`](Idempotency::with_sessions),
    /// [`with_checkpoints`](Idempotency::with_checkpoints).
    pub fn new<S: SessionStore + CheckpointStore>(store: S) -> Self {
        Self::builder(store).build()
    }

    /// Configures a runtime over `store`, as [`new`](Self::new) takes it. The runtime's
    /// [metrics](crate::metrics) are registered with the recorder installed now.
    pub fn builder<S: SessionStore + CheckpointStore>(store: S) -> IdempotencyBuilder {
        Idempotency::<Full>::builder_for(store)
    }
}

impl Idempotency<KeysOnly> {
    /// A runtime over a store that keeps plain keys only ([`Store`]), with the defaults. It
    /// runs [`Call::new`] calls; a call in a session, steps, kept requests and a completer do
    /// not compile with it (see [`capability`](crate::capability)). Also the way to serve
    /// only keys from a store that could do more.
    pub fn keys_only(store: impl Store) -> Self {
        Idempotency::<KeysOnly>::builder_for(store).build()
    }
}

impl Idempotency<KeysAndSessions> {
    /// A runtime over a store that keeps keys and client sessions ([`SessionStore`]) but no
    /// checkpoints, with the defaults.
    pub fn with_sessions(store: impl SessionStore) -> Self {
        Idempotency::<KeysAndSessions>::builder_for(store).build()
    }
}

impl Idempotency<KeysAndCheckpoints> {
    /// A runtime over a store that keeps keys and checkpoints ([`CheckpointStore`]) but no
    /// client sessions, with the defaults.
    pub fn with_checkpoints(store: impl CheckpointStore) -> Self {
        Idempotency::<KeysAndCheckpoints>::builder_for(store).build()
    }
}

impl<C: Capabilities> Idempotency<C> {
    /// Configures a runtime with capabilities `C` over `store`, which must have them:
    /// `Idempotency::<KeysOnly>::builder_for(store)`. The runtime's [metrics](crate::metrics)
    /// are registered with the recorder installed now.
    pub fn builder_for<S>(store: S) -> IdempotencyBuilder<C>
    where
        C: Admits<S>,
    {
        IdempotencyBuilder {
            store: <C as crate::capability::sealed::Erase<S>>::erase(store),
            capabilities: PhantomData,
            namespace: Box::default(),
            defaults: Defaults::new(),
            record_retry: DEFAULT_RECORD_RETRY,
            keys_in_clear: true,
        }
    }

    /// The same runtime (store, records, defaults, metrics, shutdown) serving plain keys
    /// only: for code that takes any runtime.
    pub fn keys(&self) -> Idempotency<KeysOnly> {
        self.narrowed()
    }

    /// The same runtime with client sessions, if its store serves them (`None` otherwise):
    /// for code whose input decides, such as a layer that gets a session header.
    pub fn sessions(&self) -> Option<Idempotency<KeysAndSessions>> {
        C::SESSIONS.then(|| self.narrowed())
    }

    /// The same runtime with checkpoints, if its store keeps them (`None` otherwise).
    pub fn checkpoints(&self) -> Option<Idempotency<KeysAndCheckpoints>> {
        C::CHECKPOINTS.then(|| self.narrowed())
    }

    /// This runtime as one with capabilities `N`, which its store has: a view sharing
    /// everything (the typed methods decide what it may use).
    fn narrowed<N: Capabilities>(&self) -> Idempotency<N> {
        Idempotency {
            inner: Arc::clone(&self.inner),
            capabilities: PhantomData,
        }
    }

    /// Whether records keep their key in clear
    /// ([`IdempotencyBuilder::keys_in_clear`]).
    pub fn keys_in_clear(&self) -> bool {
        self.inner.keys_in_clear
    }

    /// The namespace of this runtime's storage keys
    /// ([`IdempotencyBuilder::namespace`]).
    pub fn namespace(&self) -> &[u8] {
        &self.inner.namespace
    }

    /// The defaults of this runtime's calls ([`IdempotencyBuilder::defaults`]).
    pub fn defaults(&self) -> &Defaults {
        &self.inner.defaults
    }

    /// Shuts the runtime (and every clone of it) down gracefully, for a process that is about
    /// to exit (SIGTERM in a rolling deploy):
    ///
    /// 1. At once, every new call fails with [`Error::ShuttingDown`](crate::Error::ShuttingDown) without touching the
    ///    store (the HTTP and gRPC layers answer `503 shutting_down` with `Retry-After`, gRPC
    ///    `UNAVAILABLE`), so clients retry on another instance.
    /// 2. Calls in flight go on: their work finishes and their outcome is recorded (or their
    ///    claim released), including results still being written in the background after a
    ///    store failure. Waits for them up to `grace`.
    /// 3. At `grace`, work still waiting is stopped: its future is dropped at its current
    ///    await point, its claim is released (so a retry elsewhere runs at once rather than
    ///    after the lease) and its caller gets [`Error::ShuttingDown`](crate::Error::ShuttingDown). Up to five more seconds
    ///    are given to those releases. Stopping work half-way may leave its effect half-done
    ///    and lets a retry run it again: protect the effect downstream (see the *Failure
    ///    model*), or call [`KeyClaim::finish_on_shutdown`](crate::KeyClaim::finish_on_shutdown)
    ///    once the effect has happened, and the work is left to finish.
    ///
    /// A duplicate waiting for another owner ([`InFlightPolicy::Wait`](crate::InFlightPolicy::Wait)) has nothing in flight
    /// of its own: it stops waiting as soon as shutdown begins (within its next poll of the
    /// store, at most 200 ms) and fails with [`Error::ShuttingDown`](crate::Error::ShuttingDown).
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
    /// # use idempotent_core::memory::MemoryStore;
    /// # use idempotent_core::{Call, Error, Idempotency};
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

    /// Counts one call or request that ended with `outcome` in
    /// [`idempotency.requests`](crate::metrics), with this runtime's recorder. The runtime's
    /// own API and the layers count theirs; this is for an integration built on
    /// [`execute`](Self::execute), which counts nothing, or one that refuses requests before
    /// they reach the runtime.
    pub fn count(&self, protocol: ProtocolLabel, outcome: RequestOutcome) {
        self.inner.metrics().request(protocol, outcome);
    }

    /// The storage key `call` maps to in this runtime's namespace; for a call in a
    /// [session](crate::session), the session's own record (its request's record is known
    /// once the session's gate admits it).
    pub fn storage_key<N>(&self, call: &Call<N>) -> StorageKey {
        if let Some(at) = call.at() {
            return at;
        }
        match call.session() {
            None => StorageKey::derive(&self.inner.namespace, call.scope_ref(), call.key()),
            Some(_) => self.session_key(call).record_key(),
        }
    }

    /// The session key of `call`'s session in this runtime's namespace (whether or not the
    /// call is in a session, its key read as a session id).
    pub fn session_key<N>(&self, call: &Call<N>) -> crate::SessionKey {
        crate::SessionKey::derive(&self.inner.namespace, call.scope_ref(), call.key())
    }

    /// The largest result `call` retains in this runtime: its options'
    /// [`max_result_bytes`](crate::CallOptions::max_result_bytes), else the runtime's
    /// [`Defaults::max_result_bytes`](crate::Defaults::max_result_bytes). For an integration
    /// that bounds its results itself, as the HTTP and gRPC layers bound response bodies.
    pub fn max_result_bytes<N>(&self, call: &Call<N>) -> usize {
        call.settings(&self.inner.defaults).max_result_bytes
    }
}

impl<C: ServesSessions> Idempotency<C> {
    /// The same runtime as one of keys and sessions: for code that needs sessions and takes
    /// any runtime that has them.
    pub fn keys_and_sessions(&self) -> Idempotency<KeysAndSessions> {
        self.narrowed()
    }
}

impl<C: KeepsCheckpoints> Idempotency<C> {
    /// The same runtime as one of keys and checkpoints: for code that needs checkpoints (a
    /// completer) and takes any runtime that has them.
    pub fn keys_and_checkpoints(&self) -> Idempotency<KeysAndCheckpoints> {
        self.narrowed()
    }

    /// Up to `limit` operations of `owner` abandoned at least `idle` ago that a completer
    /// may finish ([`CheckpointStore::abandoned`](crate::CheckpointStore::abandoned)), bounded like a claim.
    pub async fn abandoned(
        &self,
        idle: std::time::Duration,
        limit: usize,
        owner: Option<&crate::RequestOwner>,
    ) -> Result<Vec<crate::steps::Abandoned>, crate::Error> {
        let bound = crate::CLAIM_TIMEOUT;
        let Some(store) = &self.inner.checkpoints else {
            return Err(no_checkpoints());
        };
        let listed = store.abandoned(idle, limit, owner);
        match crate::lease::bounded(listed, bound).await {
            Some(found) => Ok(found?),
            None => Err(crate::Error::Store(crate::StoreError::Unavailable(
                format!("the store did not list abandoned operations within {bound:?}").into(),
            ))),
        }
    }
}

/// What a runtime answers if the store it was built over lacks a capability its type says
/// it has: never, since only the capability markers' constructors build runtimes.
pub(crate) fn no_checkpoints() -> crate::Error {
    crate::Error::Store(crate::StoreError::Backend(
        "this runtime's store keeps no checkpoints".into(),
    ))
}

/// See [`no_checkpoints`].
pub(crate) fn no_sessions() -> crate::Error {
    crate::Error::Store(crate::StoreError::Backend(
        "this runtime's store keeps no client sessions".into(),
    ))
}

/// When the winning claim was sent.
#[derive(Clone, Copy)]
pub(crate) enum ClaimedAt {
    /// The store answered within the claim's first poll: the claim happened while this call
    /// ran without yielding, so the first clock read after it (when the work first waits)
    /// stands for it, late by at most the work's first synchronous stretch.
    Now,
    /// The store answered later; the request went out at this instant.
    At(tokio::time::Instant),
}

impl ClaimedAt {
    /// The instant, read as late as `elapsed` after the claim at most.
    pub(crate) fn instant_within(self, elapsed: Duration) -> tokio::time::Instant {
        match self {
            ClaimedAt::Now => {
                let now = tokio::time::Instant::now();
                now.checked_sub(elapsed).unwrap_or(now)
            }
            ClaimedAt::At(at) => at,
        }
    }

    /// The instant, read when the work first waits.
    pub(crate) fn instant(self) -> tokio::time::Instant {
        self.instant_within(Duration::ZERO)
    }
}
