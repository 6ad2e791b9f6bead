//! Fingerprints: digests of what a request *means*.

use std::fmt;
use std::sync::OnceLock;

mod canonical;
#[cfg(test)]
mod canonical_tests;

pub use canonical::CanonicalError;

const BYTES_CONTEXT: &str = "idempotent 2026-11 fingerprint bytes v1";

/// A hasher in BLAKE3's key derivation mode for `context`, whose context key is derived once
/// per process: deriving it costs as much as hashing a small request. A new hasher is made
/// from that key where it is used, rather than cloned from a ready one and the 1.9 KiB clone
/// copied into place.
#[inline]
pub(crate) fn keyed(
    context: &'static str,
    cell: &'static OnceLock<blake3::hazmat::ContextKey>,
) -> blake3::Hasher {
    use blake3::hazmat::HasherExt;
    let key = cell.get_or_init(|| blake3::hazmat::hash_derive_key_context(context));
    blake3::Hasher::new_from_context_key(key)
}

static BYTES_KEY: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
static FIELDS_KEY: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
static VALUE_KEY: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
const FIELDS_CONTEXT: &str = "idempotent 2026-11 fingerprint fields v1";
const VALUE_CONTEXT: &str = "idempotent 2026-11 fingerprint serde v1";

/// A 32-byte blake3 digest of what a request means.
///
/// A retry with the same key must mean the same thing: the runtime compares the fingerprint of
/// every request with the one recorded for its key and answers a difference with
/// [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch) instead of replaying a
/// response that belongs to another request.
///
/// The three constructors use separate derivation contexts, so a fingerprint built one way never
/// equals one built another way. All three are stable across processes, platforms and releases.
///
/// ```
/// use idempotent_core::Fingerprint;
/// use std::collections::{BTreeMap, HashMap};
///
/// // From a serde value, canonically: map order and integer width do not matter.
/// let a: HashMap<&str, u64> = [("amount", 100), ("to", 7)].into();
/// let b: BTreeMap<&str, u8> = [("to", 7), ("amount", 100)].into();
/// assert_eq!(Fingerprint::of(&a)?, Fingerprint::of(&b)?);
///
/// // From fields, each length-delimited: ("ab", "c") differs from ("a", "bc").
/// let f = Fingerprint::builder().field(b"ab").field(b"c").finish();
/// assert_ne!(f, Fingerprint::builder().field(b"a").field(b"bc").finish());
/// # Ok::<(), idempotent_core::CanonicalError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request that carries no meaning beyond its key.
    pub fn empty() -> Self {
        static EMPTY: OnceLock<Fingerprint> = OnceLock::new();
        *EMPTY.get_or_init(|| Self::builder().finish())
    }

    /// The fingerprint of raw bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut hasher = keyed(BYTES_CONTEXT, &BYTES_KEY);
        hasher.update(bytes);
        Fingerprint(*hasher.finalize().as_bytes())
    }

    /// The fingerprint of a serde value, encoded canonically: maps and struct fields in sorted
    /// order, integers independent of width, floats widened to `f64` with `-0.0` equal to `0.0`.
    /// Struct and type names are not part of it; field and variant names are.
    ///
    /// Fails for values with no canonical form: NaN, a map with two equal keys, nesting deeper
    /// than 128 levels, or a `Serialize` implementation that reports an error.
    pub fn of<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, CanonicalError> {
        let mut hasher = keyed(VALUE_CONTEXT, &VALUE_KEY);
        canonical::hash_canonical(&mut hasher, value)?;
        Ok(Fingerprint(*hasher.finalize().as_bytes()))
    }

    /// Starts a fingerprint over a sequence of fields (the HTTP layer uses method, path,
    /// query and body).
    #[inline]
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder {
            hasher: None,
            open: None,
            pending: [0; PENDING],
            pending_len: 0,
        }
    }

    /// Wraps raw digest bytes, e.g. read back from a backend.
    pub const fn from_digest(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}

/// Builds a [`Fingerprint`] from a sequence of fields. Created by [`Fingerprint::builder`].
///
/// Each field is delimited, so no two different field sequences hash the same. A field may be
/// fed in chunks (a streamed body) with [`begin_field`](Self::begin_field),
/// [`update`](Self::update) and [`end_field`](Self::end_field).
#[derive(Clone)]
pub struct FingerprintBuilder {
    /// Made once `pending` first overflows. Most requests' fields fit in `pending`, and their
    /// hasher is made in [`finish`](Self::finish), where it is used: a builder that held one
    /// would copy its 1.9 KiB each time it moves.
    hasher: Option<Box<blake3::Hasher>>,
    open: Option<u64>,
    /// Bytes not yet given to the hasher: a request's fields are a dozen small writes (each
    /// delimiter is one), and each `blake3::Hasher::update` costs more than copying them
    /// here. The digest is of the same byte stream either way.
    pending: [u8; PENDING],
    pending_len: usize,
}

/// How many bytes [`FingerprintBuilder`] gathers before it hashes them.
const PENDING: usize = 256;

impl FingerprintBuilder {
    /// Adds one whole field.
    pub fn field(mut self, bytes: &[u8]) -> Self {
        self.push_field(bytes);
        self
    }

    /// Adds one whole field, by reference.
    pub fn push_field(&mut self, bytes: &[u8]) {
        self.begin_field();
        self.update(bytes);
        self.end_field();
    }

    /// Opens a field to be fed in chunks. Opening a field closes any open one.
    pub fn begin_field(&mut self) {
        if self.open.is_some() {
            self.end_field();
        }
        self.feed(b"{");
        self.open = Some(0);
    }

    /// Feeds a chunk of the open field (opening one if none is open).
    pub fn update(&mut self, chunk: &[u8]) {
        if self.open.is_none() {
            self.begin_field();
        }
        self.feed(chunk);
        if let Some(len) = &mut self.open {
            *len += chunk.len() as u64;
        }
    }

    /// Closes the open field; a no-op when none is open.
    pub fn end_field(&mut self) {
        // The length trailer delimits the field: fields of different lengths never alias.
        if let Some(len) = self.open.take() {
            self.feed(b"}");
            self.feed(&len.to_le_bytes());
        }
    }

    /// Finishes the fingerprint.
    #[inline]
    pub fn finish(mut self) -> Fingerprint {
        self.end_field();
        let pending = &self.pending[..self.pending_len];
        let digest = match &mut self.hasher {
            Some(hasher) => hasher.update(pending).finalize(),
            None => keyed(FIELDS_CONTEXT, &FIELDS_KEY)
                .update(pending)
                .finalize(),
        };
        Fingerprint(*digest.as_bytes())
    }

    fn feed(&mut self, bytes: &[u8]) {
        if let Some(free) = self
            .pending
            .get_mut(self.pending_len..self.pending_len + bytes.len())
        {
            free.copy_from_slice(bytes);
            self.pending_len += bytes.len();
            return;
        }
        self.flush();
        if bytes.len() < PENDING {
            self.pending[..bytes.len()].copy_from_slice(bytes);
            self.pending_len = bytes.len();
        } else {
            Self::made(&mut self.hasher).update(bytes);
        }
    }

    fn flush(&mut self) {
        let len = std::mem::take(&mut self.pending_len);
        Self::made(&mut self.hasher).update(&self.pending[..len]);
    }

    /// The builder's hasher, made on first use.
    fn made(hasher: &mut Option<Box<blake3::Hasher>>) -> &mut blake3::Hasher {
        hasher.get_or_insert_with(|| Box::new(keyed(FIELDS_CONTEXT, &FIELDS_KEY)))
    }
}

impl fmt::Debug for FingerprintBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintBuilder").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_field_equals_whole_field() {
        let whole = Fingerprint::builder()
            .field(b"POST")
            .field(b"hello world")
            .finish();
        let mut b = Fingerprint::builder();
        b.push_field(b"POST");
        b.begin_field();
        b.update(b"hello");
        b.update(b" world");
        b.end_field();
        assert_eq!(whole, b.finish());
    }

    #[test]
    fn field_boundaries_matter() {
        let f = |fields: &[&[u8]]| {
            let mut b = Fingerprint::builder();
            for x in fields {
                b.push_field(x);
            }
            b.finish()
        };
        assert_ne!(f(&[b"ab", b"c"]), f(&[b"a", b"bc"]));
        assert_ne!(f(&[b"", b"a"]), f(&[b"a"]));
        assert_ne!(f(&[b"a}", b""]), f(&[b"a", b"}"]));
        assert_ne!(f(&[]), f(&[b""]));
    }

    #[test]
    fn constructors_never_collide() {
        assert_ne!(Fingerprint::from_bytes(b""), Fingerprint::empty());
        assert_ne!(Fingerprint::from_bytes(b"x"), Fingerprint::of("x").unwrap());
        assert_ne!(
            Fingerprint::builder().field(b"x").finish(),
            Fingerprint::from_bytes(b"x")
        );
    }

    #[test]
    fn fingerprints_are_stable_across_releases() {
        // Changing any of these orphans the fingerprints stored in shared stores: retries after
        // an upgrade would be refused as mismatches.
        assert_eq!(hex(&Fingerprint::from_bytes(b"abc")), GOLDEN_BYTES);
        assert_eq!(
            hex(&Fingerprint::builder()
                .field(b"POST")
                .field(b"/payments")
                .finish()),
            GOLDEN_FIELDS
        );
    }

    /// The builder gathers small writes before hashing them; the digest must be that of the
    /// same bytes written one by one, whatever the sizes of the fields and chunks.
    fn unbuffered(fields: &[Vec<Vec<u8>>]) -> Fingerprint {
        // Not `keyed`: the reference is made the way BLAKE3 documents key derivation.
        let mut hasher = blake3::Hasher::new_derive_key(FIELDS_CONTEXT);
        for chunks in fields {
            hasher.update(b"{");
            let mut len = 0u64;
            for chunk in chunks {
                hasher.update(chunk);
                len += chunk.len() as u64;
            }
            hasher.update(b"}");
            hasher.update(&len.to_le_bytes());
        }
        Fingerprint(*hasher.finalize().as_bytes())
    }

    proptest::proptest! {
        #[test]
        fn gathering_writes_does_not_change_the_digest(
            fields in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::prop_oneof![
                        proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
                        proptest::collection::vec(proptest::prelude::any::<u8>(), 200..600),
                    ],
                    0..4,
                ),
                0..12,
            )
        ) {
            let mut b = Fingerprint::builder();
            for chunks in &fields {
                b.begin_field();
                for chunk in chunks {
                    b.update(chunk);
                }
                b.end_field();
            }
            proptest::prop_assert_eq!(b.finish(), unbuffered(&fields));
        }
    }

    #[test]
    fn large_fields_are_stable_across_releases() {
        let body: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            hex(&Fingerprint::builder()
                .field(b"POST")
                .field(&body)
                .field(&body[..255])
                .finish()),
            hex(&unbuffered(&[
                vec![b"POST".to_vec()],
                vec![body.clone()],
                vec![body[..255].to_vec()],
            ]))
        );
    }

    #[test]
    fn every_context_hashes_as_blake3_key_derivation() {
        // `keyed` makes its hashers from context keys derived once: the digests are those of
        // hashers BLAKE3 derives from the context strings themselves.
        assert_eq!(
            Fingerprint::from_bytes(b"abc").as_bytes(),
            &blake3::derive_key(BYTES_CONTEXT, b"abc")
        );
        let value = ("payments", 1999u32, [true, false]);
        let mut reference = blake3::Hasher::new_derive_key(VALUE_CONTEXT);
        canonical::hash_canonical(&mut reference, &value).expect("a canonical value");
        assert_eq!(
            Fingerprint::of(&value).expect("a fingerprint").as_bytes(),
            reference.finalize().as_bytes()
        );
    }

    fn hex(f: &Fingerprint) -> String {
        f.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    const GOLDEN_BYTES: &str = "1b8ab48a911833b3beafb4e28bb001aac7a4e2268ff4758d2b47df7dbbc9c907";
    const GOLDEN_FIELDS: &str = "ec288c9454a48d4ba1fa8255aea5acf86675c1d376055ed4c4ec733655141316";
}
