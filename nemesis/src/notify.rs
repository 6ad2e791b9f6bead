//! The receiver of the ledger's notifications, in this process: an HTTP server that
//! deduplicates by `Idempotency-Key` with this library's layer (what a real receiver of an
//! at-least-once relay does) and records each notification it acted on, with its key.

use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::State;
use axum::routing::post;

/// What the receiver acted on: `(key, posting id)`, once per handler run.
pub(crate) type Acted = Arc<Mutex<Vec<(String, String)>>>;

pub(crate) struct Notifier {
    pub(crate) url: String,
    pub(crate) acted: Acted,
    server: tokio::task::JoinHandle<()>,
}

impl Notifier {
    pub(crate) async fn start() -> Result<Notifier, String> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| format!("the notifier cannot listen: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("the notifier's address: {e}"))?
            .port();
        let acted = Acted::default();
        let act = |State(acted): State<Acted>,
                   headers: http::HeaderMap,
                   body: axum::Json<serde_json::Value>| async move {
            let key = headers
                .get("idempotency-key")
                .and_then(|k| k.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let id = body["id"].as_str().unwrap_or_default().to_owned();
            lock(&acted).push((key, id));
            http::StatusCode::CREATED
        };
        let idempotency =
            idempotent_core::Idempotency::new(idempotent_core::memory::MemoryStore::new());
        let app = axum::Router::new()
            .route("/notify", post(act))
            .layer(idempotent_tower::IdempotencyLayer::http(idempotency).allow_anonymous(true))
            .with_state(Arc::clone(&acted));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Notifier {
            url: format!("http://127.0.0.1:{port}/notify"),
            acted,
            server,
        })
    }

    pub(crate) fn acted(&self) -> Vec<(String, String)> {
        lock(&self.acted).clone()
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn lock(acted: &Mutex<Vec<(String, String)>>) -> std::sync::MutexGuard<'_, Vec<(String, String)>> {
    acted.lock().unwrap_or_else(PoisonError::into_inner)
}
