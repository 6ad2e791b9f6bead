//! The receiver of the `ledger` example's notifications, for the ledger's end-to-end tests: an
//! HTTP server in the test process that deduplicates by `Idempotency-Key` with this library's
//! layer and records what it received; and the outbox's rows by state.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sqlx::PgPool;

use super::ledger::Deadline;

/// What the notifier saw.
#[derive(Default)]
pub struct Notified {
    /// Each notification its handler acted on, after deduplication: `(key, body)`.
    pub acted: Vec<(String, serde_json::Value)>,
    /// Requests received per key, duplicates and refusals included.
    pub attempts: HashMap<String, u32>,
    /// Keys of the requests being handled now.
    pub in_flight: HashSet<String>,
    /// Whether two requests with one key were ever handled at once.
    pub overlapped: bool,
}

/// The receiver of the ledger's notifications: an HTTP server in the test process that
/// deduplicates by `Idempotency-Key` with this library's layer (its records survive a
/// restart), counts what it receives, refuses (400) the notifications of one account, and
/// never answers those with a [hanging key](HANGING_KEY_PREFIX). It can be stopped, refusing
/// connections, and started again on the same port.
pub struct Notifier {
    pub port: u16,
    /// How long the handler takes.
    pub hold: Duration,
    pub seen: Arc<Mutex<Notified>>,
    pub idempotency: idempotent_core::Idempotency,
    pub server: Option<tokio::task::JoinHandle<()>>,
}

/// The account whose notifications the notifier refuses.
pub const REFUSED_ACCOUNT: &str = "acct-refused";

/// The notifier never answers a request whose `Idempotency-Key` starts with this: it counts
/// it, then holds it until its connection goes (the test kills the relay that sent it).
pub const HANGING_KEY_PREFIX: &str = "hang-";

impl Notifier {
    pub async fn start() -> Notifier {
        Notifier::start_holding(Duration::from_millis(5)).await
    }

    pub async fn start_holding(hold: Duration) -> Notifier {
        let mut notifier = Notifier {
            port: 0,
            hold,
            seen: Arc::default(),
            idempotency: idempotent_core::Idempotency::new(
                idempotent_core::memory::MemoryStore::new(),
            ),
            server: None,
        };
        notifier.up().await;
        notifier
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/notify", self.port)
    }

    /// Listens (on the same port as before, once there was one).
    pub async fn up(&mut self) {
        use axum::extract::State;
        use axum::routing::post;

        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.port = listener.local_addr().unwrap().port();
        let hold = self.hold;
        let act = move |State(seen): State<Arc<Mutex<Notified>>>,
                        headers: http::HeaderMap,
                        body: axum::Json<serde_json::Value>| async move {
            if body["account"] == REFUSED_ACCOUNT {
                return http::StatusCode::BAD_REQUEST;
            }
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            lock(&seen).acted.push((key, body.0));
            // A hold, so that a second delivery of one message at the same time would be seen.
            tokio::time::sleep(hold).await;
            http::StatusCode::CREATED
        };
        let count = |State(seen): State<Arc<Mutex<Notified>>>,
                     request: axum::extract::Request,
                     next: axum::middleware::Next| async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .map(|k| k.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let hang = {
                let mut seen = lock(&seen);
                *seen.attempts.entry(key.clone()).or_default() += 1;
                // The key as sent: an RFC 8941 string, quoted or bare.
                let hang = key.trim_matches('"').starts_with(HANGING_KEY_PREFIX);
                if !hang && !seen.in_flight.insert(key.clone()) {
                    seen.overlapped = true;
                }
                hang
            };
            if hang {
                return std::future::pending().await;
            }
            let response = next.run(request).await;
            lock(&seen).in_flight.remove(&key);
            response
        };
        let app = axum::Router::new()
            .route("/notify", post(act))
            .layer(
                idempotent_tower::IdempotencyLayer::http(self.idempotency.clone())
                    .allow_anonymous(true),
            )
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&self.seen),
                count,
            ))
            .with_state(Arc::clone(&self.seen));
        self.server = Some(tokio::spawn(async move {
            // Every connection is a task of this set: stopping the server drops them all.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                connections.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        }));
    }

    /// Stops listening and drops every connection: deliveries fail until [`up`](Self::up).
    pub async fn down(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
    }

    pub fn seen(&self) -> std::sync::MutexGuard<'_, Notified> {
        lock(&self.seen)
    }

    /// Requests received with the message key `key` (sent quoted or bare).
    pub fn attempts(&self, key: &str) -> u32 {
        self.seen()
            .attempts
            .iter()
            .filter(|(sent, _)| sent.trim_matches('"') == key)
            .map(|(_, n)| n)
            .sum()
    }

    /// Waits until notifications for `ids` were acted on.
    pub async fn wait_for(&self, ids: &BTreeSet<String>, within: Duration) {
        let deadline = Deadline::after(within, "not every notification arrived");
        loop {
            let acted: BTreeSet<String> = self
                .seen()
                .acted
                .iter()
                .map(|(_, body)| body["id"].as_str().unwrap().to_owned())
                .collect();
            if ids.is_subset(&acted) {
                return;
            }
            deadline.tick().await;
        }
    }

    /// Checks that each of `ids` was acted on exactly once, with its own key, and nothing
    /// else was.
    pub fn assert_once_each(&self, ids: &BTreeSet<String>) {
        let seen = self.seen();
        let mut by_id: BTreeMap<String, Vec<&String>> = BTreeMap::new();
        for (key, body) in &seen.acted {
            by_id
                .entry(body["id"].as_str().unwrap().to_owned())
                .or_default()
                .push(key);
        }
        let acted: BTreeSet<String> = by_id.keys().cloned().collect();
        assert_eq!(
            &acted, ids,
            "one notification per applied posting, no other"
        );
        for (id, keys) in &by_id {
            assert_eq!(keys.len(), 1, "{id} acted on {} times", keys.len());
            assert!(seen.attempts[keys[0]] >= 1);
        }
        let keys: HashSet<&String> = by_id.values().map(|k| k[0]).collect();
        assert_eq!(keys.len(), ids.len(), "each notification has its own key");
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

pub fn lock(seen: &Mutex<Notified>) -> std::sync::MutexGuard<'_, Notified> {
    seen.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The outbox rows by state.
pub async fn outbox_states(db: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM idempotent_outbox GROUP BY state")
            .fetch_all(db)
            .await
            .unwrap();
    rows.into_iter().collect()
}
