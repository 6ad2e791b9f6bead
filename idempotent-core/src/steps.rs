#![doc = include_str!("../docs/steps.md")]

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{Fingerprint, StorageKey, StoreError};

/// The longest step name, in bytes.
pub const MAX_STEP_NAME_LEN: usize = 64;

/// How many bytes of checkpoints one record may carry unless
/// [`Defaults::max_checkpoint_bytes`](crate::Defaults::max_checkpoint_bytes) says otherwise:
/// 64 KiB.
pub const DEFAULT_MAX_CHECKPOINT_BYTES: usize = 64 * 1024;

/// Why a step could not run or keep its checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The step's name is empty, too long or has a character outside `[A-Za-z0-9_.-]`.
    #[error(
        "invalid step name {name:?}: 1 to {MAX_STEP_NAME_LEN} bytes of [A-Za-z0-9_.-] are allowed"
    )]
    InvalidName {
        /// The name as given.
        name: String,
    },
    /// The step ran, but its checkpoint would take the record's checkpoints past the limit.
    /// Nothing was saved: a later attempt runs the step again.
    #[error(
        "the checkpoint of step {step:?} would make the record's checkpoints {size} bytes; the limit is {limit}"
    )]
    TooLarge {
        /// The step.
        step: String,
        /// What the record's checkpoints would have taken, in bytes.
        size: usize,
        /// The limit ([`Defaults::max_checkpoint_bytes`](crate::Defaults::max_checkpoint_bytes)).
        limit: usize,
    },
    /// A step's result could not be encoded as JSON, or its saved checkpoint could not be
    /// decoded into the type the step returns (the code changed between attempts).
    #[error("cannot encode or decode the checkpoint of step {step:?}")]
    Value {
        /// The step.
        step: String,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
}

/// Checks a step name: 1 to [`MAX_STEP_NAME_LEN`] bytes of `[A-Za-z0-9_.-]`.
pub(crate) fn check_name(name: &str) -> Result<(), CheckpointError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_STEP_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(CheckpointError::InvalidName {
            name: name.chars().take(2 * MAX_STEP_NAME_LEN).collect(),
        })
    }
}

/// One entry of a record's checkpoints, encoded as the store keeps it: the name's length (one
/// byte), the name, the value's length (four bytes, big-endian), the value.
pub fn encode_checkpoint(name: &str, value: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + name.len() + value.len());
    out.put_u8(u8::try_from(name.len()).unwrap_or(u8::MAX));
    out.put_slice(name.as_bytes());
    out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
    out.put_slice(value);
    out.freeze()
}

/// The checkpoints of one in-flight record, decoded from what the store keeps
/// ([`CheckpointStore::load_steps`](crate::CheckpointStore::load_steps)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoints {
    entries: Vec<(String, Bytes)>,
    encoded_len: usize,
    /// The bytes of the runtime's own entries (names starting with `~`), which the limit on
    /// steps does not count.
    own_len: usize,
}

impl Checkpoints {
    /// Decodes the store's byte string: entries one after another, as
    /// [`encode_checkpoint`] makes them; the first entry of a name wins. Anything else is
    /// [`StoreError::Corrupt`].
    pub fn decode(mut bytes: Bytes) -> Result<Checkpoints, StoreError> {
        let encoded_len = bytes.len();
        let mut own_len = 0;
        let mut entries: Vec<(String, Bytes)> = Vec::new();
        let corrupt = |why: &'static str| StoreError::Corrupt(why.into());
        while bytes.has_remaining() {
            let name_len = usize::from(bytes.get_u8());
            if name_len == 0 || bytes.remaining() < name_len + 4 {
                return Err(corrupt("a checkpoint entry is cut short"));
            }
            let name = bytes.split_to(name_len);
            let name = std::str::from_utf8(&name)
                .map_err(|_| corrupt("a checkpoint's name is not UTF-8"))?
                .to_owned();
            let value_len = bytes.get_u32() as usize;
            if bytes.remaining() < value_len {
                return Err(corrupt("a checkpoint's value is cut short"));
            }
            let value = bytes.split_to(value_len);
            if name.starts_with('~') {
                own_len += 5 + name_len + value_len;
            }
            if !entries.iter().any(|(n, _)| *n == name) {
                entries.push((name, value));
            }
        }
        Ok(Checkpoints {
            entries,
            encoded_len,
            own_len,
        })
    }

    /// The saved value of `name`.
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The checkpoints' names and values, in the order they were saved. Names that start with
    /// `~` are the runtime's own (the attempts [`ClaimHandle::count_attempt`] counts); a
    /// step's name never does.
    ///
    /// [`ClaimHandle::count_attempt`]: crate::ClaimHandle::count_attempt
    pub fn steps(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// How many bytes the store keeps for these checkpoints.
    pub fn encoded_len(&self) -> usize {
        self.encoded_len
    }

    /// How many bytes the steps' checkpoints take (the runtime's own entries left out): what
    /// [`Defaults::max_checkpoint_bytes`](crate::Defaults::max_checkpoint_bytes) bounds.
    pub fn steps_len(&self) -> usize {
        self.encoded_len - self.own_len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds an entry the store has saved.
    pub(crate) fn push(&mut self, name: &str, value: Bytes, encoded_len: usize) {
        self.encoded_len += encoded_len;
        if name.starts_with('~') {
            self.own_len += encoded_len;
        }
        if self.get(name).is_none() {
            self.entries.push((name.to_owned(), value));
        }
    }
}

/// An in-flight record that a completer may finish: its lease ended a while ago, nobody took
/// it over, and the layer that claimed it saved the request
/// ([`CheckpointStore::abandoned`](crate::CheckpointStore::abandoned)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// The record's storage key.
    pub key: StorageKey,
    /// The fingerprint it was claimed with.
    pub fingerprint: Fingerprint,
    /// The request as saved with [`CheckpointStore::save_request`](crate::CheckpointStore::save_request).
    pub request: Bytes,
    /// How long ago its lease ended, by the store's clock.
    pub idle: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["a", "reserve", "charge-2", "x.y_z", &"n".repeat(64)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "~request", "a b", "é", "a:b", &"n".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn entries_round_trip_and_the_first_of_a_name_wins() {
        let mut bytes = BytesMut::new();
        bytes.put(encode_checkpoint("reserve", b"\"r-1\""));
        bytes.put(encode_checkpoint("charge", b""));
        bytes.put(encode_checkpoint("reserve", b"\"r-2\""));
        let len = bytes.len();
        let decoded = Checkpoints::decode(bytes.freeze()).unwrap();
        assert_eq!(decoded.get("reserve").unwrap().as_ref(), b"\"r-1\"");
        assert_eq!(decoded.get("charge").unwrap().as_ref(), b"");
        assert_eq!(decoded.steps().count(), 2);
        assert_eq!(decoded.encoded_len(), len);
        assert!(Checkpoints::decode(Bytes::new()).unwrap().is_empty());
    }

    #[test]
    fn garbage_is_corrupt_never_a_panic() {
        let whole = encode_checkpoint("reserve", b"value");
        for cut in 1..whole.len() {
            let err = Checkpoints::decode(whole.slice(..cut)).unwrap_err();
            assert!(matches!(err, StoreError::Corrupt(_)), "{cut}");
        }
        assert!(Checkpoints::decode(Bytes::from_static(&[0, 0, 0, 0, 0])).is_err());
        assert!(Checkpoints::decode(Bytes::from_static(&[1, 0xff, 0, 0, 0, 0])).is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = Checkpoints::decode(Bytes::from(bytes));
        }
    }
}
