//! The floor: the least an idempotency layer in front of the handler can do and still answer
//! each key once. It is the memory rows' ceiling (`floor` in the table), not a product: what
//! any layer that keeps the guarantee must pay on top of the bare handler, on this machine, in
//! the same run.
//!
//! Per request it reads the `Idempotency-Key` header, and under one shard's lock of a map of
//! keys either finds the key's answer (a replay: the kept status, headers and body, marked
//! `Idempotent-Replayed: true`), finds it in flight (`409`), or marks it in flight. An owner's
//! request goes to the handler unread; its response body is collected and kept with its status
//! and headers (a copy, so the kept answer and the one sent share the body's bytes). A `5xx`
//! answer is not kept: the key is freed for a retry.
//!
//! What it leaves out, all of which `idempotent-tower` does: a fingerprint of the request (so
//! a key reused for another request is refused, not answered with the first one's response),
//! the scope and storage key, lifetimes, bounds, leases, the record's encoding and metrics.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;

/// Shards of the map: each is one mutex over a `HashMap`.
const SHARDS: usize = 64;

/// What the floor keeps for a key.
enum Entry {
    InFlight,
    Done(Arc<Answer>),
}

/// A kept answer.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// The floor's keys, shared by every request.
struct Keys {
    hasher: RandomState,
    shards: Vec<Mutex<HashMap<Box<str>, Entry>>>,
}

impl Keys {
    fn shard(&self, key: &str) -> &Mutex<HashMap<Box<str>, Entry>> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        &self.shards[index]
    }

    /// Looks `key` up, marking it in flight when it is new.
    fn begin(&self, key: &str) -> Begin {
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        match shard.get(key) {
            Some(Entry::Done(answer)) => Begin::Replay(Arc::clone(answer)),
            Some(Entry::InFlight) => Begin::InFlight,
            None => {
                shard.insert(key.into(), Entry::InFlight);
                Begin::Owner
            }
        }
    }

    /// Keeps `answer` for `key`, or frees the key when there is none to keep.
    fn finish(&self, key: &str, answer: Option<Answer>) {
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        match (shard.entry(key.into()), answer) {
            (MapEntry::Occupied(mut entry), Some(answer)) => {
                entry.insert(Entry::Done(Arc::new(answer)));
            }
            (MapEntry::Occupied(entry), None) => {
                entry.remove();
            }
            (MapEntry::Vacant(_), _) => {}
        }
    }
}

enum Begin {
    Owner,
    InFlight,
    Replay(Arc<Answer>),
}

/// The floor's layer.
#[derive(Clone)]
pub(crate) struct FloorLayer {
    keys: Arc<Keys>,
}

impl FloorLayer {
    pub(crate) fn new() -> FloorLayer {
        FloorLayer {
            keys: Arc::new(Keys {
                hasher: RandomState::new(),
                shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            }),
        }
    }
}

impl<S> tower::Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Floor<S> {
        Floor {
            inner,
            keys: Arc::clone(&self.keys),
        }
    }
}

/// The floor's service around the handler `S`.
#[derive(Clone)]
pub(crate) struct Floor<S> {
    inner: S,
    keys: Arc<Keys>,
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

type BoxFuture =
    Pin<Box<dyn Future<Output = Result<Response<Body>, std::convert::Infallible>> + Send>>;

impl<S> tower::Service<Request<Body>> for Floor<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> BoxFuture {
        let key = match request
            .headers()
            .get("idempotency-key")
            .map(HeaderValue::to_str)
        {
            Some(Ok(key)) if !key.is_empty() => key.to_owned(),
            _ => return Box::pin(std::future::ready(Ok(status(StatusCode::BAD_REQUEST)))),
        };
        match self.keys.begin(&key) {
            Begin::Replay(answer) => return Box::pin(std::future::ready(Ok(replay(&answer)))),
            Begin::InFlight => {
                return Box::pin(std::future::ready(Ok(status(StatusCode::CONFLICT))));
            }
            Begin::Owner => {}
        }
        // The ready service answers this request; a clone waits for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let keys = Arc::clone(&self.keys);
        Box::pin(async move {
            let Ok(response) = inner.call(request).await;
            let (parts, body) = response.into_parts();
            let body = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => {
                    keys.finish(&key, None);
                    return Ok(status(StatusCode::BAD_GATEWAY));
                }
            };
            let kept = (!parts.status.is_server_error()).then(|| Answer {
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
            });
            keys.finish(&key, kept);
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

    #[tokio::test]
    async fn answers_each_key_once_and_replays_the_kept_answer() {
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
        let floor = FloorLayer::new().layer(handler);

        let first = floor.clone().oneshot(request(Some("a"))).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        assert!(first.headers().get("idempotent-replayed").is_none());
        assert_eq!(body(first).await, "run 0");

        let again = floor.clone().oneshot(request(Some("a"))).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-run"], "0");
        assert_eq!(body(again).await, "run 0");

        let other = floor.clone().oneshot(request(Some("b"))).await.unwrap();
        assert_eq!(body(other).await, "run 1");
        let none = floor.clone().oneshot(request(None)).await.unwrap();
        assert_eq!(none.status(), StatusCode::BAD_REQUEST);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_key_in_flight_is_refused_and_a_server_error_is_not_kept() {
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
        let floor = FloorLayer::new().layer(handler);

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
