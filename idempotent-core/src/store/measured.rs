//! A store as the runtime holds it: type-erased ([`DynStore`]) and timed into the runtime's
//! metrics ([`Measured`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{CheckpointStore, Claim, FencingToken, RequestOwner, SessionStore, Store};
use crate::metrics::{Operation, StoreMetrics};
use crate::steps::Abandoned;
use crate::{Fingerprint, SessionKey, SessionRequest, StorageKey, StoreError};

/// A boxed future that is `Send`, as the give-back and shared cache tiers take.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe face of [`Store`], so one runtime type serves every store.
pub(crate) trait DynStore: Send + Sync + 'static {
    fn claim<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        ttl: Duration,
        label: &'a crate::inspect::KeyLabel,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;
    /// Owns what it is given, so that the runtime's first write of a record, which may be
    /// finished on a task of its own, is one boxed future rather than a box around another.
    fn complete(
        self: Arc<Self>,
        key: StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'static, Result<(), StoreError>>;
    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn wait_for_change<'a>(&'a self, key: &'a StorageKey, max_wait: Duration) -> BoxFuture<'a, ()>;
    fn keeps_records_in_process(&self) -> bool;
    /// [`Store::completed_in_process`]: not a store operation, so not timed.
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)>;
    /// [`Store::location`].
    fn location(&self) -> Option<String>;
    /// The metrics of the runtime this store serves.
    fn metrics(&self) -> &StoreMetrics;
}

/// The object-safe face of [`SessionStore`].
pub(crate) trait DynSessions: Send + Sync + 'static {
    fn open_session<'a>(
        &'a self,
        session: &'a SessionKey,
        request: SessionRequest,
    ) -> BoxFuture<'a, Result<crate::SessionGate, StoreError>>;
    fn session_mark<'a>(
        &'a self,
        session: &'a SessionKey,
    ) -> BoxFuture<'a, Result<Option<crate::SessionMark>, StoreError>>;
    fn claim_in_session<'a>(
        &'a self,
        session: &'a SessionKey,
        request: SessionRequest,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        label: &'a crate::inspect::KeyLabel,
    ) -> BoxFuture<'a, Result<super::SessionClaim, StoreError>>;
}

/// The object-safe face of [`CheckpointStore`].
pub(crate) trait DynCheckpoints: Send + Sync + 'static {
    fn resume<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Claim>, StoreError>>;
    fn save_step<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn load_steps<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Bytes, StoreError>>;
    fn save_request<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn abandoned<'a>(
        &'a self,
        idle: Duration,
        limit: usize,
        owner: Option<&'a RequestOwner>,
    ) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>>;
}

/// A store as a runtime holds it: type-erased, every operation timed into the runtime's
/// [`StoreMetrics`]. The timing lives in the one future each operation is boxed into anyway.
pub(crate) struct Measured<S> {
    store: S,
    metrics: StoreMetrics,
}

impl<S: Store> Measured<S> {
    /// `store`, with the runtime's metrics registered with the current recorder.
    pub(crate) fn new(store: S) -> Self {
        let metrics = StoreMetrics::register(store.name());
        Measured { store, metrics }
    }

    async fn timed<T>(
        &self,
        operation: Operation,
        answer: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let answer = answer.await;
        self.metrics
            .store_operation(operation, answer.as_ref().err(), started.elapsed());
        answer
    }
}

impl<S: Store> DynStore for Measured<S> {
    fn claim<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        ttl: Duration,
        label: &'a crate::inspect::KeyLabel,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(
            self.timed(
                Operation::Claim,
                self.store
                    .claim_labelled(key, fingerprint, (lease, ttl), label),
            ),
        )
    }
    fn complete(
        self: Arc<Self>,
        key: StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            self.timed(
                Operation::Complete,
                self.store.complete(&key, token, payload, ttl),
            )
            .await
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(Operation::Release, self.store.release(key, token)))
    }
    fn renew<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(Operation::Renew, self.store.renew(key, token, lease)))
    }
    fn wait_for_change<'a>(&'a self, key: &'a StorageKey, max_wait: Duration) -> BoxFuture<'a, ()> {
        Box::pin(self.store.wait_for_change(key, max_wait))
    }
    fn keeps_records_in_process(&self) -> bool {
        self.store.keeps_records_in_process()
    }
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        self.store.completed_in_process(key)
    }
    fn location(&self) -> Option<String> {
        self.store.location()
    }

    fn metrics(&self) -> &StoreMetrics {
        &self.metrics
    }
}

impl<S: SessionStore> DynSessions for Measured<S> {
    fn open_session<'a>(
        &'a self,
        session: &'a SessionKey,
        request: SessionRequest,
    ) -> BoxFuture<'a, Result<crate::SessionGate, StoreError>> {
        Box::pin(self.timed(
            Operation::OpenSession,
            self.store.open_session(session, request),
        ))
    }
    fn session_mark<'a>(
        &'a self,
        session: &'a SessionKey,
    ) -> BoxFuture<'a, Result<Option<crate::SessionMark>, StoreError>> {
        Box::pin(self.timed(Operation::SessionMark, self.store.session_mark(session)))
    }
    fn claim_in_session<'a>(
        &'a self,
        session: &'a SessionKey,
        request: SessionRequest,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        label: &'a crate::inspect::KeyLabel,
    ) -> BoxFuture<'a, Result<super::SessionClaim, StoreError>> {
        Box::pin(
            self.timed(
                Operation::ClaimInSession,
                self.store
                    .claim_in_session(session, request, fingerprint, lease, label),
            ),
        )
    }
}

impl<S: CheckpointStore> DynCheckpoints for Measured<S> {
    fn resume<'a>(
        &'a self,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Claim>, StoreError>> {
        Box::pin(self.timed(
            Operation::Resume,
            self.store.resume(key, fingerprint, lease, ttl),
        ))
    }
    fn save_step<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(Operation::SaveStep, self.store.save_step(key, token, entry)))
    }
    fn load_steps<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Bytes, StoreError>> {
        Box::pin(self.timed(Operation::LoadSteps, self.store.load_steps(key, token)))
    }
    fn save_request<'a>(
        &'a self,
        key: &'a StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.timed(
            Operation::SaveRequest,
            self.store.save_request(key, token, request),
        ))
    }
    fn abandoned<'a>(
        &'a self,
        idle: Duration,
        limit: usize,
        owner: Option<&'a RequestOwner>,
    ) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>> {
        Box::pin(self.timed(
            Operation::Abandoned,
            self.store.abandoned(idle, limit, owner),
        ))
    }
}
