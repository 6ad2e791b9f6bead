//! Looking inside a store, and repairing what is stuck: the [`InspectStore`] capability.
//!
//! Records are kept under a digest of namespace, scope and key ([`StorageKey`]), so a key a
//! customer quotes is found by deriving that digest again ([`StorageKey::derive`]) and asking
//! [`InspectStore::inspect`]. A record also keeps a [`KeyLabel`]: the key as the client sent
//! it (its first [`KeyLabel::MAX_KEY_LEN`] bytes) and which scope parts were set, so that a
//! record found by [`InspectStore::list`] can be recognised; a runtime told not to keep keys in
//! clear ([`IdempotencyBuilder::keys_in_clear`](crate::IdempotencyBuilder::keys_in_clear))
//! keeps only which scope parts were set, and an operator sees the digest.
//!
//! # States
//!
//! | [`RecordState`] | [`RecordInfo::abandoned`] | what it is |
//! |---|---|---|
//! | `InFlight` | `false` | an owner holds a live lease: its work is running |
//! | `InFlight` | `true` | the owner's lease ended without an answer (its process died, or it hung): the same request's retry, or a completer, takes it over and resumes from its steps |
//! | `Released` | `true` | the owner released it (its work failed transiently, or an operator released it): the same request's retry runs again, from its steps |
//! | `Completed` | `false` | finished: retries replay its answer until it expires |
//!
//! A key with no live record is *absent*: `inspect` answers `None`.
//!
//! # Repairs
//!
//! Every [`Repair`] names the token the operator saw ([`RecordInfo::token`]) and is refused
//! if the record has another one since (someone took it over, or it finished), and refused
//! while the record's lease is live unless forced: a repair never races a live owner by
//! accident. A forced repair ends the owner's claim: its completion is then refused, as for an
//! owner whose lease lapsed. [`repair`] logs each with the reason the operator gave.

use std::fmt;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};

use crate::session::SessionState;
use crate::steps::Checkpoints;
use crate::{FencingToken, Fingerprint, Key, Scope, SessionKey, StorageKey, Store, StoreError};

/// What a record keeps so that an operator can recognise it: the key as the client sent it
/// (up to [`MAX_KEY_LEN`](Self::MAX_KEY_LEN) bytes), and which scope parts were set. Stored
/// as opaque bytes ([`as_bytes`](Self::as_bytes)); a store keeps them with the record and
/// hands them back as they were.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeyLabel(Bytes);

const LABEL_MAGIC: u8 = b'L';
const TENANT: u8 = 1;
const PRINCIPAL: u8 = 2;
const OPERATION: u8 = 4;
const TRUNCATED: u8 = 8;
const IN_CLEAR: u8 = 16;
const SESSION: u8 = 32;

impl KeyLabel {
    /// The longest key prefix a label keeps, in bytes: a longer key is kept cut to this and
    /// marked [`truncated`](Self::truncated).
    pub const MAX_KEY_LEN: usize = 128;

    /// The label of `key` in `scope`; with `in_clear` false, the key itself is not kept.
    pub fn new(key: &Key, scope: &Scope, in_clear: bool) -> Self {
        Self::build(key, scope, in_clear, false)
    }

    /// The label of a client session's request: `session` is the session's id.
    pub fn of_session(session: &Key, scope: &Scope, in_clear: bool) -> Self {
        Self::build(session, scope, in_clear, true)
    }

    fn build(key: &Key, scope: &Scope, in_clear: bool, session: bool) -> Self {
        let (tenant, principal, operation) = scope.parts_set();
        let mut flags = 0;
        for (set, bit) in [
            (tenant, TENANT),
            (principal, PRINCIPAL),
            (operation, OPERATION),
        ] {
            if set {
                flags |= bit;
            }
        }
        if session {
            flags |= SESSION;
        }
        let text = key.as_str().as_bytes();
        let kept = if in_clear {
            flags |= IN_CLEAR;
            if text.len() > Self::MAX_KEY_LEN {
                flags |= TRUNCATED;
            }
            // Keys are ASCII: any cut is on a character boundary.
            &text[..text.len().min(Self::MAX_KEY_LEN)]
        } else {
            &[][..]
        };
        let mut out = BytesMut::with_capacity(2 + kept.len());
        out.put_u8(LABEL_MAGIC);
        out.put_u8(flags);
        out.put_slice(kept);
        KeyLabel(out.freeze())
    }

    /// A label as a store kept it. Never fails: bytes that are not a label read as one that
    /// keeps nothing ([`is_valid`](Self::is_valid) says so).
    pub fn from_bytes(bytes: Bytes) -> Self {
        KeyLabel(bytes)
    }

    /// The bytes a store keeps.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }

    /// Whether these bytes are a label this crate wrote.
    pub fn is_valid(&self) -> bool {
        self.0.len() >= 2
            && self.0[0] == LABEL_MAGIC
            && self.0[1] < 64
            && self.0[2..].iter().all(|b| (0x20..=0x7e).contains(b))
    }

    fn flags(&self) -> u8 {
        if self.is_valid() { self.0[1] } else { 0 }
    }

    /// The key as the client sent it (its first [`MAX_KEY_LEN`](Self::MAX_KEY_LEN) bytes), or
    /// `None` when the runtime did not keep keys in clear (or the bytes are not a label).
    pub fn key(&self) -> Option<&str> {
        if self.flags() & IN_CLEAR == 0 {
            return None;
        }
        std::str::from_utf8(&self.0[2..]).ok()
    }

    /// Whether the key was longer than what is kept.
    pub fn truncated(&self) -> bool {
        self.flags() & TRUNCATED != 0
    }

    /// Whether the record is a client session's request (the key is then the session's id).
    pub fn in_session(&self) -> bool {
        self.flags() & SESSION != 0
    }

    /// The scope parts that were set: `tenant`, `principal`, `operation`, in that order.
    pub fn scope_parts(&self) -> Vec<&'static str> {
        let flags = self.flags();
        [
            (TENANT, "tenant"),
            (PRINCIPAL, "principal"),
            (OPERATION, "operation"),
        ]
        .into_iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| name)
        .collect()
    }
}

/// The key is the client's and may be sensitive: `Debug` shows its length only.
impl fmt::Debug for KeyLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyLabel")
            .field("key_len", &self.key().map(str::len))
            .field("scope_parts", &self.scope_parts())
            .finish()
    }
}

/// A record's state, as [`InspectStore`] reports it (see the [module](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// Claimed, not finished: its owner's lease is live, or ended without an answer.
    InFlight,
    /// Released by its owner (or an operator): not finished, nobody holds it.
    Released,
    /// Finished: its answer is replayed.
    Completed,
}

impl RecordState {
    /// `in_flight`, `released` or `completed`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InFlight => "in_flight",
            RecordState::Released => "released",
            RecordState::Completed => "completed",
        }
    }
}

/// One record, as a store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordInfo {
    /// Where it is kept.
    pub key: StorageKey,
    /// Its state.
    pub state: RecordState,
    /// Its current token: what a [`Repair`] names.
    pub token: FencingToken,
    /// The fingerprint of the request it belongs to.
    pub fingerprint: Fingerprint,
    /// What it keeps of its key (`None`: written by a runtime or store that kept none).
    pub label: Option<KeyLabel>,
    /// Time left on its owner's lease (zero when it ended, or it is not in flight).
    pub lease_left: Duration,
    /// Time left before the record expires (an abandoned one: before it is no longer kept).
    pub expires_in: Duration,
    /// How long it has been in its state: since it was claimed or taken over (in flight with a
    /// live lease), since its lease ended (abandoned), since it was released, or since it
    /// completed.
    pub age: Duration,
    /// How many claims this operation has had: 1 for the claim that began it, one more for
    /// each takeover (a retry after a crash, a lapsed lease or a release; a completer's run).
    /// 0 when the store did not count them (a record written before it did).
    pub attempts: u32,
    /// Its checkpoints, as the runtime encoded them (empty when none or finished).
    pub steps: Bytes,
    /// The request kept on it for a completer, as its keeper encoded it.
    pub request: Option<Bytes>,
    /// A completed record's payload, byte for byte as completed.
    pub payload: Option<Bytes>,
}

impl RecordInfo {
    /// Whether nobody holds it and it is not finished: its lease ended, or it was released.
    pub fn abandoned(&self) -> bool {
        self.state != RecordState::Completed && self.lease_left.is_zero()
    }

    /// The names of the steps saved on it, in the order they were saved (the runtime's own
    /// entries, named `~…`, left out), or why its checkpoints cannot be read.
    pub fn step_names(&self) -> Result<Vec<String>, StoreError> {
        Ok(Checkpoints::decode(self.steps.clone())?
            .steps()
            .filter(|(name, _)| !name.starts_with('~'))
            .map(|(name, _)| name.to_owned())
            .collect())
    }
}

/// Which records [`InspectStore::list`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Listed {
    /// In flight with a live lease: work running now.
    InFlight,
    /// Not finished and held by nobody: in flight with an ended lease, or released.
    Abandoned,
    /// Released (a subset of `Abandoned`).
    Released,
    /// Finished.
    Completed,
}

impl Listed {
    /// Whether `record` is one of these.
    pub fn matches(self, record: &RecordInfo) -> bool {
        match self {
            Listed::InFlight => record.state == RecordState::InFlight && !record.abandoned(),
            Listed::Abandoned => record.abandoned(),
            Listed::Released => record.state == RecordState::Released,
            Listed::Completed => record.state == RecordState::Completed,
        }
    }
}

impl std::str::FromStr for Listed {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "in_flight" => Ok(Listed::InFlight),
            "abandoned" => Ok(Listed::Abandoned),
            "released" => Ok(Listed::Released),
            "completed" => Ok(Listed::Completed),
            other => Err(format!(
                "unknown state {other:?}: in_flight, abandoned, completed or released"
            )),
        }
    }
}

/// Where a listing goes on: opaque, handed back by one [`Page`] and given to the next
/// [`ListQuery`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Cursor(pub String);

/// What [`InspectStore::list`] is asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    /// Which records.
    pub state: Listed,
    /// Only records at least this [`age`](RecordInfo::age).
    pub older_than: Duration,
    /// At most this many in the page (a store may return fewer, even with more to come: go on
    /// while [`Page::next`] is set).
    pub limit: usize,
    /// Where the previous page ended (`None`: from the start).
    pub after: Option<Cursor>,
}

impl ListQuery {
    /// The first page of `state`'s records, at most 100.
    pub fn new(state: Listed) -> Self {
        ListQuery {
            state,
            older_than: Duration::ZERO,
            limit: 100,
            after: None,
        }
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    /// The records: oldest first where the store keeps an order (PostgreSQL, SQLite, memory);
    /// in the order a scan meets them on Redis.
    pub records: Vec<RecordInfo>,
    /// Where to go on, or `None` when the listing is done.
    pub next: Option<Cursor>,
}

/// A repair of one record ([`InspectStore::repair`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// Ends the claim: the record is kept as released, with its steps and kept request, and
    /// the same request's retry (or a completer) runs the operation again from its steps.
    Release,
    /// Records `payload` as the operation's answer (an `operation_failed` the caller encoded
    /// as its runtime would, see `idempotent-tower`), kept for `ttl`: retries replay it and
    /// nothing more runs under the key. The record gets a new token.
    GiveUp {
        /// The payload to complete with.
        payload: Bytes,
        /// How long it is kept.
        ttl: Duration,
    },
    /// Deletes the record, whatever its state: the key may then run again as a new
    /// operation (a completed payment's key charges again).
    Forget,
}

impl Repair {
    /// `release`, `give_up` or `forget`.
    pub fn name(&self) -> &'static str {
        match self {
            Repair::Release => "release",
            Repair::GiveUp { .. } => "give_up",
            Repair::Forget => "forget",
        }
    }
}

/// What a repair did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repaired {
    /// Done.
    Done,
    /// Refused, nothing changed.
    Refused(Refusal),
}

/// Why a repair was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The key has no live record.
    Absent,
    /// The record's token is not the one named: it changed hands, or finished, since.
    TokenMoved {
        /// Its token now.
        now: FencingToken,
    },
    /// Its owner's lease is live (repeat with `force` to end it).
    LeaseLive {
        /// Time left on the lease.
        left: Duration,
    },
    /// The repair does not apply to a finished record (release, give up).
    Completed,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Absent => f.write_str("the key has no record"),
            Refusal::TokenMoved { now } => write!(
                f,
                "the record changed since it was read (its token is now {}): inspect it again",
                now.get()
            ),
            Refusal::LeaseLive { left } => write!(
                f,
                "its owner holds a live lease for {:.1}s more: wait for it, or force the repair (the owner's work then cannot record its answer)",
                left.as_secs_f64()
            ),
            Refusal::Completed => f.write_str("the record is completed: only forget applies"),
        }
    }
}

/// A store an operator can look inside and repair. Implemented by the memory, Redis,
/// PostgreSQL and SQLite stores; the conformance suite
/// ([`conformance::inspect`](crate::conformance)) checks each rule.
///
/// A store that implements it keeps the [`KeyLabel`] [`Store::claim_labelled`] is given.
pub trait InspectStore: Store {
    /// The record kept under `key`, or `None` when there is none that is live (expired
    /// records are absent, even before they are swept).
    fn inspect(
        &self,
        key: &StorageKey,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// One page of the records `query` asks for. A store with an index on state and age
    /// (PostgreSQL, SQLite) reads only the page's rows; the memory store walks its map; Redis
    /// scans its keyspace a slice per page (`SCAN`), so a listing costs a pass over the keys
    /// spread over its pages.
    fn list(&self, query: &ListQuery) -> impl Future<Output = Result<Page, StoreError>> + Send;

    /// Applies `repair` to `key`'s record if it still holds `token`; refused while its lease
    /// is live unless `force`. Atomic: the checks and the change are one step on the store.
    ///
    /// - [`Repair::Release`]: an in-flight record becomes released (its lease ends now, if it
    ///   had not); a released one is left as it is (done).
    /// - [`Repair::GiveUp`]: an in-flight or released record becomes completed with the
    ///   payload, under a new token greater than every token before.
    /// - [`Repair::Forget`]: the record is deleted, whatever its state.
    fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> impl Future<Output = Result<Repaired, StoreError>> + Send;

    /// A client session's state (its epoch, acknowledged mark and highest admitted number),
    /// or `None` when it is unknown or expired (or the store keeps no sessions).
    fn session_state(
        &self,
        session: &SessionKey,
    ) -> impl Future<Output = Result<Option<SessionState>, StoreError>> + Send;
}

/// What an operator reads of a client session ([`session`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Its incarnation.
    pub epoch: u64,
    /// Its acknowledged mark: every number up to it is done and forgotten.
    pub mark: u64,
    /// The highest number admitted.
    pub high: u64,
    /// The numbers above the mark whose records are kept (answers held for replay, or still in
    /// flight), in order.
    pub held: Vec<u64>,
}

/// `session`'s state and the numbers whose records it holds, or `None` when it is unknown or
/// expired: one read of its state, then one lookup per number between its mark and its
/// highest (at most the session window).
pub async fn session<S: InspectStore + ?Sized>(
    store: &S,
    session: &SessionKey,
) -> Result<Option<SessionInfo>, StoreError> {
    let Some(state) = store.session_state(session).await? else {
        return Ok(None);
    };
    let mut held = Vec::new();
    // Bounded: a damaged state must not make this loop for long.
    let last = state
        .high
        .min(state.ack.saturating_add(crate::session::MAX_SESSION_WINDOW));
    for seq in state.ack.saturating_add(1)..=last {
        if store
            .inspect(&session.seq_key(state.epoch, seq))
            .await?
            .is_some()
        {
            held.push(seq);
        }
    }
    Ok(Some(SessionInfo {
        epoch: state.epoch,
        mark: state.ack,
        high: state.high,
        held,
    }))
}

/// Applies `repair` ([`InspectStore::repair`]) and logs it, done or refused, at `WARN` with
/// who asked and why (`operator`, `reason`): repairs change what clients see.
pub async fn repair<S: InspectStore + ?Sized>(
    store: &S,
    key: &StorageKey,
    token: FencingToken,
    repair: &Repair,
    force: bool,
    (operator, reason): (&str, &str),
) -> Result<Repaired, StoreError> {
    let result = store.repair(key, token, repair, force).await;
    match &result {
        Ok(Repaired::Done) => tracing::warn!(
            storage_key = %key,
            token = token.get(),
            repair = repair.name(),
            force,
            operator,
            reason,
            "record repaired"
        ),
        Ok(Repaired::Refused(why)) => tracing::warn!(
            storage_key = %key,
            token = token.get(),
            repair = repair.name(),
            force,
            operator,
            reason,
            refused = %why,
            "record repair refused"
        ),
        Err(error) => tracing::warn!(
            storage_key = %key,
            repair = repair.name(),
            operator,
            reason,
            error = error as &dyn std::error::Error,
            "record repair failed"
        ),
    }
    result
}

impl<S: InspectStore> InspectStore for std::sync::Arc<S> {
    fn inspect(
        &self,
        key: &StorageKey,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send {
        S::inspect(self, key)
    }
    fn list(&self, query: &ListQuery) -> impl Future<Output = Result<Page, StoreError>> + Send {
        S::list(self, query)
    }
    fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> impl Future<Output = Result<Repaired, StoreError>> + Send {
        S::repair(self, key, token, repair, force)
    }
    fn session_state(
        &self,
        session: &SessionKey,
    ) -> impl Future<Output = Result<Option<SessionState>, StoreError>> + Send {
        S::session_state(self, session)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> Key {
        Key::new(text).expect("a valid key")
    }

    #[test]
    fn a_label_keeps_the_key_and_the_scope_parts_set() {
        let label = KeyLabel::new(
            &key("order 17"),
            &Scope::new().tenant("acme").operation("charge"),
            true,
        );
        assert!(label.is_valid());
        assert_eq!(label.key(), Some("order 17"));
        assert!(!label.truncated() && !label.in_session());
        assert_eq!(label.scope_parts(), vec!["tenant", "operation"]);
        let session = KeyLabel::of_session(&key("device-7"), &Scope::new(), true);
        assert!(session.in_session());
        assert!(session.scope_parts().is_empty());
    }

    #[test]
    fn a_long_key_is_cut_and_marked() {
        let long = "k".repeat(crate::MAX_KEY_LEN);
        let label = KeyLabel::new(&key(&long), &Scope::new(), true);
        assert_eq!(label.key().map(str::len), Some(KeyLabel::MAX_KEY_LEN));
        assert!(label.truncated());
    }

    #[test]
    fn without_keys_in_clear_only_the_scope_parts_are_kept() {
        let label = KeyLabel::new(&key("secret-key"), &Scope::new().principal("p"), false);
        assert_eq!(label.key(), None);
        assert_eq!(label.scope_parts(), vec!["principal"]);
        assert!(!label.as_bytes().windows(6).any(|w| w == b"secret"));
        assert!(!format!("{label:?}").contains("secret"));
    }

    #[test]
    fn bytes_that_are_not_a_label_read_as_one_that_keeps_nothing() {
        for bytes in [
            &b""[..],
            b"L",
            b"X\x10key",
            b"L\xffkey",
            b"L\x10k\x00y",
            b"L\x10\xc3\xa9",
        ] {
            let label = KeyLabel::from_bytes(Bytes::copy_from_slice(bytes));
            assert!(!label.is_valid(), "{bytes:?}");
            assert_eq!(label.key(), None);
            assert!(label.scope_parts().is_empty());
        }
    }

    #[test]
    fn listed_states_parse_and_refuse_others() {
        assert_eq!("abandoned".parse::<Listed>(), Ok(Listed::Abandoned));
        assert_eq!("in_flight".parse::<Listed>(), Ok(Listed::InFlight));
        assert!("stuck".parse::<Listed>().unwrap_err().contains("in_flight"));
    }
}
