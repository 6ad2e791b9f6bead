//! A payments API on axum behind `IdempotencyLayer::http`: the contract the end-to-end tests
//! drive, and the *downstream key* pattern that makes a payment's effect exactly-once.
//!
//! ```sh
//! cargo run --release --example payments
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'Authorization: Bearer alice' \
//!      -H 'Content-Type: application/json' -d '{"amount":1999,"currency":"EUR"}'
//! curl localhost:3000/payments/count     # {"count": handler runs, "charges": charges made}
//! curl localhost:3000/metrics             # idempotency_requests_total{outcome="fresh",…} 1 …
//! ```
//!
//! and an operation in steps that resumes where it stopped (see "Orders in steps" below):
//!
//! ```sh
//! curl -i -X POST 'localhost:3000/orders?crash_after=charge' -H 'Idempotency-Key: cart-1' \
//!      -H 'Authorization: Bearer alice' -H 'Content-Type: application/json' \
//!      -d '{"sku":"tea","quantity":2,"amount":1200,"currency":"EUR"}'   # the server aborts
//! # restart it on the same store, then retry without crash_after: reserve and charge are
//! # not run again, the receipt is sent, and the answer names the first attempt's reservation
//! curl localhost:3000/orders/count   # {"orders":1,"reserved":0,"charged":0,"receipts":1,"runs":1}
//! ```
//!
//! `GET /metrics` serves the runtime's and the layer's metrics (see `idempotent_core::metrics`)
//! in Prometheus's text format, through `metrics-exporter-prometheus`.
//!
//! # The record and the effect
//!
//! The layer makes the *record* exactly-once: of any number of duplicates of one request, one
//! runs the handler while the others get 409 and, later, the recorded answer. That alone does
//! not make the *charge* exactly-once. If the store stalls for longer than the lease while the
//! handler runs (a paused Redis, a frozen database, an overloaded network), the claim ends,
//! a retry takes the key over and runs the handler again, and the first run, which did not
//! stop, still goes on to charge.
//!
//! So the handler does what one does with Stripe: it passes an idempotency key to the provider,
//! and the provider charges at most once per key, answering a repeated key with the charge it
//! already made. The in-process [`Provider`](provider::Provider) here simulates such an API.
//! The key it gets is the claim's [`operation_key`](idempotent_core::KeyClaim::operation_key)
//! (the layer puts the [`ClaimHandle`] into the request's extensions), not the client's
//! `Idempotency-Key`:
//!
//! - it is the same for every owner and every attempt of one operation, so the stalled first
//!   run and the retry that took over send the same key, and the provider charges once;
//! - it is scoped like the record: two principals who happen to send the same client key get
//!   different operation keys (the client's key would make the provider see one key with two
//!   sets of parameters, or worse, answer one principal with the other's charge);
//! - it reveals nothing: it is a one-way derivation, so neither the client's key nor the store's
//!   key leaks to the provider, and the provider's logs cannot be joined back to the client's.
//!
//! When the provider sees the key again with *other* parameters (the client reused its key for
//! a different payment after the record expired), it refuses, like Stripe's
//! `idempotency_error`, and the handler answers 422 `idempotency_key_reused`.
//!
//! The claim's fencing token and its `lost()` signal are the tools for effects without such a
//! key; with the key, the handler needs neither, and costs no extra round trip to the store.
//!
//! # Whose key it is
//!
//! Keys are scoped by the authenticated principal, which the `authenticate` middleware puts in
//! the request extensions as an [`idempotent_tower::Principal`]. This demo's "verification"
//! reads `Authorization: Bearer <user>` or `Bearer <user>.<token id>`, where the token id
//! stands for a token that is refreshed from time to time while the user stays the same: a
//! retry sent with a refreshed token still replays. A protected request without a credential
//! gets `403 missing_scope` from the layer. A real service verifies a session cookie, a signed
//! token or a client certificate there instead.
//!
//! # Sessions instead of keys
//!
//! A client may send `Idempotency-Session: id="…", seq=N, ack=M` instead of an
//! `Idempotency-Key` on the protected routes (the layer reads it by default): request `N` of
//! its session, holding every answer up to `M`. Its record is scoped by the user like a key,
//! and the operation key the provider gets is the request's own. See the README's "Sessions
//! instead of keys" and `payments_client --session`.
//!
//! # Orders in steps
//!
//! `POST /orders` takes `{"sku","quantity","amount","currency"}` (any sku, a quantity of at
//! least 1) behind a layer like theirs (the same runtime and settings) and runs three steps on
//! the request's [`ClaimHandle`], each a recovery point ([`ClaimHandle::step`], see
//! `idempotent_core::steps`): `reserve` (a stock reservation), `charge` (the provider above,
//! given the step's own key, [`step_key`](idempotent_core::KeyClaim::step_key)`("charge")`, as its
//! idempotency key) and `receipt` (a simulated mailer; on PostgreSQL, a row of the outbox table
//! `idempotent_outbox`, for destination `receipts`, written in the transaction that saves the
//! step's checkpoint, `PostgresStore::step_in_transaction`, so the two commit together). A step
//! that ran saves what it made on the in-flight record; a later attempt of the same operation
//! (the retry after a crash, a lapsed lease or a `5xx`) gets it back without running the step,
//! and goes on with the next. It answers `201` with
//! `{"order_id","reservation_id","charge_id","receipt_id","sku","quantity","amount","currency"}`:
//! the ids are derived from the steps' keys, so they are the same for every attempt of the
//! operation and a resumed run names what the first attempt made; replays are byte-identical,
//! like every recorded answer. Bad bodies are answered like those of `/payments` (415, 400,
//! 422); the provider's refusals too (an amount of 0 is declined, 402, recorded; the currency
//! `err` fails, 500, released, and the retry resumes after the reservation).
//!
//! `?crash_after=reserve` or `?crash_after=charge` aborts the process right after that
//! step's effect and checkpoint, if the step ran in this attempt (one restored from its
//! checkpoint goes on): pulling the plug between two steps. It is taken out of the query
//! before the layer sees the request, so it is not part of the fingerprint: the retry
//! without it is the same request. Any other value is answered `400 invalid_crash_after`.
//!
//! `GET /orders/count` returns this process's counters: `orders` (answered `201`),
//! `reserved`, `charged`, `receipts` (each step's effects made in this process) and `runs`
//! (handler starts, client requests and completer runs alike).
//!
//! With `IDEMPOTENCY_COMPLETER_AFTER`, the layer of `/orders` keeps each request on its
//! record, and an `idempotent_tower::Completer` finishes, in the background, an order whose
//! claim lapsed (its process died) or was released and that no retry took over for that
//! long: it runs the kept request through the routes under the layer, the handler resumes
//! from the checkpoints, and the answer is recorded, so the client's eventual retry replays
//! it. The completer is stopped at shutdown.
//!
//! Each kept request records the code version that kept it, `IDEMPOTENCY_APP_VERSION`
//! (default: this crate's version), and the completer finishes only the orders kept by that
//! version: during a deploy, an instance of the new release leaves an order an old instance
//! abandoned to the old release's completers (or its client's retry), which run the code that
//! kept it.
//!
//! # Shutdown
//!
//! On SIGTERM (or Ctrl-C) the server shuts the runtime down gracefully: new payments get
//! `503 shutting_down` with `Retry-After`, payments in flight finish and record their responses
//! (so a retry sent to another instance replays them), for up to 10 seconds; then it exits.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `PORT` | `3000` | listens on `127.0.0.1:$PORT` |
//! | `IDEMPOTENCY_STORE` | `memory` | where records live: `memory`, `redis://HOST:PORT[/DB]` (several, comma-separated: a Redis Cluster's nodes), `postgres://USER@HOST:PORT/DB` or `sqlite://PATH` (one file, durable across restarts, shared by the processes of one host) |
//! | `IDEMPOTENCY_TTL` | `24h` | how long responses are replayed: `1ms` to `365d` |
//! | `IDEMPOTENCY_LEASE` | `30s` | how long a crashed request keeps its key locked: `100ms` to `365d` |
//! | `IDEMPOTENCY_IN_FLIGHT` | `reject` | `reject` (409) or `wait` (up to one lease, then replay) |
//! | `IDEMPOTENCY_REDIS_REPLICAS` | `0` | on Redis, replicas that must acknowledge every claim and record before it counts (`WAIT`; see `RedisStoreBuilder::replicas`) |
//! | `IDEMPOTENCY_SESSION_IDLE` | `24h` | how long a client session nobody sends to is kept, with its answers: `1ms` to `365d` |
//! | `IDEMPOTENCY_SESSION_WINDOW` | `64` | how far past its acknowledged mark a session may number requests: `1` to `4096` |
//! | `IDEMPOTENCY_CACHE` | unset: no cache | finished records cached in front of the store: `memory:N` (in this process, at most `N` records) or `redis://HOST:PORT[/DB]` (a Redis every instance shares, in front of the store `IDEMPOTENCY_STORE` names); see `idempotent-cache` |
//! | `IDEMPOTENCY_APP_VERSION` | this crate's version | the code version `/orders` keeps its requests with, and the only one whose orders the completer finishes: 1 to 64 visible ASCII characters (`1.4.2`, a commit id); see "Orders in steps" |
//! | `IDEMPOTENCY_COMPLETER_AFTER` | unset: no completer | finish `/orders` operations abandoned for this long (their claim lapsed or released, no retry): `1ms` to `365d`; see "Orders in steps" |
//! | `IDEMPOTENCY_EFFECTS_LOG` | unset: none | a file every run of an order's step is appended to as a line `<step> <step key> <pid>` (a step run again under the same key included), before the step's checkpoint is written: `reserve` and `charge`, and `receipt` but on PostgreSQL (where the receipt is its outbox row); and every charge `POST /payments` makes, as `payment <operation key> <pid>`, before its answer is recorded; a count of effects that outlives the process |
//! | `RUST_LOG` | `warn,idempotent_tower=info` | log filter (logs go to stderr) |
//!
//! Durations are read by `idempotent_core::limits::parse_duration` (`500ms`, `30s`, `15m`,
//! `24h`, `7d`, `1h 30m`). A bad value, or one out of its range, makes the server exit with
//! status 2 and a message naming the variable.
//!
//! Test hooks: `?delay_ms=N` sleeps before doing the work; an amount of 0 is declined by the
//! provider (402, recorded); the currency `err` makes the provider fail (500, released, so a
//! retry runs again); on `/orders`, `?crash_after=reserve|charge` and
//! `IDEMPOTENCY_EFFECTS_LOG`.

mod common;
#[path = "payments/orders.rs"]
mod orders;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::Request;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotent_core::ClaimHandle;
use idempotent_tower::{CodeVersion, Completer, IdempotencyLayer, Principal};
use provider::{Provider, ProviderError};
use serde::Deserialize;
use serde_json::json;

/// A payment provider that takes an idempotency key the way Stripe does.
mod provider {
    use std::collections::HashMap;
    use std::sync::{Mutex, PoisonError};

    /// What the provider refuses.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum ProviderError {
        /// The card was declined. Remembered under the key: a retry gets the same decline.
        CardDeclined,
        /// The provider failed before processing the request. Not remembered: a retry with the
        /// same key is processed afresh.
        Unavailable,
        /// The key was used before with other parameters (Stripe's `idempotency_error`).
        KeyReused,
    }

    /// A request as the provider compares it with an earlier one under the same key.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Request {
        Charge { amount: u64, currency: String },
        Refund { charge: u64 },
    }

    #[derive(Default)]
    struct State {
        /// Every key seen, with its request and its answer (the id of what it created).
        seen: HashMap<String, (Request, Result<u64, ProviderError>)>,
        /// The last id handed out, to charges and refunds alike.
        last_id: u64,
        /// Charges actually made.
        charges: u64,
    }

    /// In memory, for the example; a real provider keeps keys for a day or so.
    #[derive(Default)]
    pub(crate) struct Provider {
        state: Mutex<State>,
    }

    impl Provider {
        /// Charges `amount` in `currency` once per `key`: the same key again answers the charge
        /// made the first time (its id), without charging again.
        pub(crate) fn charge(
            &self,
            key: &str,
            amount: u64,
            currency: &str,
        ) -> Result<u64, ProviderError> {
            self.once(
                key,
                Request::Charge {
                    amount,
                    currency: currency.to_owned(),
                },
            )
        }

        /// Refunds `charge` once per `key`. The simulation does not look the charge up.
        pub(crate) fn refund(&self, key: &str, charge: u64) -> Result<u64, ProviderError> {
            self.once(key, Request::Refund { charge })
        }

        /// Charges actually made (not counting answers to repeated keys).
        pub(crate) fn charges(&self) -> u64 {
            self.state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .charges
        }

        fn once(&self, key: &str, request: Request) -> Result<u64, ProviderError> {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((earlier, answer)) = state.seen.get(key) {
                return if *earlier == request {
                    *answer
                } else {
                    Err(ProviderError::KeyReused)
                };
            }
            let answer = match &request {
                Request::Charge { currency, .. } if currency == "err" => {
                    return Err(ProviderError::Unavailable);
                }
                Request::Charge { amount: 0, .. } => Err(ProviderError::CardDeclined),
                Request::Charge { .. } => {
                    state.charges += 1;
                    state.last_id += 1;
                    Ok(state.last_id)
                }
                Request::Refund { .. } => {
                    state.last_id += 1;
                    Ok(state.last_id)
                }
            };
            state.seen.insert(key.to_owned(), (request, answer));
            answer
        }
    }
}

struct App {
    /// Handler runs, counted by the handlers themselves.
    executions: AtomicU64,
    provider: Provider,
    /// `POST /orders`.
    orders: orders::Orders,
}

type Shared = State<Arc<App>>;

#[derive(Deserialize)]
struct PaymentRequest {
    amount: u64,
    currency: String,
}

#[derive(Deserialize)]
struct Delay {
    delay_ms: Option<u64>,
}

/// The demo's authentication: `Authorization: Bearer <user>[.<token id>]` is user `<user>`,
/// whichever token id (a refreshed token) it carries. Requests without one get no principal.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|token| token.split_once('.').map_or(token, |(user, _)| user))
        .filter(|user| !user.is_empty())
        .map(str::to_owned);
    if let Some(user) = user {
        request.extensions_mut().insert(Principal::new(user));
    }
    next.run(request).await
}

/// The answer to a provider error.
fn refused(error: ProviderError) -> Response {
    let (status, code) = match error {
        ProviderError::CardDeclined => (StatusCode::PAYMENT_REQUIRED, "card_declined"),
        // A 5xx is released by the layer: the client's retry runs again, with the same key.
        ProviderError::Unavailable => (StatusCode::INTERNAL_SERVER_ERROR, "provider_unavailable"),
        ProviderError::KeyReused => (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
    };
    (status, Json(json!({"error": code}))).into_response()
}

async fn create_payment(
    State(app): Shared,
    Extension(claim): Extension<ClaimHandle>,
    Query(delay): Query<Delay>,
    Extension(principal): Extension<Principal>,
    Json(payment): Json<PaymentRequest>,
) -> Response {
    if let Some(ms) = delay.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    app.executions.fetch_add(1, Ordering::SeqCst);
    // The same key for every owner and attempt of this operation: if this run outlived its
    // claim and a retry took over, both reach the provider with this key, and it charges once.
    let key = claim.operation_key();
    match app
        .provider
        .charge(key.as_str(), payment.amount, &payment.currency)
    {
        Ok(id) => {
            app.orders.log_effect("payment", &key);
            (
                StatusCode::CREATED,
                [(header::LOCATION, format!("/payments/{id}"))],
                Json(json!({
                    "id": id,
                    "amount": payment.amount,
                    "currency": payment.currency,
                    "principal": String::from_utf8_lossy(principal.id()),
                })),
            )
                .into_response()
        }
        Err(error) => refused(error),
    }
}

#[derive(Deserialize)]
struct RefundRequest {
    payment_id: u64,
}

async fn create_refund(
    State(app): Shared,
    Extension(claim): Extension<ClaimHandle>,
    Json(refund): Json<RefundRequest>,
) -> Response {
    app.executions.fetch_add(1, Ordering::SeqCst);
    match app
        .provider
        .refund(claim.operation_key().as_str(), refund.payment_id)
    {
        Ok(id) => (
            StatusCode::CREATED,
            Json(json!({"id": id, "payment_id": refund.payment_id})),
        )
            .into_response(),
        Err(error) => refused(error),
    }
}

/// Handler runs (`count`) and charges the provider made (`charges`): after any number of
/// retries and takeovers, one charge per payment.
async fn count(State(app): Shared) -> Json<serde_json::Value> {
    Json(json!({
        "count": app.executions.load(Ordering::SeqCst),
        "charges": app.provider.charges(),
    }))
}

/// `IDEMPOTENCY_APP_VERSION`, else this crate's version.
fn app_version() -> Result<CodeVersion, String> {
    const NAME: &str = "IDEMPOTENCY_APP_VERSION";
    match std::env::var(NAME) {
        Ok(value) => CodeVersion::new(&value).map_err(|error| format!("{NAME}: {error}")),
        Err(std::env::VarError::NotPresent) => CodeVersion::new(env!("CARGO_PKG_VERSION"))
            .map_err(|error| format!("this crate's version: {error}")),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("{NAME} is not a code version: it is not UTF-8"))
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    common::init_logging();
    let (settings, completer_after, version) = match common::settings(3000)
        .and_then(|settings| Ok((settings, common::completer_after()?, app_version()?)))
    {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };
    let metrics = match common::install_metrics() {
        Ok(metrics) => metrics,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::FAILURE;
        }
    };
    let (idempotency, postgres) = match common::idempotency(&settings, "payments-example").await {
        Ok(found) => found,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };

    let orders = match orders::Orders::from_env(postgres).await {
        Ok(orders) => orders,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };
    let state = Arc::new(App {
        executions: AtomicU64::new(0),
        provider: Provider::default(),
        orders,
    });

    // `/orders` keeps its requests, with this code's version, for the completer when there is
    // one; the completer runs that version's through the same routes without the layer.
    let orders_layer = match completer_after {
        Some(_) => IdempotencyLayer::http(idempotency.clone()).keep_requests(version.clone()),
        None => IdempotencyLayer::http(idempotency.clone()),
    };
    let orders = orders::router(Arc::clone(&state));
    let completer = completer_after.map(|after| {
        Completer::new(&orders_layer, orders.clone())
            .versions([version])
            .after(after)
            .spawn()
    });
    let app = Router::new()
        .route("/payments", post(create_payment))
        .route("/refunds", post(create_refund))
        .route("/payments/count", get(count))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", common::metrics_route(metrics))
        .layer(IdempotencyLayer::http(idempotency.clone()))
        .with_state(state)
        .merge(
            orders
                .layer(orders_layer)
                .layer(middleware::from_fn(orders::crash_hook)),
        )
        .layer(middleware::from_fn(authenticate));

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
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(common::shutdown::drain(idempotency, "payments"))
        .await;
    if let Some(completer) = completer {
        completer.stop().await;
    }
    if let Err(error) = served {
        eprintln!("payments: server failed: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
