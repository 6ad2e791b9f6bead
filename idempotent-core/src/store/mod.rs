//! The store contract: what a store implements ([`Store`]) and everything a store, a cache tier
//! or a transactional mode needs from this crate to be built outside it.
//!
//! The stores of this family (`idempotent-redis`, `idempotent-postgres`, `idempotent-sqlite`) and
//! the cache tier (`idempotent-cache`) are built on this module and the crate's root items only,
//! exactly as a store of yours would be:
//!
//! | item | what it is for |
//! |---|---|
//! | [`Store`], [`Claim`], [`FencingToken`], [`RequestOwner`] | the key cycle every store implements |
//! | [`SessionStore`], [`SessionClaim`], [`claim_in_session_in_steps`], [`CheckpointStore`] | client sessions; checkpoints, kept requests and resumes: what a store implements when it can (see [`capability`](crate::capability)) |
//! | [`StoreWrapper`] | a store in front of another, whose sessions and checkpoints are forwarded |
//! | [`StorageKey`], [`RecordBytes`](crate::RecordBytes), [`Fingerprint`] | what a record is keyed and checked by |
//! | [`envelope`] ([`Integrity`], [`encode_value`], [`decode`]) | the bytes of a finished record, with its format version and checksum |
//! | [`Payload`] | a result turned into the bytes to complete with |
//! | [`ClaimAnswer`], [`Step`] | how a claim loop answers what a store found (run, replay, wait, refuse), shared with the runtime |
//! | [`Settings`] | a call's settings resolved against a runtime's defaults |
//! | [`StoreMetrics`], [`Operation`] | the `idempotency.store.*` and `idempotency.requests` metrics under a store's name |
//! | [`Unanswered`], [`GiveBack`], [`claimant`] | giving back a claim a shared store made after its caller gave up |
//! | [`SessionState`](crate::session::SessionState), [`GateStep`](crate::session::GateStep) | a client session's state and the gate's rules, for a store that decides in Rust |
//! | [`BoxFuture`] | the boxed future the give-back and cache tiers use |
//!
//! # Stability
//!
//! Everything in this module follows the crate's version: a breaking change to any of it is a
//! new minor version before 1.0 (a new major version after), named in the CHANGELOG with how to
//! move, like any other public item. Nothing here is `#[doc(hidden)]` and no store of this
//! family uses anything that is not here or at the crate's root. The stored bytes are part of
//! the promise: a release reads the envelopes every earlier release wrote (the format version
//! is the envelope's third byte).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::steps::Abandoned;
use crate::{
    Fingerprint, SessionGate, SessionKey, SessionMark, SessionRequest, StorageKey, StoreError,
};

mod give_back;
mod measured;
#[cfg(feature = "memory")]
pub(crate) mod memory;

pub use self::give_back::{GIVE_BACK_MAX, GiveBack, Unanswered, claimant};
pub use self::measured::BoxFuture;
pub(crate) use self::measured::{DynCheckpoints, DynSessions, DynStore, Measured};
pub use crate::call::Settings;
pub use crate::claim_answer::{ClaimAnswer, Step};
pub use crate::metrics::{Operation, StoreMetrics};
pub use crate::recording::Payload;

/// The envelope around every finished record's bytes: a format version and a checksum.
pub mod envelope {
    pub use crate::envelope::{
        EnvelopeError, Integrity, Stored, decode, encode_not_retained, encode_value, encoded_len,
    };
}
pub use self::envelope::{Integrity, decode, encode_value};

/// Identifies one claim of one storage key. Strictly increasing per storage key: every claim
/// gets a token greater than all tokens issued before it for that key, so a caller whose lease
/// ended can be told apart from the current owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw token value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// Whose a kept request ([`CheckpointStore::save_request`]) is: its first [`RequestOwner::LEN`] bytes.
///
/// A caller that keeps the requests of several runtimes in one store begins each with a tag
/// of that length naming its runtime (the tower layer's kept format begins with its format's
/// magic and a digest of the runtime's namespace), so that a completer lists only its own
/// ([`CheckpointStore::abandoned`]). A request shorter than that names no owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestOwner([u8; RequestOwner::LEN]);

impl RequestOwner {
    /// How many leading bytes of a kept request name its owner.
    pub const LEN: usize = 36;

    /// The owner these bytes name.
    pub const fn new(bytes: [u8; Self::LEN]) -> Self {
        RequestOwner(bytes)
    }

    /// The owner `request` names: its first [`LEN`](Self::LEN) bytes, or `None` when it is
    /// shorter.
    pub fn of(request: &[u8]) -> Option<Self> {
        request
            .get(..Self::LEN)
            .and_then(|head| <[u8; Self::LEN]>::try_from(head).ok())
            .map(RequestOwner)
    }

    /// The owner's bytes.
    pub const fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller now owns the key until its lease ends, and holds this token. A new record
    /// *lifetime* begins with it: the key had no record, or its record had expired (a
    /// completed record past its TTL, an abandoned one past the TTL it was claimed with).
    Claimed(FencingToken),
    /// The caller now owns the key until its lease ends, and holds `token`, taking over a
    /// record of the same request whose owner's lease ended or who released it: the record's
    /// lifetime goes on. `lifetime` is the token that began it (see
    /// [`StorageKey::operation_key`]), so every owner and attempt of one operation passes the
    /// same operation key downstream.
    TakenOver {
        /// The caller's new token, greater than every token issued before for the key.
        token: FencingToken,
        /// The token of the claim that began the record's lifetime.
        lifetime: FencingToken,
    },
    /// Another caller owns the key: it holds a live lease, or (with `retry_after` zero) its
    /// claim was abandoned (its lease ended, or it was released) by a request other than the
    /// caller's, whose key it stays until the record expires.
    InFlight {
        /// The fingerprint the owner claimed with.
        fingerprint: Fingerprint,
        /// Time left on the owner's lease (zero when it ended).
        retry_after: Duration,
    },
    /// The key has a completed record.
    Completed {
        /// The fingerprint of the request that completed.
        fingerprint: Fingerprint,
        /// The stored payload, byte for byte as given to [`Store::complete`].
        payload: Bytes,
        /// Time left before the record expires, by the store's clock, as of this answer; at
        /// most the TTL it was completed with. A cache tier (`idempotent-cache`) keeps a copy no
        /// longer than this, so a cached answer never outlives its record: a store that
        /// cannot tell may answer [`Duration::ZERO`], and its records are then not cached.
        expires_in: Duration,
    },
}

#[doc = include_str!("../../docs/store-trait.md")]
pub trait Store: Send + Sync + 'static {
    /// Claims `key` for `lease`, or reports the record that prevents it.
    ///
    /// - A live in-flight record (its lease has not ended): returns [`Claim::InFlight`] with
    ///   its fingerprint and the time left on its lease. Nothing is changed.
    /// - A live completed record: returns [`Claim::Completed`] with its fingerprint, payload and
    ///   the time left before it expires. Nothing is changed.
    /// - An in-flight record whose lease ended or that was released, with the same
    ///   `fingerprint`, kept less than its TTL ago: the caller takes it over, with a new token
    ///   greater than every token issued before for `key` and a lease ending `lease` from now;
    ///   returns [`Claim::TakenOver`] with the token and the record's `lifetime` (the token that
    ///   began it). The record is kept at least until `ttl` from now.
    /// - An in-flight record whose lease ended or that was released, of another
    ///   `fingerprint`, kept less than its TTL ago: returns [`Claim::InFlight`] with its
    ///   fingerprint and a zero `retry_after`. Nothing is changed: the key belongs to the
    ///   request that began the record for the record's whole life (its attempt may have
    ///   taken effect before its lease lapsed or it released the claim), so the runtime
    ///   answers a fingerprint mismatch. Only the record's expiry frees the key.
    /// - Otherwise (no record, or an expired one): stores
    ///   a new in-flight record with `fingerprint`, a new token as above, a lease ending `lease`
    ///   from now, kept until `ttl` (at least `lease`) from now, and a lifetime beginning with
    ///   the token; returns [`Claim::Claimed`].
    ///
    /// Of any number of concurrent claims on a key no live record holds, exactly one returns
    /// `Claimed` or `TakenOver`.
    ///
    /// `ttl` is what the record's completion will be given: an abandoned claim is kept that
    /// long (so an owner whose lease lapsed and its successor share one lifetime) and no
    /// longer (so a key reused after its record expired is a new operation).
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// [`claim`](Self::claim), keeping `label` on the record a claim begins, so that an operator
    /// can recognise it ([`InspectStore`](crate::inspect::InspectStore)); a takeover keeps the
    /// label the record has. The runtime claims with this. The default calls `claim` and keeps
    /// no label: a store that implements `InspectStore` overrides it (the conformance suite
    /// checks that the label is kept).
    fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        label: &crate::inspect::KeyLabel,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        let _ = label;
        self.claim(key, fingerprint, lease, ttl)
    }

    /// Turns the caller's in-flight record into a completed one holding `payload`, kept for
    /// `ttl` from now.
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing. The fingerprint is kept from
    /// the claim. May return [`StoreError::Capacity`] if the payload does not fit; the record
    /// then stays in flight.
    ///
    /// A completion repeated by the owner whose completion already landed (its answer was
    /// lost, or it retries with another payload) finds the live completed record with its own
    /// `token` and succeeds again, changing nothing: the record keeps the payload that landed
    /// first.
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends the caller's lease at once, so the next claim runs the work again (the work failed
    /// transiently or was abandoned). The record is kept as an abandoned one (see
    /// [`claim`](Self::claim)): the next claim of the same request continues its lifetime,
    /// and a claim of another request is refused until the record expires (a released
    /// attempt may have had effects: its checkpoints, its calls downstream).
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing. A completed record is never
    /// released.
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the caller's lease to end `lease` from now.
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing (a lease that already ended
    /// cannot be renewed: another caller may have taken over).
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The store's name, the `store` label of its operations' metrics
    /// ([`metrics`](crate::metrics)): `memory`, `redis` and `postgres` for the built-in stores,
    /// `custom` by default. A few distinct values at most: it is a label.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Whether this store keeps the bytes [`complete`](Self::complete) is given in this
    /// process's memory and hands those same bytes back from [`claim`](Self::claim), so
    /// that nothing outside the process can change them. Default `false`.
    ///
    /// The runtime then skips the checksum it otherwise computes over every result it records
    /// and checks on every replay (the rest of the record's envelope is still checked). Return
    /// `true` only for such a store: on any other, a record damaged outside the process would
    /// be replayed instead of refused as corrupt. [`MemoryStore`] returns `true`.
    ///
    /// [`MemoryStore`]: crate::memory::MemoryStore
    fn keeps_records_in_process(&self) -> bool {
        false
    }

    /// The fingerprint and payload of `key`'s record if it is completed and live, read at once
    /// in this process, without a claim and without changing anything; `None` when it is not
    /// (absent, in flight, expired) or when the store cannot say without a round trip.
    /// Default `None`.
    ///
    /// The runtime asks it before it claims a key (never for a session's request, nor for a
    /// completer's resume): a record it returns whose fingerprint is the call's and whose
    /// payload holds a result is replayed at once, without the claim's machinery (no claim is
    /// sent, so no store operation is timed); anything else, and `None`, goes on to
    /// [`claim`](Self::claim) as before. So it must report a completed record exactly as `claim`
    /// would at that moment (the same fingerprint and payload, and only while it is live), and
    /// it is called on the request's own task: it must not block or wait. A store whose
    /// records are not in this process's memory returns `None`; so does a wrapper that changes
    /// what claims answer (one that injects faults, counts or times claims), lest replays
    /// bypass it. [`MemoryStore`] answers it from its map.
    ///
    /// [`MemoryStore`]: crate::memory::MemoryStore
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        let _ = key;
        None
    }

    /// Where this store keeps its records, as a URL without credentials (for example
    /// `postgres://db.internal:5432/app?table=idempotency`): for logs, and for a companion
    /// that must write beside the records of a claim this store made (an atomic step checks
    /// [`ClaimHandle::store_location`](crate::ClaimHandle::store_location) against its own).
    /// Two stores with the same location keep the same records. `None` (the default) names
    /// no place; a wrapper (a cache tier, a timed store) answers its store's.
    fn location(&self) -> Option<String> {
        None
    }

    /// Waits until `key` may have changed, or `max_wait` has passed, whichever is first.
    ///
    /// Callers waiting for an in-flight record to complete call this between claims. The
    /// default sleeps for `max_wait` (polling); a store with change notifications should
    /// return early when the record is completed or released. Returning early spuriously is
    /// allowed.
    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        let _ = key;
        tokio::time::sleep(max_wait)
    }
}

/// A store that keeps [client sessions](crate::session): the gate that numbers a session's
/// requests, and the session's mark. A runtime serves sessions ([`Call::in_session`]) only
/// over a store that implements it ([`Idempotency::new`](crate::Idempotency::new) and
/// [`Idempotency::with_sessions`](crate::Idempotency::with_sessions)); the conformance suite
/// runs its checks for every store that does.
///
/// [`Call::in_session`]: crate::Call::in_session
#[diagnostic::on_unimplemented(
    message = "`{Self}` keeps no client sessions: it does not implement `SessionStore`",
    label = "this store implements no `SessionStore`",
    note = "a store that keeps plain keys only runs with `Idempotency::keys_only(store)`; sessions need a store that implements `SessionStore`"
)]
pub trait SessionStore: Store {
    /// The gate of a [client session](crate::session): decides, as one atomic step on the
    /// session, whether request `request.seq` may be claimed, and applies the request's `ack`.
    ///
    /// The session's state is its *epoch* (chosen when it starts), its acknowledged mark `ack`
    /// and `high`, the highest `seq` it admitted. With `m = max(ack, request.ack)`:
    ///
    /// - no live session and `request.ack > 0`: returns [`SessionGate::Expired`], changing
    ///   nothing;
    /// - no live session and `request.ack == 0`: starts one with a new epoch (different from
    ///   every epoch this session id had before), `ack = 0` and `high = 0`, then goes on as
    ///   below;
    /// - sets `ack = m`, drops the records [`SessionKey::seq_key`]`(epoch, s)` for `s` in
    ///   `old ack + 1 ..= min(m, high)`, keeps the records for `s` in `m + 1 ..= high` (and
    ///   the session) until at least `request.idle` from now, then:
    ///   - `request.seq <= m`: returns [`SessionGate::Acknowledged`];
    ///   - `request.seq > m + request.window`: returns [`SessionGate::WindowFull`];
    ///   - otherwise: sets `high = max(high, request.seq)` and returns
    ///     [`SessionGate::Open`] with the epoch. The caller then claims the request's record,
    ///     `seq_key(epoch, seq)`, with [`claim`](Store::claim), with `request.idle` as its TTL.
    ///
    /// The runtime sends `seq` from 1 and `ack` from 0, both at most
    /// [`MAX_SEQ`](crate::session::MAX_SEQ), and a `window` from 1 to
    /// [`MAX_SESSION_WINDOW`](crate::session::MAX_SESSION_WINDOW); a store may refuse anything
    /// else with [`StoreError::Backend`] (the Redis and PostgreSQL stores do).
    ///
    /// The session's records are the store's ordinary records under storage keys that say
    /// where they sit ([`StorageKey::session_place`]). The conformance suite checks it.
    fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> impl Future<Output = Result<SessionGate, StoreError>> + Send;

    /// The live state of a [client session](crate::session) (its epoch and acknowledged
    /// mark), or `None` when there is no live session under `session`. A read: it changes
    /// nothing, and it sees every gate ([`open_session`](Self::open_session)) that answered
    /// before it was sent.
    ///
    /// The runtime asks it once a session request holds its claim, before it runs anything:
    /// between the gate and the claim a later request's `ack` may have covered the number and
    /// dropped its answer, which the claim then did not find. A store whose gate raises the
    /// mark before (or with) dropping answers makes that visible here. The conformance suite checks it.
    fn session_mark(
        &self,
        session: &SessionKey,
    ) -> impl Future<Output = Result<Option<SessionMark>, StoreError>> + Send;

    /// A session request's whole admission, as the runtime asks for it: the gate
    /// ([`open_session`](Self::open_session)), then, admitted in `epoch`, the claim
    /// ([`claim_labelled`](Store::claim_labelled)) of its record
    /// [`SessionKey::seq_key`]`(epoch, request.seq)` with `lease` and `request.idle` as its TTL,
    /// and, when that claim made the caller its owner, the check that no later request's
    /// `ack` covered the number meanwhile.
    ///
    /// It answers [`SessionClaim::Refused`] with the gate's refusal (never
    /// [`SessionGate::Open`]), or [`SessionClaim::Admitted`] with the epoch and what the claim
    /// found. A claim the caller owns is answered only if the session was still live in that
    /// epoch with its mark below `request.seq` after the claim; otherwise the claim is
    /// released and the answer is [`SessionGate::Expired`] (another epoch, or none) or
    /// [`SessionGate::Acknowledged`] with the mark.
    ///
    /// The default makes those three steps as three calls (a session request then costs the
    /// store four round trips with its completion, where a key costs two). A store that can
    /// make them one atomic step (one script, one statement) overrides it: inside one atomic
    /// step no other request's `ack` can come between the gate and the claim, and the check is
    /// not needed. The conformance suite checks both.
    fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &crate::inspect::KeyLabel,
    ) -> impl Future<Output = Result<SessionClaim, StoreError>> + Send {
        claim_in_session_in_steps(self, session, request, fingerprint, lease, label)
    }
}

/// [`SessionStore::claim_in_session`] as three calls of `store`: its gate
/// ([`open_session`](SessionStore::open_session)), the claim of the admitted request's record
/// ([`claim_labelled`](Store::claim_labelled)), and, when the claim made the caller its owner,
/// the check of the session's mark ([`session_mark`](SessionStore::session_mark)), releasing
/// the claim when a later request's `ack` covered the number meanwhile. The trait's default; a
/// store that makes the gate and the claim one step can call it where it cannot (the Redis
/// store does when it is full).
pub async fn claim_in_session_in_steps<S: SessionStore + ?Sized>(
    store: &S,
    session: &SessionKey,
    request: SessionRequest,
    fingerprint: &Fingerprint,
    lease: Duration,
    label: &crate::inspect::KeyLabel,
) -> Result<SessionClaim, StoreError> {
    let epoch = match store.open_session(session, request).await? {
        SessionGate::Open { epoch } => epoch,
        refused => return Ok(SessionClaim::Refused(refused)),
    };
    let key = session.seq_key(epoch, request.seq);
    let claim = store
        .claim_labelled(&key, fingerprint, (lease, request.idle), label)
        .await?;
    let token = match claim {
        Claim::Claimed(token) | Claim::TakenOver { token, .. } => token,
        _ => return Ok(SessionClaim::Admitted { epoch, claim }),
    };
    // Between the gate and the claim a later request's `ack` may have covered this number and
    // dropped its answer, which the claim then did not find: every store raises the mark
    // before it drops anything, so reading it now tells.
    let refused = refusal_by_mark(store.session_mark(session).await, epoch, request.seq);
    match refused {
        None => Ok(SessionClaim::Admitted { epoch, claim }),
        Some(refused) => {
            // The claim must not run; a release that fails leaves it to its lease.
            if let Err(error) = store.release(&key, token).await {
                tracing::warn!(storage_key = %key, %error, "releasing a session claim that may not run failed; its lease ends it");
            }
            refused.map(SessionClaim::Refused)
        }
    }
}

/// What a read of a session's mark, made after the claim of request `seq` admitted in
/// `epoch`, says of that request: `None` while it may run; the gate that refuses it now (a
/// later request's `ack` covered it, or the session ended or began again); or the read's
/// error. Used after a gate and a claim made in two steps (here, and by the runtime's
/// resume-only session calls).
pub(crate) fn refusal_by_mark(
    read: Result<Option<SessionMark>, StoreError>,
    epoch: u64,
    seq: u64,
) -> Option<Result<SessionGate, StoreError>> {
    match read {
        Ok(Some(mark)) if mark.epoch == epoch && mark.ack < seq => None,
        Ok(Some(mark)) if mark.epoch == epoch => {
            Some(Ok(SessionGate::Acknowledged { ack: mark.ack }))
        }
        Ok(_) => Some(Ok(SessionGate::Expired)),
        Err(error) => Some(Err(error)),
    }
}

/// What [`SessionStore::claim_in_session`] answers.
#[derive(Debug)]
pub enum SessionClaim {
    /// The gate admitted the request in `epoch`; `claim` is what the claim of its record,
    /// [`SessionKey::seq_key`]`(epoch, seq)`, found.
    Admitted {
        /// The session's incarnation the request was admitted in.
        epoch: u64,
        /// What the claim of the request's record found.
        claim: Claim,
    },
    /// The gate refused the request (never [`SessionGate::Open`]); nothing was claimed.
    Refused(SessionGate),
}

/// A store that keeps [checkpoints](crate::steps) and requests on its in-flight records, and
/// resumes and lists abandoned operations: what steps, kept requests and a completer need.
/// A runtime gives its work a [`ClaimHandle`](crate::ClaimHandle) (steps), keeps requests and
/// runs resume calls only over a store that implements it
/// ([`Idempotency::new`](crate::Idempotency::new) and
/// [`Idempotency::with_checkpoints`](crate::Idempotency::with_checkpoints)); the conformance
/// suite runs its checks for every store that does.
#[diagnostic::on_unimplemented(
    message = "`{Self}` keeps no checkpoints: it does not implement `CheckpointStore`",
    label = "this store implements no `CheckpointStore`",
    note = "a store that keeps plain keys only runs with `Idempotency::keys_only(store)`; steps, kept requests and a completer need a store that implements `CheckpointStore`"
)]
pub trait CheckpointStore: Store {
    /// Takes over the abandoned operation of `fingerprint` under `key`, and nothing else: what
    /// [`claim`](Store::claim) does when it finds an in-flight record of the same `fingerprint`
    /// whose lease ended (or which was released), kept less than its TTL ago
    /// ([`Claim::TakenOver`], with a new token and the lease and TTL as `claim` sets them). A
    /// live record is reported as `claim` reports it ([`Claim::InFlight`],
    /// [`Claim::Completed`]). Anything else (no record, an expired one, or an abandoned record
    /// of another request) answers `None` and changes nothing: unlike `claim`, it never begins
    /// a new lifetime, so it never drops another operation's checkpoints. Of concurrent
    /// resumes of one operation exactly one takes it over; the others answer the winner's
    /// [`Claim::InFlight`] or, having lost the race, `None`.
    ///
    /// A completer resumes operations with it ([`Call::resume`](crate::Call::resume)). The conformance suite checks it.
    fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send;

    /// Appends `entry` (one [checkpoint](crate::steps), encoded by
    /// [`encode_checkpoint`](crate::steps::encode_checkpoint)) to the checkpoints of the
    /// caller's in-flight record: one step's result, saved so that later attempts of the same
    /// operation return it instead of running the step.
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing (a stale owner's checkpoint is
    /// refused). May return [`StoreError::Capacity`] when the store is full. The checkpoints
    /// are an opaque byte string the store appends to and hands back whole
    /// ([`load_steps`](Self::load_steps)); it never parses them.
    ///
    /// A record keeps its checkpoints while it is in flight, across a release and a takeover
    /// ([`Claim::TakenOver`]): they belong to the operation. A claim that begins a new lifetime
    /// ([`Claim::Claimed`]) starts with none, and a completion drops them. The conformance suite checks it.
    fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The checkpoints of the caller's in-flight record: every entry
    /// [`save_step`](Self::save_step) appended in this record's lifetime, concatenated in the
    /// order they were saved (empty when there are none).
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`]. A read: it changes nothing.
    fn load_steps(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<Bytes, StoreError>> + Send;

    /// Keeps `request` on the caller's in-flight record, replacing any request kept before, so
    /// that a completer ([`abandoned`](Self::abandoned)) can run the operation again if its
    /// client never retries. Kept, fenced and dropped like checkpoints (see
    /// [`save_step`](Self::save_step)).
    ///
    /// Succeeds only if `key` holds a live in-flight record with exactly `token`; otherwise
    /// returns [`StoreError::TokenRejected`] and changes nothing.
    fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Up to `limit` in-flight records that hold a request
    /// ([`save_request`](Self::save_request)) of `owner` ([`RequestOwner::of`] the request;
    /// `None`: requests that name no owner) and whose lease ended (or which were released)
    /// at least `idle` ago, still kept (within the TTL they were claimed with), longest idle
    /// first: operations a completer may finish. A read: it changes nothing, and what it
    /// lists may be claimed by anyone before the completer gets to it (the completer claims
    /// it like any caller, and runs it only if it takes the record over).
    ///
    /// Other owners' records never take `limit`'s places: a completer sharing the store with
    /// runtimes that keep requests and finish none still gets its own operations.
    fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&RequestOwner>,
    ) -> impl Future<Output = Result<Vec<Abandoned>, StoreError>> + Send;
}

/// A store in front of another one (a cache tier, a timer, a tracer): it implements [`Store`]
/// itself and names the store behind it, and [`SessionStore`] and [`CheckpointStore`] are
/// forwarded to that store, as far as it implements them. Written once here, so that no
/// wrapper repeats the forwarding (and none forgets a method). `Arc<S>` is one; so is
/// `idempotent-cache`'s `Cached`.
///
/// A wrapper that must see sessions or checkpoints itself (to time or fail them) implements
/// those traits by hand instead of this one.
pub trait StoreWrapper: Store {
    /// The store behind this one.
    type Inner: Store;

    /// The store behind this one.
    fn inner(&self) -> &Self::Inner;
}

impl<W: StoreWrapper> SessionStore for W
where
    W::Inner: SessionStore,
{
    fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> impl Future<Output = Result<SessionGate, StoreError>> + Send {
        self.inner().open_session(session, request)
    }
    fn session_mark(
        &self,
        session: &SessionKey,
    ) -> impl Future<Output = Result<Option<SessionMark>, StoreError>> + Send {
        self.inner().session_mark(session)
    }
    fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &crate::inspect::KeyLabel,
    ) -> impl Future<Output = Result<SessionClaim, StoreError>> + Send {
        self.inner()
            .claim_in_session(session, request, fingerprint, lease, label)
    }
}

impl<W: StoreWrapper> CheckpointStore for W
where
    W::Inner: CheckpointStore,
{
    fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send {
        self.inner().resume(key, fingerprint, lease, ttl)
    }
    fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner().save_step(key, token, entry)
    }
    fn load_steps(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<Bytes, StoreError>> + Send {
        self.inner().load_steps(key, token)
    }
    fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner().save_request(key, token, request)
    }
    fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&RequestOwner>,
    ) -> impl Future<Output = Result<Vec<Abandoned>, StoreError>> + Send {
        self.inner().abandoned(idle, limit, owner)
    }
}

impl<S: Store> StoreWrapper for Arc<S> {
    type Inner = S;
    fn inner(&self) -> &S {
        self
    }
}

impl<S: Store> Store for Arc<S> {
    fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        S::claim(self, key, fingerprint, lease, ttl)
    }
    fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &crate::inspect::KeyLabel,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        S::claim_labelled(self, key, fingerprint, terms, label)
    }
    fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::complete(self, key, token, payload, ttl)
    }
    fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::release(self, key, token)
    }
    fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        S::renew(self, key, token, lease)
    }
    fn name(&self) -> &'static str {
        S::name(self)
    }
    fn keeps_records_in_process(&self) -> bool {
        S::keeps_records_in_process(self)
    }
    fn completed_in_process(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        S::completed_in_process(self, key)
    }
    fn location(&self) -> Option<String> {
        S::location(self)
    }
    fn wait_for_change(
        &self,
        key: &StorageKey,
        max_wait: Duration,
    ) -> impl Future<Output = ()> + Send {
        S::wait_for_change(self, key, max_wait)
    }
}
