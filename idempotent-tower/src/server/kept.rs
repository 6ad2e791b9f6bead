//! The request as the layer keeps it on its record for the completer (`completer`): whose it
//! is (the runtime's namespace and the code version that kept it), method, URI, headers
//! (credentials left out) and body.
//!
//! ```text
//! "IRQ2"             magic
//! [u8; 32]           owner digest: the runtime's namespace and the code version
//! u8                 version length (1 to 64), version (visible ASCII)
//! u32 len, method    (every integer big-endian)
//! u32 len, URI
//! u32 count, then per header: u32 len, name, u32 len, value
//! u32 len, body
//! ```
//!
//! The first 36 bytes (magic and digest) are the record's
//! [`RequestOwner`](idempotent_core::RequestOwner): the store lists a completer's abandoned
//! operations by them, one version at a time, so that requests of versions a completer does
//! not run never take its places. `IRQ1`, written before versions, has the same layout
//! without the version (its digest names the namespace alone); it still decodes, as a request
//! of no version.

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{AUTHORIZATION, COOKIE, PROXY_AUTHORIZATION};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use idempotent_core::RequestOwner;

/// The kept format before versions: no version after the owner.
const UNVERSIONED: &[u8; 4] = b"IRQ1";
/// The kept format with the version that kept it.
const VERSIONED: &[u8; 4] = b"IRQ2";

/// The most bytes a [`CodeVersion`] has.
pub const MAX_CODE_VERSION_LEN: usize = 64;

/// The version of the code that keeps a request ([`IdempotencyLayer::keep_requests`]) or that
/// a [`Completer`](crate::Completer) can run ([`Completer::versions`](crate::Completer::versions)):
/// 1 to [`MAX_CODE_VERSION_LEN`] visible ASCII characters (`!` to `~`: no spaces, no control
/// characters), such as `1.4.2`, `2024-06-01.3` or a commit id. Compared byte for byte:
/// `1.4.2` and `v1.4.2` are two versions.
///
/// Checked where it is made, so a builder that takes one cannot fail:
///
/// ```
/// use idempotent_tower::CodeVersion;
///
/// let version: CodeVersion = "1.4.2".parse().unwrap();
/// assert_eq!(version.as_str(), "1.4.2");
/// assert!(CodeVersion::new("1.4.2 beta").is_err()); // a space
/// assert!(CodeVersion::new("").is_err());
/// ```
///
/// [`IdempotencyLayer::keep_requests`]: crate::IdempotencyLayer::keep_requests
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodeVersion(Arc<str>);

impl CodeVersion {
    /// `version`, if it is 1 to [`MAX_CODE_VERSION_LEN`] visible ASCII characters.
    pub fn new(version: &str) -> Result<Self, InvalidCodeVersion> {
        let why = if version.is_empty() {
            Some("it is empty")
        } else if version.len() > MAX_CODE_VERSION_LEN {
            Some("it is longer than 64 bytes")
        } else if !version.bytes().all(|b| b.is_ascii_graphic()) {
            Some(
                "it holds a character that is not visible ASCII (a space, a control character or a non-ASCII letter)",
            )
        } else {
            None
        };
        match why {
            None => Ok(CodeVersion(Arc::from(version))),
            Some(why) => Err(InvalidCodeVersion {
                // Bounded: the error names the value without carrying an unbounded copy.
                value: version.chars().take(MAX_CODE_VERSION_LEN + 16).collect(),
                why,
            }),
        }
    }

    /// The version.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for CodeVersion {
    type Err = InvalidCodeVersion;

    fn from_str(version: &str) -> Result<Self, Self::Err> {
        CodeVersion::new(version)
    }
}

impl TryFrom<&str> for CodeVersion {
    type Error = InvalidCodeVersion;

    fn try_from(version: &str) -> Result<Self, Self::Error> {
        CodeVersion::new(version)
    }
}

impl AsRef<str> for CodeVersion {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for CodeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for CodeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Why a string is not a [`CodeVersion`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a code version: {why}; a version is 1 to 64 visible ASCII characters, such as 1.4.2 or a commit id"
)]
pub struct InvalidCodeVersion {
    value: String,
    why: &'static str,
}

/// Whose kept requests these are: the record's first bytes, the format's magic and a digest
/// of the runtime's namespace and `version`, derived like a storage key (so runtimes with
/// other namespaces sharing a store, and other versions of one runtime, have other owners).
/// `None`: the owner of requests kept before versions (`IRQ1`), by the namespace alone.
pub(crate) fn owner<C: idempotent_core::capability::Capabilities>(
    idempotency: &idempotent_core::Idempotency<C>,
    version: Option<&CodeVersion>,
) -> RequestOwner {
    let scope = idempotent_core::Scope::new().operation("idempotent-tower completer");
    let (magic, scope) = match version {
        // Unchanged from `IRQ1`: requests kept before versions keep their owner.
        None => (UNVERSIONED, scope),
        Some(version) => (VERSIONED, scope.tenant(version.as_str())),
    };
    let call = idempotent_core::Call::new(
        idempotent_core::Key::new("kept-requests").expect("a valid key"),
    )
    .scope(scope);
    let mut bytes = [0; RequestOwner::LEN];
    bytes[..4].copy_from_slice(magic);
    bytes[4..].copy_from_slice(idempotency.storage_key(&call).as_bytes());
    RequestOwner::new(bytes)
}

/// What a layer keeping requests writes on them: the version and its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keeper {
    pub(crate) version: CodeVersion,
    pub(crate) owner: RequestOwner,
}

impl Keeper {
    pub(crate) fn new<C: idempotent_core::capability::Capabilities>(
        idempotency: &idempotent_core::Idempotency<C>,
        version: CodeVersion,
    ) -> Self {
        Keeper {
            owner: owner(idempotency, Some(&version)),
            version,
        }
    }
}

/// Headers never kept: credentials do not belong in the store. A handler the completer runs
/// gets the request without them.
const NOT_KEPT: [HeaderName; 3] = [AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE];

/// A request as the layer keeps it on its record for a [`Completer`](crate::Completer), read
/// back with [`decode`](Self::decode): for a tool that shows an operator what an operation
/// was asked to do (the bytes are
/// [`Abandoned::request`](idempotent_core::steps::Abandoned::request), or what a store's
/// inspection returns as the record's kept request).
///
/// It holds the method, URI, headers (never `Authorization`, `Proxy-Authorization` or
/// `Cookie`, which are not kept) and body, and the [version](Self::version) of the code that
/// kept it: `None` for a request kept before versions were recorded.
///
/// ```
/// use idempotent_tower::KeptRequest;
///
/// // Not a kept request: an error, never a panic, whatever the bytes.
/// assert!(KeptRequest::decode(b"IRQ2 and then garbage").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptRequest {
    owner: RequestOwner,
    version: Option<CodeVersion>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

/// Why bytes are not a [`KeptRequest`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the kept request cannot be decoded: {0}")]
pub struct KeptRequestError(&'static str);

impl KeptRequest {
    /// The request a client sent, before any completer ran it, as `keeper` keeps it.
    pub(crate) fn of(keeper: &Keeper, parts: &Parts, body: &Bytes) -> Self {
        let mut headers = parts.headers.clone();
        for name in &NOT_KEPT {
            headers.remove(name);
        }
        KeptRequest {
            owner: keeper.owner,
            version: Some(keeper.version.clone()),
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers,
            body: body.clone(),
        }
    }

    /// Reads a kept request, of either format (with a version, or from before versions).
    /// Never panics, whatever the bytes: a damaged record is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, KeptRequestError> {
        Self::decode_bytes(Bytes::copy_from_slice(bytes))
    }

    /// The owner the store lists it under ([`CheckpointStore::abandoned`]): the runtime's
    /// namespace and the [version](Self::version), as [`owner_for`](Self::owner_for) gives it.
    ///
    /// [`CheckpointStore::abandoned`]: idempotent_core::CheckpointStore::abandoned
    pub fn owner(&self) -> RequestOwner {
        self.owner
    }

    /// The owner under which the requests that a layer over `runtime` keeps with `version`
    /// are listed ([`Idempotency::abandoned`](idempotent_core::Idempotency::abandoned)),
    /// or, with `None`, the requests kept before versions were recorded.
    pub fn owner_for<C: idempotent_core::capability::Capabilities>(
        runtime: &idempotent_core::Idempotency<C>,
        version: Option<&CodeVersion>,
    ) -> RequestOwner {
        owner(runtime, version)
    }

    /// The version of the code that kept it
    /// ([`IdempotencyLayer::keep_requests`](crate::IdempotencyLayer::keep_requests)), or
    /// `None` for a request kept before versions were recorded.
    pub fn version(&self) -> Option<&CodeVersion> {
        self.version.as_ref()
    }

    /// The request's method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The request's URI, as the layer saw it (usually a path and query).
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The request's headers, but the credentials, which are never kept.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The request's body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The parts a completer runs: method, URI, headers and body.
    pub(crate) fn into_parts(self) -> (Method, Uri, HeaderMap, Bytes) {
        (self.method, self.uri, self.headers, self.body)
    }

    pub(crate) fn encode(&self) -> Bytes {
        let uri = self.uri.to_string();
        let version = self.version.as_ref().map_or("", CodeVersion::as_str);
        let mut out = BytesMut::with_capacity(128 + version.len() + uri.len() + self.body.len());
        out.put_slice(self.owner.as_bytes());
        if self.version.is_some() {
            // At most 64 bytes: `CodeVersion` says so.
            out.put_u8(u8::try_from(version.len()).unwrap_or(u8::MAX));
            out.put_slice(version.as_bytes());
        }
        put(&mut out, self.method.as_str().as_bytes());
        put(&mut out, uri.as_bytes());
        out.put_u32(u32::try_from(self.headers.len()).unwrap_or(u32::MAX));
        for (name, value) in &self.headers {
            put(&mut out, name.as_str().as_bytes());
            put(&mut out, value.as_bytes());
        }
        put(&mut out, &self.body);
        out.freeze()
    }

    pub(crate) fn decode_bytes(mut input: Bytes) -> Result<Self, KeptRequestError> {
        let owner = RequestOwner::of(&input).ok_or(KeptRequestError("not a kept request"))?;
        let versioned = match &owner.as_bytes()[..4] {
            magic if magic == VERSIONED => true,
            magic if magic == UNVERSIONED => false,
            _ => return Err(KeptRequestError("not a kept request")),
        };
        input.advance(RequestOwner::LEN);
        let version = if versioned {
            if !input.has_remaining() {
                return Err(KeptRequestError("cut short"));
            }
            let len = usize::from(input.get_u8());
            if input.remaining() < len {
                return Err(KeptRequestError("cut short"));
            }
            let version = input.split_to(len);
            let version = std::str::from_utf8(&version)
                .ok()
                .and_then(|version| CodeVersion::new(version).ok())
                .ok_or(KeptRequestError("invalid code version"))?;
            Some(version)
        } else {
            None
        };
        let method = Method::from_bytes(&take(&mut input)?)
            .map_err(|_| KeptRequestError("invalid method"))?;
        let uri = Uri::try_from(take(&mut input)?.as_ref())
            .map_err(|_| KeptRequestError("invalid URI"))?;
        if input.remaining() < 4 {
            return Err(KeptRequestError("cut short"));
        }
        let count = input.get_u32();
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(&take(&mut input)?)
                .map_err(|_| KeptRequestError("invalid header name"))?;
            let value = HeaderValue::from_maybe_shared(take(&mut input)?)
                .map_err(|_| KeptRequestError("invalid header value"))?;
            // Never `append`: it panics past 32,768 distinct names, and these bytes come from
            // the store (a damaged record is unreadable, not a panicking completer pass).
            headers.try_append(name, value).map_err(|_| {
                KeptRequestError("more distinct header names than a header map holds")
            })?;
        }
        let body = take(&mut input)?;
        if input.has_remaining() {
            return Err(KeptRequestError("trailing bytes"));
        }
        Ok(KeptRequest {
            owner,
            version,
            method,
            uri,
            headers,
            body,
        })
    }
}

fn put(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
    out.put_slice(bytes);
}

fn take(input: &mut Bytes) -> Result<Bytes, KeptRequestError> {
    if input.remaining() < 4 {
        return Err(KeptRequestError("cut short"));
    }
    let len = input.get_u32() as usize;
    if input.remaining() < len {
        return Err(KeptRequestError("cut short"));
    }
    Ok(input.split_to(len))
}

#[cfg(test)]
mod tests {
    use idempotent_core::Idempotency;
    use idempotent_core::memory::MemoryStore;

    use super::*;

    fn keeper(version: &str) -> Keeper {
        let mut owner = [7; RequestOwner::LEN];
        owner[..4].copy_from_slice(VERSIONED);
        Keeper {
            version: CodeVersion::new(version).unwrap(),
            owner: RequestOwner::new(owner),
        }
    }

    fn sample() -> KeptRequest {
        let request = http::Request::builder()
            .method("POST")
            .uri("/orders?crash_after=charge")
            .header("content-type", "application/json")
            .header("idempotency-key", "order-1")
            .header("authorization", "Bearer alice")
            .header("cookie", "session=secret")
            .header("x-many", "1")
            .header("x-many", "2")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        KeptRequest::of(
            &keeper("1.4.2"),
            &parts,
            &Bytes::from_static(b"{\"sku\":\"a\"}"),
        )
    }

    /// A request as a layer kept it before versions (`IRQ1`): the same fields, no version.
    fn unversioned_bytes() -> Bytes {
        let mut bytes = BytesMut::new();
        bytes.put_slice(UNVERSIONED);
        bytes.put_slice(&[9; 32]);
        put(&mut bytes, b"POST");
        put(&mut bytes, b"/orders");
        bytes.put_u32(1);
        put(&mut bytes, b"content-type");
        put(&mut bytes, b"application/json");
        put(&mut bytes, b"{}");
        bytes.freeze()
    }

    #[test]
    fn round_trips_with_its_version_and_without_credentials() {
        let saved = sample();
        let encoded = saved.encode();
        assert_eq!(&encoded[..4], b"IRQ2");
        assert_eq!(RequestOwner::of(&encoded), Some(keeper("1.4.2").owner));
        let decoded = KeptRequest::decode(&encoded).unwrap();
        assert_eq!(decoded, saved);
        assert_eq!(decoded.version().map(CodeVersion::as_str), Some("1.4.2"));
        assert!(decoded.headers().get("authorization").is_none());
        assert!(decoded.headers().get("cookie").is_none());
        assert_eq!(decoded.headers().get_all("x-many").iter().count(), 2);
        assert_eq!(decoded.headers().len(), 4);
        assert_eq!(decoded.uri(), "/orders?crash_after=charge");
        assert_eq!(decoded.method(), Method::POST);
        assert_eq!(decoded.body().len(), 11);
    }

    #[test]
    fn a_request_kept_before_versions_decodes_without_one() {
        let bytes = unversioned_bytes();
        let decoded = KeptRequest::decode(&bytes).unwrap();
        assert_eq!(decoded.version(), None);
        assert_eq!(decoded.uri(), "/orders");
        assert_eq!(decoded.headers().len(), 1);
        assert_eq!(decoded.body(), &Bytes::from_static(b"{}"));
        assert_eq!(decoded.owner(), RequestOwner::of(&bytes).unwrap());
        // Written back as it was read.
        assert_eq!(decoded.encode(), bytes);
    }

    #[test]
    fn owners_differ_by_namespace_and_version_and_the_unversioned_one_is_unchanged() {
        let ours = Idempotency::new(MemoryStore::new());
        let theirs = Idempotency::builder(MemoryStore::new())
            .namespace("another service")
            .build();
        let v1 = CodeVersion::new("1").unwrap();
        let v2 = CodeVersion::new("2").unwrap();
        let owners = [
            owner(&ours, None),
            owner(&ours, Some(&v1)),
            owner(&ours, Some(&v2)),
            owner(&theirs, None),
            owner(&theirs, Some(&v1)),
        ];
        for (i, a) in owners.iter().enumerate() {
            for b in &owners[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(&owners[0].as_bytes()[..4], b"IRQ1");
        assert_eq!(&owners[1].as_bytes()[..4], b"IRQ2");
        // The owner of requests kept before versions is the digest those layers wrote: a
        // completer told to run them finds them.
        let call = idempotent_core::Call::new("kept-requests".parse().unwrap())
            .scope(idempotent_core::Scope::new().operation("idempotent-tower completer"));
        assert_eq!(
            &owners[0].as_bytes()[4..],
            ours.storage_key(&call).as_bytes()
        );
    }

    #[test]
    fn code_versions_are_visible_ascii_up_to_64_bytes() {
        for good in [
            "1",
            "1.4.2",
            "1.4.2+build.7",
            "0123abcd",
            "9".repeat(64).as_str(),
        ] {
            assert_eq!(CodeVersion::new(good).unwrap().as_str(), good);
        }
        for bad in [
            "",
            "1.4 beta",
            "1.4\n",
            "vé",
            "\u{7f}",
            "9".repeat(65).as_str(),
        ] {
            let error = CodeVersion::new(bad).unwrap_err().to_string();
            assert!(error.contains("is not a code version"), "{error}");
        }
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for whole in [sample().encode(), unversioned_bytes()] {
            for cut in 0..whole.len() {
                assert!(KeptRequest::decode(&whole[..cut]).is_err(), "{cut}");
            }
            let mut longer = BytesMut::from(&whole[..]);
            longer.put_u8(0);
            assert!(KeptRequest::decode(&longer).is_err());
        }
        // A version that is not one: empty, too long for the bytes, or not visible ASCII.
        let whole = sample().encode();
        for version_len in [0_u8, 200] {
            let mut bytes = BytesMut::from(&whole[..]);
            bytes[RequestOwner::LEN] = version_len;
            assert!(KeptRequest::decode(&bytes).is_err(), "{version_len}");
        }
        let mut bytes = BytesMut::from(&whole[..]);
        bytes[RequestOwner::LEN + 2] = b' ';
        let error = KeptRequest::decode(&bytes).unwrap_err();
        assert!(error.to_string().contains("version"), "{error}");
    }

    /// A damaged record can claim any number of headers: more distinct names than a
    /// `HeaderMap` holds (32,768) is an error, never `HeaderMap::append`'s panic.
    #[test]
    fn more_header_names_than_a_map_holds_is_an_error_never_a_panic() {
        let names = 40_000_u32;
        for versioned in [false, true] {
            let mut bytes = BytesMut::new();
            bytes.put_slice(if versioned { VERSIONED } else { UNVERSIONED });
            bytes.put_slice(&[7; 32]);
            if versioned {
                bytes.put_u8(1);
                bytes.put_u8(b'1');
            }
            put(&mut bytes, b"POST");
            put(&mut bytes, b"/orders");
            bytes.put_u32(names);
            for i in 0..names {
                put(&mut bytes, format!("x-{i}").as_bytes());
                put(&mut bytes, b"1");
            }
            put(&mut bytes, b"{}");
            let error = KeptRequest::decode(&bytes).expect_err("too many header names");
            assert!(error.to_string().contains("header"), "{error}");
        }
    }

    proptest::proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            for magic in [UNVERSIONED, VERSIONED] {
                let mut with_magic = magic.to_vec();
                with_magic.extend_from_slice(&bytes);
                let _ = KeptRequest::decode(&with_magic);
            }
            let _ = KeptRequest::decode(&bytes);
        }

        /// Past the owner, the version's length and a short version, so that the fields
        /// after it are reached.
        #[test]
        fn decoding_any_fields_after_a_version_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let mut input = VERSIONED.to_vec();
            input.extend_from_slice(&[7; 32]);
            input.extend_from_slice(&[3, b'1', b'.', b'2']);
            input.extend_from_slice(&bytes);
            let _ = KeptRequest::decode(&input);
        }
    }
}
