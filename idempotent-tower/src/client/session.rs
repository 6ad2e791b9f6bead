//! A client session ([`ClientSession`]): the id, the numbers it gave its calls and which of
//! them have their answer; and a call's number ([`SessionSeq`]) to send a call again with.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use http::HeaderValue;
use idempotent_core::Key;
use idempotent_core::session::MAX_SEQ;

use super::error::ClientError;
use crate::session::SessionHeader;

/// A client session: one id for many calls, each numbered `1, 2, 3, …`, sent with the
/// `Idempotency-Session` header instead of a key per call (how, below). Give it to
/// [`ClientLayer::session`](super::ClientLayer::session).
///
/// Cheap to clone: the clones share the numbering and the record of answers, so a layer, its
/// services and their clones all send in the same session.
///
/// ```
/// use idempotent_tower::client::{ClientLayer, ClientSession};
///
/// let session = ClientSession::new();
/// let layer = ClientLayer::http().session(session.clone());
/// assert_eq!(session.ack(), 0);
/// eprintln!("session {}", session.id().as_str());
/// ```
///
#[doc = include_str!("../../docs/tower-sessions.md")]
#[derive(Clone)]
pub struct ClientSession {
    shared: Arc<Shared>,
}

struct Shared {
    id: Key,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The highest number given to a call so far.
    last: u64,
    /// Every call numbered this or lower has its answer.
    ack: u64,
    /// The numbers above `ack` with their answer.
    answered: BTreeSet<u64>,
    /// The server said the session is unknown or expired.
    expired: bool,
}

impl State {
    /// `seq` needs no answer any more: it has one, or it never will be sent again.
    fn settle(&mut self, seq: u64) {
        if seq <= self.ack || seq > self.last {
            return;
        }
        self.answered.insert(seq);
        while self.answered.remove(&(self.ack + 1)) {
            self.ack += 1;
        }
    }
}

impl ClientSession {
    /// A new session with a fresh random id (a UUIDv4, as the keys the layer makes).
    pub fn new() -> Self {
        Self::with_id(Key::new(uuid::Uuid::new_v4().to_string()).expect("a UUID is a valid key"))
    }

    /// A new session named `id`, numbering its calls from 1 with nothing acknowledged. The
    /// server must not know the id already (or must have forgotten it): a session it knows
    /// refuses numbers it has seen acknowledged.
    pub fn with_id(id: Key) -> Self {
        ClientSession {
            shared: Arc::new(Shared {
                id,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The session id.
    pub fn id(&self) -> &Key {
        &self.shared.id
    }

    /// The acknowledged mark: the highest `n` such that every call numbered `n` or lower has
    /// its answer (the lowest number still without one, minus 1). Sent with every attempt.
    pub fn ack(&self) -> u64 {
        self.state().ack
    }

    /// The highest number given to a call so far (0 before the first call).
    pub fn last_seq(&self) -> u64 {
        self.state().last
    }

    /// Whether the server said the session is unknown or expired (`410 session_expired`):
    /// every later call fails at once with [`ClientError::SessionExpired`], and the caller
    /// needs a new session.
    pub fn is_expired(&self) -> bool {
        self.state().expired
    }

    /// Gives up on learning the answer of call `seq`: the acknowledged mark may then pass it,
    /// and the server drops what it kept for it. For a call that ended with
    /// [`ClientError::GaveUp`] (or an answer the client would retry) and that will not be sent
    /// again: until it is answered or abandoned, the mark stays below it, and after a window
    /// of further calls the server refuses new ones (`429 session_window_full`).
    pub fn abandon(&self, seq: u64) {
        self.state().settle(seq);
    }

    /// The number of a call: `resend` if the caller sends an earlier call again (it must be
    /// one this session gave), else the next one.
    pub(crate) fn ticket(&self, resend: Option<SessionSeq>) -> Result<Ticket, ClientError> {
        let mut state = self.state();
        let seq = match resend {
            Some(SessionSeq(seq)) if seq == 0 || seq > state.last => {
                return Err(ClientError::UnknownSessionSeq { seq });
            }
            Some(SessionSeq(seq)) => seq,
            None if state.last >= MAX_SEQ => {
                return Err(ClientError::UnknownSessionSeq { seq: MAX_SEQ + 1 });
            }
            None => {
                state.last += 1;
                state.last
            }
        };
        if state.expired {
            // Never sent: as if abandoned, so that no clone waits on it.
            state.settle(seq);
            return Err(ClientError::SessionExpired { seq });
        }
        drop(state);
        Ok(Ticket {
            session: self.clone(),
            seq,
            open: true,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state is consistent after every statement: a panic elsewhere cannot break it.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Default for ClientSession {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ClientSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("ClientSession")
            .field("id", &self.id().as_str())
            .field("last_seq", &state.last)
            .field("ack", &state.ack)
            .field("expired", &state.expired)
            .finish()
    }
}

/// A call's number in its client session. The client puts it on every answer
/// ([`Delivery::session_seq`](super::Delivery::session_seq)) and in
/// [`ClientError::GaveUp`]; put it in a request's extensions to send that call again with the
/// same number (and learn its outcome without running it twice) instead of numbering it anew.
/// Ignored by a layer without a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionSeq(pub u64);

/// One call's number, held while the call is under way. It ends as answered, as given up (the
/// number stays unanswered, to be sent again), or settled; a call dropped before its end
/// (its future cancelled: its caller never learns the number) is settled, so that it does not
/// hold the acknowledged mark back for ever.
pub(crate) struct Ticket {
    session: ClientSession,
    seq: u64,
    open: bool,
}

impl Ticket {
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn session(&self) -> &ClientSession {
        &self.session
    }

    /// The header for an attempt now: this number and the newest acknowledged mark.
    pub(crate) fn header_value(&self) -> HeaderValue {
        let ack = self.session.ack();
        SessionHeader::new(self.session.id().clone(), self.seq, ack)
            .expect("the number and the mark are at most MAX_SEQ")
            .to_header_value()
    }

    /// The call has its answer.
    pub(crate) fn answered(mut self) {
        self.open = false;
        self.session.state().settle(self.seq);
    }

    /// The server will never answer it (at or below its mark, or the session is gone).
    pub(crate) fn settled(self) {
        self.answered();
    }

    /// The call ended without its answer: the number stays unanswered.
    pub(crate) fn unanswered(mut self) {
        self.open = false;
    }

    /// The server knows the session no more.
    pub(crate) fn expire(self) {
        self.session.state().expired = true;
        self.settled();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.open {
            self.session.state().settle(self.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_is_the_lowest_unanswered_number_minus_one() {
        let session = ClientSession::with_id("s".parse().unwrap());
        let tickets: Vec<_> = (0..5).map(|_| session.ticket(None).unwrap()).collect();
        assert_eq!(
            tickets.iter().map(Ticket::seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        assert_eq!(session.last_seq(), 5);
        let mut tickets = tickets.into_iter();
        let (one, two, three, four, five) = (
            tickets.next().unwrap(),
            tickets.next().unwrap(),
            tickets.next().unwrap(),
            tickets.next().unwrap(),
            tickets.next().unwrap(),
        );
        two.answered();
        assert_eq!(session.ack(), 0);
        one.answered();
        assert_eq!(session.ack(), 2);
        three.unanswered();
        four.answered();
        assert_eq!(session.ack(), 2, "3 has no answer");
        assert_eq!(
            five.header_value(),
            r#"id="s", seq=5, ack=2"#,
            "every attempt carries the newest mark"
        );
        drop(five);
        assert_eq!(session.ack(), 2);
        // Sent again: the same number, answered this time.
        let again = session.ticket(Some(SessionSeq(3))).unwrap();
        assert_eq!(again.seq(), 3);
        again.answered();
        assert_eq!(session.ack(), 5, "4 answered, 5 dropped");
        for unknown in [0, 6, u64::MAX] {
            assert!(matches!(
                session.ticket(Some(SessionSeq(unknown))),
                Err(ClientError::UnknownSessionSeq { seq }) if seq == unknown
            ));
        }
        session.abandon(100);
        assert_eq!(session.ack(), 5);
        let six = session.ticket(None).unwrap();
        six.unanswered();
        session.abandon(6);
        assert_eq!(session.ack(), 6);
    }

    #[test]
    fn an_expired_session_refuses_every_later_call() {
        let session = ClientSession::new();
        assert_eq!(session.id().as_str().len(), 36);
        assert_ne!(session.id(), ClientSession::new().id());
        let first = session.ticket(None).unwrap();
        let other = session.clone().ticket(None).unwrap();
        first.expire();
        assert!(session.is_expired());
        assert!(matches!(
            session.ticket(None),
            Err(ClientError::SessionExpired { seq: 3 })
        ));
        assert!(matches!(
            session.ticket(Some(SessionSeq(2))),
            Err(ClientError::SessionExpired { seq: 2 })
        ));
        other.unanswered();
    }
}
