#![doc = include_str!("../docs/session.md")]

use std::time::Duration;

use crate::{Key, Scope, StorageKey};

/// Default window: how far past its acknowledged mark a session may number requests.
pub const DEFAULT_SESSION_WINDOW: u64 = 64;
/// The largest window a runtime accepts.
pub const MAX_SESSION_WINDOW: u64 = 4096;
/// Default idle time after which a session nobody sends to is forgotten: 24 hours.
pub const DEFAULT_SESSION_IDLE: Duration = Duration::from_secs(24 * 60 * 60);
/// The largest sequence number or `ack`: the largest RFC 8941 integer (15 digits), which every
/// store keeps exactly (a Lua number, a PostgreSQL `bigint`).
pub const MAX_SEQ: u64 = 999_999_999_999_999;

/// Why a sequence number or `ack` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// `seq` is 0 or above [`MAX_SEQ`].
    #[error("session sequence number {0} is out of range; it must be 1 to {MAX_SEQ}")]
    SeqOutOfRange(u64),
    /// `ack` is above [`MAX_SEQ`].
    #[error("session ack {0} is out of range; it must be 0 to {MAX_SEQ}")]
    AckOutOfRange(u64),
}

/// A call's place in its client's session: its sequence number and the client's `ack`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InSession {
    seq: u64,
    ack: u64,
}

impl InSession {
    /// `seq` (1 to [`MAX_SEQ`]) with `ack` (0 to [`MAX_SEQ`]).
    pub fn new(seq: u64, ack: u64) -> Result<Self, SessionError> {
        if !(1..=MAX_SEQ).contains(&seq) {
            return Err(SessionError::SeqOutOfRange(seq));
        }
        if ack > MAX_SEQ {
            return Err(SessionError::AckOutOfRange(ack));
        }
        Ok(InSession { seq, ack })
    }

    /// The request's sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The client's acknowledged mark: it holds every answer numbered this or lower.
    pub fn ack(&self) -> u64 {
        self.ack
    }
}

/// The fixed-size name of one client session in one scope and namespace: a blake3 digest,
/// separate from every idempotency key's (a key cannot hold the byte that begins a session's
/// derivation input). Stores get it in [`SessionStore::open_session`](crate::SessionStore::open_session).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    /// Derives the session key of session `id` in `scope` under `namespace`; stable across
    /// processes, platforms and releases.
    pub fn derive(namespace: &[u8], scope: &Scope, id: &Key) -> Self {
        let mut input = Vec::with_capacity(9 + id.as_str().len());
        input.extend_from_slice(b"\0session\0");
        input.extend_from_slice(id.as_str().as_bytes());
        SessionKey(*StorageKey::derive_raw(namespace, scope, &input).as_bytes())
    }

    /// Wraps raw digest bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        SessionKey(bytes)
    }

    /// The digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The storage key of the session's own record (its mark and epoch), for a store that keeps
    /// it among its records.
    pub const fn record_key(&self) -> StorageKey {
        StorageKey::session(self.0)
    }

    /// The storage key of request `seq`'s record in incarnation `epoch`.
    pub const fn seq_key(&self, epoch: u64, seq: u64) -> StorageKey {
        StorageKey::seq(self.0, epoch, seq)
    }
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionKey({})", StorageKey::from_bytes(self.0))
    }
}

/// What the runtime asks a store's session gate about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionRequest {
    /// The request's sequence number, 1 to [`MAX_SEQ`].
    pub seq: u64,
    /// The client's acknowledged mark, 0 to [`MAX_SEQ`].
    pub ack: u64,
    /// How far past the mark a request may be numbered, 1 to [`MAX_SESSION_WINDOW`].
    pub window: u64,
    /// How long the session and its answers live after this request.
    pub idle: Duration,
}

impl SessionRequest {
    /// A request numbered `seq` acknowledging `ack`, in a session with `window` and `idle`.
    pub const fn new(seq: u64, ack: u64, window: u64, idle: Duration) -> Self {
        SessionRequest {
            seq,
            ack,
            window,
            idle,
        }
    }
}

/// A live session's state, as [`SessionStore::session_mark`](crate::SessionStore::session_mark) reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionMark {
    /// The session's incarnation (see [`SessionGate::Open`]).
    pub epoch: u64,
    /// The highest acknowledged mark the session has seen.
    pub ack: u64,
}

/// What a store's session gate decided about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionGate {
    /// Admitted: claim the request's record, [`SessionKey::seq_key`]`(epoch, seq)`.
    Open {
        /// The session's incarnation: a number the store chose when it started the session,
        /// different for every start of the same session id.
        epoch: u64,
    },
    /// `seq` is at or below the acknowledged mark `ack`: its answer was dropped at the
    /// client's word.
    Acknowledged {
        /// The session's acknowledged mark.
        ack: u64,
    },
    /// `seq` is beyond the acknowledged mark `ack` plus the window.
    WindowFull {
        /// The session's acknowledged mark.
        ack: u64,
    },
    /// The store knows no such session, and the request says the client holds answers
    /// (`ack > 0`): the session existed and was forgotten after its idle time.
    Expired,
}

/// A session's state as a store keeps it, and the one statement of the gate's rules every
/// built-in store follows (the Redis and PostgreSQL stores spell the same steps in Lua and
/// SQL; the conformance suite checks all of them). A store that decides in Rust, under its own
/// lock or transaction, calls [`SessionState::gate`] rather than writing the rules again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionState {
    /// The session's incarnation: a number from the store's token sequence, taken when it
    /// started.
    pub epoch: u64,
    /// The highest acknowledged mark seen.
    pub ack: u64,
    /// The highest sequence number admitted.
    pub high: u64,
}

/// What the gate does to a session for one request ([`SessionState::gate`]): the answer, and
/// what the store then writes in the same atomic step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateStep {
    /// The answer to the request.
    pub gate: SessionGate,
    /// The session's state after the request, or `None` to leave it absent.
    pub state: Option<SessionState>,
    /// The sequence numbers whose records to drop (now acknowledged).
    pub dropped: std::ops::RangeInclusive<u64>,
    /// The sequence numbers whose records live on, to keep as long as the session.
    pub kept: std::ops::RangeInclusive<u64>,
}

impl SessionState {
    /// The gate's decision on `request` for a session in `state` (`None`: unknown, or
    /// expired), with `new_epoch` the epoch to start it with (used only when it starts).
    pub fn gate(state: Option<SessionState>, request: SessionRequest, new_epoch: u64) -> GateStep {
        let Some(old) = state else {
            if request.ack > 0 {
                return GateStep {
                    gate: SessionGate::Expired,
                    state: None,
                    dropped: empty(),
                    kept: empty(),
                };
            }
            let started = SessionState {
                epoch: new_epoch,
                ack: 0,
                high: 0,
            };
            return SessionState::gate(Some(started), request, new_epoch);
        };
        let ack = old.ack.max(request.ack);
        // Records live only above the old mark and at most at `high`, which the window keeps
        // within `window` of the mark: the ranges are never longer than the window.
        let dropped = (old.ack + 1)..=ack.min(old.high);
        let gate = if request.seq <= ack {
            SessionGate::Acknowledged { ack }
        } else if request.seq > ack.saturating_add(request.window) {
            SessionGate::WindowFull { ack }
        } else {
            SessionGate::Open { epoch: old.epoch }
        };
        let high = match gate {
            SessionGate::Open { .. } => old.high.max(request.seq),
            _ => old.high,
        };
        GateStep {
            gate,
            state: Some(SessionState {
                epoch: old.epoch,
                ack,
                high,
            }),
            dropped,
            kept: (ack + 1)..=old.high,
        }
    }
}

#[allow(clippy::reversed_empty_ranges)]
fn empty() -> std::ops::RangeInclusive<u64> {
    1..=0
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(60);

    fn request(seq: u64, ack: u64) -> SessionRequest {
        SessionRequest::new(seq, ack, 4, IDLE)
    }

    #[test]
    fn an_unknown_session_starts_only_without_an_ack() {
        let started = SessionState::gate(None, request(1, 0), 7);
        assert_eq!(started.gate, SessionGate::Open { epoch: 7 });
        assert_eq!(
            started.state,
            Some(SessionState {
                epoch: 7,
                ack: 0,
                high: 1
            })
        );
        let expired = SessionState::gate(None, request(3, 2), 7);
        assert_eq!((expired.gate, expired.state), (SessionGate::Expired, None));
        // A first request may be numbered anywhere in the window.
        assert_eq!(
            SessionState::gate(None, request(4, 0), 7).gate,
            SessionGate::Open { epoch: 7 }
        );
        assert_eq!(
            SessionState::gate(None, request(5, 0), 7).gate,
            SessionGate::WindowFull { ack: 0 }
        );
    }

    #[test]
    fn the_mark_rises_drops_what_it_covers_and_refuses_below_it() {
        let state = Some(SessionState {
            epoch: 1,
            ack: 2,
            high: 5,
        });
        let step = SessionState::gate(state, request(6, 4), 9);
        assert_eq!(step.gate, SessionGate::Open { epoch: 1 });
        assert_eq!(step.dropped, 3..=4);
        assert_eq!(step.kept, 5..=5);
        assert_eq!(
            step.state,
            Some(SessionState {
                epoch: 1,
                ack: 4,
                high: 6
            })
        );
        // An older ack never lowers the mark.
        let step = SessionState::gate(step.state, request(6, 1), 9);
        assert_eq!(step.state.unwrap().ack, 4);
        assert!(step.dropped.is_empty());
        // At or below the mark, its own ack included.
        for (seq, ack) in [(4, 0), (3, 0), (7, 7)] {
            let step = SessionState::gate(step.state, request(seq, ack), 9);
            assert!(
                matches!(step.gate, SessionGate::Acknowledged { .. }),
                "{seq} {ack}"
            );
        }
        // Past the window, counted from the mark the request brings.
        let state = step.state;
        assert_eq!(
            SessionState::gate(state, request(9, 4), 9).gate,
            SessionGate::WindowFull { ack: 4 }
        );
        assert_eq!(
            SessionState::gate(state, request(9, 5), 9).gate,
            SessionGate::Open { epoch: 1 }
        );
    }

    #[test]
    fn an_ack_far_past_anything_sent_drops_no_more_than_was_admitted() {
        let state = Some(SessionState {
            epoch: 1,
            ack: 10,
            high: 14,
        });
        let step = SessionState::gate(state, request(2_000, 1_999), 9);
        assert_eq!(step.dropped, 11..=14);
        assert!(step.kept.is_empty());
        assert_eq!(step.gate, SessionGate::Open { epoch: 1 });
    }

    #[test]
    fn places_are_checked() {
        assert!(InSession::new(0, 0).is_err());
        assert!(InSession::new(MAX_SEQ + 1, 0).is_err());
        assert!(InSession::new(1, MAX_SEQ + 1).is_err());
        assert_eq!(InSession::new(MAX_SEQ, MAX_SEQ).unwrap().seq(), MAX_SEQ);
    }

    #[test]
    fn session_keys_never_meet_idempotency_keys() {
        let id = Key::new("s-1").unwrap();
        let session = SessionKey::derive(b"app", &Scope::new(), &id);
        assert_ne!(
            *session.as_bytes(),
            *StorageKey::derive(b"app", &Scope::new(), &id).as_bytes()
        );
        assert_ne!(
            session,
            SessionKey::derive(b"app", &Scope::new().principal("p"), &id)
        );
        let (a, b) = (session.seq_key(1, 1), session.seq_key(1, 2));
        assert_ne!(a, b);
        assert_ne!(session.seq_key(2, 1), a);
        assert_ne!(
            a.operation_key(crate::FencingToken::new(5)),
            b.operation_key(crate::FencingToken::new(5))
        );
        assert!(a.record_bytes().as_ref() < b.record_bytes().as_ref());
        assert!(session.record_key().record_bytes().as_ref() < a.record_bytes().as_ref());
    }
}
