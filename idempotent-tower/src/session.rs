//! The `Idempotency-Session` header: a client session's id, the request's sequence number and
//! the client's acknowledged mark, as an RFC 8941 dictionary.
//!
//! ```text
//! Idempotency-Session: id="device-7f3a", seq=42, ack=40
//! ```
//!
//! `id` is an sf-string following the rules of an idempotency key (1 to 255 printable ASCII
//! characters, no leading or trailing space); `seq` is an integer from 1 and `ack` one from 0,
//! both at most [`MAX_SEQ`] (the largest RFC 8941 integer). Other members are ignored, as RFC
//! 8941 asks, and so are parameters; a member given twice counts with its last value. Several
//! header fields are read as one dictionary, joined by commas. gRPC carries the same value in
//! the `idempotency-session` metadata entry.
//!
//! Shared by both sides, so at the top of the crate rather than in `server/`: the server layer
//! parses the header, the client layer writes it.

use std::fmt;

use http::{HeaderMap, HeaderName, HeaderValue};
use idempotent_core::session::{InSession, MAX_SEQ};
use idempotent_core::{Key, KeyError};

use crate::key::{KeyProblem, Parser, trim_ows};

/// The default header (and gRPC metadata entry) carrying a request's session.
pub const IDEMPOTENCY_SESSION: HeaderName = HeaderName::from_static("idempotency-session");

/// The response header (and gRPC metadata entry) by which the server marks an answer to a
/// request in a client session as its own: `Idempotency-Session-Seq: 42`, the request's
/// `seq` as an RFC 8941 integer. The layer puts it on the handler's answer, fresh or replayed,
/// and on its own final refusals of a number that reached its session (`422
/// fingerprint_mismatch`, `result_not_retained`, `corrupt_record`), so that such a number
/// cannot hold the session's window back; never on a refusal to retry (`409 in_flight`,
/// `503`, `429`) or one made before the request reached its session (`413`, `403
/// missing_scope`, an unreadable body: give those numbers up with `ClientSession::abandon`).
///
/// The client layer acknowledges a session number only with an answer that carries this
/// field naming that number: any other answer (a proxy's `500`, a load balancer's `502`, a
/// server without sessions' marker) is returned to the caller, but the number stays
/// unanswered. Not stored with the record; a handler's own field of this name is replaced.
pub const IDEMPOTENCY_SESSION_SEQ: HeaderName = HeaderName::from_static("idempotency-session-seq");

/// One request's place in a client session, as the `Idempotency-Session` header carries it.
///
/// ```
/// use idempotent_tower::SessionHeader;
///
/// let header = SessionHeader::new("device-7".parse()?, 42, 40)?;
/// assert_eq!(header.to_string(), r#"id="device-7", seq=42, ack=40"#);
/// assert_eq!(SessionHeader::parse(br#"id="device-7", seq=42, ack=40"#), Ok(header));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHeader {
    id: Key,
    place: InSession,
}

impl SessionHeader {
    /// Session `id`, request `seq` (1 to [`MAX_SEQ`]), acknowledging `ack` (0 to
    /// [`MAX_SEQ`]).
    pub fn new(
        id: Key,
        seq: u64,
        ack: u64,
    ) -> Result<Self, idempotent_core::session::SessionError> {
        Ok(SessionHeader {
            id,
            place: InSession::new(seq, ack)?,
        })
    }

    /// Reads one header value.
    pub fn parse(value: &[u8]) -> Result<Self, SessionProblem> {
        parse_value(value)
    }

    /// The session id.
    pub fn id(&self) -> &Key {
        &self.id
    }

    /// The request's sequence number.
    pub fn seq(&self) -> u64 {
        self.place.seq()
    }

    /// The client's acknowledged mark.
    pub fn ack(&self) -> u64 {
        self.place.ack()
    }

    /// The request's place in the session, as the runtime takes it.
    pub fn place(&self) -> InSession {
        self.place
    }

    /// The header value.
    pub fn to_header_value(&self) -> HeaderValue {
        HeaderValue::try_from(self.to_string())
            .expect("a session id is printable ASCII, and so is the rest")
    }
}

/// The RFC 8941 serialization: `id="…", seq=N, ack=N`, with `"` and `\` escaped in the id.
impl fmt::Display for SessionHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("id=\"")?;
        for c in self.id.as_str().chars() {
            if c == '"' || c == '\\' {
                f.write_str("\\")?;
            }
            write!(f, "{c}")?;
        }
        write!(f, "\", seq={}, ack={}", self.seq(), self.ack())
    }
}

/// Why a request's session header is unusable (answered `400 invalid_session`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionProblem {
    /// The value is not an RFC 8941 dictionary.
    Unparsable(&'static str),
    /// A required member (`id`, `seq` or `ack`) is missing.
    Missing(&'static str),
    /// A member has the wrong type: `id` must be a string, `seq` and `ack` integers.
    WrongType(&'static str),
    /// `seq` or `ack` is out of range.
    OutOfRange(&'static str),
    /// The id breaks the key rules.
    InvalidId(KeyError),
}

impl SessionProblem {
    pub(crate) fn detail(&self, header: &HeaderName) -> String {
        let what = match self {
            SessionProblem::Unparsable(why) => {
                format!("is not a structured-field dictionary: {why}")
            }
            SessionProblem::Missing(member) => format!("has no `{member}` member"),
            SessionProblem::WrongType(member) => match *member {
                "id" => "must give `id` as a quoted string".to_owned(),
                other => format!("must give `{other}` as an integer"),
            },
            SessionProblem::OutOfRange(member) => match *member {
                "seq" => format!("must give `seq` from 1 to {MAX_SEQ}"),
                other => format!("must give `{other}` from 0 to {MAX_SEQ}"),
            },
            SessionProblem::InvalidId(e) => format!("has an invalid `id`: {e}"),
        };
        format!(
            "the {header} header {what}; expected e.g. id=\"device-7\", seq=42, ack=41 (the request was not processed)"
        )
    }
}

impl fmt::Display for SessionProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail(&IDEMPOTENCY_SESSION))
    }
}

impl std::error::Error for SessionProblem {}

/// The session carried by `headers` under `name`: `None` when there is no such header.
pub(crate) fn session_from_headers(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Option<Result<SessionHeader, SessionProblem>> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    let Some(second) = values.next() else {
        return Some(parse_value(first.as_bytes()));
    };
    // Several fields are one dictionary (RFC 8941 §4.2): joined with commas.
    let mut joined = first.as_bytes().to_vec();
    for value in std::iter::once(second).chain(values) {
        joined.extend_from_slice(b", ");
        joined.extend_from_slice(value.as_bytes());
    }
    Some(parse_value(&joined))
}

enum Member {
    String(String),
    Integer(i64),
    Other,
}

fn parse_value(value: &[u8]) -> Result<SessionHeader, SessionProblem> {
    let unparsable = |problem: KeyProblem| match problem {
        KeyProblem::Unparsable(why) => SessionProblem::Unparsable(why),
        KeyProblem::Invalid(e) => SessionProblem::InvalidId(e),
        _ => SessionProblem::Unparsable("malformed value"),
    };
    let mut p = Parser {
        input: trim_ows(value),
        pos: 0,
    };
    let (mut id, mut seq, mut ack) = (None, None, None);
    if p.peek().is_none() {
        return Err(SessionProblem::Unparsable("the value is empty"));
    }
    loop {
        let name = member_name(&mut p)?;
        let member = if p.peek() == Some(b'=') {
            p.pos += 1;
            let member = match p.peek() {
                Some(b'"') => Member::String(p.sf_string().map_err(unparsable)?),
                Some(b'-' | b'0'..=b'9') => integer(&mut p)?,
                Some(b'(') => {
                    inner_list(&mut p).map_err(unparsable)?;
                    Member::Other
                }
                _ => {
                    p.bare_item().map_err(unparsable)?;
                    Member::Other
                }
            };
            p.parameters().map_err(unparsable)?;
            member
        } else {
            // A member without a value is the boolean true, with optional parameters.
            p.parameters().map_err(unparsable)?;
            Member::Other
        };
        match name {
            b"id" => id = Some(member),
            b"seq" => seq = Some(member),
            b"ack" => ack = Some(member),
            _ => {}
        }
        // Optional whitespace, then a comma and the next member, or the end.
        while let Some(b' ' | b'\t') = p.peek() {
            p.pos += 1;
        }
        match p.bump() {
            None => break,
            Some(b',') => {
                while let Some(b' ' | b'\t') = p.peek() {
                    p.pos += 1;
                }
                if p.peek().is_none() {
                    return Err(SessionProblem::Unparsable("a trailing comma"));
                }
            }
            Some(_) => {
                return Err(SessionProblem::Unparsable(
                    "members must be separated by commas",
                ));
            }
        }
    }
    let id = match id.ok_or(SessionProblem::Missing("id"))? {
        Member::String(id) => Key::new(id).map_err(SessionProblem::InvalidId)?,
        _ => return Err(SessionProblem::WrongType("id")),
    };
    let number = |member: Option<Member>, name: &'static str| match member {
        None => Err(SessionProblem::Missing(name)),
        Some(Member::Integer(n)) => u64::try_from(n).map_err(|_| SessionProblem::OutOfRange(name)),
        Some(_) => Err(SessionProblem::WrongType(name)),
    };
    let (seq, ack) = (number(seq, "seq")?, number(ack, "ack")?);
    let place = InSession::new(seq, ack).map_err(|e| match e {
        idempotent_core::session::SessionError::AckOutOfRange(_) => {
            SessionProblem::OutOfRange("ack")
        }
        _ => SessionProblem::OutOfRange("seq"),
    })?;
    Ok(SessionHeader { id, place })
}

/// RFC 8941 §3.1.2 key: `lcalpha / "*"`, then `lcalpha / DIGIT / "_" / "-" / "." / "*"`.
fn member_name<'a>(p: &mut Parser<'a>) -> Result<&'a [u8], SessionProblem> {
    let start = p.pos;
    match p.bump() {
        Some(b'a'..=b'z' | b'*') => {}
        _ => return Err(SessionProblem::Unparsable("malformed member name")),
    }
    while let Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*') = p.peek() {
        p.pos += 1;
    }
    Ok(&p.input[start..p.pos])
}

/// RFC 8941 §4.2.4: an integer of at most 15 digits; a decimal is [`Member::Other`].
fn integer(p: &mut Parser<'_>) -> Result<Member, SessionProblem> {
    let start = p.pos;
    let negative = p.peek() == Some(b'-');
    if negative {
        p.pos += 1;
    }
    let digits_from = p.pos;
    while let Some(b'0'..=b'9') = p.peek() {
        p.pos += 1;
    }
    let digits = p.pos - digits_from;
    if digits == 0 {
        return Err(SessionProblem::Unparsable("malformed number"));
    }
    if p.peek() == Some(b'.') {
        p.pos += 1;
        let fraction_from = p.pos;
        while let Some(b'0'..=b'9') = p.peek() {
            p.pos += 1;
        }
        let fraction = p.pos - fraction_from;
        if digits > 12 || fraction == 0 || fraction > 3 {
            return Err(SessionProblem::Unparsable("malformed decimal"));
        }
        return Ok(Member::Other);
    }
    if digits > 15 {
        return Err(SessionProblem::Unparsable(
            "an integer has at most 15 digits",
        ));
    }
    let text = std::str::from_utf8(&p.input[start..p.pos]).expect("ASCII digits");
    let n: i64 = text
        .parse()
        .map_err(|_| SessionProblem::Unparsable("malformed number"))?;
    Ok(Member::Integer(n))
}

/// RFC 8941 §3.1.1 inner list, parsed for well-formedness and ignored.
fn inner_list(p: &mut Parser<'_>) -> Result<(), KeyProblem> {
    p.pos += 1; // (
    loop {
        while p.peek() == Some(b' ') {
            p.pos += 1;
        }
        match p.peek() {
            Some(b')') => {
                p.pos += 1;
                return Ok(());
            }
            None => return Err(KeyProblem::Unparsable("unterminated inner list")),
            Some(_) => {
                p.bare_item()?;
                // Parameters, then the spaces after them (skipped by `parameters`): items are
                // separated by at least one space.
                p.parameters()?;
                if p.peek() != Some(b')') && p.input.get(p.pos.wrapping_sub(1)) != Some(&b' ') {
                    return Err(KeyProblem::Unparsable("malformed inner list"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(v: &str) -> Result<(String, u64, u64), SessionProblem> {
        SessionHeader::parse(v.as_bytes()).map(|h| (h.id().as_str().to_owned(), h.seq(), h.ack()))
    }

    #[test]
    fn reads_the_three_members_in_any_order_with_any_spacing() {
        let expected = Ok(("dev-1".to_owned(), 7, 5));
        for value in [
            r#"id="dev-1", seq=7, ack=5"#,
            r#"seq=7,ack=5,id="dev-1""#,
            r#"  ack=5 ,	seq=7, id="dev-1"  "#,
            r#"id="dev-1";x=1, seq=7;y, ack=5, extra=(1 2;p "a"), flag, dec=1.5, tok=abc"#,
            r#"id="other", seq=7, ack=5, id="dev-1""#,
        ] {
            assert_eq!(parse(value), expected, "{value}");
        }
        assert_eq!(
            parse(r#"id="a \"q\" \\ b", seq=1, ack=0"#),
            Ok((r#"a "q" \ b"#.to_owned(), 1, 0))
        );
    }

    #[test]
    fn refuses_what_is_not_a_session() {
        for (value, expected) in [
            ("", SessionProblem::Unparsable("the value is empty")),
            (r#"seq=1, ack=0"#, SessionProblem::Missing("id")),
            (r#"id="a", ack=0"#, SessionProblem::Missing("seq")),
            (r#"id="a", seq=1"#, SessionProblem::Missing("ack")),
            (r#"id=abc, seq=1, ack=0"#, SessionProblem::WrongType("id")),
            (
                r#"id="a", seq="1", ack=0"#,
                SessionProblem::WrongType("seq"),
            ),
            (
                r#"id="a", seq=1.0, ack=0"#,
                SessionProblem::WrongType("seq"),
            ),
            (r#"id="a", seq, ack=0"#, SessionProblem::WrongType("seq")),
            (r#"id="a", seq=0, ack=0"#, SessionProblem::OutOfRange("seq")),
            (
                r#"id="a", seq=-1, ack=0"#,
                SessionProblem::OutOfRange("seq"),
            ),
            (
                r#"id="a", seq=2, ack=-1"#,
                SessionProblem::OutOfRange("ack"),
            ),
            (
                r#"id="a", seq=1234567890123456, ack=0"#,
                SessionProblem::Unparsable("an integer has at most 15 digits"),
            ),
            (
                r#"id="", seq=1, ack=0"#,
                SessionProblem::InvalidId(KeyError::Empty),
            ),
            (
                r#"id=" a", seq=1, ack=0"#,
                SessionProblem::InvalidId(KeyError::SurroundingSpace),
            ),
            (
                r#"id="a" seq=1, ack=0"#,
                SessionProblem::Unparsable("members must be separated by commas"),
            ),
            (
                r#"id="a", seq=1, ack=0,"#,
                SessionProblem::Unparsable("a trailing comma"),
            ),
            (
                r#"Id="a", seq=1, ack=0"#,
                SessionProblem::Unparsable("malformed member name"),
            ),
            (
                r#"id="a", seq=1, ack=0, x=(1"2")"#,
                SessionProblem::Unparsable("malformed inner list"),
            ),
        ] {
            assert_eq!(
                SessionHeader::parse(value.as_bytes()),
                Err(expected),
                "{value}"
            );
        }
        assert!(matches!(
            SessionHeader::parse("id=\"caf\u{e9}\", seq=1, ack=0".as_bytes()),
            Err(SessionProblem::Unparsable(_))
        ));
    }

    #[test]
    fn several_fields_are_one_dictionary() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_SESSION, HeaderValue::from_static(r#"id="a""#));
        headers.append(
            IDEMPOTENCY_SESSION,
            HeaderValue::from_static("seq=3, ack=2"),
        );
        let header = session_from_headers(&headers, &IDEMPOTENCY_SESSION)
            .unwrap()
            .unwrap();
        assert_eq!(
            (header.id().as_str(), header.seq(), header.ack()),
            ("a", 3, 2)
        );
        assert!(session_from_headers(&HeaderMap::new(), &IDEMPOTENCY_SESSION).is_none());
    }

    proptest! {
        #[test]
        fn every_header_round_trips(id in "[ -~]{1,255}", seq in 1..=MAX_SEQ, ack in 0..=MAX_SEQ) {
            prop_assume!(!id.starts_with(' ') && !id.ends_with(' '));
            let header = SessionHeader::new(Key::new(id).unwrap(), seq, ack).unwrap();
            let value = header.to_header_value();
            prop_assert_eq!(SessionHeader::parse(value.as_bytes()), Ok(header));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = SessionHeader::parse(&bytes);
        }
    }
}
