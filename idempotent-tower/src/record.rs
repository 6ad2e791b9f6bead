//! The stored form of a response: what a replay sends back.
//!
//! ```text
//! u8   format version (1)
//! u16  status
//! u16  header count, then per header: u16 name length, name, u32 value length, value
//! u32  body length, body
//! u16  trailer count (0xFFFF = no trailers frame), then trailers as headers
//! ```
//!
//! All integers are big-endian. Decoding checks every length against the remaining input, so a
//! corrupt record is an error, never a panic or an over-read.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const VERSION: u8 = 1;
const NO_TRAILERS: u16 = u16::MAX;

/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// Why a stored response cannot be decoded.
#[derive(Debug)]
pub(crate) struct DecodeError(pub(crate) &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stored response is malformed: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Encodes a response, leaving out the headers `skip` rejects.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    trailers: Option<&HeaderMap>,
    skip: impl Fn(&HeaderName) -> bool,
) -> Bytes {
    let mut out = BytesMut::with_capacity(16 + body.len() + 32 * headers.len());
    out.put_u8(VERSION);
    out.put_u16(status.as_u16());
    put_headers(&mut out, headers, &skip);
    out.put_u32(u32::try_from(body.len()).unwrap_or(u32::MAX));
    out.put_slice(body);
    match trailers {
        None => out.put_u16(NO_TRAILERS),
        Some(trailers) => put_headers(&mut out, trailers, &|_| false),
    }
    out.freeze()
}

fn put_headers(out: &mut BytesMut, headers: &HeaderMap, skip: &dyn Fn(&HeaderName) -> bool) {
    let kept: Vec<_> = headers.iter().filter(|(name, _)| !skip(name)).collect();
    // More than 65,534 headers cannot come out of hyper; cap rather than wrap.
    let kept = &kept[..kept.len().min(usize::from(NO_TRAILERS - 1))];
    out.put_u16(kept.len() as u16);
    for (name, value) in kept {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

pub(crate) fn decode(mut input: Bytes) -> Result<StoredResponse, DecodeError> {
    if take_u8(&mut input)? != VERSION {
        return Err(DecodeError("unknown format version"));
    }
    let status = StatusCode::from_u16(take_u16(&mut input)?)
        .map_err(|_| DecodeError("invalid status code"))?;
    let count = take_u16(&mut input)?;
    if count == NO_TRAILERS {
        return Err(DecodeError("invalid header count"));
    }
    let headers = take_headers(&mut input, count)?;
    let body_len = take_u32(&mut input)? as usize;
    let body = take_bytes(&mut input, body_len)?;
    let trailers = match take_u16(&mut input)? {
        NO_TRAILERS => None,
        count => Some(take_headers(&mut input, count)?),
    };
    if input.has_remaining() {
        return Err(DecodeError("trailing bytes"));
    }
    Ok(StoredResponse {
        status,
        headers,
        body,
        trailers,
    })
}

fn take_headers(input: &mut Bytes, count: u16) -> Result<HeaderMap, DecodeError> {
    let mut headers = HeaderMap::with_capacity(usize::from(count));
    for _ in 0..count {
        let name_len = usize::from(take_u16(input)?);
        let name = take_bytes(input, name_len)?;
        let name = HeaderName::from_bytes(&name).map_err(|_| DecodeError("invalid header name"))?;
        let value_len = take_u32(input)? as usize;
        let value = take_bytes(input, value_len)?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| DecodeError("invalid header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn take_u8(input: &mut Bytes) -> Result<u8, DecodeError> {
    if input.remaining() < 1 {
        return Err(DecodeError("truncated"));
    }
    Ok(input.get_u8())
}

fn take_u16(input: &mut Bytes) -> Result<u16, DecodeError> {
    if input.remaining() < 2 {
        return Err(DecodeError("truncated"));
    }
    Ok(input.get_u16())
}

fn take_u32(input: &mut Bytes) -> Result<u32, DecodeError> {
    if input.remaining() < 4 {
        return Err(DecodeError("truncated"));
    }
    Ok(input.get_u32())
}

fn take_bytes(input: &mut Bytes, len: usize) -> Result<Bytes, DecodeError> {
    if input.remaining() < len {
        return Err(DecodeError("truncated"));
    }
    Ok(input.split_to(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (HeaderMap, HeaderMap) {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("2"));
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        (headers, trailers)
    }

    #[test]
    fn round_trips_status_headers_body_and_trailers() {
        let (headers, trailers) = sample();
        let enc = encode(
            StatusCode::CREATED,
            &headers,
            b"{\"id\":1}",
            Some(&trailers),
            |n| n == "set-cookie",
        );
        let dec = decode(enc).unwrap();
        assert_eq!(dec.status, StatusCode::CREATED);
        assert_eq!(dec.body, Bytes::from_static(b"{\"id\":1}"));
        assert_eq!(dec.trailers, Some(trailers));
        let multi: Vec<_> = dec.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["1", "2"]);
        assert!(
            dec.headers.get("set-cookie").is_none(),
            "skipped headers are not stored"
        );
        let none = decode(encode(StatusCode::OK, &HeaderMap::new(), b"", None, |_| {
            false
        }))
        .unwrap();
        assert_eq!(none.trailers, None);
        assert!(none.body.is_empty());
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let (headers, trailers) = sample();
        let enc = encode(StatusCode::OK, &headers, b"body", Some(&trailers), |_| {
            false
        });
        for cut in 0..enc.len() {
            assert!(decode(enc.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut longer = enc.to_vec();
        longer.push(0);
        assert!(decode(Bytes::from(longer)).is_err());
    }

    #[test]
    fn garbage_never_panics() {
        for seed in 0u32..2000 {
            let bytes: Vec<u8> = (0..(seed % 64))
                .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 40503) >> 7) as u8)
                .collect();
            let _ = decode(Bytes::from(bytes));
        }
    }
}
