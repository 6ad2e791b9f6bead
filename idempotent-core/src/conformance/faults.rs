//! A store wrapper that injects faults, for testing what a caller of the store does when the
//! store stalls, fails or fills up.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;

use crate::{
    CheckpointStore, Claim, FencingToken, Fingerprint, SessionGate, SessionKey, SessionRequest,
    SessionStore, StorageKey, Store, StoreError,
};

/// A store operation, as named by [`Faults`] rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`Store::claim`].
    Claim,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`SessionStore::open_session`].
    OpenSession,
    /// [`SessionStore::session_mark`].
    SessionMark,
    /// [`CheckpointStore::resume`].
    Resume,
    /// [`CheckpointStore::save_step`].
    SaveStep,
    /// [`CheckpointStore::load_steps`].
    LoadSteps,
    /// [`CheckpointStore::save_request`].
    SaveRequest,
    /// [`CheckpointStore::abandoned`].
    Abandoned,
}

/// What an operation under a fault does instead of (or besides) its normal work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Fails with [`StoreError::Unavailable`]; the wrapped store is not called.
    Unavailable,
    /// Fails with [`StoreError::Capacity`]; the wrapped store is not called.
    Full,
    /// Never answers (a hung connection); the wrapped store is not called. Callers must bound
    /// their wait.
    Hang,
    /// Answers after this delay (a slow or briefly stalled store), then runs normally.
    Delay(Duration),
    /// Runs on the wrapped store, then fails with [`StoreError::Unavailable`] as if the reply
    /// was lost on the way back: the operation took effect but the caller cannot know.
    LoseReply,
}

#[derive(Debug, Clone, Copy)]
struct Rule {
    fault: Fault,
    /// How many more calls the rule applies to; `None` for every call until healed.
    remaining: Option<usize>,
}

#[derive(Default)]
struct State {
    rules: Mutex<HashMap<Op, Rule>>,
    calls: [AtomicUsize; 11],
    faulted: [AtomicUsize; 11],
}

/// Controls the faults of a [`FaultyStore`]. Cheap to clone; clones control the same store.
#[derive(Clone, Default)]
pub struct Faults(Arc<State>);

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("rules", &*self.rules())
            .finish_non_exhaustive()
    }
}

fn index(op: Op) -> usize {
    match op {
        Op::Claim => 0,
        Op::Complete => 1,
        Op::Release => 2,
        Op::Renew => 3,
        Op::OpenSession => 4,
        Op::SessionMark => 5,
        Op::SaveStep => 6,
        Op::LoadSteps => 7,
        Op::SaveRequest => 8,
        Op::Abandoned => 9,
        Op::Resume => 10,
    }
}

impl Faults {
    fn rules(&self) -> std::sync::MutexGuard<'_, HashMap<Op, Rule>> {
        // A test that panicked while holding the lock leaves valid rules behind.
        self.0.rules.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every call of `op` suffers `fault` from now until [`heal`](Self::heal).
    pub fn fail(&self, op: Op, fault: Fault) {
        self.rules().insert(
            op,
            Rule {
                fault,
                remaining: None,
            },
        );
    }

    /// The next `calls` calls of `op` suffer `fault`; later calls run normally.
    pub fn fail_next(&self, op: Op, calls: usize, fault: Fault) {
        self.rules().insert(
            op,
            Rule {
                fault,
                remaining: Some(calls),
            },
        );
    }

    /// Calls of `op` run normally again.
    pub fn heal(&self, op: Op) {
        self.rules().remove(&op);
    }

    /// Every operation runs normally again.
    pub fn heal_all(&self) {
        self.rules().clear();
    }

    /// How many calls of `op` the store received, faulted or not.
    pub fn calls(&self, op: Op) -> usize {
        self.0.calls[index(op)].load(Ordering::SeqCst)
    }

    /// How many calls of `op` suffered a fault.
    pub fn faulted(&self, op: Op) -> usize {
        self.0.faulted[index(op)].load(Ordering::SeqCst)
    }

    /// Counts a call of `op` and returns the fault it suffers, if any.
    fn next(&self, op: Op) -> Option<Fault> {
        self.0.calls[index(op)].fetch_add(1, Ordering::SeqCst);
        let mut rules = self.rules();
        let rule = rules.get_mut(&op)?;
        let fault = rule.fault;
        match &mut rule.remaining {
            Some(0) => {
                rules.remove(&op);
                return None;
            }
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    rules.remove(&op);
                }
            }
            None => {}
        }
        self.0.faulted[index(op)].fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }
}

/// Wraps any [`Store`] and injects [`Fault`]s into chosen operations, controlled through
/// [`Faults`] while the store is in use.
///
/// It is how this crate tests that a store stalling past the lease, refusing the completion
/// write or hanging cannot cause a second run; authors of custom stores and of code around the
/// runtime can run the same tests against their own store.
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::conformance::{Fault, FaultyStore, Op};
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::{Call, Error, Idempotency};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Error> {
/// let store = FaultyStore::new(MemoryStore::new());
/// let faults = store.faults();
/// let idempotency = Idempotency::new(store);
///
/// // The first completion write fails: the runtime retries it while keeping the claim.
/// faults.fail_next(Op::Complete, 1, Fault::Unavailable);
/// let call = Call::new("k".parse()?);
/// idempotency.run(&call, async { 1 }).await?;
/// tokio::time::sleep(Duration::from_secs(1)).await;
/// assert!(idempotency.run(&call, async { 2 }).await?.is_replayed());
/// assert_eq!(faults.calls(Op::Complete), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Faults,
}

impl<S> fmt::Debug for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner`; no faults until told.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            faults: Faults::default(),
        }
    }

    /// The control over this store's faults.
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    async fn apply<T, F>(&self, op: Op, operation: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let injected = || StoreError::Unavailable(format!("injected fault on {op:?}").into());
        match self.faults.next(op) {
            None => operation.await,
            Some(Fault::Unavailable) => Err(injected()),
            Some(Fault::Full) => Err(StoreError::Capacity {
                what: "injected fault",
            }),
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::Delay(delay)) => {
                tokio::time::sleep(delay).await;
                operation.await
            }
            Some(Fault::LoseReply) => {
                let _ = operation.await;
                Err(injected())
            }
        }
    }
}

impl<S: Store> Store for FaultyStore<S> {
    fn location(&self) -> Option<String> {
        self.inner.location()
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.apply(Op::Claim, self.inner.claim(key, fingerprint, lease, ttl))
            .await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.apply(Op::Complete, self.inner.complete(key, token, payload, ttl))
            .await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.apply(Op::Release, self.inner.release(key, token))
            .await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.apply(Op::Renew, self.inner.renew(key, token, lease))
            .await
    }

    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        self.inner.wait_for_change(key, max_wait)
    }
}

impl<S: SessionStore> SessionStore for FaultyStore<S> {
    async fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        self.apply(Op::OpenSession, self.inner.open_session(session, request))
            .await
    }

    async fn session_mark(
        &self,
        session: &SessionKey,
    ) -> Result<Option<crate::SessionMark>, StoreError> {
        self.apply(Op::SessionMark, self.inner.session_mark(session))
            .await
    }
}

impl<S: CheckpointStore> CheckpointStore for FaultyStore<S> {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.apply(Op::Resume, self.inner.resume(key, fingerprint, lease, ttl))
            .await
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> Result<(), StoreError> {
        self.apply(Op::SaveStep, self.inner.save_step(key, token, entry))
            .await
    }

    async fn load_steps(&self, key: &StorageKey, token: FencingToken) -> Result<Bytes, StoreError> {
        self.apply(Op::LoadSteps, self.inner.load_steps(key, token))
            .await
    }

    async fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        self.apply(
            Op::SaveRequest,
            self.inner.save_request(key, token, request),
        )
        .await
    }

    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&crate::RequestOwner>,
    ) -> Result<Vec<crate::steps::Abandoned>, StoreError> {
        self.apply(Op::Abandoned, self.inner.abandoned(idle, limit, owner))
            .await
    }
}

/// Any store seen as one that keeps plain keys only: it implements [`Store`] and nothing
/// else, forwarding the key cycle to the store inside. For testing what a keys-only store
/// gets (a runtime from [`Idempotency::keys_only`](crate::Idempotency::keys_only), the
/// conformance suite's key checks alone) without writing one.
#[derive(Debug, Clone)]
pub struct KeysOnlyStore<S>(S);

impl<S: Store> KeysOnlyStore<S> {
    /// `store`, with its sessions and checkpoints out of sight.
    pub fn new(store: S) -> Self {
        KeysOnlyStore(store)
    }
}

impl<S: Store> Store for KeysOnlyStore<S> {
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.0.claim(key, fingerprint, lease, ttl)
    }
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.complete(key, token, payload, ttl)
    }
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.release(key, token)
    }
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.renew(key, token, lease)
    }
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn keeps_records_in_process(&self) -> bool {
        self.0.keeps_records_in_process()
    }
    fn location(&self) -> Option<String> {
        self.0.location()
    }
    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        self.0.wait_for_change(key, max_wait)
    }
}
