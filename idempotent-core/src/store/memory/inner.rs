//! The memory store's state: the map of records, the byte and entry bounds, the sweeper and
//! the waiters, and every operation as one step on one map entry.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::sync::Notify;

use crate::clock::Clock;
use crate::inspect::{
    Cursor, KeyLabel, ListQuery, Page, RecordInfo, RecordState, Refusal, Repair, Repaired,
};
use crate::session::{MAX_SEQ, MAX_SESSION_WINDOW, SessionState};
use crate::{
    Claim, FencingToken, Fingerprint, SessionGate, SessionKey, SessionRequest, StorageKey,
    StoreError, limits,
};

/// What one record is charged against the byte bound besides its payload: the map slot, the
/// key, the record, the payload's allocation and the map's spare capacity. Measured resident
/// memory per record (BENCHMARKS.md) stays below payload + this at 100k and 1M records, so the
/// byte bound is an upper bound on what records really use.
pub const RECORD_OVERHEAD: usize = 256;

pub(super) const NEVER: u64 = u64::MAX;

/// Completions with payloads this small are accepted even when the byte bound is reached, so
/// the byte bound can be exceeded by at most this much per in-flight record.
const ALWAYS_FITS: usize = 64;

pub(super) struct Inner {
    pub(super) records: DashMap<StorageKey, Record>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) max_entries: usize,
    pub(super) max_bytes: usize,
    pub(super) entries: AtomicUsize,
    pub(super) bytes: AtomicUsize,
    pub(super) last_token: AtomicU64,
    pub(super) changed: Notify,
    pub(super) waiters: AtomicUsize,
    pub(super) capacity_sweep_gap: u64,
    pub(super) last_capacity_sweep: AtomicU64,
    pub(super) sweeper: OnceLock<tokio::task::AbortHandle>,
}

pub(super) enum Record {
    InFlight {
        token: u64,
        /// The token that began the record's lifetime.
        lifetime: u64,
        fingerprint: Fingerprint,
        lease_until: u64,
        /// Until when the record is kept once its lease ended (or it was released), so that a
        /// takeover of the same request continues its lifetime.
        kept_until: u64,
        /// The operation's checkpoints, as the runtime encoded them, one after another.
        steps: Vec<u8>,
        /// The request a completer may run again.
        request: Option<Bytes>,
        /// What an operator sees of its key ([`KeyLabel`](crate::inspect::KeyLabel)).
        label: Option<Bytes>,
        /// Whether its owner released it (its lease then ended at the release).
        released: bool,
        /// The claims of its lifetime.
        attempts: u32,
        /// When it was claimed, taken over or released.
        since: u64,
    },
    Completed {
        token: u64,
        fingerprint: Fingerprint,
        payload: Bytes,
        expires: u64,
        label: Option<Bytes>,
        attempts: u32,
        /// When it completed.
        since: u64,
    },
    /// A client session's own record: its state, live until `expires`.
    Session { state: SessionState, expires: u64 },
}

impl Record {
    /// What a claim at `now` reports about this record, or `None` if it has expired and may
    /// be claimed.
    fn report(&self, now: u64) -> Option<Claim> {
        match self {
            Record::InFlight {
                fingerprint,
                lease_until,
                ..
            } if *lease_until > now => Some(Claim::InFlight {
                fingerprint: *fingerprint,
                retry_after: Duration::from_nanos(lease_until - now),
            }),
            Record::Completed {
                fingerprint,
                payload,
                expires,
                ..
            } if *expires > now => Some(Claim::Completed {
                fingerprint: *fingerprint,
                payload: payload.clone(),
                expires_in: Duration::from_nanos(expires - now),
            }),
            // A session's own record is never claimed: its storage key is no request's.
            _ => None,
        }
    }

    /// Whether a sweep at `now` keeps the record: it is live, or (unless `pressed`: the store is
    /// full) an abandoned claim still within the TTL it was claimed with.
    fn is_kept(&self, now: u64, pressed: bool) -> bool {
        match self {
            Record::InFlight {
                lease_until,
                kept_until,
                ..
            } => *lease_until > now || (!pressed && *kept_until > now),
            Record::Completed { expires, .. } | Record::Session { expires, .. } => *expires > now,
        }
    }

    /// The lifetime an abandoned claim of `fingerprint` at `now` continues, if this record is
    /// one.
    fn continued_by(&self, fingerprint: &Fingerprint, now: u64) -> Option<u64> {
        match self {
            Record::InFlight {
                lifetime,
                fingerprint: recorded,
                kept_until,
                ..
            } if *kept_until > now && recorded == fingerprint => Some(*lifetime),
            _ => None,
        }
    }

    /// What a claim of `fingerprint` at `now` is told about an abandoned claim of *another*
    /// request still kept (its lease lapsed or it was released, within its TTL): the key is
    /// that request's for the record's whole life, so it is reported (nobody holds its lease)
    /// and nothing changes.
    fn pinned_against(&self, fingerprint: &Fingerprint, now: u64) -> Option<Claim> {
        match self {
            Record::InFlight {
                fingerprint: recorded,
                kept_until,
                ..
            } if *kept_until > now && recorded != fingerprint => Some(Claim::InFlight {
                fingerprint: *recorded,
                retry_after: Duration::ZERO,
            }),
            _ => None,
        }
    }

    /// What the record holds besides its fixed overhead, in bytes.
    fn held(&self) -> usize {
        self.cost() - RECORD_OVERHEAD
    }

    fn cost(&self) -> usize {
        let label_len = |label: &Option<Bytes>| label.as_ref().map_or(0, Bytes::len);
        match self {
            Record::InFlight {
                steps,
                request,
                label,
                ..
            } => {
                RECORD_OVERHEAD
                    + steps.len()
                    + request.as_ref().map_or(0, Bytes::len)
                    + label_len(label)
            }
            Record::Session { .. } => RECORD_OVERHEAD,
            Record::Completed { payload, label, .. } => {
                RECORD_OVERHEAD + payload.len() + label_len(label)
            }
        }
    }
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.sweeper.get() {
            task.abort();
        }
    }
}

impl Inner {
    fn now(&self) -> u64 {
        nanos(self.clock.now())
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.last_token.fetch_add(1, Ordering::AcqRel) + 1)
    }

    fn try_reserve(&self, entries: usize, bytes: usize) -> Result<(), StoreError> {
        if entries > 0
            && self.entries.fetch_add(entries, Ordering::AcqRel) + entries > self.max_entries
        {
            self.entries.fetch_sub(entries, Ordering::AcqRel);
            return Err(StoreError::Capacity {
                what: "max entries",
            });
        }
        if self.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes > self.max_bytes {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.entries.fetch_sub(entries, Ordering::AcqRel);
            return Err(StoreError::Capacity { what: "max bytes" });
        }
        Ok(())
    }

    fn unreserve(&self, entries: usize, bytes: usize) {
        self.entries.fetch_sub(entries, Ordering::AcqRel);
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Reserves capacity, sweeping once if the store is full and a sweep is due. Must be called
    /// with no shard lock held: the sweep takes every shard's lock.
    fn reserve(&self, entries: usize, bytes: usize, now: u64) -> Result<(), StoreError> {
        match self.try_reserve(entries, bytes) {
            Ok(()) => Ok(()),
            Err(full) => {
                if self.sweep_if_due(now) > 0 {
                    self.try_reserve(entries, bytes)
                } else {
                    Err(full)
                }
            }
        }
    }

    /// Sweeps a full store: abandoned claims go too (their successors begin new lifetimes).
    fn sweep_if_due(&self, now: u64) -> usize {
        let last = self.last_capacity_sweep.load(Ordering::Acquire);
        if last != NEVER && now < last.saturating_add(self.capacity_sweep_gap) {
            return 0;
        }
        if self
            .last_capacity_sweep
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return 0; // another caller is sweeping
        }
        self.sweep(true)
    }

    pub(super) fn sweep(&self, pressed: bool) -> usize {
        let now = self.now();
        let (mut removed, mut freed) = (0, 0);
        self.records.retain(|_, record| {
            let live = record.is_kept(now, pressed);
            if !live {
                removed += 1;
                freed += record.cost();
            }
            live
        });
        self.unreserve(removed, freed);
        removed
    }

    fn notify_changed(&self) {
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.changed.notify_waiters();
        }
    }

    /// [`Store::completed_in_process`](crate::Store::completed_in_process): `key`'s record if it
    /// is completed and live now, as a claim would report it; under the shard's read lock, and
    /// nothing changed.
    pub(super) fn completed(&self, key: &StorageKey) -> Option<(Fingerprint, Bytes)> {
        match self.records.get(key)?.report(self.now())? {
            Claim::Completed {
                fingerprint,
                payload,
                ..
            } => Some((fingerprint, payload)),
            Claim::InFlight { .. } | Claim::Claimed(_) | Claim::TakenOver { .. } => None,
        }
    }

    pub(super) fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        label: Option<&KeyLabel>,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), false, label)?
            .ok_or_else(|| StoreError::Backend("a claim always claims or reports".into()))
    }

    /// [`CheckpointStore::resume`](crate::CheckpointStore::resume): a claim that only takes an abandoned operation
    /// of the same request over.
    pub(super) fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), true, None)
    }

    /// A claim, or with `resume` a takeover only (`None`: nothing of this request to take over,
    /// nothing changed).
    fn claim_or_resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        resume: bool,
        label: Option<&KeyLabel>,
    ) -> Result<Option<Claim>, StoreError> {
        let now = self.now();
        // Replays and in-flight reports need only the shard's read lock.
        if let Some(found) = self.records.get(key).and_then(|r| r.report(now)) {
            return Ok(Some(found));
        }
        // Kept only by a record made or taken over below: not cloned for a replay (the first
        // clone of a label's bytes allocates their share count).
        let label = label.map(|label| label.as_bytes().clone());
        let lease_until = now.saturating_add(nanos(limits::clamp_lease(lease)));
        let kept_until = now
            .saturating_add(nanos(limits::clamp_ttl(ttl)))
            .max(lease_until);
        let in_flight = |token: FencingToken, lifetime: Option<u64>, carried: Carried| {
            let record = Record::InFlight {
                token: token.get(),
                lifetime: lifetime.unwrap_or(token.get()),
                fingerprint: *fingerprint,
                lease_until,
                kept_until,
                steps: carried.0,
                request: carried.1,
                label: carried.2,
                released: false,
                attempts: carried.3.saturating_add(1),
                since: now,
            };
            let claim = match lifetime {
                Some(lifetime) => Claim::TakenOver {
                    token,
                    lifetime: FencingToken::new(lifetime),
                },
                None => Claim::Claimed(token),
            };
            (record, claim)
        };
        let mut reserved = false;
        loop {
            match self.records.entry(*key) {
                Entry::Occupied(mut slot) => {
                    if reserved {
                        self.unreserve(1, RECORD_OVERHEAD);
                    }
                    if let Some(found) = slot.get().report(now) {
                        return Ok(Some(found));
                    }
                    // Expired or abandoned: reclaimed in place; the slot keeps its entry, the
                    // payload's bytes are freed. A takeover keeps the operation's checkpoints
                    // and request; a new lifetime starts without them.
                    let lifetime = slot.get().continued_by(fingerprint, now);
                    if resume && lifetime.is_none() {
                        return Ok(None);
                    }
                    if let Some(pinned) = slot.get().pinned_against(fingerprint, now) {
                        return Ok(Some(pinned));
                    }
                    let carried = match (lifetime, slot.get_mut()) {
                        (
                            Some(_),
                            Record::InFlight {
                                steps,
                                request,
                                label,
                                attempts,
                                ..
                            },
                        ) => (
                            std::mem::take(steps),
                            request.take(),
                            label.take(),
                            *attempts,
                        ),
                        _ => (Vec::new(), None, label.clone(), 0),
                    };
                    let freed = slot.get().held();
                    // A new lifetime's label is charged here (a takeover moves the old one):
                    // at most a label's length past the byte bound, like a small completion.
                    let added = if lifetime.is_none() {
                        carried.2.as_ref().map_or(0, Bytes::len)
                    } else {
                        0
                    };
                    let (record, claim) = in_flight(self.next_token(), lifetime, carried);
                    slot.insert(record);
                    self.bytes.fetch_add(added, Ordering::AcqRel);
                    self.bytes.fetch_sub(freed, Ordering::AcqRel);
                    return Ok(Some(claim));
                }
                Entry::Vacant(slot) => {
                    if resume {
                        if reserved {
                            self.unreserve(1, RECORD_OVERHEAD);
                        }
                        return Ok(None);
                    }
                    // A store with room takes the record's share here, under the shard's
                    // lock (atomics only), and the key is looked up once. A full one is swept
                    // outside the lock (a sweep takes every shard's), and the key looked up
                    // again: it may have been claimed meanwhile.
                    if reserved || self.try_reserve(1, RECORD_OVERHEAD).is_ok() {
                        let added = label.as_ref().map_or(0, Bytes::len);
                        let (record, claim) =
                            in_flight(self.next_token(), None, (Vec::new(), None, label, 0));
                        slot.insert(record);
                        self.bytes.fetch_add(added, Ordering::AcqRel);
                        return Ok(Some(claim));
                    }
                    drop(slot);
                    self.reserve(1, RECORD_OVERHEAD, now)?;
                    reserved = true;
                }
            }
        }
    }

    pub(super) fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = self.now();
        let extra = payload.len();
        // Reserve before locking the record; give it back if the token is rejected. A payload of
        // at most ALWAYS_FITS bytes is accepted even by a full store: that is how the runtime
        // records "done, result not retained" when the result itself did not fit, and refusing
        // it too would let the claim lapse and the work run again.
        match self.reserve(0, extra, now) {
            Ok(()) => {}
            Err(_) if extra <= ALWAYS_FITS => {
                self.bytes.fetch_add(extra, Ordering::AcqRel);
            }
            Err(full) => return Err(full),
        }
        let mut dropped = 0;
        let completed = match self.records.get_mut(key) {
            Some(mut record) => match &*record {
                Record::InFlight {
                    token: current,
                    lease_until,
                    released: false,
                    ..
                } if *current == token.get() && *lease_until > now => {
                    // The finished record drops the operation's checkpoints and request.
                    dropped = finish(
                        &mut record,
                        token.get(),
                        payload,
                        now.saturating_add(nanos(limits::clamp_ttl(ttl))),
                        now,
                    );
                    Completion::Written
                }
                // This owner's earlier completion landed: done already, nothing changes.
                Record::Completed {
                    token: current,
                    expires,
                    ..
                } if *current == token.get() && *expires > now => Completion::Repeated,
                _ => Completion::Rejected,
            },
            None => Completion::Rejected,
        };
        if completed == Completion::Written {
            self.bytes.fetch_sub(dropped, Ordering::AcqRel);
            self.notify_changed();
            Ok(())
        } else if completed == Completion::Repeated {
            self.unreserve(0, extra);
            Ok(())
        } else {
            self.unreserve(0, extra);
            Err(StoreError::TokenRejected)
        }
    }

    /// Ends the lease at once; the record is kept as an abandoned claim (see `is_kept`).
    pub(super) fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let now = self.now();
        let released = match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                released,
                since,
                ..
            }) if *current == token.get() && *lease_until > now && !*released => {
                *lease_until = now;
                *released = true;
                *since = now;
                true
            }
            _ => false,
        };
        if released {
            self.notify_changed();
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }

    pub(super) fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = self.now();
        match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                kept_until,
                released: false,
                ..
            }) if *current == token.get() && *lease_until > now => {
                *lease_until = now.saturating_add(nanos(limits::clamp_lease(lease)));
                *kept_until = (*kept_until).max(*lease_until);
                Ok(())
            }
            _ => Err(StoreError::TokenRejected),
        }
    }
}

/// What a takeover carries over from the abandoned record: its checkpoints, request, label
/// and count of claims.
type Carried = (Vec<u8>, Option<Bytes>, Option<Bytes>, u32);

/// Turns an in-flight `record` into a completed one under `token`, keeping its fingerprint,
/// label and count of claims; returns the bytes of checkpoints and request it dropped.
fn finish(record: &mut Record, token: u64, payload: Bytes, expires: u64, now: u64) -> usize {
    let Record::InFlight {
        fingerprint,
        steps,
        request,
        label,
        attempts,
        ..
    } = record
    else {
        return 0;
    };
    let dropped = steps.len() + request.as_ref().map_or(0, Bytes::len);
    *record = Record::Completed {
        token,
        fingerprint: *fingerprint,
        payload,
        expires,
        label: label.take(),
        attempts: *attempts,
        since: now,
    };
    dropped
}

impl Inner {
    /// Appends a checkpoint to the in-flight record held with `token` (see
    /// [`CheckpointStore::save_step`](crate::CheckpointStore::save_step)); its bytes count against the byte bound.
    pub(super) fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: &[u8],
    ) -> Result<(), StoreError> {
        let now = self.now();
        self.reserve(0, entry.len(), now)?;
        match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                steps,
                released: false,
                ..
            }) if *current == token.get() && *lease_until > now => {
                steps.extend_from_slice(entry);
                Ok(())
            }
            _ => {
                self.unreserve(0, entry.len());
                Err(StoreError::TokenRejected)
            }
        }
    }

    /// The checkpoints of the in-flight record held with `token`.
    pub(super) fn load_steps(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> Result<Bytes, StoreError> {
        let now = self.now();
        match self.records.get(key).as_deref() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                steps,
                released: false,
                ..
            }) if *current == token.get() && *lease_until > now => {
                Ok(Bytes::copy_from_slice(steps))
            }
            _ => Err(StoreError::TokenRejected),
        }
    }

    /// Keeps `request` on the in-flight record held with `token`, replacing the one before.
    pub(super) fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        let now = self.now();
        let size = request.len();
        self.reserve(0, size, now)?;
        match self.records.get_mut(key).as_deref_mut() {
            Some(Record::InFlight {
                token: current,
                lease_until,
                request: kept,
                released: false,
                ..
            }) if *current == token.get() && *lease_until > now => {
                let before = kept.replace(request).map_or(0, |r| r.len());
                self.unreserve(0, before);
                Ok(())
            }
            _ => {
                self.unreserve(0, size);
                Err(StoreError::TokenRejected)
            }
        }
    }

    /// Up to `limit` in-flight records with a request of `owner`, idle at least `idle`,
    /// longest first. A walk over every record: the memory store is bounded, and a completer
    /// asks rarely.
    pub(super) fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&crate::RequestOwner>,
    ) -> Vec<crate::steps::Abandoned> {
        let now = self.now();
        let idle = nanos(idle);
        let mut found: Vec<(u64, crate::steps::Abandoned)> = Vec::new();
        for entry in &self.records {
            if let Record::InFlight {
                fingerprint,
                lease_until,
                kept_until,
                request: Some(request),
                ..
            } = entry.value()
                && lease_until.saturating_add(idle) <= now
                && *kept_until > now
                && crate::RequestOwner::of(request).as_ref() == owner
            {
                found.push((
                    *lease_until,
                    crate::steps::Abandoned {
                        key: *entry.key(),
                        fingerprint: *fingerprint,
                        request: request.clone(),
                        idle: Duration::from_nanos(now - lease_until),
                    },
                ));
            }
        }
        found.sort_by_key(|(until, _)| *until);
        found.into_iter().take(limit).map(|(_, a)| a).collect()
    }
}

impl Inner {
    /// The session gate (see [`SessionStore::open_session`](crate::SessionStore::open_session)): one step on
    /// the session's own record under its shard's lock; then the records its mark now covers
    /// are dropped and the ones above it kept as long as the session. Those follow the step
    /// rather than share it (a shard lock cannot be held across shards); the mark is raised
    /// first, so a claim that still lands on a covered record is refused by the runtime, which
    /// reads the mark ([`session_mark`](Self::session_mark)) before it runs anything, and the
    /// record goes with the sweep.
    pub(super) fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        if request.seq > MAX_SEQ || request.ack > MAX_SEQ || request.window > MAX_SESSION_WINDOW {
            return Err(StoreError::Backend(
                format!("session request out of range: {request:?}").into(),
            ));
        }
        let now = self.now();
        let until = now.saturating_add(nanos(limits::clamp_ttl(request.idle)));
        let key = session.record_key();
        let live = |record: &Record| match record {
            Record::Session { state, expires } if *expires > now => Some(*state),
            _ => None,
        };
        let mut reserved = false;
        let step = loop {
            match self.records.entry(key) {
                Entry::Occupied(mut slot) => {
                    if reserved {
                        self.unreserve(1, RECORD_OVERHEAD);
                    }
                    let state = live(slot.get());
                    let epoch = if state.is_none() {
                        self.next_token().get()
                    } else {
                        0
                    };
                    let step = SessionState::gate(state, request, epoch);
                    if let Some(state) = step.state {
                        slot.insert(Record::Session {
                            state,
                            expires: until,
                        });
                    }
                    break step;
                }
                Entry::Vacant(slot) => {
                    let step = SessionState::gate(None, request, self.next_token().get());
                    let Some(state) = step.state else {
                        if reserved {
                            self.unreserve(1, RECORD_OVERHEAD);
                        }
                        break step;
                    };
                    // The record's share taken under the shard's lock when the store has
                    // room; a full store is swept outside it and the key looked up again (as
                    // a claim does).
                    if reserved || self.try_reserve(1, RECORD_OVERHEAD).is_ok() {
                        slot.insert(Record::Session {
                            state,
                            expires: until,
                        });
                        break step;
                    }
                    drop(slot);
                    self.reserve(1, RECORD_OVERHEAD, now)?;
                    reserved = true;
                }
            }
        };
        if let Some(state) = step.state {
            let mut dropped = false;
            for seq in step.dropped.clone() {
                if let Some((_, record)) = self.records.remove(&session.seq_key(state.epoch, seq)) {
                    self.unreserve(1, record.cost());
                    dropped = true;
                }
            }
            for seq in step.kept.clone() {
                if let Some(mut record) = self.records.get_mut(&session.seq_key(state.epoch, seq)) {
                    match &mut *record {
                        Record::InFlight { kept_until, .. } => {
                            *kept_until = (*kept_until).max(until)
                        }
                        Record::Completed { expires, .. } if *expires > now => {
                            *expires = (*expires).max(until);
                        }
                        _ => {}
                    }
                }
            }
            if dropped {
                self.notify_changed();
            }
        }
        Ok(step.gate)
    }
}

impl Inner {
    /// [`SessionStore::claim_in_session`](crate::SessionStore::claim_in_session): the gate, the
    /// claim and the check of the mark, as the default makes them, in one call.
    pub(super) fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &KeyLabel,
    ) -> Result<crate::SessionClaim, StoreError> {
        use crate::SessionClaim;
        let epoch = match self.open_session(session, request)? {
            SessionGate::Open { epoch } => epoch,
            refused => return Ok(SessionClaim::Refused(refused)),
        };
        let key = session.seq_key(epoch, request.seq);
        let claim = self.claim(&key, fingerprint, lease, request.idle, Some(label))?;
        let token = match claim {
            Claim::Claimed(token) | Claim::TakenOver { token, .. } => token,
            _ => return Ok(SessionClaim::Admitted { epoch, claim }),
        };
        // The gate drops answers after it leaves the session's entry: a later request's `ack`
        // may have covered this number between the gate and the claim.
        let refused = match self.session_mark(session) {
            Some(mark) if mark.epoch == epoch && mark.ack < request.seq => {
                return Ok(SessionClaim::Admitted { epoch, claim });
            }
            Some(mark) if mark.epoch == epoch => SessionGate::Acknowledged { ack: mark.ack },
            _ => SessionGate::Expired,
        };
        // A release refused (the lease lapsed already) leaves the record to the next claim.
        let _ = self.release(&key, token);
        Ok(SessionClaim::Refused(refused))
    }

    /// The live state of `session`, if any.
    pub(super) fn session_mark(&self, session: &SessionKey) -> Option<crate::SessionMark> {
        let now = self.now();
        match self.records.get(&session.record_key()).as_deref() {
            Some(Record::Session { state, expires }) if *expires > now => {
                Some(crate::SessionMark {
                    epoch: state.epoch,
                    ack: state.ack,
                })
            }
            _ => None,
        }
    }
}

/// What a completion found.
#[derive(PartialEq, Eq)]
enum Completion {
    Written,
    /// The same owner's completion had landed already.
    Repeated,
    Rejected,
}

pub(super) struct Waiting<'a>(pub(super) &'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Record {
    /// What an operator sees of this record at `now`, or `None` when it is not live (expired,
    /// or a session's own record).
    fn info(&self, key: &StorageKey, now: u64) -> Option<RecordInfo> {
        let left = |until: u64| Duration::from_nanos(until.saturating_sub(now));
        let label = |label: &Option<Bytes>| label.clone().map(KeyLabel::from_bytes);
        match self {
            Record::InFlight {
                token,
                fingerprint,
                lease_until,
                kept_until,
                steps,
                request,
                label: kept,
                released,
                attempts,
                since,
                ..
            } if *lease_until > now || *kept_until > now => Some(RecordInfo {
                key: *key,
                state: if *released {
                    RecordState::Released
                } else {
                    RecordState::InFlight
                },
                token: FencingToken::new(*token),
                fingerprint: *fingerprint,
                label: label(kept),
                lease_left: left(*lease_until),
                expires_in: left((*kept_until).max(*lease_until)),
                // A live lease: since the claim; abandoned (lapsed or released): since the
                // lease ended.
                age: Duration::from_nanos(if *lease_until > now {
                    now.saturating_sub(*since)
                } else {
                    now.saturating_sub(*lease_until)
                }),
                attempts: *attempts,
                steps: Bytes::copy_from_slice(steps),
                request: request.clone(),
                payload: None,
            }),
            Record::Completed {
                token,
                fingerprint,
                payload,
                expires,
                label: kept,
                attempts,
                since,
            } if *expires > now => Some(RecordInfo {
                key: *key,
                state: RecordState::Completed,
                token: FencingToken::new(*token),
                fingerprint: *fingerprint,
                label: label(kept),
                lease_left: Duration::ZERO,
                expires_in: left(*expires),
                age: Duration::from_nanos(now.saturating_sub(*since)),
                attempts: *attempts,
                steps: Bytes::new(),
                request: None,
                payload: Some(payload.clone()),
            }),
            _ => None,
        }
    }
}

impl Inner {
    pub(super) fn inspect(&self, key: &StorageKey) -> Option<RecordInfo> {
        let now = self.now();
        self.records.get(key).and_then(|r| r.info(key, now))
    }

    /// A walk over every record (the memory store is bounded, and an operator asks rarely),
    /// oldest first; the cursor is the last record's age stamp and key.
    pub(super) fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let now = self.now();
        let after = match &query.after {
            None => None,
            Some(cursor) => Some(parse_cursor(&cursor.0)?),
        };
        let mut found: Vec<(u64, RecordInfo)> = self
            .records
            .iter()
            .filter_map(|entry| entry.value().info(entry.key(), now))
            .filter(|info| query.state.matches(info) && info.age >= query.older_than)
            .map(|info| (now.saturating_sub(nanos(info.age)), info))
            .filter(|(stamp, info)| {
                after
                    .as_ref()
                    .is_none_or(|(s, k)| (*stamp, info.key.to_hex()) > (*s, k.clone()))
            })
            .collect();
        found.sort_by_cached_key(|(stamp, info)| (*stamp, info.key.to_hex()));
        let limit = query.limit.max(1);
        let more = found.len() > limit;
        found.truncate(limit);
        let next = if more {
            found
                .last()
                .map(|(stamp, info)| Cursor(format!("{stamp}:{}", info.key.to_hex())))
        } else {
            None
        };
        Ok(Page {
            records: found.into_iter().map(|(_, info)| info).collect(),
            next,
        })
    }

    pub(super) fn session_state(&self, session: &SessionKey) -> Option<SessionState> {
        let now = self.now();
        match self.records.get(&session.record_key()).as_deref() {
            Some(Record::Session { state, expires }) if *expires > now => Some(*state),
            _ => None,
        }
    }

    /// One repair, its checks and its change under the record's shard lock.
    pub(super) fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let now = self.now();
        // A give-up's payload is reserved before the shard lock (a full store sweeps every
        // shard), and given back if the repair is refused.
        let extra = match repair {
            Repair::GiveUp { payload, .. } => payload.len(),
            _ => 0,
        };
        if extra > 0 {
            match self.reserve(0, extra, now) {
                Ok(()) => {}
                Err(_) if extra <= ALWAYS_FITS * 16 => {
                    self.bytes.fetch_add(extra, Ordering::AcqRel);
                }
                Err(full) => return Err(full),
            }
        }
        let refused = |why: Refusal| {
            self.unreserve(0, extra);
            Ok(Repaired::Refused(why))
        };
        let Entry::Occupied(mut slot) = self.records.entry(*key) else {
            return refused(Refusal::Absent);
        };
        let Some(info) = slot.get().info(key, now) else {
            return refused(Refusal::Absent);
        };
        if info.token != token {
            return refused(Refusal::TokenMoved { now: info.token });
        }
        if !info.lease_left.is_zero() && !force {
            return refused(Refusal::LeaseLive {
                left: info.lease_left,
            });
        }
        match repair {
            Repair::Forget => {
                let record = slot.remove();
                self.unreserve(1, record.cost());
            }
            Repair::Release => match slot.get_mut() {
                Record::InFlight {
                    lease_until,
                    released,
                    since,
                    ..
                } => {
                    if !*released {
                        *lease_until = (*lease_until).min(now);
                        *released = true;
                        *since = now;
                    }
                }
                _ => return refused(Refusal::Completed),
            },
            Repair::GiveUp { payload, ttl } => {
                if info.state == RecordState::Completed {
                    return refused(Refusal::Completed);
                }
                let expires = now.saturating_add(nanos(limits::clamp_ttl(*ttl)));
                let token = self.next_token().get();
                let dropped = finish(slot.get_mut(), token, payload.clone(), expires, now);
                self.bytes.fetch_sub(dropped, Ordering::AcqRel);
            }
        }
        self.notify_changed();
        Ok(Repaired::Done)
    }
}

/// A listing cursor: `stamp:hex key`.
fn parse_cursor(cursor: &str) -> Result<(u64, String), StoreError> {
    cursor
        .split_once(':')
        .and_then(|(stamp, key)| Some((stamp.parse().ok()?, key.to_owned())))
        .ok_or_else(|| StoreError::Backend(format!("not a listing cursor: {cursor:?}").into()))
}
