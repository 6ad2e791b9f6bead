//! What a client layer is configured with, shared by its services and the reqwest middleware,
//! and the decisions read from it: which requests are keyed, which key or session number they
//! carry, what an answer means, and the count of each call.

use std::fmt;
use std::future::Future;

use http::{HeaderMap, HeaderName, Method, StatusCode};
use idempotent_core::BoxError;
use tokio::time::Instant;

use super::error::{ClientError, GiveUp};
use super::key::{Delivery, IdempotencyKey};
use super::metrics::ClientMetrics;
use super::policy::{Delivered, RetryPolicy, deliver};
use super::protocol::ClientProtocol;
use super::session::{ClientSession, SessionSeq, Ticket};
use super::verdict::{Ended, Refusal, Verdict, is_problem_document};
use crate::server::config::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use crate::session::{IDEMPOTENCY_SESSION, IDEMPOTENCY_SESSION_SEQ};

/// The largest problem document read from a `410` answer in a session, to learn its `code`;
/// the layer's own are under 1 KiB.
pub(crate) const MAX_PROBLEM_DOCUMENT: usize = 64 * 1024;

/// Everything a client layer is configured with; its services share it behind an `Arc`.
#[derive(Clone)]
pub(crate) struct Config<P: ClientProtocol> {
    pub(crate) header: HeaderName,
    pub(crate) policy: RetryPolicy,
    pub(crate) metrics: ClientMetrics,
    /// The session every protected request is sent in, instead of a key of its own.
    pub(crate) session: Option<ClientSession>,
    /// What only this protocol has.
    pub(crate) protocol: P::ClientSettings,
}

/// What names one logical call to the server: its key, or its number in the session.
pub(crate) enum Name {
    Key(String),
    Session(Ticket),
}

impl Name {
    /// The key, or the session's id: for logs, [`Delivery::key`] and [`ClientError::GaveUp`].
    pub(crate) fn label(&self) -> &str {
        match self {
            Name::Key(key) => key,
            Name::Session(ticket) => ticket.session().id().as_str(),
        }
    }

    /// The call's number in its session.
    pub(crate) fn seq(&self) -> Option<u64> {
        match self {
            Name::Key(_) => None,
            Name::Session(ticket) => Some(ticket.seq()),
        }
    }

    /// Names one attempt: a call in a session gets its `Idempotency-Session` header now, with
    /// the newest acknowledged mark; a key is in the headers already.
    pub(crate) fn apply(&self, headers: &mut HeaderMap) {
        if let Name::Session(ticket) = self {
            headers.insert(IDEMPOTENCY_SESSION, ticket.header_value());
        }
    }

    /// Whether an answer with this head is to be read, to tell a session's refusal by the
    /// `code` of its problem document (HTTP `410` in a session).
    pub(crate) fn reads<P: ClientProtocol>(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        matches!(self, Name::Session(_))
            && P::READS_PROBLEMS
            && status == StatusCode::GONE
            && is_problem_document(headers)
    }
}

impl<P: ClientProtocol> Config<P> {
    /// The defaults: the `Idempotency-Key` header, [`RetryPolicy::default`], the protocol's
    /// own defaults, and the client's metrics registered with the recorder installed now.
    pub(crate) fn new() -> Self {
        Config {
            header: IDEMPOTENCY_KEY,
            policy: RetryPolicy::default(),
            metrics: ClientMetrics::register(P::LABEL),
            session: None,
            protocol: P::ClientSettings::default(),
        }
    }

    /// Whether a request of `method` gets a key and retries.
    pub(crate) fn protects(&self, method: &Method) -> bool {
        P::keyed(&self.protocol, method)
    }

    /// What names the request: the key its headers already carry; else, with a session, a
    /// number in it (`resend`'s, or the next); else the caller's `chosen` key or a fresh one,
    /// added to the headers. Fails, counted, for a session that is expired or never gave
    /// `resend`'s number.
    pub(crate) fn name(
        &self,
        headers: &mut HeaderMap,
        chosen: Option<IdempotencyKey>,
        resend: Option<SessionSeq>,
    ) -> Result<Name, ClientError> {
        if let Some(given) = headers.get(&self.header) {
            return Ok(Name::Key(
                String::from_utf8_lossy(given.as_bytes()).into_owned(),
            ));
        }
        if let Some(session) = &self.session {
            return match session.ticket(resend) {
                Ok(ticket) => Ok(Name::Session(ticket)),
                Err(error) => {
                    self.metrics.failed(&error);
                    Err(error)
                }
            };
        }
        let key = chosen.unwrap_or_else(IdempotencyKey::random);
        headers.insert(self.header.clone(), key.header_value());
        Ok(Name::Key(key.as_str().to_owned()))
    }

    /// What an answer with this head means for the call; a session's refusal only for a call
    /// in a session.
    pub(crate) fn verdict(&self, name: &Name, status: StatusCode, headers: &HeaderMap) -> Verdict {
        match P::verdict(status, headers) {
            Verdict::Refused(_) if name.seq().is_none() => Verdict::Done,
            verdict => verdict,
        }
    }

    /// What a `410` problem document read whole (see [`Name::reads`]) means for the call.
    pub(crate) fn document_verdict(document: &[u8]) -> Verdict {
        Refusal::from_document(document).map_or(Verdict::Done, Verdict::Refused)
    }

    /// Sends one logical call by the policy, counting it if it fails. A call in a session
    /// first waits, within its deadline, for its number to be within the session's window
    /// ([`ClientSession::with_window`]); not admitted by then, it ends unsent.
    pub(crate) async fn deliver<R, F, Fut>(
        &self,
        name: &Name,
        send: F,
        verdict: impl Fn(&R) -> Verdict,
    ) -> Result<Delivered<R>, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<R, BoxError>>,
    {
        let deadline = self.policy.deadline_from(Instant::now());
        let delivered = async {
            if let Name::Session(ticket) = name {
                ticket
                    .admitted(deadline)
                    .await
                    .map_err(|closed| ClientError::GaveUp {
                        key: name.label().to_owned(),
                        seq: name.seq(),
                        attempts: 0,
                        reason: GiveUp::Deadline,
                        last: Box::new(closed),
                    })?;
            }
            deliver(
                &self.policy,
                &self.metrics,
                name.label(),
                name.seq(),
                deadline,
                send,
                verdict,
            )
            .await
        }
        .await;
        if let Err(error) = &delivered {
            self.metrics.failed(error);
        }
        delivered
    }

    /// The end of a call: its answer and [`Delivery`] (counted), or the error it ended with;
    /// in a session, the call's number marked answered (or left unanswered when the call
    /// gave up), and a refusal as its typed error.
    pub(crate) fn conclude<R>(
        &self,
        name: Name,
        delivered: Result<Delivered<R>, ClientError>,
        headers: impl FnOnce(&R) -> &HeaderMap,
    ) -> Result<(R, Delivery), ClientError> {
        let delivered = match delivered {
            Ok(delivered) => delivered,
            Err(error) => {
                if let Name::Session(ticket) = name {
                    ticket.unanswered();
                }
                return Err(error);
            }
        };
        let head = headers(&delivered.answer);
        let replayed = head.get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
        // Only the server's own answer to this number settles it: never a proxy's.
        let session_answered = matches!(delivered.ended, Ended::Answered)
            && name.seq().is_some_and(|seq| marks(head, seq));
        self.metrics.answered(delivered.ended, replayed);
        let delivery = Delivery {
            key: name.label().to_owned(),
            session_seq: name.seq(),
            attempts: delivered.attempts,
            replayed,
            session_answered,
        };
        if let Name::Session(ticket) = name {
            let seq = ticket.seq();
            match delivered.ended {
                Ended::Answered if session_answered => ticket.answered(),
                // An answer the server did not mark as its own for this number (a proxy's
                // 500, a server without the marker): it may never have run, so the mark must
                // not pass it. The caller sends it again or abandons it.
                Ended::Answered => ticket.unanswered(),
                // The number was used for another request (a resend that changed its body):
                // the answer of the request it was first used for is still the server's to
                // give, so the ack must not pass it.
                Ended::KeyReused => ticket.unanswered(),
                // A retryable answer is not the call's outcome: it may be sent again.
                Ended::GaveUp(_) => ticket.unanswered(),
                Ended::Refused(Refusal::SequenceAcknowledged) => {
                    // The server's mark is past it already: the client's may pass it too.
                    ticket.settled();
                    return Err(ClientError::SequenceAcknowledged { seq });
                }
                Ended::Refused(Refusal::SessionExpired) => {
                    ticket.expire();
                    return Err(ClientError::SessionExpired { seq });
                }
            }
        }
        Ok((delivered.answer, delivery))
    }
}

/// Whether `headers` mark the answer as the server's own to session number `seq`
/// ([`IDEMPOTENCY_SESSION_SEQ`]: one field, an integer, that number).
fn marks(headers: &HeaderMap, seq: u64) -> bool {
    let mut fields = headers.get_all(IDEMPOTENCY_SESSION_SEQ).iter();
    let (Some(field), None) = (fields.next(), fields.next()) else {
        return false;
    };
    let value = crate::key::trim_ows(field.as_bytes());
    !value.is_empty()
        && value.len() <= 15
        && value.iter().all(u8::is_ascii_digit)
        && std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            == Some(seq)
}

impl<P: ClientProtocol> fmt::Debug for Config<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientLayer")
            .field("protocol", &P::LABEL)
            .field("settings", &self.protocol)
            .field("header", &self.header)
            .field("policy", &self.policy)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}
