//! The payments fixture every mode shares: its route, request body and keys, the handler that
//! counts its executions per key (served by the HTTP rows), and an in-process stand-in with a
//! fixed answer (behind the layer in the memory mode and the prefills).

use std::convert::Infallible;
use std::future::Ready;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response};
use http_body_util::Full;
use idempotent_tower::{IDEMPOTENCY_SESSION, RequestBody, SessionHeader};
use serde::{Deserialize, Serialize};
use tower::service_fn;

/// The path of the handler.
pub(crate) const PAYMENTS: &str = "/payments";
/// The path that opens a session (rows whose middleware needs one: axum-idempotent).
pub(crate) const SESSION: &str = "/session";
/// How long the handler works on a probe key, so that concurrent duplicates overlap it.
pub(crate) const PROBE_HOLD: Duration = Duration::from_millis(25);

/// The request body every row sends.
pub(crate) const REQUEST_BODY: &[u8] =
    br#"{"amount":1999,"currency":"EUR","customer":"cus_8f14e45f"}"#;

/// A key as the load generator makes it; the handler attributes executions by parsing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyId {
    /// The `index`-th key of load-generator connection `lane`: `c<lane>-<index>`.
    Load { lane: usize, index: usize },
    /// The `n`-th probe key, sent as concurrent duplicates: `p<n>`.
    Probe(usize),
}

impl KeyId {
    pub(crate) fn parse(key: &str) -> Option<KeyId> {
        if let Some(rest) = key.strip_prefix('c') {
            let (lane, index) = rest.split_once('-')?;
            return Some(KeyId::Load {
                lane: lane.parse().ok()?,
                index: index.parse().ok()?,
            });
        }
        key.strip_prefix('p')?.parse().ok().map(KeyId::Probe)
    }

    pub(crate) fn to_key(self) -> String {
        match self {
            KeyId::Load { lane, index } => format!("c{lane}-{index}"),
            KeyId::Probe(n) => format!("p{n}"),
        }
    }

    /// The request numbered `seq` of a client session as the load generator names them:
    /// session `c<lane>` for connection `lane`, session `p` for the probe; the key of index
    /// `seq - 1`.
    pub(crate) fn of_session(id: &str, seq: u64) -> Option<KeyId> {
        let index = usize::try_from(seq.checked_sub(1)?).ok()?;
        match id {
            "p" => Some(KeyId::Probe(index)),
            _ => Some(KeyId::Load {
                lane: id.strip_prefix('c')?.parse().ok()?,
                index,
            }),
        }
    }

    /// The session id and sequence number of this key's request in a client session (the
    /// inverse of [`KeyId::of_session`]).
    pub(crate) fn to_session(self) -> (String, u64) {
        match self {
            KeyId::Load { lane, index } => (format!("c{lane}"), index as u64 + 1),
            KeyId::Probe(n) => ("p".to_owned(), n as u64 + 1),
        }
    }
}

/// Which key a request names: its `Idempotency-Key`, else the place its
/// `Idempotency-Session` gives.
fn key_of(headers: &HeaderMap) -> Option<KeyId> {
    if let Some(key) = headers.get("idempotency-key") {
        return key.to_str().ok().and_then(KeyId::parse);
    }
    let session = SessionHeader::parse(headers.get(IDEMPOTENCY_SESSION)?.as_bytes()).ok()?;
    KeyId::of_session(session.id().as_str(), session.seq())
}

/// How many times the handler ran per distinct key during one row, as counted by the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Executions {
    /// Per load-generator connection: executions of the key with that index.
    pub(crate) lanes: Vec<Vec<u32>>,
    /// Executions of each probe key (sent as concurrent duplicates, then retried).
    pub(crate) probes: Vec<u32>,
    /// Executions of requests whose key the handler could not attribute.
    pub(crate) unattributed: u64,
}

/// Executions per key, counted by the handler.
pub(crate) struct Tally {
    lanes: Vec<Mutex<Vec<u32>>>,
    probes: Mutex<Vec<u32>>,
    unattributed: AtomicU64,
    next_id: AtomicU64,
}

impl Tally {
    pub(crate) fn new(lanes: usize) -> Self {
        Tally {
            lanes: (0..lanes).map(|_| Mutex::new(Vec::new())).collect(),
            probes: Mutex::new(Vec::new()),
            unattributed: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
        }
    }

    /// Counts one execution for `key`; returns a new receipt id.
    pub(crate) fn record(&self, key: Option<KeyId>) -> u64 {
        let bump = |counts: &Mutex<Vec<u32>>, index: usize| {
            let mut counts = counts.lock().unwrap();
            if counts.len() <= index {
                counts.resize(index + 1, 0);
            }
            counts[index] += 1;
        };
        match key {
            Some(KeyId::Load { lane, index }) if lane < self.lanes.len() => {
                bump(&self.lanes[lane], index)
            }
            Some(KeyId::Probe(n)) => bump(&self.probes, n),
            _ => {
                self.unattributed.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn executions(&self) -> Executions {
        Executions {
            lanes: self
                .lanes
                .iter()
                .map(|l| l.lock().unwrap().clone())
                .collect(),
            probes: self.probes.lock().unwrap().clone(),
            unattributed: self.unattributed.load(Ordering::Relaxed),
        }
    }
}

#[derive(Deserialize)]
struct Payment {
    amount: u64,
    currency: String,
    customer: String,
}

#[derive(Serialize)]
struct Receipt {
    id: u64,
    amount: u64,
    currency: String,
    customer: String,
    status: &'static str,
}

/// The handler of every row: parse a small JSON body, count the execution, answer 201 with a
/// small JSON body.
async fn pay(
    State(tally): State<Arc<Tally>>,
    headers: HeaderMap,
    Json(payment): Json<Payment>,
) -> (StatusCode, Json<Receipt>) {
    let key = key_of(&headers);
    if let Some(KeyId::Probe(_)) = key {
        tokio::time::sleep(PROBE_HOLD).await;
    }
    let id = tally.record(key);
    let receipt = Receipt {
        id,
        amount: payment.amount,
        currency: payment.currency,
        customer: payment.customer,
        status: "captured",
    };
    (StatusCode::CREATED, Json(receipt))
}

/// The handler's route, without middleware.
pub(crate) fn payments() -> Router<Arc<Tally>> {
    Router::new().route(PAYMENTS, post(pay))
}

/// The size of the stand-in's response body.
pub(crate) const BODY_BYTES: usize = 200;

/// The stand-in's response body: [`BODY_BYTES`] bytes of JSON.
pub(crate) fn response_body() -> Bytes {
    let prefix = r#"{"id":"pay_"#;
    let suffix = r#"","status":"captured"}"#;
    let filler = BODY_BYTES - prefix.len() - suffix.len();
    let body = format!("{prefix}{}{suffix}", "x".repeat(filler));
    debug_assert_eq!(body.len(), BODY_BYTES);
    Bytes::from(body)
}

/// What the stand-in answers.
pub(crate) type Answer = Response<Full<Bytes>>;

/// The payments handler's answer without the payments handler, for a service behind
/// `IdempotencyLayer` in process: 201, `Content-Type: application/json`, [`response_body`].
pub(crate) fn stand_in() -> impl tower::Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Answer,
    Error = Infallible,
    Future = Ready<Result<Answer, Infallible>>,
> + Clone {
    let body = response_body();
    service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        std::future::ready(Ok(Response::builder()
            .status(StatusCode::CREATED)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .expect("a valid response")))
    })
}

/// A `POST` of [`REQUEST_BODY`] to [`PAYMENTS`] under idempotency key `key`, for a service in
/// process.
pub(crate) fn payment_request(key: String) -> Request<Full<Bytes>> {
    Request::post(PAYMENTS)
        .header("idempotency-key", key)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(REQUEST_BODY)))
        .expect("a valid request")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for key in [
            KeyId::Load { lane: 0, index: 0 },
            KeyId::Load {
                lane: 63,
                index: 1_234_567,
            },
            KeyId::Probe(7),
        ] {
            assert_eq!(KeyId::parse(&key.to_key()), Some(key));
        }
        for bad in [
            "", "c", "c1", "c1-", "c-1", "cx-1", "p", "px", "x1-1", "\"c1-1\"",
        ] {
            assert_eq!(KeyId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sessions_name_keys() {
        for key in [
            KeyId::Load { lane: 0, index: 0 },
            KeyId::Load {
                lane: 63,
                index: 99,
            },
            KeyId::Probe(7),
        ] {
            let (id, seq) = key.to_session();
            assert_eq!(KeyId::of_session(&id, seq), Some(key));
        }
        assert_eq!(
            KeyId::Load { lane: 3, index: 0 }.to_session(),
            ("c3".to_owned(), 1)
        );
        assert_eq!(KeyId::of_session("c3", 0), None, "seq starts at 1");
        assert_eq!(KeyId::of_session("x3", 1), None);
        assert_eq!(KeyId::of_session("c", 1), None);

        let mut headers = HeaderMap::new();
        headers.insert(
            IDEMPOTENCY_SESSION,
            http::HeaderValue::from_static(r#"id="c2", seq=5, ack=4"#),
        );
        assert_eq!(key_of(&headers), Some(KeyId::Load { lane: 2, index: 4 }));
        headers.insert("idempotency-key", http::HeaderValue::from_static("p1"));
        assert_eq!(key_of(&headers), Some(KeyId::Probe(1)), "a key first");
        assert_eq!(key_of(&HeaderMap::new()), None);
    }

    #[test]
    fn tally_counts_per_key() {
        let tally = Tally::new(2);
        tally.record(Some(KeyId::Load { lane: 1, index: 2 }));
        tally.record(Some(KeyId::Load { lane: 1, index: 2 }));
        tally.record(Some(KeyId::Probe(0)));
        tally.record(Some(KeyId::Load { lane: 5, index: 0 }));
        let id = tally.record(None);
        assert_eq!(id, 5);
        let executions = tally.executions();
        assert_eq!(executions.lanes, vec![vec![], vec![0, 0, 2]]);
        assert_eq!(executions.probes, vec![1]);
        assert_eq!(executions.unattributed, 2);
    }

    #[test]
    fn body_has_the_stated_size_and_is_json() {
        let body = response_body();
        assert_eq!(body.len(), BODY_BYTES);
        serde_json::from_slice::<serde_json::Value>(&body).unwrap();
    }
}
