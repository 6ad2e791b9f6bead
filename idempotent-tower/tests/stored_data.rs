//! Stored responses at the edge of what a record holds, records that cannot be read back, and
//! unquoted keys holding `;`: the layer answers with a replay or a problem, never a panic, and
//! two different keys never share a record.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Claim, FencingToken, Fingerprint, Idempotency, StorageKey, Store, StoreError,
};
use idempotent_tower::IdempotencyLayer;
use support::{Answer, Req, TestBody, memory, post, send, stack};
use tower::{BoxError, Service, service_fn};

/// The most header fields, and separately trailer fields, the layer keeps for replay.
const MAX_FIELDS: usize = 4096;

/// `n` fields: all named `x-field` (`distinct == false`) or `x-field-0`, `x-field-1`, …
fn fields(n: usize, distinct: bool) -> HeaderMap {
    let mut map = HeaderMap::new();
    for i in 0..n {
        let name = if distinct {
            HeaderName::from_bytes(format!("x-field-{i}").as_bytes()).unwrap()
        } else {
            HeaderName::from_static("x-field")
        };
        map.append(name, HeaderValue::from(i));
    }
    map
}

/// Answers `/headers/<n>`, `/distinct-headers/<n>` and `/trailers/<n>` with `n` fields in that
/// place (201, body `run <count>`); anything else with no extra fields.
fn handler(
    runs: &Arc<AtomicUsize>,
) -> impl Service<Req, Response = Response<TestBody>, Error = BoxError, Future: Send + 'static>
+ Clone
+ Send
+ Sync
+ 'static {
    let runs = Arc::clone(runs);
    service_fn(move |req: Req| {
        let runs = Arc::clone(&runs);
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let mut parts = req.uri().path().trim_start_matches('/').split('/');
            let place = parts.next().unwrap_or_default().to_owned();
            let count: usize = parts.next().and_then(|c| c.parse().ok()).unwrap_or(0);
            let mut response = Response::new(TestBody::new(format!("run {n}")));
            *response.status_mut() = StatusCode::CREATED;
            match place.as_str() {
                "headers" => *response.headers_mut() = fields(count, false),
                "distinct-headers" => *response.headers_mut() = fields(count, true),
                "trailers" => response.body_mut().trailers = Some(fields(count, false)),
                _ => {}
            }
            Ok::<_, BoxError>(response)
        }
    })
}

/// The answer's fields named like `fields` names them, in order.
fn fields_of(answer: &Answer, place: &str) -> Vec<(String, String)> {
    let map = match place {
        "trailers" => answer.trailers.clone().unwrap_or_default(),
        _ => answer.headers.clone(),
    };
    map.iter()
        .filter(|(name, _)| name.as_str().starts_with("x-field"))
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect()
}

#[tokio::test]
async fn responses_with_up_to_the_field_limit_replay_whole() {
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = stack(memory(), handler(&runs));
    for place in ["headers", "distinct-headers", "trailers"] {
        let path = format!("/{place}/{MAX_FIELDS}");
        let first = send(&svc, post(&path, Some(place), "{}")).await;
        assert_eq!(fields_of(&first, place).len(), MAX_FIELDS, "{place}");
        let retry = send(&svc, post(&path, Some(place), "{}")).await;
        assert!(retry.replayed(), "{place}");
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(retry.body, first.body);
        assert_eq!(
            fields_of(&retry, place),
            fields_of(&first, place),
            "{place}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// Regression: the stored form wrote up to 65,534 fields, which the reader could not hold (a
/// panic above 24,576), and cut anything beyond 65,534 without a word.
#[tokio::test]
async fn responses_with_more_fields_run_once_and_are_not_retained() {
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = stack(memory(), handler(&runs));
    for place in ["headers", "distinct-headers", "trailers"] {
        for count in [MAX_FIELDS + 1, 70_000] {
            if place == "distinct-headers" && count > 24_576 {
                continue; // more distinct names than a header map holds
            }
            let path = format!("/{place}/{count}");
            let key = format!("{place}-{count}");
            let first = send(&svc, post(&path, Some(&key), "{}")).await;
            assert_eq!(first.status, StatusCode::CREATED);
            assert_eq!(
                fields_of(&first, place).len(),
                count,
                "the client gets the whole response ({place}, {count})"
            );
            let retry = send(&svc, post(&path, Some(&key), "{}")).await;
            assert_eq!(retry.status, StatusCode::GONE, "{place}, {count}");
            assert_eq!(retry.problem()["code"], "result_not_retained");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 5, "every response ran once");
}

/// A memory store whose completed records hold `record` instead of the response the layer
/// stored: records written by another release, or damaged at rest.
#[derive(Clone)]
struct PlantedStore {
    inner: MemoryStore,
    record: Bytes,
}

/// The record envelope, as documented in `idempotent-core`: magic `ID`, version 1, kind 0 (a
/// result follows), the first 8 bytes of the result's blake3 digest, the result.
fn envelope(result: &[u8]) -> Bytes {
    let mut out = BytesMut::from(&b"ID\x01\x00"[..]);
    out.put_slice(&blake3::hash(result).as_bytes()[..8]);
    out.put_slice(result);
    out.freeze()
}

impl Store for PlantedStore {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fingerprint, lease, ttl).await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        // The layer's own record is a well-formed envelope; replace what it holds.
        assert_eq!(payload, envelope(&payload[12..]), "envelope format changed");
        self.inner
            .complete(key, token, envelope(&self.record), ttl)
            .await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease).await
    }
}

/// A stored response (format version 1, status 200) claiming `claimed` header fields, followed
/// by `present` fields named by `name`, an empty body and no trailers.
fn record(claimed: u16, present: usize, name: impl Fn(usize) -> String) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u8(1);
    out.put_u16(200);
    out.put_u16(claimed);
    for i in 0..present {
        let name = name(i);
        out.put_u16(u16::try_from(name.len()).unwrap());
        out.put_slice(name.as_bytes());
        out.put_u32(0);
    }
    out.put_u32(0);
    out.put_u16(u16::MAX);
    out.freeze()
}

/// Regression: a stored response claiming more than 24,576 header fields panicked the reader
/// (`HeaderMap::with_capacity`), taking the request's task down instead of answering.
#[tokio::test]
async fn records_claiming_more_fields_than_a_header_map_holds_are_corrupt_records() {
    for claimed in [24_577u16, 65_534] {
        let planted = [
            (
                "nothing behind the count",
                record(claimed, 0, |_| String::new()),
            ),
            (
                "distinct names",
                record(claimed, usize::from(claimed), |i| format!("h{i}")),
            ),
        ];
        for (what, planted) in planted {
            let runs = Arc::new(AtomicUsize::new(0));
            let store = PlantedStore {
                inner: MemoryStore::new(),
                record: planted,
            };
            let svc = stack(
                IdempotencyLayer::http(Idempotency::keys_only(store)),
                handler(&runs),
            );
            let first = send(&svc, post("/p", Some("k"), "{}")).await;
            assert_eq!(first.status, StatusCode::CREATED, "{claimed}, {what}");
            let retry = send(&svc, post("/p", Some("k"), "{}")).await;
            assert_eq!(
                retry.status,
                StatusCode::INTERNAL_SERVER_ERROR,
                "{claimed}, {what}"
            );
            assert_eq!(retry.problem()["code"], "corrupt_record");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "never run again");
        }
    }
    // The same counts of values under one name are a readable record.
    let runs = Arc::new(AtomicUsize::new(0));
    let store = PlantedStore {
        inner: MemoryStore::new(),
        record: record(65_534, 65_534, |_| "x-field".into()),
    };
    let svc = stack(
        IdempotencyLayer::http(Idempotency::keys_only(store)),
        handler(&runs),
    );
    send(&svc, post("/p", Some("k"), "{}")).await;
    let retry = send(&svc, post("/p", Some("k"), "{}")).await;
    assert!(retry.replayed());
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.headers.get_all("x-field").iter().count(), 65_534);
}

/// Regression: `abc;x` and `abc;y` were both read as the key `abc` with a parameter, so the
/// second request replayed the first one's response.
#[tokio::test]
async fn unquoted_keys_with_a_semicolon_are_refused_and_quoted_ones_stay_apart() {
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = stack(memory(), handler(&runs));
    for bare in ["abc;x", "abc;y", "abc ;x", "abc;v=1"] {
        let answer = send(&svc, post("/p", Some(bare), "{}")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bare:?}");
        let problem = answer.problem();
        assert_eq!(problem["code"], "invalid_key", "{bare:?}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("quote the key"), "{detail}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // Quoted, `;` belongs to the key: two keys, two runs.
    let x = send(&svc, post("/p", Some("\"abc;x\""), "{}")).await;
    let y = send(&svc, post("/p", Some("\"abc;y\""), "{}")).await;
    assert!(!x.replayed() && !y.replayed());
    assert_ne!(x.body, y.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(
        send(&svc, post("/p", Some("\"abc;x\""), "{}"))
            .await
            .replayed()
    );

    // Parameters after a quoted key are still ignored.
    let first = send(&svc, post("/p", Some("\"abc\";x=1"), "{}")).await;
    let other_parameters = send(&svc, post("/p", Some("\"abc\";y=2"), "{}")).await;
    assert!(!first.replayed());
    assert!(other_parameters.replayed());
    assert_eq!(other_parameters.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // Strict mode refuses the unquoted form too, and keeps the quoted forms apart.
    let strict = stack(memory().strict(true), handler(&runs));
    assert_eq!(
        send(&strict, post("/p", Some("abc;x"), "{}")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert!(
        !send(&strict, post("/p", Some("\"abc;x\""), "{}"))
            .await
            .replayed()
    );
    assert!(
        !send(&strict, post("/p", Some("\"abc;y\""), "{}"))
            .await
            .replayed()
    );
}
