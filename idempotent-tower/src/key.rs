//! Reading the idempotency key from request headers.
//!
//! Shared by both sides, so at the top of the crate rather than in `server/`: the server layer
//! reads the key with it, the session header (`session.rs`) is parsed with its RFC 8941
//! [`Parser`], and the client trims field values with [`trim_ows`].
//!
//! The IETF draft defines `Idempotency-Key` as an RFC 8941 Item whose bare item is an sf-string:
//! `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`. Most clients in the wild send the
//! key unquoted, so by default a bare value is accepted as the same key; strict mode refuses it.
//! Parameters (`;name=value`) after a quoted key are parsed and ignored. A bare key may not
//! contain `;`: read as RFC 8941, `abc;x` and `abc;y` would both be the key `abc` with different
//! parameters, so two operations would share one record; read verbatim, the same header would
//! mean something else to a strict RFC 8941 peer. It is refused, with a detail asking to quote
//! the key. Two header fields, or a list (a top-level comma), are refused: the request is
//! ambiguous.

use http::{HeaderMap, HeaderName};
use idempotent_core::{Key, KeyError};

/// Why a request's key header is unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyProblem {
    /// No key header.
    Missing,
    /// More than one key: two header fields, or a list.
    Multiple,
    /// The header is not an sf-string item (or, outside strict mode, a bare key).
    Unparsable(&'static str),
    /// Strict mode: the key was not quoted.
    BareInStrictMode,
    /// An unquoted key followed by `;`: a key with parameters, or a key containing `;`.
    BareWithSemicolon,
    /// The key is parsed but breaks the key rules.
    Invalid(KeyError),
}

impl KeyProblem {
    pub(crate) fn detail(&self, header: &HeaderName) -> String {
        match self {
            KeyProblem::Missing => format!("this request requires an {header} header"),
            KeyProblem::Multiple => {
                format!(
                    "the {header} header must carry exactly one key; it was given more than once"
                )
            }
            KeyProblem::Unparsable(why) => {
                format!("the {header} header is not a structured-field string: {why}")
            }
            KeyProblem::BareInStrictMode => format!(
                "the {header} header must be a quoted structured-field string, e.g. \"8e03978e-40d5-43e8-bc93-6894a57f9324\""
            ),
            KeyProblem::BareWithSemicolon => format!(
                "the {header} header has an unquoted key with a `;`; quote the key as a structured-field string, e.g. \"order;42\" (parameters may follow the closing quote)"
            ),
            KeyProblem::Invalid(e) => format!("the {header} header is invalid: {e}"),
        }
    }
}

/// The key carried by `headers`.
pub(crate) fn key_from_headers(
    headers: &HeaderMap,
    name: &HeaderName,
    strict: bool,
) -> Result<Key, KeyProblem> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().ok_or(KeyProblem::Missing)?;
    if values.next().is_some() {
        return Err(KeyProblem::Multiple);
    }
    let key = parse_value(value.as_bytes(), strict)?;
    Key::new(key).map_err(KeyProblem::Invalid)
}

/// Parses one header field value into the key it carries.
pub(crate) fn parse_value(value: &[u8], strict: bool) -> Result<String, KeyProblem> {
    let value = trim_ows(value);
    let mut p = Parser {
        input: value,
        pos: 0,
    };
    let key = match p.peek() {
        Some(b'"') => p.sf_string()?,
        Some(_) if strict => return Err(KeyProblem::BareInStrictMode),
        Some(_) => p.bare_key()?,
        None => return Err(KeyProblem::Invalid(KeyError::Empty)),
    };
    p.parameters()?;
    match p.peek() {
        None => Ok(key),
        Some(b',') => Err(KeyProblem::Multiple),
        Some(_) => Err(KeyProblem::Unparsable(
            "unexpected characters after the key",
        )),
    }
}

/// Bytes the parser has checked to be printable ASCII, as a string of their own (exactly as
/// long as they are: the key keeps it as it is).
fn ascii(bytes: &[u8]) -> Result<String, KeyProblem> {
    String::from_utf8(bytes.to_vec())
        .map_err(|_| KeyProblem::Unparsable("strings may contain only printable ASCII"))
}

pub(crate) fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

pub(crate) struct Parser<'a> {
    pub(crate) input: &'a [u8],
    pub(crate) pos: usize,
}

impl Parser<'_> {
    pub(crate) fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    pub(crate) fn bump(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    pub(crate) fn skip_spaces(&mut self) {
        while self.peek() == Some(b' ') {
            self.pos += 1;
        }
    }

    /// RFC 8941 §4.2.5: `"` then printable ASCII with `\"` and `\\` escapes, then `"`.
    pub(crate) fn sf_string(&mut self) -> Result<String, KeyProblem> {
        self.bump(); // opening quote
        // The usual string, without escapes (a key as the IETF draft writes one): its bytes up
        // to the closing quote, copied once. Anything else (an escape, a byte that is not
        // printable ASCII, no closing quote) is read byte by byte below, from the same place.
        let rest = &self.input[self.pos..];
        let plain = rest
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || !(0x20..=0x7e).contains(&c));
        if let Some(end) = plain.filter(|&end| rest[end] == b'"') {
            self.pos += end + 1;
            return ascii(&rest[..end]);
        }
        self.sf_string_byte_by_byte()
    }

    /// The rest of a string after its opening quote, read a byte at a time.
    fn sf_string_byte_by_byte(&mut self) -> Result<String, KeyProblem> {
        let mut out = String::new();
        loop {
            match self.bump() {
                None => return Err(KeyProblem::Unparsable("unterminated string")),
                Some(b'"') => return Ok(out),
                Some(b'\\') => match self.bump() {
                    Some(c @ (b'"' | b'\\')) => out.push(char::from(c)),
                    _ => {
                        return Err(KeyProblem::Unparsable(
                            "a backslash may only escape a quote or a backslash",
                        ));
                    }
                },
                Some(c @ 0x20..=0x7e) => out.push(char::from(c)),
                Some(_) => {
                    return Err(KeyProblem::Unparsable(
                        "strings may contain only printable ASCII",
                    ));
                }
            }
        }
    }

    /// An unquoted key: visible ASCII up to a list delimiter. A `;` is refused: whether it
    /// starts parameters or belongs to the key, two different headers would otherwise name the
    /// same key.
    fn bare_key(&mut self) -> Result<String, KeyProblem> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            match c {
                b';' => return Err(KeyProblem::BareWithSemicolon),
                b',' => break,
                b'"' | b'\\' => {
                    return Err(KeyProblem::Unparsable(
                        "an unquoted key may not contain quotes or backslashes",
                    ));
                }
                0x21..=0x7e => self.pos += 1,
                b' ' | b'\t' => {
                    // Whitespace may only precede a delimiter or the end.
                    let rest = trim_ows(&self.input[self.pos..]);
                    match rest.first() {
                        None | Some(b',') => break,
                        Some(b';') => return Err(KeyProblem::BareWithSemicolon),
                        Some(_) => {}
                    }
                    return Err(KeyProblem::Unparsable(
                        "an unquoted key may not contain spaces; quote it",
                    ));
                }
                _ => {
                    return Err(KeyProblem::Invalid(KeyError::InvalidByte {
                        offset: self.pos - start,
                        byte: c,
                    }));
                }
            }
        }
        let key = &self.input[start..self.pos];
        self.skip_spaces();
        ascii(key)
    }

    /// RFC 8941 §3.1.2 parameters, parsed for well-formedness and ignored.
    pub(crate) fn parameters(&mut self) -> Result<(), KeyProblem> {
        while self.peek() == Some(b';') {
            self.pos += 1;
            self.skip_spaces();
            self.param_key()?;
            if self.peek() == Some(b'=') {
                self.pos += 1;
                self.bare_item()?;
            }
        }
        self.skip_spaces();
        Ok(())
    }

    fn param_key(&mut self) -> Result<(), KeyProblem> {
        match self.bump() {
            Some(b'a'..=b'z' | b'*') => {}
            _ => return Err(KeyProblem::Unparsable("malformed parameter name")),
        }
        while let Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*') = self.peek() {
            self.pos += 1;
        }
        Ok(())
    }

    pub(crate) fn bare_item(&mut self) -> Result<(), KeyProblem> {
        match self.peek() {
            Some(b'"') => self.sf_string().map(drop),
            Some(b'-' | b'0'..=b'9') => {
                self.pos += 1;
                let mut digits = 0;
                while let Some(b'0'..=b'9' | b'.') = self.peek() {
                    self.pos += 1;
                    digits += 1;
                }
                if digits == 0 && self.input[self.pos - 1] == b'-' {
                    return Err(KeyProblem::Unparsable("malformed number in a parameter"));
                }
                Ok(())
            }
            Some(b'?') => {
                self.pos += 1;
                match self.bump() {
                    Some(b'0' | b'1') => Ok(()),
                    _ => Err(KeyProblem::Unparsable("malformed boolean in a parameter")),
                }
            }
            Some(b':') => {
                self.pos += 1;
                while let Some(c) = self.bump() {
                    match c {
                        b':' => return Ok(()),
                        b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' | b'=' => {}
                        _ => break,
                    }
                }
                Err(KeyProblem::Unparsable(
                    "malformed byte sequence in a parameter",
                ))
            }
            Some(b'A'..=b'Z' | b'a'..=b'z' | b'*') => {
                self.pos += 1;
                while let Some(c) = self.peek() {
                    if is_tchar(c) || c == b':' || c == b'/' {
                        self.pos += 1;
                    } else {
                        break;
                    }
                }
                Ok(())
            }
            _ => Err(KeyProblem::Unparsable("malformed parameter value")),
        }
    }
}

fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::strategy::Strategy;

    fn parse(v: &str) -> Result<String, KeyProblem> {
        parse_value(v.as_bytes(), false)
    }

    #[test]
    fn quoted_and_bare_forms_are_the_same_key() {
        assert_eq!(parse("\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse("abc-123").unwrap(), "abc-123");
        assert_eq!(parse("  \"abc-123\"\t").unwrap(), "abc-123");
        assert_eq!(
            parse("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn escapes_and_spaces_inside_strings() {
        assert_eq!(
            parse(r#""a \"quoted\" \\ key""#).unwrap(),
            r#"a "quoted" \ key"#
        );
        assert!(matches!(
            parse(r#""bad \n escape""#),
            Err(KeyProblem::Unparsable(_))
        ));
        assert!(matches!(
            parse("\"unterminated"),
            Err(KeyProblem::Unparsable(_))
        ));
    }

    #[test]
    fn parameters_are_ignored_when_well_formed() {
        assert_eq!(
            parse("\"k\"; a=1; b=?0; c=tok/en; d=\"s\"; e=:aGk=:; f").unwrap(),
            "k"
        );
        assert_eq!(parse("\"k\";v=1").unwrap(), "k");
        assert_eq!(parse("\"abc\";x").unwrap(), parse("\"abc\";y").unwrap());
        assert!(matches!(parse("\"k\";A=1"), Err(KeyProblem::Unparsable(_))));
        assert!(matches!(
            parse("\"k\";a=?2"),
            Err(KeyProblem::Unparsable(_))
        ));
        assert!(matches!(parse("\"k\";a="), Err(KeyProblem::Unparsable(_))));
    }

    /// Regression: parameters were parsed after an unquoted key, so `abc;x` and `abc;y` were
    /// both the key `abc` and two different operations replayed each other.
    #[test]
    fn an_unquoted_key_with_a_semicolon_is_refused() {
        for bare in [
            "abc;x", "abc;y", "abc;v=1", "abc ;x", "abc\t; x", "abc;", ";x", "a;b;c",
        ] {
            assert_eq!(parse(bare), Err(KeyProblem::BareWithSemicolon), "{bare:?}");
        }
        // Quoted, the `;` is part of the key, and the two keys differ.
        assert_eq!(parse("\"abc;x\"").unwrap(), "abc;x");
        assert_eq!(parse("\"abc;y\"").unwrap(), "abc;y");
        let name = HeaderName::from_static("idempotency-key");
        let detail = KeyProblem::BareWithSemicolon.detail(&name);
        assert!(detail.contains("quote the key"), "{detail}");
        // A list is still a list, whatever follows it.
        assert_eq!(parse("a,b;x"), Err(KeyProblem::Multiple));
    }

    #[test]
    fn lists_are_refused_as_multiple_keys() {
        assert_eq!(parse("\"a\", \"b\""), Err(KeyProblem::Multiple));
        assert_eq!(parse("a,b"), Err(KeyProblem::Multiple));
        let mut headers = HeaderMap::new();
        let name = HeaderName::from_static("idempotency-key");
        headers.append(&name, HeaderValue::from_static("a"));
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(
            key_from_headers(&headers, &name, false),
            Err(KeyProblem::Multiple)
        );
    }

    #[test]
    fn strict_mode_refuses_bare_keys() {
        assert_eq!(parse_value(b"abc", true), Err(KeyProblem::BareInStrictMode));
        assert_eq!(parse_value(b"\"abc\"", true).unwrap(), "abc");
    }

    #[test]
    fn key_rules_apply_after_parsing() {
        let name = HeaderName::from_static("idempotency-key");
        let key = |v: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(&name, HeaderValue::from_str(v).unwrap());
            key_from_headers(&headers, &name, false)
        };
        assert_eq!(key("\"\""), Err(KeyProblem::Invalid(KeyError::Empty)));
        assert_eq!(key(""), Err(KeyProblem::Invalid(KeyError::Empty)));
        assert_eq!(
            key(&"x".repeat(256)),
            Err(KeyProblem::Invalid(KeyError::TooLong { len: 256 }))
        );
        assert_eq!(key(&"x".repeat(255)).unwrap().as_str().len(), 255);
        assert_eq!(
            key("\" padded\""),
            Err(KeyProblem::Invalid(KeyError::SurroundingSpace))
        );
        assert!(matches!(key("two words"), Err(KeyProblem::Unparsable(_))));
        assert_eq!(
            key_from_headers(&HeaderMap::new(), &name, false),
            Err(KeyProblem::Missing)
        );
    }

    #[test]
    fn non_ascii_bytes_are_refused() {
        assert!(matches!(
            parse_value(b"caf\xc3\xa9", false),
            Err(KeyProblem::Invalid(_))
        ));
        assert!(matches!(
            parse_value(b"\"caf\xc3\xa9\"", false),
            Err(KeyProblem::Unparsable(_))
        ));
    }

    /// Bytes an unquoted key may hold: visible ASCII but `"`, `\`, `;` and `,`.
    fn is_bare_key_byte(b: u8) -> bool {
        matches!(b, 0x21..=0x7e) && !b"\"\\;,".contains(&b)
    }

    fn quote(key: &str) -> String {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_header_bytes_never_panic_nor_yield_an_invalid_key(
            bytes in proptest::prop_oneof![
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
                // Mostly the bytes keys, parameters and lists are made of.
                "[a-z0-9 \";,=?:*\\\\-]{0,40}".prop_map(String::into_bytes),
            ],
            strict in proptest::prelude::any::<bool>(),
        ) {
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                let name = HeaderName::from_static("idempotency-key");
                let mut headers = HeaderMap::new();
                headers.insert(&name, value);
                if let Ok(key) = key_from_headers(&headers, &name, strict) {
                    proptest::prop_assert!(Key::new(key.as_str()).is_ok());
                    proptest::prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= 255);
                }
            }
            let trimmed = trim_ows(&bytes);
            if let Ok(key) = parse_value(&bytes, strict) {
                // A parsed key reads back the same once quoted.
                proptest::prop_assert_eq!(parse_value(quote(&key).as_bytes(), true).unwrap(), key.as_str());
                if trimmed.first() != Some(&b'"') {
                    // An unquoted key is taken verbatim: nothing is dropped, so two different
                    // bare headers never name the same key.
                    proptest::prop_assert!(!strict);
                    proptest::prop_assert_eq!(key.as_bytes(), trimmed);
                    proptest::prop_assert!(key.bytes().all(is_bare_key_byte));
                }
            }
            if trimmed.first().is_some_and(|&b| b != b'"') && trimmed.contains(&b';') {
                proptest::prop_assert!(parse_value(&bytes, strict).is_err());
            }
        }

        #[test]
        fn a_string_reads_as_it_does_byte_by_byte(
            rest in proptest::prop_oneof![
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
                // Mostly quotes, escapes, spaces and what follows a string in a header.
                "[a-c \"\\\\;,=\t~\u{7f}]{0,30}".prop_map(String::into_bytes),
            ],
        ) {
            let mut input = vec![b'"'];
            input.extend_from_slice(&rest);
            let mut p = Parser { input: &input, pos: 0 };
            let read = p.sf_string();
            // The reference: every byte after the opening quote read one at a time, as
            // `sf_string` read every string before it took one without escapes in one copy.
            let mut reference = Parser { input: &input, pos: 1 };
            let expected = reference.sf_string_byte_by_byte();
            proptest::prop_assert_eq!(&read, &expected);
            if read.is_ok() {
                // Where the parser goes on from: just past the closing quote.
                proptest::prop_assert_eq!(p.pos, reference.pos);
            }
        }

        #[test]
        fn every_valid_key_round_trips_quoted(key in "[ -~]{1,255}") {
            if let Ok(key) = Key::new(key) {
                proptest::prop_assert_eq!(parse_value(quote(key.as_str()).as_bytes(), true).unwrap(), key.as_str());
                let with_parameters = format!("{};a=1;b", quote(key.as_str()));
                proptest::prop_assert_eq!(parse_value(with_parameters.as_bytes(), false).unwrap(), key.as_str());
            }
        }

        #[test]
        fn every_bare_key_round_trips_unquoted(key in "[!#-+\\--:<-\\[\\]-~]{1,255}") {
            proptest::prop_assert!(key.bytes().all(is_bare_key_byte));
            proptest::prop_assert_eq!(parse_value(key.as_bytes(), false).unwrap(), key.as_str());
            proptest::prop_assert_eq!(parse_value(quote(&key).as_bytes(), true).unwrap(), key.as_str());
        }
    }
}
