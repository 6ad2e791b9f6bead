//! The floor: the least an idempotency layer in front of the handler can do and still answer
//! each key once. It is the rows' ceiling (`floor` in the tables), not a product: what any
//! layer that keeps the guarantee must pay on top of the bare handler (on memory) or on top of
//! the store's own statements (on Redis and PostgreSQL), on this machine, in the same run.
//!
//! Per request it reads the `Idempotency-Key` header and the body, computes the two digests the
//! layer's guarantees rest on (the request's fingerprint, over its method, path, query and body,
//! so that a key reused for another request is refused with `422` rather than answered with the
//! first one's response; and the storage key, the key named within its scope), and asks its
//! ledger for the storage key: the key's answer (a replay: the kept status, headers and body,
//! marked `Idempotent-Replayed: true`), the key in flight (`409`), or the key now the request's.
//! An owner's request goes to the handler with the body read; its response body is collected
//! and its status, headers and body kept. A `5xx` answer is not kept: the key is freed for a
//! retry, as it is when the request ends before its answer is kept (the client went away, the
//! handler panicked).
//!
//! - [`MemoryLedger`]: a map of storage keys in shards, each under a mutex; the kept answer is
//!   shared with the response sent (its body's bytes are not copied).
//! - [`StoreLedger`]: a [`Store`]'s own claim and completion (Redis's scripts, PostgreSQL's
//!   statements, what `redis-benchmark` and `pgbench` run in the limit rows), with the answer
//!   in the least encoding that keeps it (status, header fields, body).
//!
//! Every key is in one scope, the empty one; its storage key is derived in the namespace the
//! [`FloorLayer`] is given.
//!
//! What it leaves out, all of which `idempotent-tower` does: scopes from the request, the
//! record's label, checksum and envelope, lease renewal, the claim shared with the handler,
//! limits on the body, shutdown, metrics; on memory, the records' lifetime and the store's
//! bounds; the choice of which answers to keep (it keeps all but `5xx`, where the layer also
//! gives back `408`, `409`, `425` and `429`) and of which methods to protect (it protects every
//! one). Until issue 43's twentieth part it also left out both digests (BENCHMARKS.md).

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use idempotent_core::{Claim, FencingToken, Fingerprint, Key, Scope, StorageKey, Store};

/// Shards of the memory ledger's map: each is one mutex over a `HashMap`.
const SHARDS: usize = 64;
/// The store ledger's lease and record lifetime: the layer's defaults.
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// A kept answer.
pub(crate) struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// What a ledger found for a key.
pub(crate) enum Begin<O> {
    /// The key is the request's; `O` is what the ledger needs to finish it.
    Owner(O),
    InFlight,
    Replay(Arc<Answer>),
    /// The key's answer is another request's (`422`).
    Mismatch,
    /// The ledger cannot answer (`503`).
    Unavailable,
}

/// Where the floor keeps its keys.
pub(crate) trait Ledger: Send + Sync + 'static {
    /// What an owner hands back to finish its key.
    type Owner: Send + 'static;

    /// Looks `key` up for the request of `fingerprint`, making it the caller's when it is new.
    fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Begin<Self::Owner>> + Send;

    /// Keeps `answer` for the owner's key, or frees the key when there is none to keep.
    fn finish(&self, owner: Self::Owner, answer: Option<Answer>)
    -> impl Future<Output = ()> + Send;
}

/// The floor's keys in the server's memory.
pub(crate) struct MemoryLedger {
    hasher: RandomState,
    shards: Vec<Mutex<HashMap<StorageKey, Entry>>>,
}

/// What the memory ledger keeps for a key: the fingerprint of the request that has it, and
/// that request's answer once kept.
enum Entry {
    InFlight(Fingerprint),
    Done(Fingerprint, Arc<Answer>),
}

impl MemoryLedger {
    pub(crate) fn new() -> MemoryLedger {
        MemoryLedger {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, key: &StorageKey) -> std::sync::MutexGuard<'_, HashMap<StorageKey, Entry>> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        self.shards[index].lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Ledger for MemoryLedger {
    type Owner = StorageKey;

    async fn begin(&self, key: &StorageKey, fingerprint: &Fingerprint) -> Begin<StorageKey> {
        let mut shard = self.shard(key);
        match shard.get(key) {
            Some(Entry::Done(kept, answer)) if kept == fingerprint => {
                Begin::Replay(Arc::clone(answer))
            }
            Some(Entry::InFlight(_)) => Begin::InFlight,
            Some(Entry::Done(..)) => Begin::Mismatch,
            None => {
                shard.insert(*key, Entry::InFlight(*fingerprint));
                Begin::Owner(*key)
            }
        }
    }

    async fn finish(&self, key: StorageKey, answer: Option<Answer>) {
        let mut shard = self.shard(&key);
        match (shard.entry(key), answer) {
            (MapEntry::Occupied(mut entry), Some(answer)) => {
                if let Entry::InFlight(fingerprint) = *entry.get() {
                    entry.insert(Entry::Done(fingerprint, Arc::new(answer)));
                }
            }
            (MapEntry::Occupied(entry), None) => {
                entry.remove();
            }
            (MapEntry::Vacant(_), _) => {}
        }
    }
}

/// The floor's keys in a store, by the store's own claim and completion.
pub(crate) struct StoreLedger<S> {
    store: S,
}

impl<S: Store> StoreLedger<S> {
    pub(crate) fn new(store: S) -> StoreLedger<S> {
        StoreLedger { store }
    }
}

impl<S: Store> Ledger for StoreLedger<S> {
    type Owner = (StorageKey, FencingToken);

    async fn begin(&self, key: &StorageKey, fingerprint: &Fingerprint) -> Begin<Self::Owner> {
        match self.store.claim(key, fingerprint, LEASE, TTL).await {
            Ok(Claim::Claimed(token) | Claim::TakenOver { token, .. }) => {
                Begin::Owner((*key, token))
            }
            Ok(Claim::InFlight { .. }) => Begin::InFlight,
            Ok(Claim::Completed {
                fingerprint: kept, ..
            }) if kept != *fingerprint => Begin::Mismatch,
            Ok(Claim::Completed { payload, .. }) => match decode(payload) {
                Some(answer) => Begin::Replay(Arc::new(answer)),
                None => Begin::Unavailable,
            },
            Err(_) => Begin::Unavailable,
        }
    }

    async fn finish(&self, (storage, token): Self::Owner, answer: Option<Answer>) {
        // A completion or release that fails leaves the key in flight until its lease ends,
        // as a crashed owner would: the floor does not retry.
        // An answer the encoding cannot keep is not kept, as a `5xx` is not.
        let _ = match answer.as_ref().and_then(encode) {
            Some(payload) => self.store.complete(&storage, token, payload, TTL).await,
            None => self.store.release(&storage, token).await,
        };
    }
}

/// `status, fields, (name length, name, value length, value)*, body`, lengths as `u16`;
/// `None` for an answer whose field count or a field's name or value does not fit one.
fn encode(answer: &Answer) -> Option<Bytes> {
    let fields: usize = answer
        .headers
        .iter()
        .map(|(name, value)| 4 + name.as_str().len() + value.len())
        .sum();
    let mut out = BytesMut::with_capacity(4 + fields + answer.body.len());
    out.put_u16(answer.status.as_u16());
    out.put_u16(u16::try_from(answer.headers.len()).ok()?);
    for (name, value) in &answer.headers {
        out.put_u16(u16::try_from(name.as_str().len()).ok()?);
        out.put_slice(name.as_str().as_bytes());
        out.put_u16(u16::try_from(value.len()).ok()?);
        out.put_slice(value.as_bytes());
    }
    out.put_slice(&answer.body);
    Some(out.freeze())
}

/// [`encode`]'s answer back; `None` for anything else.
fn decode(mut bytes: Bytes) -> Option<Answer> {
    fn take(bytes: &mut Bytes) -> Option<Bytes> {
        let len = usize::from(bytes.try_get_u16().ok()?);
        (bytes.len() >= len).then(|| bytes.split_to(len))
    }
    let status = StatusCode::from_u16(bytes.try_get_u16().ok()?).ok()?;
    let fields = bytes.try_get_u16().ok()?;
    // The count is untrusted, as the layer's record decoding treats it: reserve no more than
    // the bytes left can hold (each field takes at least its two lengths).
    let room = usize::from(fields).min(bytes.len() / 4);
    let mut headers = HeaderMap::try_with_capacity(room + 1).ok()?;
    for _ in 0..fields {
        let name = HeaderName::from_bytes(&take(&mut bytes)?).ok()?;
        let value = HeaderValue::from_maybe_shared(take(&mut bytes)?).ok()?;
        headers.append(name, value);
    }
    Some(Answer {
        status,
        headers,
        body: bytes,
    })
}

/// An owner's key, given back (`finish` with no answer) if the request ends before its answer
/// is kept: the client went away or the handler panicked. The give-back runs on a task of its
/// own, as a drop cannot wait.
struct Owned<L: Ledger> {
    ledger: Arc<L>,
    owner: Option<L::Owner>,
}

impl<L: Ledger> Owned<L> {
    async fn finish(mut self, answer: Option<Answer>) {
        if let Some(owner) = self.owner.take() {
            self.ledger.finish(owner, answer).await;
        }
    }
}

impl<L: Ledger> Drop for Owned<L> {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let ledger = Arc::clone(&self.ledger);
            runtime.spawn(async move { ledger.finish(owner, None).await });
        }
    }
}

/// The floor's layer over ledger `L`, its storage keys derived in `namespace`.
pub(crate) struct FloorLayer<L> {
    ledger: Arc<L>,
    namespace: Arc<[u8]>,
}

impl<L> Clone for FloorLayer<L> {
    fn clone(&self) -> Self {
        FloorLayer {
            ledger: Arc::clone(&self.ledger),
            namespace: Arc::clone(&self.namespace),
        }
    }
}

impl<L: Ledger> FloorLayer<L> {
    pub(crate) fn new(ledger: L, namespace: &str) -> FloorLayer<L> {
        FloorLayer {
            ledger: Arc::new(ledger),
            namespace: namespace.as_bytes().into(),
        }
    }
}

impl<S, L> tower::Layer<S> for FloorLayer<L> {
    type Service = Floor<S, L>;

    fn layer(&self, inner: S) -> Floor<S, L> {
        Floor {
            inner,
            ledger: Arc::clone(&self.ledger),
            namespace: Arc::clone(&self.namespace),
        }
    }
}

/// The floor's service around the handler `S`.
pub(crate) struct Floor<S, L> {
    inner: S,
    ledger: Arc<L>,
    namespace: Arc<[u8]>,
}

impl<S: Clone, L> Clone for Floor<S, L> {
    fn clone(&self) -> Self {
        Floor {
            inner: self.inner.clone(),
            ledger: Arc::clone(&self.ledger),
            namespace: Arc::clone(&self.namespace),
        }
    }
}

/// The request's fingerprint as the layer takes it: its method, its path, its query's
/// `&`-separated pairs in sorted order (their count first), and its body, each a field.
fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let mut f = Fingerprint::builder();
    f.push_field(parts.method.as_str().as_bytes());
    f.push_field(parts.uri.path().as_bytes());
    let mut pairs: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
        .collect();
    pairs.sort_unstable();
    f.push_field(&(pairs.len() as u64).to_le_bytes());
    for pair in pairs {
        f.push_field(pair.as_bytes());
    }
    f.push_field(body);
    f.finish()
}

fn status(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    response
}

fn replay(answer: &Answer) -> Response<Body> {
    let mut response = Response::new(Body::from(answer.body.clone()));
    *response.status_mut() = answer.status;
    let headers = response.headers_mut();
    headers.reserve(answer.headers.len() + 1);
    headers.extend(
        answer
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), value.clone())),
    );
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S, L> tower::Service<Request<Body>> for Floor<S, L>
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    L: Ledger,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> BoxFuture {
        // The ready service answers this request; a clone waits for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let ledger = Arc::clone(&self.ledger);
        let namespace = Arc::clone(&self.namespace);
        Box::pin(async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|key| Key::new(key.to_str().ok()?).ok());
            let Some(key) = key else {
                return Ok(status(StatusCode::BAD_REQUEST));
            };
            let (parts, body) = request.into_parts();
            let Ok(body) = body.collect().await.map(|body| body.to_bytes()) else {
                return Ok(status(StatusCode::BAD_REQUEST));
            };
            let fingerprint = fingerprint(&parts, &body);
            let storage = StorageKey::derive(&namespace, &Scope::new(), &key);
            let owned = match ledger.begin(&storage, &fingerprint).await {
                Begin::Owner(owner) => Owned {
                    ledger: Arc::clone(&ledger),
                    owner: Some(owner),
                },
                Begin::Replay(answer) => return Ok(replay(&answer)),
                Begin::InFlight => return Ok(status(StatusCode::CONFLICT)),
                Begin::Mismatch => return Ok(status(StatusCode::UNPROCESSABLE_ENTITY)),
                Begin::Unavailable => return Ok(status(StatusCode::SERVICE_UNAVAILABLE)),
            };
            let request = Request::from_parts(parts, Body::from(body));
            let Ok(response) = inner.call(request).await;
            let (parts, body) = response.into_parts();
            let body = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => {
                    owned.finish(None).await;
                    return Ok(status(StatusCode::BAD_GATEWAY));
                }
            };
            let kept = (!parts.status.is_server_error()).then(|| Answer {
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
            });
            owned.finish(kept).await;
            Ok(Response::from_parts(parts, Body::from(body)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, ServiceExt, service_fn};

    fn request(key: Option<&str>) -> Request<Body> {
        let mut request = Request::new(Body::empty());
        if let Some(key) = key {
            request
                .headers_mut()
                .insert("idempotency-key", HeaderValue::from_str(key).unwrap());
        }
        request
    }

    async fn body(response: Response<Body>) -> Bytes {
        response.into_body().collect().await.unwrap().to_bytes()
    }

    /// The store ledger on the memory store: the same claim and completion contract as the
    /// rows' Redis and PostgreSQL stores (the conformance suite's).
    fn store_ledger() -> StoreLedger<idempotent_core::memory::MemoryStore> {
        StoreLedger::new(idempotent_core::memory::MemoryStore::new())
    }

    #[tokio::test]
    async fn answers_each_key_once_replays_the_kept_answer_and_refuses_a_reused_key() {
        answers_each_key_once(MemoryLedger::new()).await;
        answers_each_key_once(store_ledger()).await;
    }

    #[tokio::test]
    async fn a_key_in_flight_is_refused_and_a_server_error_is_not_kept() {
        refuses_a_key_in_flight(MemoryLedger::new()).await;
        refuses_a_key_in_flight(store_ledger()).await;
    }

    #[tokio::test]
    async fn a_request_that_ends_before_its_answer_gives_its_key_back() {
        gives_back_a_dropped_key(MemoryLedger::new()).await;
        gives_back_a_dropped_key(store_ledger()).await;
    }

    async fn gives_back_a_dropped_key(ledger: impl Ledger) {
        let (started, on_start) = tokio::sync::oneshot::channel::<()>();
        let first = Arc::new(Mutex::new(Some(started)));
        let handler = service_fn(move |_request: Request<Body>| {
            let first = first.lock().unwrap().take();
            async move {
                if let Some(started) = first {
                    // The first request's handler never answers: its client goes away.
                    let _ = started.send(());
                    std::future::pending::<()>().await;
                }
                Ok::<_, std::convert::Infallible>(Response::new(Body::from("second")))
            }
        });
        let floor = FloorLayer::new(ledger, "floor-test").layer(handler);
        let abandoned = tokio::spawn(floor.clone().oneshot(request(Some("k"))));
        on_start.await.unwrap();
        abandoned.abort();
        let _ = abandoned.await;
        // The give-back runs on a task of its own: until it has, the key is in flight.
        for _ in 0..100 {
            let answer = floor.clone().oneshot(request(Some("k"))).await.unwrap();
            if answer.status() != StatusCode::CONFLICT {
                assert_eq!(answer.status(), StatusCode::OK);
                assert_eq!(body(answer).await, "second");
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the abandoned request's key was never given back");
    }

    #[test]
    fn an_answer_is_kept_whole_and_garbage_is_no_answer() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-two", HeaderValue::from_static("1"));
        headers.append("x-two", HeaderValue::from_static("2"));
        let answer = Answer {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":1}"),
        };
        let back = decode(encode(&answer).unwrap()).unwrap();
        assert_eq!(back.status, answer.status);
        assert_eq!(back.headers, answer.headers);
        assert_eq!(back.body, answer.body);
        let whole = encode(&answer).unwrap();
        for cut in 0..whole.len() - answer.body.len() {
            assert!(decode(whole.slice(..cut)).is_none(), "cut at {cut}");
        }
        assert!(
            decode(Bytes::from_static(&[0, 1, 0, 0])).is_none(),
            "status 1"
        );
        // More fields than a header map holds: no answer, no panic.
        assert!(decode(Bytes::from_static(&[0, 200, 0xff, 0xff])).is_none());
    }

    async fn answers_each_key_once(ledger: impl Ledger) {
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        let handler = service_fn(move |_request: Request<Body>| {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                let mut response = Response::new(Body::from(format!("run {n}")));
                *response.status_mut() = StatusCode::CREATED;
                response.headers_mut().insert("x-run", HeaderValue::from(n));
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let floor = FloorLayer::new(ledger, "floor-test").layer(handler);

        let first = floor.clone().oneshot(request(Some("a"))).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        assert!(first.headers().get("idempotent-replayed").is_none());
        assert_eq!(body(first).await, "run 0");

        let again = floor.clone().oneshot(request(Some("a"))).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-run"], "0");
        assert_eq!(body(again).await, "run 0");

        // The same key for another request (another body): refused, not answered with the
        // first one's response, and not run.
        let mut reused = request(Some("a"));
        *reused.body_mut() = Body::from("another body");
        let reused = floor.clone().oneshot(reused).await.unwrap();
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(reused.headers().get("idempotent-replayed").is_none());

        let other = floor.clone().oneshot(request(Some("b"))).await.unwrap();
        assert_eq!(body(other).await, "run 1");
        // Not a key (longer than a key may be): refused, not run.
        let long = "k".repeat(idempotent_core::MAX_KEY_LEN + 1);
        let bad = floor.clone().oneshot(request(Some(&long))).await.unwrap();
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        let none = floor.clone().oneshot(request(None)).await.unwrap();
        assert_eq!(none.status(), StatusCode::BAD_REQUEST);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    async fn refuses_a_key_in_flight(ledger: impl Ledger) {
        let (started, on_start) = tokio::sync::oneshot::channel::<()>();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let hold = Arc::new(Mutex::new(Some((started, released))));
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        let handler = service_fn(move |request: Request<Body>| {
            let hold = hold.lock().unwrap().take();
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let fails = request.headers()["idempotency-key"] == "fails";
            async move {
                if let Some((started, released)) = hold.filter(|_| !fails) {
                    let _ = started.send(());
                    let _ = released.await;
                }
                let mut response = Response::new(Body::empty());
                if fails {
                    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                }
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let floor = FloorLayer::new(ledger, "floor-test").layer(handler);

        let slow = tokio::spawn(floor.clone().oneshot(request(Some("slow"))));
        on_start.await.unwrap();
        let duplicate = floor.clone().oneshot(request(Some("slow"))).await.unwrap();
        assert_eq!(duplicate.status(), StatusCode::CONFLICT);
        release.send(()).unwrap();
        assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
        let after = floor.clone().oneshot(request(Some("slow"))).await.unwrap();
        assert_eq!(after.headers()["idempotent-replayed"], "true");

        for _ in 0..2 {
            let failed = floor.clone().oneshot(request(Some("fails"))).await.unwrap();
            assert_eq!(failed.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert!(failed.headers().get("idempotent-replayed").is_none());
        }
        // "slow" once, "fails" twice: a 5xx frees its key for the retry.
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
}
