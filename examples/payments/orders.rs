//! `POST /orders`: an operation in three steps (reserve the stock, charge the card, send the
//! receipt), each a recovery point on the request's claim, and `GET /orders/count`.
//!
//! Each step runs through [`ClaimHandle::step`] (or, for the receipt on PostgreSQL,
//! `PostgresStore::step_in_transaction`): the first attempt runs it and saves what it made on
//! the in-flight record; a later attempt of the same operation (the client's retry after a
//! crash, or the completer) gets that back without running the step again, and goes on from
//! there. Each step's downstream key is [`KeyClaim::step_key`](idempotent_core::KeyClaim::step_key), and the ids in the answer
//! are derived from it, so a resumed run names what the first attempt made.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write as _;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{Request, State};
use axum::http::uri::PathAndQuery;
use axum::http::{StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotent_core::{ClaimHandle, Error, Key, StepError};
use idempotent_postgres::PostgresStore;
use idempotent_postgres::outbox::{Outbox, Outgoing};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::App;
use crate::provider::ProviderError;

/// The outbox destination of the receipts (on PostgreSQL).
const RECEIPTS: &str = "receipts";

/// The orders' side of the example: what each step's downstream did in this process, and
/// where the receipts go.
pub(crate) struct Orders {
    /// Orders answered `201`.
    answered: AtomicU64,
    /// Handler starts: client requests and completer runs alike.
    runs: AtomicU64,
    /// The stock reservations made.
    stock: Downstream,
    /// The charges the provider made for orders.
    charges: Downstream,
    /// The receipts sent (by the mailer, or written to the outbox).
    receipts: Downstream,
    /// On PostgreSQL: the receipt is an outbox row written in its step's transaction.
    outbox: Option<(PostgresStore, Outbox)>,
    /// `IDEMPOTENCY_EFFECTS_LOG`: a line per effect, kept across processes.
    log: Option<EffectsLog>,
}

impl Orders {
    /// Reads `IDEMPOTENCY_EFFECTS_LOG` and, when the runtime's store is PostgreSQL (`postgres`),
    /// creates the receipts' outbox table there.
    pub(crate) async fn from_env(postgres: Option<PostgresStore>) -> Result<Orders, String> {
        let log = match std::env::var("IDEMPOTENCY_EFFECTS_LOG") {
            Ok(path) => Some(EffectsLog::open(&path).map_err(|error| {
                format!("IDEMPOTENCY_EFFECTS_LOG={path:?} cannot be opened for appending: {error}")
            })?),
            Err(_) => None,
        };
        // The receipt's transaction writes the step's checkpoint to the claim's row: the same
        // store, the same pool.
        let outbox = match postgres {
            Some(store) => {
                let outbox = Outbox::new();
                outbox
                    .migrate(store.pool())
                    .await
                    .map_err(|e| format!("cannot create the outbox table: {e}"))?;
                Some((store, outbox))
            }
            None => None,
        };
        Ok(Orders {
            answered: AtomicU64::new(0),
            runs: AtomicU64::new(0),
            stock: Downstream::default(),
            charges: Downstream::default(),
            receipts: Downstream::default(),
            outbox,
            log,
        })
    }

    /// With `IDEMPOTENCY_EFFECTS_LOG`, appends `<what> <key> <pid>` to the log: the
    /// `/payments` handler's charges (`payment`, under the claim's operation key) use it.
    pub(crate) fn log_effect(&self, what: &str, key: &Key) {
        if let Some(log) = &self.log {
            log.append(what, key);
        }
    }

    /// Records the effect of `step` under `key` in this process (once per key, as a downstream
    /// that deduplicates by key does) and, with `IDEMPOTENCY_EFFECTS_LOG`, every run of it in
    /// the log, a repeated key included: the log shows a step that ran twice even where the
    /// downstream's key kept its effect to one.
    fn effect(&self, downstream: &Downstream, step: &str, key: &Key) {
        self.log_effect(step, key);
        downstream.apply(key.as_str());
    }
}

/// A downstream system that takes an idempotency key: the same key again changes nothing.
#[derive(Default)]
struct Downstream {
    seen: Mutex<HashSet<String>>,
    effects: AtomicU64,
}

impl Downstream {
    /// Applies the effect under `key`; false if it was applied before.
    fn apply(&self, key: &str) -> bool {
        let fresh = self
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.to_owned());
        if fresh {
            self.effects.fetch_add(1, Ordering::SeqCst);
        }
        fresh
    }

    fn effects(&self) -> u64 {
        self.effects.load(Ordering::SeqCst)
    }
}

/// `IDEMPOTENCY_EFFECTS_LOG`: one line per effect, `<step> <step key> <pid>` (a step, before
/// its checkpoint is written) or `payment <operation key> <pid>` (a charge of `POST
/// /payments`, before its answer is recorded), each written with one `write` to a file opened
/// for appending, so the lines outlive a process killed at any moment.
struct EffectsLog(Mutex<File>);

impl EffectsLog {
    fn open(path: &str) -> std::io::Result<EffectsLog> {
        let file = File::options().create(true).append(true).open(path)?;
        Ok(EffectsLog(Mutex::new(file)))
    }

    /// Appends a line; a line that cannot be written stops the process (the log would lie).
    fn append(&self, step: &str, key: &Key) {
        let line = format!("{step} {} {}\n", key.as_str(), std::process::id());
        let mut file = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(error) = file.write_all(line.as_bytes()) {
            eprintln!("payments: cannot write IDEMPOTENCY_EFFECTS_LOG: {error}");
            std::process::abort();
        }
    }
}

/// The routes, with the app's state, without any layer: `POST /orders` and
/// `GET /orders/count`.
pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/count", get(count))
        .with_state(app)
}

/// After which step `?crash_after=` aborts the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CrashAfter {
    Reserve,
    Charge,
}

impl CrashAfter {
    fn step(self) -> &'static str {
        match self {
            CrashAfter::Reserve => "reserve",
            CrashAfter::Charge => "charge",
        }
    }
}

/// Takes `crash_after` out of the query before the idempotency layer sees the request, into
/// a [`CrashAfter`] extension: the retry without it is the same request (the same
/// fingerprint), and a request kept for the completer does not carry it. An unknown value
/// is answered `400 invalid_crash_after`.
pub(crate) async fn crash_hook(mut request: Request, next: Next) -> Response {
    let Some(query) = request.uri().query() else {
        return next.run(request).await;
    };
    let mut crash = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("crash_after", "reserve") => crash = Some(CrashAfter::Reserve),
            ("crash_after", "charge") => crash = Some(CrashAfter::Charge),
            ("crash_after", _) => {
                let error = json!({"error": "invalid_crash_after"});
                return (StatusCode::BAD_REQUEST, Json(error)).into_response();
            }
            _ => kept.push(pair),
        }
    }
    let Some(crash) = crash else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    let rest = if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    };
    let mut parts = request.uri().clone().into_parts();
    parts.path_and_query = PathAndQuery::from_str(&rest).ok();
    if let Ok(uri) = Uri::from_parts(parts) {
        *request.uri_mut() = uri;
    }
    request.extensions_mut().insert(crash);
    next.run(request).await
}

#[derive(Deserialize)]
struct OrderRequest {
    sku: String,
    quantity: NonZeroU64,
    amount: u64,
    currency: String,
}

/// The answer: what each step made, and the request.
#[derive(Serialize)]
struct Order {
    order_id: String,
    reservation_id: String,
    charge_id: String,
    receipt_id: String,
    sku: String,
    quantity: u64,
    amount: u64,
    currency: String,
}

/// An id for what a step made: `prefix`, then the first 24 characters of its key (the
/// operation key's, which the step key begins with).
fn id_of(prefix: &str, key: &Key) -> String {
    let key = key.as_str();
    format!("{prefix}_{}", &key[..key.len().min(24)])
}

/// Aborts the process if `ran` (the step ran in this attempt) and it is the step
/// `crash_after` names: a demo of pulling the plug between two steps.
fn crash_if(crash: Option<CrashAfter>, step: CrashAfter, ran: bool) {
    if ran && crash == Some(step) {
        eprintln!("payments: crash_after={}: aborting", step.step());
        std::process::abort();
    }
}

async fn create_order(
    State(app): State<Arc<App>>,
    Extension(claim): Extension<ClaimHandle>,
    crash: Option<Extension<CrashAfter>>,
    Json(order): Json<OrderRequest>,
) -> Response {
    let orders = &app.orders;
    orders.runs.fetch_add(1, Ordering::SeqCst);
    let crash = crash.map(|Extension(crash)| crash);
    let keys = ["reserve", "charge", "receipt"].map(|step| claim.step_key(step));
    let [Ok(reserve_key), Ok(charge_key), Ok(receipt_key)] = keys else {
        return internal("step_key");
    };

    // Step 1: reserve the stock.
    let mut ran = false;
    let reservation = claim
        .step("reserve", async {
            ran = true;
            orders.effect(&orders.stock, "reserve", &reserve_key);
            id_of("res", &reserve_key)
        })
        .await;
    let reservation_id: String = match reservation {
        Ok(id) => id,
        Err(error) => return step_failed("reserve", &error),
    };
    crash_if(crash, CrashAfter::Reserve, ran);

    // Step 2: charge the card, with the step's key as the provider's idempotency key. A
    // failure is not saved: the retry charges again, with the same key.
    let mut ran = false;
    let charge = claim
        .try_step("charge", async {
            ran = true;
            app.provider
                .charge(charge_key.as_str(), order.amount, &order.currency)?;
            orders.effect(&orders.charges, "charge", &charge_key);
            Ok::<_, ProviderError>(id_of("ch", &charge_key))
        })
        .await;
    let charge_id: String = match charge {
        Ok(id) => id,
        Err(StepError::Failed(error)) => return crate::refused(error),
        Err(StepError::Idempotency(error)) => return step_failed("charge", &error),
    };
    crash_if(crash, CrashAfter::Charge, ran);

    // Step 3: the receipt: on PostgreSQL an outbox row committed with the step's checkpoint,
    // elsewhere the simulated mailer.
    let receipt_id = id_of("rcpt", &receipt_key);
    let receipt = match &orders.outbox {
        Some((store, outbox)) => {
            let payload = json!({
                "order_id": id_of("ord", &claim.operation_key()),
                "receipt_id": receipt_id,
                "sku": order.sku,
                "quantity": order.quantity.get(),
                "amount": order.amount,
                "currency": order.currency,
            });
            let message = Outgoing::new(RECEIPTS, payload.to_string())
                .header("content-type", "application/json")
                .claim(&claim)
                .part("receipt");
            let outbox = outbox.clone();
            let mut ran = false;
            let saved = store
                .step_in_transaction(&claim, "receipt", |mut tx| {
                    ran = true;
                    async move {
                        outbox.enqueue(&mut tx, &message).await?;
                        Ok::<_, idempotent_postgres::outbox::OutboxError>((tx, receipt_id))
                    }
                })
                .await;
            if ran && saved.is_ok() {
                orders.receipts.apply(receipt_key.as_str());
            }
            match saved {
                Ok(id) => Ok(id),
                Err(StepError::Failed(error)) => {
                    eprintln!("payments: the receipt's outbox row was not written: {error}");
                    return internal("outbox_unavailable");
                }
                Err(StepError::Idempotency(error)) => Err(error),
            }
        }
        None => {
            claim
                .step("receipt", async {
                    orders.effect(&orders.receipts, "receipt", &receipt_key);
                    receipt_id
                })
                .await
        }
    };
    let receipt_id: String = match receipt {
        Ok(id) => id,
        Err(error) => return step_failed("receipt", &error),
    };

    orders.answered.fetch_add(1, Ordering::SeqCst);
    let answer = Order {
        order_id: id_of("ord", &claim.operation_key()),
        reservation_id,
        charge_id,
        receipt_id,
        sku: order.sku,
        quantity: order.quantity.get(),
        amount: order.amount,
        currency: order.currency,
    };
    (StatusCode::CREATED, Json(answer)).into_response()
}

/// A step that could not run or keep its checkpoint: `503` (released by the layer), so the
/// retry resumes from the steps saved so far.
fn step_failed(step: &str, error: &Error) -> Response {
    eprintln!("payments: order step {step} failed: {error}");
    let code = match error {
        Error::ClaimLost => "claim_lost",
        Error::Store(_) => "store_unavailable",
        _ => "step_failed",
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        Json(json!({"error": code, "step": step})),
    )
        .into_response()
}

/// `500` (released by the layer: the retry runs again).
fn internal(code: &str) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({"error": code})),
    )
        .into_response()
}

/// `GET /orders/count`.
#[derive(Serialize)]
struct Counts {
    /// Orders answered `201`.
    orders: u64,
    /// Each step's effects made in this process.
    reserved: u64,
    charged: u64,
    receipts: u64,
    /// Handler starts: client requests and completer runs alike.
    runs: u64,
}

/// Orders answered, each step's effects in this process, and handler starts.
async fn count(State(app): State<Arc<App>>) -> Json<Counts> {
    let orders = &app.orders;
    Json(Counts {
        orders: orders.answered.load(Ordering::SeqCst),
        reserved: orders.stock.effects(),
        charged: orders.charges.effects(),
        receipts: orders.receipts.effects(),
        runs: orders.runs.load(Ordering::SeqCst),
    })
}
