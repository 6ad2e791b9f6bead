//! A payments API on axum behind `IdempotencyLayer`: the contract the end-to-end tests drive.
//!
//! ```sh
//! cargo run --release --example payments
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'Content-Type: application/json' -d '{"amount":1999,"currency":"EUR"}'
//! ```
//!
//! Environment:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `PORT` | `3000` | listens on `127.0.0.1:$PORT` |
//! | `IDEMPOTENCY_STORE` | `memory` | where records live: `memory`, `redis://HOST:PORT[/DB]` or `postgres://USER@HOST:PORT/DB` |
//! | `IDEMPOTENCY_TTL` | `24h` | how long responses are replayed |
//! | `IDEMPOTENCY_LEASE` | `30s` | how long a crashed request keeps its key locked |
//! | `IDEMPOTENCY_IN_FLIGHT` | `reject` | `reject` (409) or `wait` (up to one lease, then replay) |
//!
//! Durations are a number followed by `ms`, `s`, `m`, `h` or `d`.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotent_tower::IdempotencyLayer;
use serde::Deserialize;
use serde_json::json;

#[derive(Default)]
struct Ledger {
    executions: AtomicU64,
    next_id: AtomicU64,
}

type Shared = State<Arc<Ledger>>;

#[derive(Deserialize)]
struct PaymentRequest {
    amount: u64,
    currency: String,
}

#[derive(Deserialize)]
struct Delay {
    delay_ms: Option<u64>,
}

fn principal(headers: &HeaderMap) -> String {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("anonymous")
        .to_owned()
}

async fn create_payment(
    State(ledger): Shared,
    Query(delay): Query<Delay>,
    headers: HeaderMap,
    Json(payment): Json<PaymentRequest>,
) -> Response {
    if let Some(ms) = delay.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    ledger.executions.fetch_add(1, Ordering::SeqCst);
    if payment.amount == 0 {
        return (
            StatusCode::PAYMENT_REQUIRED,
            Json(json!({"error": "card_declined"})),
        )
            .into_response();
    }
    if payment.currency == "err" {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "provider_unavailable"})),
        )
            .into_response();
    }
    let id = ledger.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(json!({
            "id": id,
            "amount": payment.amount,
            "currency": payment.currency,
            "principal": principal(&headers),
        })),
    )
        .into_response()
}

#[derive(Deserialize)]
struct RefundRequest {
    payment_id: u64,
}

async fn create_refund(State(ledger): Shared, Json(refund): Json<RefundRequest>) -> Response {
    ledger.executions.fetch_add(1, Ordering::SeqCst);
    let id = ledger.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({"id": id, "payment_id": refund.payment_id})),
    )
        .into_response()
}

async fn count(State(ledger): Shared) -> Json<serde_json::Value> {
    Json(json!({"count": ledger.executions.load(Ordering::SeqCst)}))
}

#[tokio::main]
async fn main() -> ExitCode {
    common::init_logging();
    let settings = match common::settings(3000) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };
    let idempotency = match common::idempotency(&settings, "payments-example").await {
        Ok(idempotency) => idempotency,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };

    let app = Router::new()
        .route("/payments", post(create_payment))
        .route("/refunds", post(create_refund))
        .route("/payments/count", get(count))
        .route("/health", get(|| async { StatusCode::OK }))
        .layer(IdempotencyLayer::new(idempotency))
        .with_state(Arc::new(Ledger::default()));

    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, settings.port));
    let listener = match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("payments: cannot listen on {address}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let port = listener.local_addr().map_or(settings.port, |a| a.port());
    println!("listening on http://127.0.0.1:{port}");
    if let Err(error) = axum::serve(listener, app).await {
        eprintln!("payments: server failed: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
