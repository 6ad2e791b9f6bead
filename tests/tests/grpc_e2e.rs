//! The `grpc` example as a real process, driven by a real tonic client over TCP: replays with
//! status, message and metadata, refusals as gRPC statuses, the outcome policy by
//! `grpc-status`, concurrency, scopes, and streaming calls passing through.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{Client, Protocol, Server, metric};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request};

mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("payments.v1");
}

use pb::payments_client::PaymentsClient;
use pb::{ChargeRequest, CountRequest, StreamRequest};

async fn start() -> (Server, PaymentsClient<Channel>) {
    let server = Server::start("grpc", &[], "listening on 127.0.0.1:").await;
    let client = PaymentsClient::connect(format!("http://127.0.0.1:{}", server.port))
        .await
        .expect("connect to the grpc example");
    (server, client)
}

fn charge(
    amount: u64,
    currency: &str,
    key: Option<&str>,
    principal: Option<&str>,
) -> Request<ChargeRequest> {
    charge_slow(amount, currency, 0, key, principal)
}

fn charge_slow(
    amount: u64,
    currency: &str,
    delay_ms: u64,
    key: Option<&str>,
    principal: Option<&str>,
) -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        amount,
        currency: currency.into(),
        delay_ms,
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", MetadataValue::try_from(key).unwrap());
    }
    if let Some(principal) = principal {
        let value = MetadataValue::try_from(format!("Bearer {principal}")).unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

async fn count(client: &mut PaymentsClient<Channel>) -> u64 {
    client
        .count(CountRequest {})
        .await
        .unwrap()
        .into_inner()
        .count
}

fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_replays_the_identical_message_with_the_replay_metadata() {
    let (_server, mut client) = start().await;
    let first = client
        .charge(charge(1999, "EUR", Some("k1"), Some("alice")))
        .await
        .unwrap();
    assert!(!replayed(first.metadata()));
    let payment = first.into_inner();
    assert_eq!(
        (
            payment.amount,
            payment.currency.as_str(),
            payment.principal.as_str()
        ),
        (1999, "EUR", "alice")
    );
    for _ in 0..3 {
        let retry = client
            .charge(charge(1999, "EUR", Some("k1"), Some("alice")))
            .await
            .unwrap();
        assert!(replayed(retry.metadata()));
        assert_eq!(retry.into_inner(), payment);
    }
    assert_eq!(count(&mut client).await, 1);
}

/// The handler reads the running claim from the tonic request's extensions: its operation key
/// (returned here as `x-operation-key`) is the same for every attempt of one operation and
/// differs across keys and principals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_reads_the_claim_from_the_request_extensions() {
    let (_server, mut client) = start().await;
    let operation_key = |response: &tonic::Response<pb::Payment>| {
        response
            .metadata()
            .get("x-operation-key")
            .expect("the handler saw its claim")
            .to_str()
            .unwrap()
            .to_owned()
    };
    let first = client
        .charge(charge(1999, "EUR", Some("op-1"), Some("alice")))
        .await
        .unwrap();
    let key = operation_key(&first);
    assert_eq!(key.len(), 64);
    assert!(!key.contains("op-1"));
    let retry = client
        .charge(charge(1999, "EUR", Some("op-1"), Some("alice")))
        .await
        .unwrap();
    assert!(replayed(retry.metadata()));
    assert_eq!(operation_key(&retry), key);
    let other_key = client
        .charge(charge(1999, "EUR", Some("op-2"), Some("alice")))
        .await
        .unwrap();
    assert_ne!(operation_key(&other_key), key);
    let other_principal = client
        .charge(charge(1999, "EUR", Some("op-1"), Some("bob")))
        .await
        .unwrap();
    assert_ne!(operation_key(&other_principal), key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_invalid_key_is_invalid_argument() {
    let (_server, mut client) = start().await;
    let missing = client
        .charge(charge(5, "EUR", None, Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(
        missing.metadata().get("idempotent-error").unwrap(),
        "missing_key"
    );
    assert!(
        missing.message().contains("idempotency-key"),
        "{}",
        missing.message()
    );
    let long = "k".repeat(256);
    let invalid = client
        .charge(charge(5, "EUR", Some(&long), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert_eq!(
        invalid.metadata().get("idempotent-error").unwrap(),
        "invalid_key"
    );
    assert_eq!(count(&mut client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_another_message_is_failed_precondition() {
    let (_server, mut client) = start().await;
    let first = client
        .charge(charge(100, "EUR", Some("k"), Some("alice")))
        .await
        .unwrap()
        .into_inner();
    let other = client
        .charge(charge(200, "EUR", Some("k"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition);
    assert_eq!(
        other.metadata().get("idempotent-error").unwrap(),
        "fingerprint_mismatch"
    );
    let original = client
        .charge(charge(100, "EUR", Some("k"), Some("alice")))
        .await
        .unwrap();
    assert!(replayed(original.metadata()));
    assert_eq!(original.into_inner(), first);
    assert_eq!(count(&mut client).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicate_is_aborted_with_a_retry_delay() {
    let (_server, mut client) = start().await;
    let first = tokio::spawn({
        let mut client = client.clone();
        async move {
            client
                .charge(charge_slow(5, "EUR", 600, Some("k"), Some("alice")))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dup = client
        .charge(charge_slow(5, "EUR", 600, Some("k"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::Aborted);
    assert_eq!(dup.metadata().get("idempotent-error").unwrap(), "in_flight");
    let pushback: u64 = dup
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=1000).contains(&pushback), "{pushback}");
    let first = first.await.unwrap().unwrap().into_inner();
    let later = client
        .charge(charge_slow(5, "EUR", 600, Some("k"), Some("alice")))
        .await
        .unwrap();
    assert!(replayed(later.metadata()));
    assert_eq!(later.into_inner(), first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_execute_once() {
    let (_server, mut client) = start().await;
    let start = Arc::new(tokio::sync::Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (mut client, start) = (client.clone(), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                client
                    .charge(charge_slow(7, "EUR", 200, Some("same"), Some("alice")))
                    .await
            })
        })
        .collect();
    let (mut fresh, mut aborted, mut replays) = (0, 0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(response) if replayed(response.metadata()) => replays += 1,
            Ok(_) => fresh += 1,
            Err(status) if status.code() == Code::Aborted => aborted += 1,
            Err(status) => panic!("unexpected {status:?}"),
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(fresh + aborted + replays, 20);
    assert_eq!(count(&mut client).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_invalid_argument_is_replayed_with_its_message() {
    let (_server, mut client) = start().await;
    let first = client
        .charge(charge(0, "EUR", Some("declined"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(first.code(), Code::InvalidArgument);
    assert_eq!(first.message(), "card_declined");
    assert!(!replayed(first.metadata()));
    let retry = client
        .charge(charge(0, "EUR", Some("declined"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(retry.code(), Code::InvalidArgument);
    assert_eq!(retry.message(), "card_declined");
    assert!(
        replayed(retry.metadata()),
        "the status was replayed, not re-executed"
    );
    assert_eq!(count(&mut client).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_is_released_and_the_retry_executes_again() {
    let (_server, mut client) = start().await;
    for _ in 0..2 {
        let status = client
            .charge(charge(10, "err", Some("flaky"), Some("alice")))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(status.message(), "provider_unavailable");
        assert!(!replayed(status.metadata()));
    }
    assert_eq!(count(&mut client).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principals_never_share_keys() {
    let (_server, mut client) = start().await;
    let alice = client
        .charge(charge(5, "EUR", Some("k"), Some("alice")))
        .await
        .unwrap()
        .into_inner();
    let bob = client
        .charge(charge(9, "USD", Some("k"), Some("bob")))
        .await
        .unwrap();
    assert!(!replayed(bob.metadata()));
    let bob = bob.into_inner();
    assert_eq!(bob.principal, "bob");
    assert_ne!(alice.id, bob.id);
    // Without a principal the key has no scope: refused before the handler runs.
    let anonymous = client
        .charge(charge(5, "EUR", Some("k"), None))
        .await
        .unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        anonymous.metadata().get("idempotent-error").unwrap(),
        "missing_scope"
    );
    assert_eq!(count(&mut client).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_is_resource_exhausted() {
    let (_server, mut client) = start().await;
    let huge = "x".repeat(2 << 20);
    let status = client
        .charge(charge(5, &huge, Some("big"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        status.metadata().get("idempotent-error").unwrap(),
        "request_too_large"
    );
    assert_eq!(count(&mut client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_unprotected_calls_pass_through() {
    let (_server, mut client) = start().await;
    for _ in 0..2 {
        let mut request = Request::new(StreamRequest { n: 3 });
        request
            .metadata_mut()
            .insert("idempotency-key", MetadataValue::from_static("stream"));
        let response = client.stream(request).await.unwrap();
        assert!(!replayed(response.metadata()));
        let mut stream = response.into_inner();
        let mut ids = Vec::new();
        while let Some(payment) = stream.message().await.unwrap() {
            ids.push(payment.id);
        }
        assert_eq!(ids, [1, 2, 3]);
    }
    // Count carries no key and is not refused.
    assert_eq!(count(&mut client).await, 0);
}

/// SIGTERM during a long call: the call gets its response, a call arriving meanwhile gets
/// `UNAVAILABLE` with `idempotent-error: shutting_down`, and the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_call_in_flight_finish_and_refuses_new_ones() {
    let (mut server, client) = start().await;
    let in_flight = tokio::spawn({
        let mut client = client.clone();
        async move {
            client
                .charge(charge_slow(5, "EUR", 1500, Some("long"), Some("alice")))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    server.signal("TERM");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = client
        .clone()
        .charge(charge(5, "EUR", Some("late"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert_eq!(
        refused.metadata().get("idempotent-error").unwrap(),
        "shutting_down"
    );
    let payment = in_flight
        .await
        .unwrap()
        .expect("the call in flight finishes");
    assert_eq!(payment.into_inner().principal, "alice");
    let exit = tokio::time::timeout(Duration::from_secs(15), server.child.wait())
        .await
        .expect("the process exits once its calls are done")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_their_own_port_count_grpc_calls_by_outcome() {
    let metrics_port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let metrics_port = metrics_port.to_string();
    let server = Server::start(
        "grpc",
        &[("METRICS_PORT", metrics_port.as_str())],
        "listening on 127.0.0.1:",
    )
    .await;
    let mut client = PaymentsClient::connect(format!("http://127.0.0.1:{}", server.port))
        .await
        .expect("connect to the grpc example");
    client
        .charge(charge(100, "EUR", Some("g-1"), Some("alice")))
        .await
        .unwrap();
    client
        .charge(charge(100, "EUR", Some("g-1"), Some("alice")))
        .await
        .unwrap();
    let mismatch = client
        .charge(charge(200, "EUR", Some("g-1"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::FailedPrecondition);
    let mut slow_client = client.clone();
    let slow = tokio::spawn(async move {
        slow_client
            .charge(charge_slow(100, "EUR", 1500, Some("g-2"), Some("alice")))
            .await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let conflict = client
        .charge(charge_slow(100, "EUR", 1500, Some("g-2"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), Code::Aborted);
    slow.await.unwrap().unwrap();

    let scrape = Client::new(Protocol::Http1)
        .get(&format!("http://127.0.0.1:{metrics_port}/metrics"))
        .await;
    let scrape = String::from_utf8_lossy(&scrape.body).into_owned();
    let requests = |outcome| {
        metric(
            &scrape,
            "idempotency_requests_total",
            &[("protocol", "grpc"), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("fresh"), Some(2.0), "{scrape}");
    assert_eq!(requests("replayed"), Some(1.0));
    assert_eq!(requests("mismatch"), Some(1.0));
    assert_eq!(requests("in_flight"), Some(1.0));
}

/// A client session over gRPC (`idempotency-session` metadata) against the real example:
/// a retry replays, an acknowledged number is `OUT_OF_RANGE`, a number past the window
/// `RESOURCE_EXHAUSTED`, an unknown session holding answers `NOT_FOUND`, a key and a session
/// together `INVALID_ARGUMENT`; each with its code in `idempotent-error`, and one charge per
/// number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_over_grpc_runs_each_number_once() {
    let server = Server::start(
        "grpc",
        &[("IDEMPOTENCY_SESSION_WINDOW", "4")],
        "listening on 127.0.0.1:",
    )
    .await;
    let mut client = PaymentsClient::connect(format!("http://127.0.0.1:{}", server.port))
        .await
        .unwrap();
    let in_session = |seq: u64, ack: u64, amount: u64, id: &str| {
        let mut request = charge(amount, "EUR", None, Some("alice"));
        let value = format!(r#"id="{id}", seq={seq}, ack={ack}"#);
        request.metadata_mut().insert(
            "idempotency-session",
            MetadataValue::try_from(value).unwrap(),
        );
        request
    };
    let first = client.charge(in_session(1, 0, 100, "g-1")).await.unwrap();
    assert!(!replayed(first.metadata()));
    let payment = first.into_inner();
    let retry = client.charge(in_session(1, 0, 100, "g-1")).await.unwrap();
    assert!(replayed(retry.metadata()));
    assert_eq!(retry.into_inner(), payment);
    client.charge(in_session(2, 1, 200, "g-1")).await.unwrap();
    let refused = |status: tonic::Status, code: Code, error: &str| {
        assert_eq!(status.code(), code, "{status:?}");
        assert_eq!(status.metadata().get("idempotent-error").unwrap(), error);
    };
    refused(
        client
            .charge(in_session(1, 1, 100, "g-1"))
            .await
            .unwrap_err(),
        Code::OutOfRange,
        "sequence_acknowledged",
    );
    refused(
        client
            .charge(in_session(6, 1, 600, "g-1"))
            .await
            .unwrap_err(),
        Code::ResourceExhausted,
        "session_window_full",
    );
    refused(
        client
            .charge(in_session(3, 2, 300, "g-unknown"))
            .await
            .unwrap_err(),
        Code::NotFound,
        "session_expired",
    );
    let mut both = in_session(3, 2, 300, "g-1");
    both.metadata_mut()
        .insert("idempotency-key", MetadataValue::from_static("k"));
    refused(
        client.charge(both).await.unwrap_err(),
        Code::InvalidArgument,
        "conflicting_idempotency_headers",
    );
    assert_eq!(count(&mut client).await, 2);
}
