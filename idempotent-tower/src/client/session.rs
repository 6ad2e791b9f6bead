//! A client session ([`ClientSession`]): the id, the numbers it gave its calls and which of
//! them have their answer; and a call's number ([`SessionSeq`]) to send a call again with.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use http::HeaderValue;
use idempotent_core::session::{DEFAULT_SESSION_WINDOW, MAX_SEQ, MAX_SESSION_WINDOW};
use idempotent_core::{Key, limits};
use tokio::sync::Notify;
use tokio::time::Instant;

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
    /// Woken when the acknowledged mark advances or the session expires: the calls waiting
    /// for the window ([`Ticket::admitted`]) look again.
    advanced: Notify,
}

#[derive(Debug)]
struct State {
    /// The highest number given to a call so far.
    last: u64,
    /// Every call numbered this or lower has its answer.
    ack: u64,
    /// The numbers above `ack` with their answer.
    answered: BTreeSet<u64>,
    /// The server said the session is unknown or expired.
    expired: bool,
    /// How far past `ack` a call may be numbered and still be sent.
    window: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            last: 0,
            ack: 0,
            answered: BTreeSet::new(),
            expired: false,
            window: DEFAULT_SESSION_WINDOW,
        }
    }
}

impl State {
    /// `seq` needs no answer any more: it has one, or it never will be sent again. Whether
    /// the mark advanced.
    fn settle(&mut self, seq: u64) -> bool {
        if seq <= self.ack || seq > self.last {
            return false;
        }
        self.answered.insert(seq);
        let before = self.ack;
        while self.answered.remove(&(self.ack + 1)) {
            self.ack += 1;
        }
        self.ack != before
    }

    /// Whether call `seq` is within the window the server admits.
    fn admits(&self, seq: u64) -> bool {
        self.expired || seq <= self.ack.saturating_add(self.window)
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
                advanced: Notify::new(),
            }),
        }
    }

    /// How far past the acknowledged mark this client sends calls: a call numbered past
    /// `ack + window` is not sent until the mark reaches `seq - window` (see "Calls in a
    /// session" in the type's documentation), so that it is not refused with `429
    /// session_window_full`. Set it to the server's window
    /// ([`Defaults::session_window`](idempotent_core::Defaults::session_window)); the
    /// default is the server's default, [`DEFAULT_SESSION_WINDOW`] (64). With a window larger
    /// than the server's, calls past the server's are sent and refused, and each refusal is
    /// retried, spending one of the call's attempts, as without this window. Clamped, with a
    /// warning, into 1 to [`MAX_SESSION_WINDOW`] (no server admits more), as the server's.
    /// Shared by the session's clones; the calls waiting then look again.
    pub fn with_window(self, window: u64) -> Self {
        let window = limits::check_session_window(window).unwrap_or_else(|error| {
            let clamped = window.clamp(1, MAX_SESSION_WINDOW);
            tracing::warn!(
                %error,
                clamped,
                "a client session window out of its range was clamped into it"
            );
            clamped
        });
        self.state().window = window;
        self.shared.advanced.notify_waiters();
        self
    }

    /// How far past the acknowledged mark calls are sent ([`with_window`](Self::with_window)).
    pub fn window(&self) -> u64 {
        self.state().window
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
        self.settle(seq);
    }

    /// Settles `seq` ([`State::settle`]), waking the calls waiting for the window if the
    /// mark advanced.
    fn settle(&self, seq: u64) {
        let advanced = self.state().settle(seq);
        if advanced {
            self.shared.advanced.notify_waiters();
        }
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
            drop(state);
            // Never sent: as if abandoned, so that no clone waits on it.
            self.settle(seq);
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

    /// Waits until the call may be sent: its number is within the window past the
    /// acknowledged mark (at once for most calls), or the session expired (the server's
    /// `410` then ends the call). Fails if the mark has not advanced far enough by
    /// `deadline`: the call was not sent.
    pub(crate) async fn admitted(&self, deadline: Instant) -> Result<(), WindowClosed> {
        loop {
            // Made before the mark is read, so that an advance between the two wakes it.
            let advanced = self.session.shared.advanced.notified();
            let (ack, window) = {
                let state = self.session.state();
                if state.admits(self.seq) {
                    return Ok(());
                }
                (state.ack, state.window)
            };
            tracing::debug!(
                session = self.session.id().as_str(),
                seq = self.seq,
                ack,
                window,
                "idempotent request waits for the session's window"
            );
            if tokio::time::timeout_at(deadline, advanced).await.is_err() {
                return Err(WindowClosed {
                    seq: self.seq,
                    ack,
                    window,
                });
            }
        }
    }

    /// The call has its answer.
    pub(crate) fn answered(mut self) {
        self.open = false;
        self.session.settle(self.seq);
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
        // The calls waiting for the window go, to learn it from the server.
        self.session.shared.advanced.notify_waiters();
        self.settled();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.open {
            self.session.settle(self.seq);
        }
    }
}

/// Why a call in a session was not sent: the `last` error of its
/// [`ClientError::GaveUp`] (with no attempts, for its deadline).
#[derive(Debug, thiserror::Error)]
#[error(
    "not sent: call {seq} is more than {window} past the session's acknowledged mark {ack}, which did not advance before the call's deadline (an earlier call of the session has no answer yet: it is retrying, or it gave up and holds the mark until it is sent again or abandoned)"
)]
pub(crate) struct WindowClosed {
    seq: u64,
    ack: u64,
    window: u64,
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

    /// `waiting` waiting for the window on a task of its own, with an hour to go: whether it
    /// was admitted, how long it waited, and the mark when it went.
    fn waits(
        session: &ClientSession,
        waiting: Ticket,
    ) -> tokio::task::JoinHandle<(bool, std::time::Duration, u64)> {
        let session = session.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let hour = started + std::time::Duration::from_secs(3600);
            let admitted = waiting.admitted(hour).await;
            (admitted.is_ok(), started.elapsed(), session.ack())
        })
    }

    fn still_waits<T>(task: &tokio::task::JoinHandle<T>) {
        assert!(!task.is_finished(), "admitted too early");
    }

    /// `waiting` is not admitted until `release` runs, and is admitted then.
    async fn goes_only_after(session: &ClientSession, waiting: Ticket, release: impl FnOnce()) {
        let task = waits(session, waiting);
        tokio::task::yield_now().await;
        still_waits(&task);
        release();
        assert!(task.await.unwrap().0, "not admitted");
    }

    // A call past the window waits for the mark; it goes (admitted) as soon as the number
    // holding the mark is answered, abandoned or dropped, the window is raised, or the
    // session expires, each long before its deadline; and not before.
    #[tokio::test(start_paused = true)]
    async fn a_call_past_the_window_goes_when_the_mark_moves_or_the_session_ends() {
        let session = ClientSession::with_id("s".parse().unwrap()).with_window(1);
        let first = session.ticket(None).unwrap();
        let second = session.ticket(None).unwrap();
        // Answered.
        let task = waits(&session, second);
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        still_waits(&task);
        first.answered();
        let (admitted, waited, ack) = task.await.unwrap();
        assert!(admitted && ack == 1, "{ack}");
        assert_eq!(waited, std::time::Duration::from_secs(60));
        // Abandoned (2 was never answered: its ticket went to the waiting task and was
        // dropped there, which settles it).
        assert_eq!(session.ack(), 2);
        let third = session.ticket(None).unwrap();
        third.unanswered();
        let fourth = session.ticket(None).unwrap();
        goes_only_after(&session, fourth, || session.abandon(3)).await;
        // Dropped (4 settled as its task dropped it).
        assert_eq!(session.ack(), 4);
        let fifth = session.ticket(None).unwrap();
        let sixth = session.ticket(None).unwrap();
        goes_only_after(&session, sixth, || drop(fifth)).await;
        // The window raised (on a clone: the session's clones share it).
        let seventh = session.ticket(None).unwrap();
        let eighth = session.ticket(None).unwrap();
        goes_only_after(&session, eighth, || {
            let _ = session.clone().with_window(2);
        })
        .await;
        assert_eq!(session.window(), 2);
        // The session expired (its refusal then comes from the server).
        let ninth = session.ticket(None).unwrap();
        let tenth = session.ticket(None).unwrap();
        goes_only_after(&session, tenth, || ninth.expire()).await;
        seventh.unanswered();
    }

    // With nothing moving, the wait ends at its deadline, not admitted.
    #[tokio::test(start_paused = true)]
    async fn a_call_past_the_window_is_not_admitted_after_its_deadline() {
        let session = ClientSession::new().with_window(1);
        let first = session.ticket(None).unwrap();
        let second = session.ticket(None).unwrap();
        let started = Instant::now();
        let deadline = started + std::time::Duration::from_secs(5);
        let closed = second.admitted(deadline).await.unwrap_err();
        assert_eq!(Instant::now(), deadline);
        assert_eq!((closed.seq, closed.ack, closed.window), (2, 0, 1));
        first.unanswered();
        second.unanswered();
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
