//! A gRPC payments service on tonic behind `IdempotencyLayer::grpc`: the contract the
//! end-to-end tests drive.
//!
//! ```sh
//! cargo run --release --example grpc
//! ```
//!
//! It listens on `127.0.0.1:$PORT` (default 50051) and reads the same `IDEMPOTENCY_*`
//! environment as the `payments` example (see `common/mod.rs`). With `METRICS_PORT` set, it
//! also serves `GET /metrics` (Prometheus text format, see `idempotent_core::metrics`) on
//! `127.0.0.1:$METRICS_PORT`. The service is
//! `payments.v1.Payments` from `proto/payments.proto`, compiled at build time by `protox` (a
//! protobuf compiler in pure Rust: no `protoc` needed):
//!
//! - `Charge` (protected by the `idempotency-key` metadata entry) sleeps `delay_ms`, counts an
//!   execution, then: amount 0 → `INVALID_ARGUMENT` `card_declined` (stored and replayed);
//!   currency `err` → `UNAVAILABLE` `provider_unavailable` (released: the retry runs again);
//!   otherwise a `Payment` with a new id and the principal.
//!
//! Keys are scoped by the [`Principal`] an interceptor in front of the layer derives from
//! `authorization: Bearer NAME` (a stand-in for verifying a real token); a protected call
//! without one gets `PERMISSION_DENIED` with `idempotent-error: missing_scope`. On SIGTERM
//! (or Ctrl-C) the server shuts down gracefully: new protected calls get `UNAVAILABLE`
//! (`shutting_down`), calls in flight finish and record their responses (up to 10 s).
//! - `Count` (not protected) returns the executions so far.
//! - `Stream` (server streaming, passes through) sends `n` payments with ids 1..=n.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent_core::ClaimHandle;
use idempotent_tower::{IdempotencyLayer, Principal};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// The generated protobuf and gRPC code.
pub mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("payments.v1");
}

use pb::payments_server::{Payments, PaymentsServer};
use pb::{ChargeRequest, CountReply, CountRequest, Payment, StreamRequest};

#[derive(Default)]
struct PaymentService {
    executions: AtomicU64,
    next_id: AtomicU64,
}

/// The demo's authentication, run before the idempotency layer: `authorization: Bearer NAME`
/// is principal `NAME`. Calls without it go on without a principal.
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let user = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|user| !user.is_empty())
        .map(str::to_owned);
    if let Some(user) = user {
        request.extensions_mut().insert(Principal::new(user));
    }
    Ok(request)
}

fn principal<T>(request: &Request<T>) -> String {
    request.extensions().get::<Principal>().map_or_else(
        || "anonymous".to_owned(),
        |p| String::from_utf8_lossy(p.id()).into_owned(),
    )
}

type PaymentStream = Pin<Box<dyn Stream<Item = Result<Payment, Status>> + Send>>;

#[tonic::async_trait]
impl Payments for PaymentService {
    async fn charge(&self, request: Request<ChargeRequest>) -> Result<Response<Payment>, Status> {
        let principal = principal(&request);
        // The layer puts the running claim into the request's extensions. A real service
        // passes its operation key to the provider it charges (see the payments example);
        // this one returns it as metadata, so that clients can see it is one per operation.
        let operation_key = request
            .extensions()
            .get::<ClaimHandle>()
            .map(|claim| claim.operation_key());
        let charge = request.into_inner();
        if charge.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(charge.delay_ms)).await;
        }
        self.executions.fetch_add(1, Ordering::SeqCst);
        if charge.amount == 0 {
            return Err(Status::invalid_argument("card_declined"));
        }
        if charge.currency == "err" {
            return Err(Status::unavailable("provider_unavailable"));
        }
        let mut response = Response::new(Payment {
            id: self.next_id.fetch_add(1, Ordering::SeqCst) + 1,
            amount: charge.amount,
            currency: charge.currency,
            principal,
        });
        if let Some(key) = operation_key.and_then(|key| key.as_str().parse().ok()) {
            response.metadata_mut().insert("x-operation-key", key);
        }
        Ok(response)
    }

    async fn count(&self, _: Request<CountRequest>) -> Result<Response<CountReply>, Status> {
        Ok(Response::new(CountReply {
            count: self.executions.load(Ordering::SeqCst),
        }))
    }

    type StreamStream = PaymentStream;

    async fn stream(
        &self,
        request: Request<StreamRequest>,
    ) -> Result<Response<PaymentStream>, Status> {
        let principal = principal(&request);
        let n = u64::from(request.into_inner().n);
        let payments = (1..=n).map(move |id| {
            Ok(Payment {
                id,
                amount: 0,
                currency: String::new(),
                principal: principal.clone(),
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(payments))))
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    common::init_logging();
    let settings = match common::settings(50051) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("grpc: {message}");
            return ExitCode::from(2);
        }
    };
    let metrics = match common::install_metrics() {
        Ok(metrics) => metrics,
        Err(message) => {
            eprintln!("grpc: {message}");
            return ExitCode::FAILURE;
        }
    };
    if let Ok(port) = std::env::var("METRICS_PORT") {
        let Ok(port) = port.parse::<u16>() else {
            eprintln!("grpc: METRICS_PORT={port:?} is not a port number");
            return ExitCode::from(2);
        };
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let listener = match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("grpc: cannot listen on {address} for metrics: {error}");
                return ExitCode::FAILURE;
            }
        };
        let app = axum::Router::new().route("/metrics", common::metrics_route(metrics));
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                eprintln!("grpc: metrics server failed: {error}");
            }
        });
    }
    let idempotency = match common::idempotency(&settings, "grpc-example").await {
        Ok((idempotency, _)) => idempotency,
        Err(message) => {
            eprintln!("grpc: {message}");
            return ExitCode::from(2);
        }
    };
    let layer =
        IdempotencyLayer::grpc(idempotency.clone()).methods(["/payments.v1.Payments/Charge"]);

    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, settings.port));
    let listener = match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("grpc: cannot listen on {address}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let port = listener.local_addr().map_or(settings.port, |a| a.port());
    println!("listening on 127.0.0.1:{port}");
    let served = tonic::transport::Server::builder()
        .layer(tonic::service::InterceptorLayer::new(authenticate))
        .layer(layer)
        .add_service(PaymentsServer::new(PaymentService::default()))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            common::shutdown::drain(idempotency, "grpc"),
        )
        .await;
    if let Err(error) = served {
        eprintln!("grpc: server failed: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
