//! Idempotency keys, scopes and the storage keys derived from them.

use std::fmt;
use std::str::FromStr;

/// The longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as sent by a client.
///
/// A key is 1 to [`MAX_KEY_LEN`] bytes of printable ASCII: visible characters `0x21..=0x7E`,
/// plus the space `0x20` between them (an RFC 8941 sf-string may contain spaces; a bare header
/// token cannot). A key may not start or end with a space, so a key always has the same meaning
/// whether it arrived quoted or bare. Every key can be sent as a quoted sf-string; a key holding
/// a space, `"`, `\`, `;` or `,` can only be sent quoted (`;` would start RFC 8941 parameters,
/// `,` a list).
///
/// A key is never used raw as a storage key: the store sees only a [`StorageKey`], a fixed-size
/// digest of the namespace, the [`Scope`] and the key.
///
/// ```
/// use idempotent_core::Key;
///
/// let key: Key = "order-8472".parse()?;
/// assert_eq!(key.as_str(), "order-8472");
/// assert!(Key::new("").is_err());
/// assert!(Key::new("naïve").is_err());
/// # Ok::<(), idempotent_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Box<str>);

/// Why a string is not a valid [`Key`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    #[error("idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("idempotency key is {len} bytes long; the limit is {MAX_KEY_LEN}")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// The key contains a byte outside printable ASCII.
    #[error(
        "idempotency key has byte 0x{byte:02x} at offset {offset}; only printable ASCII (0x20..=0x7e) is allowed"
    )]
    InvalidByte {
        /// Offset of the first offending byte.
        offset: usize,
        /// The offending byte.
        byte: u8,
    },
    /// The key starts or ends with a space.
    #[error("idempotency key starts or ends with a space")]
    SurroundingSpace,
}

impl Key {
    /// Validates `key`.
    pub fn new(key: impl AsRef<str> + Into<String>) -> Result<Self, KeyError> {
        validate(key.as_ref().as_bytes())?;
        Ok(Key(key.into().into_boxed_str()))
    }

    /// The key as sent by the client.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Checks the key rules on raw bytes without allocating.
pub(crate) fn validate(bytes: &[u8]) -> Result<(), KeyError> {
    if bytes.is_empty() {
        return Err(KeyError::Empty);
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: bytes.len() });
    }
    if let Some(offset) = bytes.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(KeyError::InvalidByte {
            offset,
            byte: bytes[offset],
        });
    }
    if bytes[0] == b' ' || bytes[bytes.len() - 1] == b' ' {
        return Err(KeyError::SurroundingSpace);
    }
    Ok(())
}

impl FromStr for Key {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        Key::new(s)
    }
}

impl TryFrom<&str> for Key {
    type Error = KeyError;
    fn try_from(s: &str) -> Result<Self, KeyError> {
        Key::new(s)
    }
}

impl TryFrom<String> for Key {
    type Error = KeyError;
    fn try_from(s: String) -> Result<Self, KeyError> {
        Key::new(s)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Keys are client-supplied and may be sensitive, so `Debug` shows only their length and a
/// short digest; use [`Key::as_str`] to see the key itself.
impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = blake3::hash(self.0.as_bytes());
        write!(
            f,
            "Key(len={}, blake3={})",
            self.0.len(),
            &digest.to_hex()[..12]
        )
    }
}

/// Who a key belongs to.
///
/// Two requests share a record only when their namespace, scope and key are all equal, so one
/// tenant can never replay — or even detect — another tenant's response. Each part is optional
/// and opaque bytes; parts are length-prefixed when hashed, so `("ab", "c")` and `("a", "bc")`
/// never collide.
///
/// ```
/// use idempotent_core::Scope;
///
/// let scope = Scope::new().tenant("acme").principal("alice").operation("POST /payments");
/// assert_ne!(scope, Scope::new().tenant("acme").principal("bob").operation("POST /payments"));
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: Option<Box<[u8]>>,
    principal: Option<Box<[u8]>>,
    operation: Option<Box<[u8]>>,
}

impl Scope {
    /// An empty scope: every caller shares one key space.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the tenant (organisation, account) the key belongs to.
    pub fn tenant(mut self, tenant: impl AsRef<[u8]>) -> Self {
        self.tenant = Some(tenant.as_ref().into());
        self
    }

    /// Sets the principal (user, API client) the key belongs to.
    pub fn principal(mut self, principal: impl AsRef<[u8]>) -> Self {
        self.principal = Some(principal.as_ref().into());
        self
    }

    /// Sets the operation (function name, route) the key belongs to.
    pub fn operation(mut self, operation: impl AsRef<[u8]>) -> Self {
        self.operation = Some(operation.as_ref().into());
        self
    }
}

impl Scope {
    /// Which parts are set: `(tenant, principal, operation)`.
    pub fn parts_set(&self) -> (bool, bool, bool) {
        (
            self.tenant.is_some(),
            self.principal.is_some(),
            self.operation.is_some(),
        )
    }
}

/// Scope parts may be credentials (an `Authorization` digest), so `Debug` shows only which parts
/// are set.
impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = |p: &Option<Box<[u8]>>| if p.is_some() { "set" } else { "unset" };
        f.debug_struct("Scope")
            .field("tenant", &part(&self.tenant))
            .field("principal", &part(&self.principal))
            .field("operation", &part(&self.operation))
            .finish()
    }
}

/// The fixed-size name under which a store keeps one record: a blake3 digest of the namespace,
/// the [`Scope`] and the [`Key`].
///
/// Storage keys have bounded size, contain no client bytes (so no injection into a backend's key
/// syntax), and map to exactly one backend key (so one Redis Cluster slot per record).
///
/// The records of a [client session](crate::session) have storage keys too: the session's own
/// record ([`SessionKey::record_key`](crate::SessionKey::record_key)) and one per request of
/// the session ([`SessionKey::seq_key`](crate::SessionKey::seq_key)). Such a key is the
/// session's digest plus its place in the session ([`session_place`](Self::session_place)),
/// so that a store can keep a session's records together (one Redis Cluster slot) and drop a
/// range of them at once.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StorageKey {
    digest: [u8; 32],
    place: Place,
}

/// Where a storage key sits: a record of its own, or in a client session.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Place {
    /// A key of its own (an idempotency key).
    Own,
    /// A session's own record: its acknowledged mark and its epoch.
    Session,
    /// The record of request `seq` in the session's incarnation `epoch`.
    Seq { epoch: u64, seq: u64 },
}

/// Where a storage key sits in a client session, as [`StorageKey::session_place`] tells it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SessionPlace {
    /// The session's own record.
    Session,
    /// The record of request `seq` in the session's incarnation `epoch`.
    Seq {
        /// The session's incarnation (see [`SessionGate::Open`](crate::SessionGate::Open)).
        epoch: u64,
        /// The request's sequence number.
        seq: u64,
    },
}

/// A storage key as bytes a backend keeps (the PostgreSQL store's `storage_key` column): the
/// 32-byte digest of a key of its own, or the session's digest followed by the epoch and the
/// sequence number, big-endian (zero for the session's own record), so that the records of
/// one session sort together and in order.
#[derive(Clone, Copy)]
pub struct RecordBytes {
    bytes: [u8; 48],
    len: usize,
}

impl AsRef<[u8]> for RecordBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Feeds only the first 8 bytes to the hasher: the key is already a uniform digest, so they
/// identify it as well as all 32 (finding two keys that share them takes about 2^32 digests
/// per collision), and hash maps keyed by storage keys hash a quarter of the input. Maps should
/// still use a keyed hasher (std's default), so that colliding *buckets* cannot be precomputed.
impl std::hash::Hash for StorageKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.digest[..8]);
        let first = u64::from_le_bytes(first);
        match self.place {
            Place::Own => state.write_u64(first),
            // The records of one session share the digest: their place tells them apart.
            Place::Session => state.write_u64(!first),
            Place::Seq { epoch, seq } => {
                state.write_u64(first ^ seq.rotate_left(17) ^ epoch.rotate_left(41))
            }
        }
    }
}

const STORAGE_KEY_CONTEXT: &str = "idempotent 2026-11 storage key v1";

impl StorageKey {
    /// Derives the storage key for `key` in `scope` under `namespace`.
    ///
    /// The derivation is stable across processes, platforms and releases of this crate.
    pub fn derive(namespace: &[u8], scope: &Scope, key: &Key) -> Self {
        Self::derive_raw(namespace, scope, key.as_str().as_bytes())
    }

    pub(crate) fn derive_raw(namespace: &[u8], scope: &Scope, key: &[u8]) -> Self {
        // The context key is derived once per process; each call feeds a new hasher one
        // buffer (a few small updates cost more than the hashing itself).
        static KEYED: std::sync::OnceLock<blake3::hazmat::ContextKey> = std::sync::OnceLock::new();
        let mut hasher = crate::fingerprint::keyed(STORAGE_KEY_CONTEXT, &KEYED);
        let fields = [
            (b'n', Some(namespace)),
            (b't', scope.tenant.as_deref()),
            (b'p', scope.principal.as_deref()),
            (b'o', scope.operation.as_deref()),
            (b'k', Some(key)),
        ];
        let len: usize = fields
            .iter()
            .map(|(_, v)| 2 + v.map_or(0, |v| 8 + v.len()))
            .sum();
        let mut stack = [0u8; 512];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= stack.len() {
            &mut stack[..len]
        } else {
            heap.resize(len, 0);
            &mut heap
        };
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            buf[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        for (tag, value) in fields {
            match value {
                None => put(&[tag, 0]),
                Some(v) => {
                    put(&[tag, 1]);
                    put(&(v.len() as u64).to_le_bytes());
                    put(v);
                }
            }
        }
        hasher.update(buf);
        StorageKey::from_bytes(*hasher.finalize().as_bytes())
    }

    /// Wraps raw digest bytes, e.g. read back from a backend: a key of its own.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        StorageKey {
            digest: bytes,
            place: Place::Own,
        }
    }

    /// The storage key of a client session's own record, whose session digest is `digest`: for
    /// a store that reads keys back from where it keeps them (see [`session_place`](Self::session_place)).
    pub const fn session(digest: [u8; 32]) -> Self {
        StorageKey {
            digest,
            place: Place::Session,
        }
    }

    /// The storage key of request `seq` in incarnation `epoch` of the client session whose
    /// digest is `digest`: for a store that reads keys back from where it keeps them.
    pub const fn seq(digest: [u8; 32], epoch: u64, seq: u64) -> Self {
        StorageKey {
            digest,
            place: Place::Seq { epoch, seq },
        }
    }

    /// The digest bytes: of the key, or for a key in a client session, of the session.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Where this key sits in a client session, or `None` for a key of its own.
    pub const fn session_place(&self) -> Option<SessionPlace> {
        match self.place {
            Place::Own => None,
            Place::Session => Some(SessionPlace::Session),
            Place::Seq { epoch, seq } => Some(SessionPlace::Seq { epoch, seq }),
        }
    }

    /// The key as the bytes a backend keeps (see [`RecordBytes`]).
    pub fn record_bytes(&self) -> RecordBytes {
        let mut bytes = [0u8; 48];
        bytes[..32].copy_from_slice(&self.digest);
        let len = match self.place {
            Place::Own => 32,
            Place::Session => 48,
            Place::Seq { epoch, seq } => {
                bytes[32..40].copy_from_slice(&epoch.to_be_bytes());
                bytes[40..].copy_from_slice(&seq.to_be_bytes());
                48
            }
        };
        RecordBytes { bytes, len }
    }

    /// The key to hand to a downstream system for the operation of this storage key whose
    /// record lifetime began with the claim holding `lifetime` (a payment provider's
    /// `Idempotency-Key`, a consumer that deduplicates, the outbox relay). The running work
    /// gets it from [`KeyClaim::operation_key`](crate::KeyClaim::operation_key).
    ///
    /// A record's lifetime begins with the claim that finds no live record, and goes on
    /// through every takeover of the same request after a lease lapsed or a claim was
    /// released, until the record expires. So the key is the same for every owner and every
    /// attempt of one operation, and different when the client key is reused after its
    /// record expired (a new operation, which must reach the provider as a new charge). It
    /// differs across scopes and namespaces, and reveals nothing of the client's key or of
    /// the storage key (it is a separate blake3 derivation of the storage key and the
    /// lifetime). It is 64 lowercase hex characters: a valid [`Key`], and a valid idempotency
    /// key for providers that accept up to 255 printable characters.
    ///
    /// The derivation is stable across processes and platforms. It changed once, in 0.3, when
    /// the lifetime became part of it (see the CHANGELOG).
    ///
    /// In a client session, each request's operation key is its own: the session's digest,
    /// the request's place in the session and the lifetime go into it.
    pub fn operation_key(&self, lifetime: crate::FencingToken) -> Key {
        let mut input = [0u8; 56];
        input[..32].copy_from_slice(&self.digest);
        input[32..40].copy_from_slice(&lifetime.get().to_be_bytes());
        let len = match self.place {
            Place::Own => 40,
            Place::Session => 41,
            Place::Seq { epoch, seq } => {
                input[40..48].copy_from_slice(&epoch.to_be_bytes());
                input[48..].copy_from_slice(&seq.to_be_bytes());
                56
            }
        };
        let digest = blake3::derive_key(OPERATION_KEY_CONTEXT, &input[..len]);
        Key(hex(&digest).into_boxed_str())
    }

    /// The digest as 64 lowercase hex characters, suitable as a backend key; for a key in a
    /// client session, followed by `:s` (the session's own record) or `:<epoch>:<seq>`.
    pub fn to_hex(&self) -> String {
        let mut out = hex(&self.digest);
        match self.place {
            Place::Own => {}
            Place::Session => out.push_str(":s"),
            Place::Seq { epoch, seq } => {
                use std::fmt::Write as _;
                let _ = write!(out, ":{epoch}:{seq}");
            }
        }
        out
    }
}

fn hex(bytes: &[u8; 32]) -> String {
    let mut out = String::with_capacity(64);
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out
}

const OPERATION_KEY_CONTEXT: &str = "idempotent 2026-11 downstream operation key v2";

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageKey({})", self)
    }
}

impl fmt::Display for StorageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_printable_ascii_and_inner_spaces() {
        for ok in [
            "a",
            "~",
            "!",
            "order 42",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
        ] {
            assert_eq!(Key::new(ok).unwrap().as_str(), ok);
        }
        assert!(Key::new("x".repeat(MAX_KEY_LEN)).is_ok());
    }

    #[test]
    fn rejects_each_rule_with_its_own_error() {
        assert_eq!(Key::new(""), Err(KeyError::Empty));
        assert_eq!(
            Key::new("x".repeat(256)),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(
            Key::new("ab\ncd"),
            Err(KeyError::InvalidByte {
                offset: 2,
                byte: b'\n'
            })
        );
        assert_eq!(
            Key::new("é"),
            Err(KeyError::InvalidByte {
                offset: 0,
                byte: 0xc3
            })
        );
        assert_eq!(
            Key::new("a\x7f"),
            Err(KeyError::InvalidByte {
                offset: 1,
                byte: 0x7f
            })
        );
        assert_eq!(Key::new(" a"), Err(KeyError::SurroundingSpace));
        assert_eq!(Key::new("a "), Err(KeyError::SurroundingSpace));
        assert_eq!(Key::new(" "), Err(KeyError::SurroundingSpace));
    }

    #[test]
    fn debug_never_shows_the_raw_key() {
        let shown = format!("{:?}", Key::new("secret-key-123").unwrap());
        assert!(!shown.contains("secret"), "{shown}");
        let scope = format!("{:?}", Scope::new().principal("Bearer hunter2"));
        assert!(!scope.contains("hunter2"), "{scope}");
    }

    #[test]
    fn storage_key_separates_namespace_scope_and_key() {
        let k = Key::new("k1").unwrap();
        let base = StorageKey::derive(b"app", &Scope::new(), &k);
        assert_eq!(base, StorageKey::derive(b"app", &Scope::new(), &k));
        let variants = [
            StorageKey::derive(b"other", &Scope::new(), &k),
            StorageKey::derive(b"app", &Scope::new().tenant("t"), &k),
            StorageKey::derive(b"app", &Scope::new().principal("t"), &k),
            StorageKey::derive(b"app", &Scope::new().operation("t"), &k),
            StorageKey::derive(b"app", &Scope::new().tenant(""), &k),
            StorageKey::derive(b"app", &Scope::new(), &Key::new("k2").unwrap()),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {i}");
            for w in &variants[i + 1..] {
                assert_ne!(v, w);
            }
        }
        // Length prefixes keep part boundaries unambiguous.
        assert_ne!(
            StorageKey::derive(b"a", &Scope::new().tenant("bc"), &k),
            StorageKey::derive(b"ab", &Scope::new().tenant("c"), &k)
        );
    }

    #[test]
    fn storage_key_is_stable_across_releases() {
        // A changed derivation would orphan every record in every shared store.
        let key = StorageKey::derive(
            b"payments",
            &Scope::new().principal("alice"),
            &Key::new("order-1").unwrap(),
        );
        assert_eq!(key.to_hex().len(), 64);
        assert_eq!(
            key.to_hex(),
            StorageKey::derive(
                b"payments",
                &Scope::new().principal("alice"),
                &Key::new("order-1").unwrap()
            )
            .to_string()
        );
        assert_eq!(key.to_hex(), GOLDEN_STORAGE_KEY);
    }

    /// The derivation spelled out field by field, as documented.
    fn reference(namespace: &[u8], scope: &Scope, key: &[u8]) -> StorageKey {
        let mut hasher = blake3::Hasher::new_derive_key(STORAGE_KEY_CONTEXT);
        for (tag, value) in [
            (b'n', Some(namespace)),
            (b't', scope.tenant.as_deref()),
            (b'p', scope.principal.as_deref()),
            (b'o', scope.operation.as_deref()),
            (b'k', Some(key)),
        ] {
            hasher.update(&[tag, u8::from(value.is_some())]);
            if let Some(v) = value {
                hasher.update(&(v.len() as u64).to_le_bytes());
                hasher.update(v);
            }
        }
        StorageKey::from_bytes(*hasher.finalize().as_bytes())
    }

    #[test]
    fn derivation_matches_the_reference_for_small_and_large_inputs() {
        let key = "k".repeat(255);
        for size in [0, 1, 100, 400, 600, 5000] {
            let namespace = vec![b'n'; size];
            let scope = Scope::new().tenant(vec![b't'; size / 2]).principal("p");
            assert_eq!(
                StorageKey::derive_raw(&namespace, &scope, key.as_bytes()),
                reference(&namespace, &scope, key.as_bytes()),
                "size {size}"
            );
        }
    }

    const GOLDEN_STORAGE_KEY: &str =
        "c86b7a46ba4d39f15b97821158a6ba1d7b4e2251c4add45474745cbbab7129bb";
}
