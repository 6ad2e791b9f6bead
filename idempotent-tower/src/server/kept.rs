//! The request as the layer keeps it on its record for the completer (`completer`): whose it
//! is (the runtime's owner digest), method, URI, headers (credentials left out) and body.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{AUTHORIZATION, COOKIE, PROXY_AUTHORIZATION};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};

const MAGIC: &[u8; 4] = b"IRQ1";

/// Whose kept requests these are: a digest of the runtime's namespace, derived like a storage
/// key (so runtimes with other namespaces sharing a store have other owners). A completer runs
/// only its own runtime's requests.
pub(crate) fn owner<C: idempotent_core::capability::Capabilities>(
    idempotency: &idempotent_core::Idempotency<C>,
) -> [u8; 32] {
    let call = idempotent_core::Call::new(
        idempotent_core::Key::new("kept-requests").expect("a valid key"),
    )
    .scope(idempotent_core::Scope::new().operation("idempotent-tower completer"));
    *idempotency.storage_key(&call).as_bytes()
}

/// Headers never kept: credentials do not belong in the store. A handler the completer runs
/// gets the request without them.
const NOT_KEPT: [HeaderName; 3] = [AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE];

/// A protected request as kept on its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SavedRequest {
    /// The runtime whose request it is ([`owner`]).
    pub(crate) owner: [u8; 32],
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// Why a kept request could not be read back.
#[derive(Debug, thiserror::Error)]
#[error("the kept request cannot be decoded: {0}")]
pub(crate) struct SavedRequestError(&'static str);

impl SavedRequest {
    /// The request a client sent, before any completer ran it.
    pub(crate) fn of(owner: [u8; 32], parts: &Parts, body: &Bytes) -> Self {
        let mut headers = parts.headers.clone();
        for name in &NOT_KEPT {
            headers.remove(name);
        }
        SavedRequest {
            owner,
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers,
            body: body.clone(),
        }
    }

    pub(crate) fn encode(&self) -> Bytes {
        let uri = self.uri.to_string();
        let mut out = BytesMut::with_capacity(64 + uri.len() + self.body.len());
        out.put_slice(MAGIC);
        out.put_slice(&self.owner);
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

    pub(crate) fn decode(mut input: Bytes) -> Result<Self, SavedRequestError> {
        if input.len() < 36 || &input[..4] != MAGIC {
            return Err(SavedRequestError("not a kept request"));
        }
        input.advance(4);
        let mut owner = [0; 32];
        input.copy_to_slice(&mut owner);
        let method = Method::from_bytes(&take(&mut input)?)
            .map_err(|_| SavedRequestError("invalid method"))?;
        let uri = Uri::try_from(take(&mut input)?.as_ref())
            .map_err(|_| SavedRequestError("invalid URI"))?;
        if input.remaining() < 4 {
            return Err(SavedRequestError("cut short"));
        }
        let count = input.get_u32();
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(&take(&mut input)?)
                .map_err(|_| SavedRequestError("invalid header name"))?;
            let value = HeaderValue::from_maybe_shared(take(&mut input)?)
                .map_err(|_| SavedRequestError("invalid header value"))?;
            // Never `append`: it panics past 32,768 distinct names, and these bytes come from
            // the store (a damaged record is unreadable, not a panicking completer pass).
            headers.try_append(name, value).map_err(|_| {
                SavedRequestError("more distinct header names than a header map holds")
            })?;
        }
        let body = take(&mut input)?;
        if input.has_remaining() {
            return Err(SavedRequestError("trailing bytes"));
        }
        Ok(SavedRequest {
            owner,
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

fn take(input: &mut Bytes) -> Result<Bytes, SavedRequestError> {
    if input.remaining() < 4 {
        return Err(SavedRequestError("cut short"));
    }
    let len = input.get_u32() as usize;
    if input.remaining() < len {
        return Err(SavedRequestError("cut short"));
    }
    Ok(input.split_to(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SavedRequest {
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
        SavedRequest::of([7; 32], &parts, &Bytes::from_static(b"{\"sku\":\"a\"}"))
    }

    #[test]
    fn round_trips_without_credentials() {
        let saved = sample();
        let decoded = SavedRequest::decode(saved.encode()).unwrap();
        assert_eq!(decoded, saved);
        assert_eq!(decoded.owner, [7; 32]);
        assert!(decoded.headers.get("authorization").is_none());
        assert!(decoded.headers.get("cookie").is_none());
        assert_eq!(decoded.headers.get_all("x-many").iter().count(), 2);
        assert_eq!(decoded.uri, "/orders?crash_after=charge");
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let whole = sample().encode();
        for cut in 0..whole.len() {
            assert!(SavedRequest::decode(whole.slice(..cut)).is_err(), "{cut}");
        }
        let mut longer = BytesMut::from(&whole[..]);
        longer.put_u8(0);
        assert!(SavedRequest::decode(longer.freeze()).is_err());
    }

    /// A damaged record can claim any number of headers: more distinct names than a
    /// `HeaderMap` holds (32,768) is an error, never `HeaderMap::append`'s panic.
    #[test]
    fn more_header_names_than_a_map_holds_is_an_error_never_a_panic() {
        let names = 40_000_u32;
        let mut bytes = BytesMut::new();
        bytes.put_slice(MAGIC);
        bytes.put_slice(&[7; 32]);
        put(&mut bytes, b"POST");
        put(&mut bytes, b"/orders");
        bytes.put_u32(names);
        for i in 0..names {
            put(&mut bytes, format!("x-{i}").as_bytes());
            put(&mut bytes, b"1");
        }
        put(&mut bytes, b"{}");
        let error = SavedRequest::decode(bytes.freeze()).expect_err("too many header names");
        assert!(error.to_string().contains("header"), "{error}");
    }

    proptest::proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = SavedRequest::decode(Bytes::from(with_magic));
            let _ = SavedRequest::decode(Bytes::from(bytes));
        }
    }
}
