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
//! All integers are big-endian.
//!
//! [`encode`] refuses a response this form cannot give back exactly: more than [`MAX_FIELDS`]
//! header fields or trailer fields, or a body or header value of 4 GiB or more. Every response
//! it accepts decodes to an equal response.
//!
//! [`decode`] reads any byte string without panicking: every length is checked against the
//! remaining input, room is reserved only for as many fields as the remaining bytes can hold,
//! and a field list the header map cannot hold is an error. A corrupt record is an error, never
//! a panic, an over-read or an allocation sized by an untrusted count.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const VERSION: u8 = 1;
const NO_TRAILERS: u16 = u16::MAX;

/// The most fields a stored response holds in its headers, and separately in its trailers.
///
/// `http`'s `HeaderMap` holds at most 24,576 distinct names, and once it switches to its
/// collision-resistant hashing it cannot grow past 6,553; below this bound, decoding never meets
/// either limit, whatever the names hash to.
pub(crate) const MAX_FIELDS: usize = 4096;

const _: () = assert!(MAX_FIELDS <= 6553 && MAX_FIELDS < NO_TRAILERS as usize);

/// The fields a replayed response may get after it is decoded, for which its header map has
/// room, so that adding them does not grow (rehash and move) the map: `idempotent-replayed`,
/// a session's `idempotency-session-seq`, and the `content-length` the server sets on the
/// response as it sends it (a stored response rarely has one: the layer captures the
/// handler's response before any server sets it).
const REPLAY_ADDS: usize = 3;

/// The smallest a stored field can be: both lengths and a one-byte name.
const MIN_FIELD_BYTES: usize = 2 + 1 + 4;

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

/// Why a response cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EncodeError {
    /// More than [`MAX_FIELDS`] header or trailer fields.
    TooManyFields { section: &'static str, count: usize },
    /// A body or header value of 4 GiB or more.
    TooLong { part: &'static str, len: usize },
}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodeError::TooManyFields { section, count } => write!(
                f,
                "the response has {count} {section} fields; at most {MAX_FIELDS} are stored"
            ),
            EncodeError::TooLong { part, len } => write!(
                f,
                "the response {part} is {len} bytes; at most {} are stored",
                u32::MAX
            ),
        }
    }
}

impl std::error::Error for EncodeError {}

/// Encodes a response, leaving out the headers `skip` rejects.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    trailers: Option<&HeaderMap>,
    skip: impl Fn(&HeaderName) -> bool,
) -> Result<Bytes, EncodeError> {
    let body_len = stored_len("body", body.len())?;
    let mut out = BytesMut::with_capacity(16 + body.len() + 32 * headers.len());
    out.put_u8(VERSION);
    out.put_u16(status.as_u16());
    put_fields(&mut out, "header", headers, &skip)?;
    out.put_u32(body_len);
    out.put_slice(body);
    match trailers {
        None => out.put_u16(NO_TRAILERS),
        Some(trailers) => put_fields(&mut out, "trailer", trailers, &|_| false)?,
    }
    Ok(out.freeze())
}

fn put_fields(
    out: &mut BytesMut,
    section: &'static str,
    fields: &HeaderMap,
    skip: &dyn Fn(&HeaderName) -> bool,
) -> Result<(), EncodeError> {
    // The count is written once the fields are: each is asked of `skip` once, and the kept
    // ones are not gathered first.
    let at = out.len();
    out.put_u16(0);
    let mut count = 0usize;
    for (name, value) in fields.iter().filter(|(name, _)| !skip(name)) {
        count += 1;
        if count > MAX_FIELDS {
            return Err(EncodeError::TooManyFields {
                section,
                count: fields.iter().filter(|(name, _)| !skip(name)).count(),
            });
        }
        // `http` caps header names at 65,535 bytes, so the length always fits.
        let name_len = u16::try_from(name.as_str().len()).map_err(|_| EncodeError::TooLong {
            part: "header name",
            len: name.as_str().len(),
        })?;
        out.put_u16(name_len);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(stored_len("header value", value.len())?);
        out.put_slice(value.as_bytes());
    }
    // At most `MAX_FIELDS`, far below `u16::MAX`.
    out[at..at + 2].copy_from_slice(&(count as u16).to_be_bytes());
    Ok(())
}

/// `len` as a stored 32-bit length.
fn stored_len(part: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { part, len })
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
    let headers = take_fields(&mut input, count, REPLAY_ADDS)?;
    let body_len = usize::try_from(take_u32(&mut input)?).map_err(|_| DecodeError("truncated"))?;
    let body = take_bytes(&mut input, body_len)?;
    let trailers = match take_u16(&mut input)? {
        NO_TRAILERS => None,
        count => Some(take_fields(&mut input, count, 0)?),
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

/// `count` fields, in a map with room for `spare` more.
fn take_fields(input: &mut Bytes, count: u16, spare: usize) -> Result<HeaderMap, DecodeError> {
    // The count is untrusted: reserve no more than the remaining bytes can hold, and never more
    // than `MAX_FIELDS` (far below the size `HeaderMap::with_capacity` panics at); the map grows
    // if a record written with more fields really holds them.
    let capacity = usize::from(count)
        .min(input.remaining() / MIN_FIELD_BYTES)
        .min(MAX_FIELDS)
        + spare;
    let mut fields = HeaderMap::with_capacity(capacity);
    for _ in 0..count {
        let name_len = usize::from(take_u16(input)?);
        let name = take_bytes(input, name_len)?;
        let name = HeaderName::from_bytes(&name).map_err(|_| DecodeError("invalid header name"))?;
        let value_len = usize::try_from(take_u32(input)?).map_err(|_| DecodeError("truncated"))?;
        let value = take_bytes(input, value_len)?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| DecodeError("invalid header value"))?;
        fields
            .try_append(name, value)
            .map_err(|_| DecodeError("more distinct header names than a header map holds"))?;
    }
    Ok(fields)
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
    use proptest::prelude::*;

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

    fn encode_all(
        status: StatusCode,
        headers: &HeaderMap,
        body: &[u8],
        trailers: Option<&HeaderMap>,
    ) -> Result<Bytes, EncodeError> {
        encode(status, headers, body, trailers, |_| false)
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
        )
        .unwrap();
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
        let none =
            decode(encode_all(StatusCode::OK, &HeaderMap::new(), b"", None).unwrap()).unwrap();
        assert_eq!(none.trailers, None);
        assert!(none.body.is_empty());
    }

    #[test]
    fn decoded_headers_take_what_a_replay_adds_without_growing() {
        for count in [0, 1, 2, 5, 17] {
            let mut headers = HeaderMap::new();
            for i in 0..count {
                headers.insert(
                    HeaderName::try_from(format!("x-h{i}")).unwrap(),
                    HeaderValue::from_static("v"),
                );
            }
            let dec = decode(encode_all(StatusCode::OK, &headers, b"", None).unwrap()).unwrap();
            assert_eq!(dec.headers, headers);
            let mut replayed = dec.headers;
            let capacity = replayed.capacity();
            // What the layer adds to a session's replay, and what the server adds as it sends it.
            replayed.insert(
                crate::server::config::IDEMPOTENT_REPLAYED,
                HeaderValue::from_static("true"),
            );
            replayed.insert(crate::IDEMPOTENCY_SESSION_SEQ, HeaderValue::from(7u64));
            replayed.insert(http::header::CONTENT_LENGTH, HeaderValue::from(0u64));
            assert_eq!(
                replayed.capacity(),
                capacity,
                "{count} fields: the map grew to take what a replay adds"
            );
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let (headers, trailers) = sample();
        let enc = encode_all(StatusCode::OK, &headers, b"body", Some(&trailers)).unwrap();
        for cut in 0..enc.len() {
            assert!(decode(enc.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut longer = enc.to_vec();
        longer.push(0);
        assert!(decode(Bytes::from(longer)).is_err());
    }

    /// `count` fields named by `name(i)` with empty values, as the header section of a record
    /// with an empty body and no trailers.
    fn record_with_fields(claimed: u16, present: usize, name: impl Fn(usize) -> String) -> Bytes {
        let mut out = BytesMut::new();
        out.put_u8(VERSION);
        out.put_u16(200);
        out.put_u16(claimed);
        for i in 0..present {
            let name = name(i);
            out.put_u16(name.len() as u16);
            out.put_slice(name.as_bytes());
            out.put_u32(0);
        }
        out.put_u32(0);
        out.put_u16(NO_TRAILERS);
        out.freeze()
    }

    /// Regression: a record claiming more than 24,576 header fields made decoding call
    /// `HeaderMap::with_capacity` with the claimed count, which panics; the encoder wrote counts
    /// up to 65,534.
    #[test]
    fn header_counts_beyond_what_a_header_map_holds_never_panic() {
        for claimed in [24_577, 65_534] {
            // The count alone, with nothing behind it.
            let mut bare = BytesMut::new();
            bare.put_u8(VERSION);
            bare.put_u16(200);
            bare.put_u16(claimed);
            assert_eq!(
                decode(bare.freeze()).unwrap_err().0,
                "truncated",
                "{claimed} claimed, none present"
            );
            // As many values as claimed, all under one name: the map holds them.
            let one_name = decode(record_with_fields(claimed, usize::from(claimed), |_| {
                "a".into()
            }))
            .unwrap();
            assert_eq!(one_name.headers.len(), usize::from(claimed));
            // As many distinct names as claimed: more than a header map can hold.
            assert_eq!(
                decode(record_with_fields(
                    claimed,
                    usize::from(claimed),
                    |i| format!("h{i}")
                ))
                .unwrap_err()
                .0,
                "more distinct header names than a header map holds",
                "{claimed} distinct names"
            );
        }
        // The same counts in the trailer section.
        for claimed in [24_577u16, 65_534] {
            let mut out = BytesMut::new();
            out.put_u8(VERSION);
            out.put_u16(200);
            out.put_u16(0);
            out.put_u32(0);
            out.put_u16(claimed);
            assert!(decode(out.freeze()).is_err());
        }
    }

    #[test]
    fn the_encoder_refuses_what_the_decoder_cannot_give_back() {
        let many = |n: usize, distinct: bool| {
            let mut map = HeaderMap::new();
            for i in 0..n {
                let name = if distinct {
                    format!("h{i}")
                } else {
                    "x-many".into()
                };
                map.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from(i),
                );
            }
            map
        };
        for distinct in [false, true] {
            let full = many(MAX_FIELDS, distinct);
            let enc = encode_all(StatusCode::OK, &full, b"", Some(&full)).unwrap();
            let dec = decode(enc).unwrap();
            assert_eq!(dec.headers, full);
            assert_eq!(dec.trailers, Some(full));

            let over = many(MAX_FIELDS + 1, distinct);
            assert_eq!(
                encode_all(StatusCode::OK, &over, b"", None),
                Err(EncodeError::TooManyFields {
                    section: "header",
                    count: MAX_FIELDS + 1
                })
            );
            assert_eq!(
                encode_all(StatusCode::OK, &HeaderMap::new(), b"", Some(&over)),
                Err(EncodeError::TooManyFields {
                    section: "trailer",
                    count: MAX_FIELDS + 1
                })
            );
            // Fields left out by `skip` do not count.
            let enc = encode(StatusCode::OK, &over, b"", None, |name| name == "h0");
            assert_eq!(enc.is_ok(), distinct);
            if let Ok(enc) = enc {
                // The count written is that of the fields kept, in their order.
                let mut kept = over.clone();
                kept.remove("h0");
                assert_eq!(decode(enc).unwrap().headers, kept);
            }
        }
        // More fields than a u16 counts: refused, not wrapped or cut.
        let huge = many(70_000, false);
        assert!(matches!(
            encode_all(StatusCode::OK, &huge, b"", None),
            Err(EncodeError::TooManyFields { count: 70_000, .. })
        ));
        // 4 GiB is one byte more than a stored length holds.
        assert_eq!(stored_len("body", u32::MAX as usize), Ok(u32::MAX));
        if let Some(len) = (u32::MAX as usize).checked_add(1) {
            assert_eq!(
                stored_len("body", len),
                Err(EncodeError::TooLong { part: "body", len })
            );
        }
    }

    const NAME_POOL: &[&str] = &[
        "content-type",
        "x-multi",
        "x-skip",
        "etag",
        "location",
        "grpc-status",
    ];

    fn field_name() -> impl Strategy<Value = HeaderName> {
        prop_oneof![
            5 => proptest::sample::select(NAME_POOL).prop_map(HeaderName::from_static),
            1 => "[a-z0-9!#$%&'*+.^_`|~-]{1,40}"
                .prop_map(|name| HeaderName::from_bytes(name.as_bytes()).unwrap()),
        ]
    }

    /// Every byte a header value may hold: tab, visible ASCII and space, and obs-text.
    fn field_value() -> impl Strategy<Value = HeaderValue> {
        proptest::collection::vec(any::<u8>(), 0..48).prop_map(|mut bytes| {
            for b in &mut bytes {
                *b = match *b {
                    b'\t' => b'\t',
                    0..0x20 => *b + 0x20,
                    0x7f => b'~',
                    _ => *b,
                };
            }
            HeaderValue::from_bytes(&bytes).unwrap()
        })
    }

    fn fields(max: usize) -> impl Strategy<Value = Vec<(HeaderName, HeaderValue)>> {
        proptest::collection::vec((field_name(), field_value()), 0..max)
    }

    fn map(fields: &[(HeaderName, HeaderValue)], skip: impl Fn(&HeaderName) -> bool) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields.iter().filter(|(name, _)| !skip(name)) {
            map.append(name.clone(), value.clone());
        }
        map
    }

    /// A record `encode` accepted, as bytes.
    fn valid_record() -> impl Strategy<Value = Bytes> {
        (
            100u16..=999,
            fields(12),
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::option::of(fields(4)),
        )
            .prop_map(|(status, headers, body, trailers)| {
                let trailers = trailers.map(|t| map(&t, |_| false));
                encode_all(
                    StatusCode::from_u16(status).unwrap(),
                    &map(&headers, |_| false),
                    &body,
                    trailers.as_ref(),
                )
                .unwrap()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn every_accepted_response_round_trips(
            status in 100u16..=999,
            headers in prop_oneof![7 => fields(16), 1 => fields(400)],
            body in proptest::collection::vec(any::<u8>(), 0..512),
            trailers in proptest::option::of(fields(16)),
        ) {
            let status = StatusCode::from_u16(status).unwrap();
            let skip = |name: &HeaderName| name == "x-skip";
            let all_headers = map(&headers, |_| false);
            let trailers = trailers.map(|t| map(&t, |_| false));
            let enc = encode(status, &all_headers, &body, trailers.as_ref(), skip).unwrap();
            let dec = decode(enc).unwrap();
            prop_assert_eq!(dec, StoredResponse {
                status,
                headers: map(&headers, skip),
                body: Bytes::from(body),
                trailers,
            });
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_decode_or_fail_without_panicking(
            bytes in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..256),
                // Past the version check, into the counts and lengths.
                proptest::collection::vec(any::<u8>(), 0..256).prop_map(|mut b| {
                    b.insert(0, VERSION);
                    b
                }),
            ],
        ) {
            if let Ok(decoded) = decode(Bytes::from(bytes)) {
                // Whatever decodes is a response the encoder takes back.
                let again = encode_all(
                    decoded.status,
                    &decoded.headers,
                    &decoded.body,
                    decoded.trailers.as_ref(),
                )
                .unwrap();
                prop_assert_eq!(decode(again).unwrap(), decoded);
            }
        }

        #[test]
        fn damaged_records_decode_or_fail_without_panicking(
            record in valid_record(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            damage in 0..3u8,
        ) {
            let mut bytes = record.to_vec();
            let i = at.index(bytes.len());
            match damage {
                0 => bytes[i] = byte,
                1 => bytes.insert(i, byte),
                _ => bytes.truncate(i),
            }
            let _ = decode(Bytes::from(bytes));
        }
    }
}
