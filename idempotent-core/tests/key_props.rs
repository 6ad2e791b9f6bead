//! `Key` accepts exactly the documented keys, from every constructor, and never panics.

use idempotent_core::{Key, KeyError, MAX_KEY_LEN};
use proptest::prelude::*;

/// The key rules, spelled out independently of the crate: the first rule `s` breaks.
fn expected(s: &str) -> Result<(), KeyError> {
    let bytes = s.as_bytes();
    if bytes.is_empty() {
        return Err(KeyError::Empty);
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: bytes.len() });
    }
    for (offset, &byte) in bytes.iter().enumerate() {
        if !(b' '..=b'~').contains(&byte) {
            return Err(KeyError::InvalidByte { offset, byte });
        }
    }
    if s.starts_with(' ') || s.ends_with(' ') {
        return Err(KeyError::SurroundingSpace);
    }
    Ok(())
}

/// Strings near the rules: printable ASCII with spaces at the edges, some control and
/// non-ASCII characters, lengths around the limit; and arbitrary Unicode.
fn candidate() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,300}",
        " ?[!-~]{1,8} ?",
        "[ -~]{250,260}",
        "[ -~\\x00-\\x1f\\x7f\\u{80}-\\u{10ffff}]{0,20}",
        any::<String>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_constructor_accepts_exactly_the_documented_keys(s in candidate()) {
        let want = expected(&s);
        let new = Key::new(s.as_str());
        prop_assert_eq!(new.clone().map(|_| ()), want);
        prop_assert_eq!(&s.parse::<Key>(), &new);
        prop_assert_eq!(&Key::try_from(s.as_str()), &new);
        prop_assert_eq!(&Key::try_from(s.clone()), &new);
        if let Ok(key) = new {
            // A key is the string it was made from, and reads back as itself.
            prop_assert_eq!(key.as_str(), s.as_str());
            prop_assert_eq!(key.as_ref(), s.as_str());
            prop_assert_eq!(key.as_str().parse::<Key>(), Ok(key.clone()));
            prop_assert_eq!(Key::new(key.as_str().to_owned()), Ok(key));
        }
    }

    #[test]
    fn arbitrary_bytes_are_a_key_or_a_typed_error(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        // Keys arrive as bytes (headers, metadata). Valid UTF-8 is judged by the rules above;
        // the rest, read leniently, holds a replacement character and is never a key.
        let text = String::from_utf8_lossy(&bytes);
        let judged = Key::new(text.as_ref()).map(|_| ());
        prop_assert_eq!(&judged, &expected(&text));
        if std::str::from_utf8(&bytes).is_err() {
            prop_assert!(judged.is_err());
        }
    }
}
