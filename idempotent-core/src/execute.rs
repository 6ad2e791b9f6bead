//! Running a call: claim (waiting out or answering duplicates as the policy says), run the work
//! with the lease kept alive, then record its outcome or release the claim.

use crate::inspect::KeyLabel;
use crate::lent::Lent;
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::call::Settings;
use crate::claim::{ClaimHandle, ClaimSlot, Seed};
use crate::claim_answer::{ClaimAnswer, Step};
use crate::lease::{Renewal, attempt_limit, bounded};

use crate::capability::{Capabilities, Runs};
use crate::recording::{First, Payload, Recording, finish};
use crate::run_to_end::RunToEnd;
use crate::runtime::{CLAIM_TIMEOUT, ClaimedAt};
use crate::shutdown::Active;
use crate::store::BoxFuture;
use crate::{
    Call, Claim, Error, Execution, FencingToken, Fingerprint, Idempotency, InFlightPolicy, Outcome,
    Retain, SessionClaim, SessionGate, SessionRequest, StorageKey, StoreError,
};

impl<C: Capabilities> Idempotency<C> {
    /// Runs `work` at most once per key, retaining its result as JSON for replay.
    ///
    /// Every result is kept. To decide per result (release transient failures), use
    /// [`run_with`](Self::run_with).
    pub async fn run<T, F, N>(&self, call: &Call<N>, work: F) -> Result<Outcome<T>, Error>
    where
        C: Runs<N>,
        F: Future<Output = T>,
        T: Serialize + DeserializeOwned,
    {
        self.run_with(call, work, |_| Retain::Keep).await
    }

    /// Like [`run`](Self::run), but a result for which `retain` returns [`Retain::Release`] is
    /// not kept: the claim is released and the next retry runs the work again.
    pub async fn run_with<T, F, N>(
        &self,
        call: &Call<N>,
        work: F,
        retain: impl FnOnce(&T) -> Retain,
    ) -> Result<Outcome<T>, Error>
    where
        C: Runs<N>,
        F: Future<Output = T>,
        T: Serialize + DeserializeOwned,
    {
        let mut encode_error = None;
        let execution = self
            .execute(call, work, retain, |value| {
                match serde_json::to_vec(value) {
                    Ok(bytes) => Some(Bytes::from(bytes)),
                    // The work ran: record that it did, so a retry is refused with
                    // `ResultNotRetained` instead of running it again.
                    Err(e) => {
                        encode_error = Some(e);
                        None
                    }
                }
            })
            .await;
        self.inner.metrics().call(&execution);
        let execution = execution?;
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

    /// The byte-level primitive under [`run`](Self::run): runs `work` at most once per key.
    /// `retain` decides whether its output is kept or its claim released; only a kept output
    /// is given to `encode`, which returns the bytes retries replay, or `None` when the output
    /// cannot be kept (a response too large to buffer): the call is then recorded as done
    /// without a result, and retries get [`Error::ResultNotRetained`] instead of running the
    /// work again.
    ///
    /// It records the store's and the work's [metrics](crate::metrics) but does not count the
    /// call in `idempotency.requests`: what the caller makes of the execution is its outcome
    /// (see [`count`](Self::count)).
    pub async fn execute<V, F, N>(
        &self,
        call: &Call<N>,
        work: F,
        retain: impl FnOnce(&V) -> Retain,
        encode: impl FnOnce(&V) -> Option<Bytes>,
    ) -> Result<Execution<V>, Error>
    where
        C: Runs<N>,
        F: Future<Output = V>,
    {
        let inner = &*self.inner;
        // A replay that a store in this process can answer at once needs none of the claim's
        // machinery (the count in flight, the label, the timed claim, its answer): the call
        // is answered before any of it is built. Not once the shutdown is seen to have begun
        // (calls are refused below); a replay answered in the same instant is not counted in
        // flight, and needs not be: it reads this process's memory and runs nothing. Never
        // for a session's request, which passes its gate first, nor for a completer's resume.
        let key = call.session().is_none().then(|| self.storage_key(call));
        if let Some(key) = &key
            && !call.is_resume_only()
            && inner.drain.is_open()
            && let Some(bytes) = self.replay_in_process(key, call.fingerprint_ref())
        {
            tracing::debug!(storage_key = %key, "idempotent call replayed from the store's record in this process");
            return Ok(Execution::Replayed(bytes));
        }
        // Pinned once, here, and lent to the watcher below, so the work (often the largest part
        // of this future: a handler's whole future) is not moved again, nor held twice. The
        // watcher drops it in place as soon as it ends or is stopped, and when the watcher is
        // dropped: always inside the claim's scope, and before the claim's slot.
        let mut work = std::pin::pin!(Some(work));
        // Counted in flight from before its claim until its outcome is recorded, so that a
        // shutdown waits for a claim still on its way to the store; refused without touching
        // the store once shutdown has begun.
        let Some(mut active) = inner.drain.enter() else {
            return Err(Error::ShuttingDown);
        };
        let Settings {
            ttl,
            lease,
            in_flight,
            max_result_bytes,
            session_window,
            session_idle,
            max_checkpoint_bytes,
        } = call.settings(&inner.defaults);
        // A call in a session passes its session's gate first; admitted, it is an ordinary
        // claim of its `(session, seq)` record, kept as long as the session. The store makes
        // both (and the check of the session's mark that follows a claim) in one call.
        let (target, ttl, label) = match call.session() {
            None => (
                Target::Key(key.unwrap_or_else(|| self.storage_key(call))),
                ttl,
                KeyLabel::new(call.key(), call.scope_ref(), inner.keys_in_clear),
            ),
            Some(place) => (
                Target::Session(
                    self.session_key(call),
                    SessionRequest::new(place.seq(), place.ack(), session_window, session_idle),
                ),
                session_idle,
                KeyLabel::of_session(call.key(), call.scope_ref(), inner.keys_in_clear),
            ),
        };
        let (key, acquired) = self
            .acquire(
                &target,
                call.fingerprint_ref(),
                (lease, ttl),
                (in_flight, call.is_resume_only()),
                &label,
            )
            .await?;
        let (token, lifetime, claimed_at) = match acquired {
            Acquired::Owner(token, lifetime, claimed_at) => (token, lifetime, claimed_at),
            Acquired::Replay(bytes) => {
                tracing::debug!(storage_key = %key, "idempotent call replayed");
                return Ok(Execution::Replayed(bytes));
            }
        };
        tracing::debug!(storage_key = %key, token = token.get(), "idempotent call claimed");
        active.own(&inner.metrics().in_flight);
        let started = std::time::Instant::now();

        let slot = ClaimSlot::leased(Seed {
            store: Arc::clone(&inner.store),
            checkpoints: inner.checkpoints.clone(),
            key,
            token,
            lifetime,
            lease,
            max_checkpoint_bytes,
        });
        // The lease is renewed on a task of its own, started only once the work first returns
        // pending: work that finishes at once costs nothing.
        let mut renewal: Option<Renewal> = None;
        let (value, slot) = {
            let renewal = &mut renewal;
            let mut stopping = inner.drain.stopping();
            let lent = Lent::new(work.as_mut());
            let watched = async move {
                let mut work = lent;
                std::future::poll_fn(|cx| {
                    let polled = std::pin::Pin::new(&mut work).poll(cx);
                    if polled.is_pending() {
                        if renewal.is_none() {
                            *renewal = ClaimSlot::start_renewal(claimed_at.instant());
                        }
                        // A graceful shutdown's deadline stops work that is still waiting,
                        // unless the work asked to finish.
                        if stopping.poll_stop(cx).is_ready()
                            && !ClaimHandle::current().is_some_and(|c| c.finishes_on_shutdown())
                        {
                            work.stop();
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
        inner.metrics().work.record(started.elapsed());
        let Some(value) = value else {
            drop(renewal);
            active.stopped();
            tracing::warn!(storage_key = %key, "idempotent call stopped by shutdown; its claim is released");
            finish(slot.release(), active.into_owned()).await;
            return Err(Error::ShuttingDown);
        };
        let mut slot = slot;
        // The work ran: a panic in `retain` or `encode` (a `Serialize` impl, say) must not
        // unwind through the armed slot, which would release the claim and let a retry run
        // the work again. It is recorded as "not retained", then resumed.
        let decided =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match retain(&value) {
                Retain::Keep => Some(encode(&value)),
                Retain::Release => None,
            }));
        let (result, panicked) = match decided {
            Ok(Some(result)) => (result, None),
            Ok(None) => {
                drop(renewal);
                // Finished in the background if the caller stops waiting, like a record.
                finish(slot.release(), active.into_owned()).await;
                return Ok(Execution::Fresh(value));
            }
            Err(panic) => {
                tracing::error!(
                    storage_key = %key,
                    "deciding or encoding the result of an idempotent call panicked after its work ran; \
                     it is recorded as done without a result (retries get result_not_retained)"
                );
                (None, Some(panic))
            }
        };
        slot.disarm();
        let finishing = Finishing {
            key,
            token,
            ttl,
            max_result_bytes,
            claimed_at,
            renewal,
            slot,
            active,
        };
        let recorded = self.finish(finishing, result, value).await;
        if let Some(panic) = panicked {
            std::panic::resume_unwind(panic);
        }
        recorded
    }

    /// Records the result of work that ran (`None`: done, not retained), and gives the
    /// caller its value.
    async fn finish<V>(
        &self,
        finishing: Finishing<'_>,
        result: Option<Bytes>,
        value: V,
    ) -> Result<Execution<V>, Error> {
        let Finishing {
            key,
            token,
            ttl,
            max_result_bytes,
            claimed_at,
            renewal,
            slot,
            active,
        } = finishing;
        let payload = Payload::new(&key, result, max_result_bytes);
        // The first write is polled here; only if the store does not answer at once (or
        // fails) does the call build the machinery that finishes it if the caller goes away
        // and retries it if it failed.
        if let Some(claim) = slot.existing() {
            claim.start_recording();
        }
        let envelope = payload.envelope(self.inner.integrity);
        let mut first = Arc::clone(&self.inner.store).complete(key, token, envelope, ttl);
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
            active: active.into_owned(),
        };
        let this = self.clone();
        RunToEnd::new(async move { this.record(recording, first).await }).await;
        Ok(Execution::Fresh(value))
    }

    /// The result `key`'s completed record keeps for a call of `fingerprint`, if the store
    /// can say so in this process without a claim ([`Store::completed_in_process`]) and the
    /// claim would replay it: the same fingerprint, and a result kept and readable. `None`
    /// otherwise, and the claim answers (a reused key, a result not retained, a damaged
    /// record are refused there, as ever).
    ///
    /// [`Store::completed_in_process`]: crate::Store::completed_in_process
    fn replay_in_process(&self, key: &StorageKey, fingerprint: &Fingerprint) -> Option<Bytes> {
        let (recorded, payload) = self.inner.store.completed_in_process(key)?;
        if recorded != *fingerprint {
            return None;
        }
        match crate::envelope::decode(&payload, self.inner.integrity) {
            Ok(crate::envelope::Stored::Value(bytes)) => Some(bytes),
            Ok(crate::envelope::Stored::NotRetained) | Err(_) => None,
        }
    }

    async fn acquire(
        &self,
        target: &Target,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        (policy, resume): (InFlightPolicy, bool),
        label: &KeyLabel,
    ) -> Result<(StorageKey, Acquired), Error> {
        let store = &*self.inner.store;
        let mut answer = ClaimAnswer::new(policy, self.inner.integrity);
        loop {
            // The lease is counted from when the successful claim was sent, so it never ends
            // later than the store's. A claim the store answers within its first poll (an
            // in-process store) needs no clock read: it happened now, and the work reads the
            // clock only if it waits (see `ClaimedAt`).
            //
            // Bounded like every other store operation: a store that does not answer (frozen,
            // or its connections hung) fails the call closed instead of hanging it. The store
            // gives back a claim that lands after this (see its docs).
            let limit = claim_limit(lease);
            let (key, claim, sent) = match target {
                // A completer's call only takes an abandoned operation over
                // (`CheckpointStore::resume`): it never begins one, so it never drops another
                // operation's checkpoints.
                Target::Key(key) if resume => {
                    let Some(checkpoints) = &self.inner.checkpoints else {
                        return Err(crate::runtime::no_checkpoints());
                    };
                    let (found, sent) =
                        sent(checkpoints.resume(key, fingerprint, lease, ttl), limit).await;
                    match found? {
                        Some(claim) => (*key, claim, sent),
                        None => return Err(Error::NothingToResume),
                    }
                }
                Target::Key(key) => {
                    let (claim, sent) =
                        sent(store.claim(key, fingerprint, lease, ttl, label), limit).await;
                    (*key, claim?, sent)
                }
                // A resume-only call in a session: its gate, then a takeover of its record
                // only, then the check of the mark (the takeover is not the gate's step).
                Target::Session(session, request) if resume => {
                    let (Some(sessions), Some(checkpoints)) =
                        (&self.inner.sessions, &self.inner.checkpoints)
                    else {
                        return Err(crate::runtime::no_sessions());
                    };
                    let unanswered = |what: &str| {
                        StoreError::Unavailable(
                            format!("the store did not answer the {what} within {limit:?}").into(),
                        )
                    };
                    let gate = bounded(sessions.open_session(session, *request), limit)
                        .await
                        .unwrap_or_else(|| Err(unanswered("session gate")))?;
                    let SessionGate::Open { epoch } = gate else {
                        return Err(refused(gate, *request));
                    };
                    let key = session.seq_key(epoch, request.seq);
                    let (found, sent) =
                        sent(checkpoints.resume(&key, fingerprint, lease, ttl), limit).await;
                    let Some(claim) = found? else {
                        return Err(Error::NothingToResume);
                    };
                    if let Claim::Claimed(token) | Claim::TakenOver { token, .. } = claim {
                        let read = bounded(sessions.session_mark(session), limit)
                            .await
                            .unwrap_or_else(|| Err(unanswered("session read")));
                        let refusal = crate::store::refusal_by_mark(read, epoch, request.seq)
                            .map(|by| by.map_or_else(Error::Store, |gate| refused(gate, *request)));
                        if let Some(refusal) = refusal {
                            if bounded(store.release(&key, token), limit).await.is_none() {
                                tracing::warn!(storage_key = %key, "releasing a session claim that may not run timed out; its lease ends it");
                            }
                            return Err(refusal);
                        }
                    }
                    (key, claim, sent)
                }
                // Asked again after a wait: the gate admits the same number again (or refuses
                // it, if an `ack` covered it meanwhile).
                Target::Session(session, request) => {
                    let Some(sessions) = &self.inner.sessions else {
                        return Err(crate::runtime::no_sessions());
                    };
                    let (found, sent) = sent(
                        sessions.claim_in_session(session, *request, fingerprint, lease, label),
                        limit,
                    )
                    .await;
                    match found? {
                        SessionClaim::Admitted { epoch, claim } => {
                            (session.seq_key(epoch, request.seq), claim, sent)
                        }
                        SessionClaim::Refused(gate) => return Err(refused(gate, *request)),
                    }
                }
            };
            match answer.step(&key, fingerprint, claim)? {
                Step::Owner(token, lifetime) => {
                    return Ok((key, Acquired::Owner(token, lifetime, sent)));
                }
                Step::Replay(bytes) => return Ok((key, Acquired::Replay(bytes))),
                // Once shutdown has begun, a duplicate stops waiting for another owner: its
                // client retries elsewhere rather than holding the shutdown up.
                Step::Wait(_) if !self.inner.drain.is_open() => {
                    return Err(Error::ShuttingDown);
                }
                Step::Wait(wait) => store.wait_for_change(&key, wait).await,
            }
        }
    }
}

/// What a call claims: a key's record, or a request of a client session (its gate, then its
/// record).
enum Target {
    Key(StorageKey),
    Session(crate::SessionKey, SessionRequest),
}

/// Why a session's gate refused `request`.
fn refused(gate: SessionGate, request: SessionRequest) -> Error {
    match gate {
        SessionGate::Acknowledged { ack } => Error::SequenceAcknowledged {
            seq: request.seq,
            ack,
        },
        SessionGate::WindowFull { ack } => Error::SessionWindowFull {
            seq: request.seq,
            ack,
            window: request.window,
        },
        SessionGate::Expired => Error::SessionExpired,
        SessionGate::Open { .. } => Error::Store(StoreError::Corrupt(
            "the store refused a session request with an open gate".into(),
        )),
    }
}

/// Awaits one claim (or resume) of the store, bounded by `limit`, noting when it was sent: at
/// once if it answers within its first poll, or the moment it first waited.
async fn sent<T>(
    mut claiming: BoxFuture<'_, Result<T, StoreError>>,
    limit: Duration,
) -> (Result<T, StoreError>, ClaimedAt) {
    let mut sent = ClaimedAt::Now;
    let answer = bounded(
        std::future::poll_fn(|cx| {
            let polled = claiming.as_mut().poll(cx);
            if polled.is_pending() && matches!(sent, ClaimedAt::Now) {
                sent = ClaimedAt::At(tokio::time::Instant::now());
            }
            polled
        }),
        limit,
    )
    .await
    .unwrap_or_else(|| {
        Err(StoreError::Unavailable(
            format!("the store did not answer the claim within {limit:?}").into(),
        ))
    });
    (answer, sent)
}

/// The longest a claim is waited for: [`CLAIM_TIMEOUT`], or a sixth of a shorter lease (like
/// every other store operation), but at least [`MIN_CLAIM_TIMEOUT`].
fn claim_limit(lease: Duration) -> Duration {
    attempt_limit(lease).clamp(MIN_CLAIM_TIMEOUT, CLAIM_TIMEOUT)
}

/// However short the lease, a claim is given this long: waiting for a pooled connection is
/// part of it, and each abandoned claim costs a background give-back.
const MIN_CLAIM_TIMEOUT: Duration = Duration::from_secs(1);

/// What the runtime keeps of a call whose work ran, while its result is recorded.
struct Finishing<'a> {
    key: StorageKey,
    token: FencingToken,
    ttl: Duration,
    max_result_bytes: usize,
    claimed_at: ClaimedAt,
    renewal: Option<Renewal>,
    slot: ClaimSlot,
    active: Active<'a>,
}

enum Acquired {
    /// The call owns the key with this token, in the record lifetime the second token began;
    /// its claim was sent then.
    Owner(FencingToken, FencingToken, ClaimedAt),
    Replay(Bytes),
}
