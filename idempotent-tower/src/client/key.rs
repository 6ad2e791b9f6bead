//! The key of one logical call ([`IdempotencyKey`]), and what became of the call
//! ([`Delivery`]).

use std::fmt;

use http::HeaderValue;
use idempotent_core::Key;

use super::error::ClientError;

/// The key of one logical call, chosen by the caller: put it in a request's extensions and
/// the client sends it instead of a fresh UUID. Keep it to retry the call later.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Key);

impl IdempotencyKey {
    /// `key` as a key, by the rules the server applies ([`Key`]): 1–255 bytes of printable
    /// ASCII, no leading or trailing space.
    pub fn new(key: impl AsRef<str> + Into<String>) -> Result<Self, ClientError> {
        Ok(IdempotencyKey(Key::new(key)?))
    }

    /// A fresh random key (a UUIDv4).
    pub fn random() -> Self {
        IdempotencyKey(Key::new(uuid::Uuid::new_v4().to_string()).expect("a UUID is a valid key"))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The header value: an RFC 8941 string.
    pub(crate) fn header_value(&self) -> HeaderValue {
        let mut quoted = String::with_capacity(self.as_str().len() + 2);
        quoted.push('"');
        for c in self.as_str().chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        HeaderValue::from_str(&quoted).expect("printable ASCII is a valid header value")
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the client did for one logical call: an extension of the answer it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub(crate) key: String,
    pub(crate) session_seq: Option<u64>,
    pub(crate) attempts: u32,
    pub(crate) replayed: bool,
    pub(crate) session_answered: bool,
}

impl Delivery {
    /// The key the call was sent with (as sent, for a key the request already carried); in a
    /// session, the session's id.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The call's number in its client session, if it was sent in one
    /// ([`ClientLayer::session`](super::ClientLayer::session)): every attempt carried it.
    pub fn session_seq(&self) -> Option<u64> {
        self.session_seq
    }

    /// In a session, whether this answer counts as the call's answer, so that the session's
    /// acknowledged mark may pass its number: only an answer the server marked as its own for
    /// this number ([`IDEMPOTENCY_SESSION_SEQ`](crate::IDEMPOTENCY_SESSION_SEQ)). `false` for
    /// another answer (a proxy's `500`, say, or a `422`): the number stays unanswered; send
    /// the request again with [`SessionSeq`](super::SessionSeq)`(seq)` (it runs if it never
    /// did, or replays), or [abandon](super::ClientSession::abandon) it. Always `false`
    /// without a session.
    pub fn session_answered(&self) -> bool {
        self.session_answered
    }

    /// Requests sent for the call, retries included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the answer was a replay of an earlier attempt's answer
    /// (`Idempotent-Replayed: true`): an earlier attempt ran, and its answer was lost.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_sent_quoted() {
        for bad in ["", " a", "a ", "é", "a\nb", &"k".repeat(256)] {
            assert!(
                matches!(IdempotencyKey::new(bad), Err(ClientError::InvalidKey(_))),
                "{bad:?}"
            );
        }
        let key = IdempotencyKey::new(r#"order "7"\x"#).unwrap();
        assert_eq!(key.header_value(), r#""order \"7\"\\x""#);
        let random = IdempotencyKey::random();
        assert_eq!(random.as_str().len(), 36);
        assert_ne!(random, IdempotencyKey::random());
    }
}
