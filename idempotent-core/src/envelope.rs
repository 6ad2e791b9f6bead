#![doc = include_str!("../docs/envelope.md")]

use bytes::{BufMut, Bytes, BytesMut};

const MAGIC: &[u8; 2] = b"ID";
const VERSION: u8 = 1;
const HEADER: usize = 12;
const KIND_VALUE: u8 = 0;
const KIND_NOT_RETAINED: u8 = 1;

/// Whether a store's envelopes carry a checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Computed on write, checked on read: the bytes went through a store outside the process.
    Checksummed,
    /// Neither: the store keeps the bytes in this process and hands back the same ones.
    InProcess,
}

impl Integrity {
    fn checksum(self, bytes: &[u8]) -> [u8; 8] {
        match self {
            Integrity::Checksummed => checksum(bytes),
            Integrity::InProcess => [0; 8],
        }
    }
}

/// What a decoded envelope holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// The result bytes.
    Value(Bytes),
    /// The call completed but its result was too large to keep.
    NotRetained,
}

/// Why stored bytes are not a valid envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("stored record is {0} bytes, shorter than the 12-byte envelope header")]
    /// Shorter than the header (its length).
    Truncated(usize),
    #[error("stored record does not start with the envelope magic")]
    /// Not an envelope of this crate.
    BadMagic,
    #[error("stored record has envelope version {0}; this release reads version 1")]
    /// Written by a newer release (its version).
    UnknownVersion(u8),
    #[error("stored record has unknown kind {0}")]
    /// A kind this release does not know.
    UnknownKind(u8),
    #[error("stored record checksum does not match its contents")]
    /// The bytes were damaged.
    Checksum,
}

fn checksum(bytes: &[u8]) -> [u8; 8] {
    let digest = blake3::hash(bytes);
    let mut out = [0; 8];
    out.copy_from_slice(&digest.as_bytes()[..8]);
    out
}

/// The envelope of `result`: the bytes a completion writes.
pub fn encode_value(result: &[u8], integrity: Integrity) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER + result.len());
    out.put_slice(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(KIND_VALUE);
    out.put_slice(&integrity.checksum(result));
    out.put_slice(result);
    out.freeze()
}

/// The envelope of a call that ran and whose result is not kept.
pub fn encode_not_retained() -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER);
    out.put_slice(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(KIND_NOT_RETAINED);
    out.put_slice(&checksum(&[]));
    out.freeze()
}

/// The stored size of a result of `len` bytes: what a store that bounds its records' bytes
/// must allow for a result of `len` bytes.
pub const fn encoded_len(len: usize) -> usize {
    HEADER + len
}

/// The result `stored` holds, or why it is not a whole envelope; never panics, whatever
/// the bytes.
pub fn decode(stored: &Bytes, integrity: Integrity) -> Result<Stored, EnvelopeError> {
    if stored.len() < HEADER {
        return Err(EnvelopeError::Truncated(stored.len()));
    }
    if &stored[..2] != MAGIC {
        return Err(EnvelopeError::BadMagic);
    }
    if stored[2] != VERSION {
        return Err(EnvelopeError::UnknownVersion(stored[2]));
    }
    let body = &stored[HEADER..];
    if integrity == Integrity::Checksummed && stored[4..HEADER] != checksum(body) {
        return Err(EnvelopeError::Checksum);
    }
    match stored[3] {
        KIND_VALUE => Ok(Stored::Value(stored.slice(HEADER..))),
        KIND_NOT_RETAINED if body.is_empty() => Ok(Stored::NotRetained),
        kind => Err(EnvelopeError::UnknownKind(kind)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_empty_small_and_large_results() {
        for len in [0, 1, 100, 1 << 20] {
            let result: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let enc = encode_value(&result, Integrity::Checksummed);
            assert_eq!(enc.len(), encoded_len(len));
            assert_eq!(
                decode(&enc, Integrity::Checksummed),
                Ok(Stored::Value(Bytes::from(result)))
            );
        }
        assert_eq!(
            decode(&encode_not_retained(), Integrity::Checksummed),
            Ok(Stored::NotRetained)
        );
    }

    #[test]
    fn every_corruption_is_an_error() {
        let enc = encode_value(b"{\"id\":1}", Integrity::Checksummed);
        for i in 0..enc.len() {
            let mut bad = enc.to_vec();
            bad[i] ^= 0x01;
            assert!(
                decode(&Bytes::from(bad), Integrity::Checksummed).is_err(),
                "flip at {i} went unnoticed"
            );
        }
        for cut in 0..enc.len() {
            assert!(
                decode(&enc.slice(..cut), Integrity::Checksummed).is_err(),
                "truncation to {cut}"
            );
        }
        assert_eq!(
            decode(&Bytes::new(), Integrity::Checksummed),
            Err(EnvelopeError::Truncated(0))
        );
        let mut future = enc.to_vec();
        future[2] = 2;
        assert_eq!(
            decode(&Bytes::from(future), Integrity::Checksummed),
            Err(EnvelopeError::UnknownVersion(2))
        );
    }

    #[test]
    fn in_process_envelopes_skip_only_the_checksum() {
        let enc = encode_value(b"{\"id\":1}", Integrity::InProcess);
        assert_eq!(&enc[4..HEADER], &[0; 8]);
        assert_eq!(
            decode(&enc, Integrity::InProcess),
            Ok(Stored::Value(Bytes::from_static(b"{\"id\":1}")))
        );
        // A checksummed envelope reads the same in process; the reverse fails the checksum.
        let checked = encode_value(b"{\"id\":1}", Integrity::Checksummed);
        assert_eq!(
            decode(&checked, Integrity::InProcess),
            decode(&enc, Integrity::InProcess)
        );
        assert_eq!(
            decode(&enc, Integrity::Checksummed),
            Err(EnvelopeError::Checksum)
        );
        // The header is still checked.
        for at in 0..4 {
            let mut bad = enc.to_vec();
            bad[at] ^= 0x02;
            assert!(
                decode(&Bytes::from(bad), Integrity::InProcess).is_err(),
                "flip at {at}"
            );
        }
        for cut in 0..HEADER {
            assert!(decode(&enc.slice(..cut), Integrity::InProcess).is_err());
        }
    }

    /// Bytes that reach every check: arbitrary, or a valid envelope with one byte changed,
    /// inserted or cut.
    fn stored_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let valid = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(|r| encode_value(
                &r,
                Integrity::Checksummed
            )
            .to_vec()),
            Just(encode_not_retained().to_vec()),
        ];
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            (valid, any::<prop::sample::Index>(), any::<u8>(), 0..3u8).prop_map(
                |(mut bytes, at, byte, damage)| {
                    let i = at.index(bytes.len());
                    match damage {
                        0 => bytes[i] ^= byte | 1,
                        1 => bytes.insert(i, byte),
                        _ => bytes.truncate(i),
                    }
                    bytes
                }
            ),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_decode_or_fail_without_panicking(bytes in stored_bytes()) {
            let stored = Bytes::from(bytes);
            // Whatever decodes is exactly what the encoder writes for it: no two byte strings
            // decode to the same result.
            match decode(&stored, Integrity::Checksummed) {
                Ok(Stored::Value(result)) => proptest::prop_assert_eq!(encode_value(&result, Integrity::Checksummed), stored),
                Ok(Stored::NotRetained) => proptest::prop_assert_eq!(encode_not_retained(), stored),
                Err(_) => {}
            }
        }

        #[test]
        fn every_result_round_trips(result in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1024)) {
            let stored = encode_value(&result, Integrity::Checksummed);
            proptest::prop_assert_eq!(stored.len(), encoded_len(result.len()));
            proptest::prop_assert_eq!(decode(&stored, Integrity::Checksummed), Ok(Stored::Value(Bytes::from(result))));
        }
    }
}
