//! The client layer against the real `payments` example, through a TCP proxy that loses
//! answers: the request reaches the server, which charges, and the proxy cuts the connection
//! instead of passing the answer on. Every payment still succeeds, and the server charges
//! each exactly once.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_tower::client::{
    ClientError, ClientLayer, ClientService, Delivery, IdempotencyKey, IdempotencyMiddleware,
    RetryPolicy,
};
use support::{Client, Protocol, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::{Layer, Service, ServiceExt};

/// What the proxy does to the connections and answers it carries.
#[derive(Clone, Copy)]
struct Faults {
    /// The share of answers lost: the request was forwarded, the server answered, and the
    /// proxy closes the client's connection instead of forwarding the answer.
    lose_answer: f64,
    /// The share of connections closed before anything is forwarded.
    reset_before: f64,
    /// A delay added before forwarding each answer, up to this long (uniformly drawn).
    delay: Duration,
    /// How the proxy tells an answer in the bytes it carries.
    wire: Wire,
}

/// How the proxy finds each request and its answer in the bytes of a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// HTTP/1: the server sends nothing unasked, so an answer is the first bytes the server
    /// sends after the client sent a request.
    Http1,
    /// HTTP/2 (gRPC): a request is a `HEADERS` frame of the client on a new stream, its answer
    /// the first `HEADERS` frame of the server on that stream. Nothing else (`SETTINGS`,
    /// `WINDOW_UPDATE`, `PING`, of which each new connection sends several) counts, so a loss
    /// is one request's answer.
    Http2,
}

/// 30 % of the answers lost, 5 % of the connections reset, answers delayed up to 20 ms.
const A_THIRD_LOST: Faults = Faults {
    lose_answer: 0.3,
    reset_before: 0.05,
    delay: Duration::from_millis(20),
    wire: Wire::Http1,
};

/// A TCP proxy on loopback in front of `upstream`, causing `faults`.
struct FaultProxy {
    address: SocketAddr,
    lost: Arc<AtomicU64>,
    /// HTTP/2 only: the requests forwarded to the server.
    requests: Arc<AtomicU64>,
    reset: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    async fn start(upstream: SocketAddr, faults: Faults) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (lost, reset) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (lost_count, reset_count) = (Arc::clone(&lost), Arc::clone(&reset));
        let requests = Arc::new(AtomicU64::new(0));
        let request_count = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if fastrand::f64() < faults.reset_before {
                    reset_count.fetch_add(1, Ordering::SeqCst);
                    // Closed before anything is forwarded: the server sees nothing.
                    drop(client);
                    continue;
                }
                let lost = Arc::clone(&lost_count);
                let requests = Arc::clone(&request_count);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        match faults.wire {
                            Wire::Http1 => carry(client, server, faults, lost).await,
                            Wire::Http2 => carry_h2(client, server, faults, lost, requests).await,
                        }
                    }
                });
            }
        });
        FaultProxy {
            address,
            lost,
            requests,
            reset,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }
}

/// Carries one connection both ways. Each answer (the first bytes the server sends after
/// the client sent a request) is lost with probability `lose_answer`: the proxy reads it, so
/// the server has answered, and closes both sides without forwarding it.
async fn carry(client: TcpStream, server: TcpStream, faults: Faults, lost: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requested = Arc::new(AtomicBool::new(false));
    let asked = Arc::clone(&requested);
    let upstream = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    asked.store(true, Ordering::SeqCst);
                    if server_write.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let n = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if requested.swap(false, Ordering::SeqCst) {
                if fastrand::f64() < faults.lose_answer {
                    lost.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                if !faults.delay.is_zero() {
                    tokio::time::sleep(faults.delay.mul_f64(fastrand::f64())).await;
                }
            }
            if client_write.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
    };
    // Whichever side ends first ends the connection (a lost answer ends it at once).
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// The complete HTTP/2 frames at the start of `bytes`: each one's type, stream and end.
fn h2_frames(bytes: &[u8]) -> Vec<(u8, u32, usize)> {
    let mut frames = Vec::new();
    let mut at = 0;
    while bytes.len() - at >= 9 {
        let head = &bytes[at..at + 9];
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let end = at + 9 + len;
        if end > bytes.len() {
            break;
        }
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        frames.push((head[3], stream, end));
        at = end;
    }
    frames
}

/// The HTTP/2 frame type `HEADERS`.
const H2_HEADERS: u8 = 1;

/// Carries one HTTP/2 connection both ways, counting each request (a client `HEADERS` frame
/// on a new stream). Each answer (the server's first `HEADERS` frame on a stream: the server
/// has answered) is lost with probability `lose_answer`: the proxy closes both sides instead
/// of forwarding it. The connection's own frames are always forwarded.
async fn carry_h2(
    client: TcpStream,
    server: TcpStream,
    faults: Faults,
    lost: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
) {
    const PREFACE: usize = 24;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        let mut parsed = Vec::new();
        let mut preface = PREFACE;
        let mut streams = std::collections::HashSet::new();
        loop {
            let n = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let skipped = preface.min(n);
            preface -= skipped;
            parsed.extend_from_slice(&buffer[skipped..n]);
            let mut used = 0;
            for (kind, stream, end) in h2_frames(&parsed) {
                if kind == H2_HEADERS && stream != 0 && streams.insert(stream) {
                    requests.fetch_add(1, Ordering::SeqCst);
                }
                used = end;
            }
            parsed.drain(..used);
            if server_write.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        let mut pending = Vec::new();
        let mut answered = std::collections::HashSet::new();
        loop {
            let n = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buffer[..n]);
            let mut start = 0;
            let mut forwarded = 0;
            for (kind, stream, end) in h2_frames(&pending) {
                if kind == H2_HEADERS && stream != 0 && answered.insert(stream) {
                    // An answer starts: what came before it goes on, then it is lost or not.
                    if client_write
                        .write_all(&pending[forwarded..start])
                        .await
                        .is_err()
                    {
                        return;
                    }
                    forwarded = start;
                    if fastrand::f64() < faults.lose_answer {
                        lost.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    if !faults.delay.is_zero() {
                        tokio::time::sleep(faults.delay.mul_f64(fastrand::f64())).await;
                    }
                }
                start = end;
            }
            if client_write
                .write_all(&pending[forwarded..start])
                .await
                .is_err()
            {
                break;
            }
            pending.drain(..start);
        }
    };
    // Whichever side ends first ends the connection (a lost answer ends it at once).
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

fn upstream(server: &Server) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], server.port))
}

/// The attempts each call gets here (`payments_client --attempts`, and [`lossy`]). Through the
/// proxy that loses about a third of the answers, a call gives up only if it loses all of them:
/// with the example's 12, one call in 531,441 does, and these tests make over 4,000 calls a
/// run (about one run in 125 would fail by chance); with 20, one in 3.5 billion.
const ATTEMPTS: u32 = 20;

/// Runs the `payments_client` example to its end (killed if the test is dropped first), with
/// [`ATTEMPTS`] attempts a payment.
async fn run_payments_client(url: &str, payments: u32, concurrency: u32) -> std::process::Output {
    run_payments_client_with(url, payments, concurrency, &[]).await
}

/// Like [`run_payments_client`], with `extra` arguments.
async fn run_payments_client_with(
    url: &str,
    payments: u32,
    concurrency: u32,
    extra: &[&str],
) -> std::process::Output {
    tokio::process::Command::new(support::example_binary("payments_client"))
        .args([
            "--url",
            url,
            "--payments",
            &payments.to_string(),
            "--concurrency",
            &concurrency.to_string(),
            "--attempts",
            &ATTEMPTS.to_string(),
        ])
        .args(extra)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap()
}

/// The summary line `payments_client` printed last.
fn summary(output: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_else(|| {
        panic!(
            "no summary ({}); stderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )
    });
    serde_json::from_str(last).unwrap()
}

/// Runs the `payments_client` example and returns its summary line.
async fn payments_client(url: &str, payments: u32, concurrency: u32) -> (bool, serde_json::Value) {
    let output = run_payments_client(url, payments, concurrency).await;
    if !output.status.success() {
        // Shown with the failing test: which payments failed, and why.
        eprintln!(
            "payments_client: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    (output.status.success(), summary(&output))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_third_of_the_answers_lost_every_payment_is_charged_once() {
    let server = Server::payments(&[]).await;
    let proxy = FaultProxy::start(upstream(&server), A_THIRD_LOST).await;
    let (ok, summary) = payments_client(&proxy.url(""), 300, 8).await;
    assert!(ok, "{summary}");
    assert_eq!(summary["sent"], 300);
    assert_eq!(summary["succeeded"], 300, "{summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    let lost = proxy.lost.load(Ordering::SeqCst);
    assert!(
        lost >= 50,
        "the proxy lost {lost} answers: the fault did not happen"
    );
    // Every lost answer cost an attempt; the payments whose answer was lost after the server
    // ran them were answered by a replay.
    let attempts = summary["attempts"].as_u64().unwrap();
    assert!(attempts >= 300 + lost, "{summary}, {lost} lost");
    assert!(summary["replayed"].as_u64().unwrap() > 0, "{summary}");
    let client = Client::new(Protocol::Http1);
    assert_eq!(client.count(&server).await, 300, "one charge per payment");
    assert_eq!(client.charges(&server).await, 300);
    eprintln!(
        "{summary}: {lost} answers lost, {} connections reset",
        proxy.reset.load(Ordering::SeqCst)
    );
}

/// 1,000 payments in one client session (`payments_client --session`) through the proxy that
/// loses a third of the answers, on each store: every payment is charged exactly once, and no
/// call is sent past the session's window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_one_session_with_a_third_of_the_answers_lost_every_payment_is_charged_once() {
    let mut stores = vec!["memory".to_owned()];
    stores.extend(idempotent_test_kit::backend::redis_url());
    stores.extend(idempotent_test_kit::backend::postgres_url());
    for store in stores {
        let server = Server::payments(&[("IDEMPOTENCY_STORE", store.as_str())]).await;
        let proxy = FaultProxy::start(upstream(&server), A_THIRD_LOST).await;
        let output = run_payments_client_with(&proxy.url(""), 1_000, 8, &["--session"]).await;
        let summary = summary(&output);
        assert!(
            output.status.success(),
            "{store}: {summary}; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(summary["sent"], 1_000, "{store}");
        assert_eq!(summary["succeeded"], 1_000, "{store}: {summary}");
        let lost = proxy.lost.load(Ordering::SeqCst);
        assert!(lost >= 150, "{store}: the proxy lost only {lost} answers");
        assert!(
            summary["replayed"].as_u64().unwrap() > 0,
            "{store}: {summary}"
        );
        let client = Client::new(Protocol::Http1);
        assert_eq!(
            client.charges(&server).await,
            1_000,
            "{store}: one charge each"
        );
        assert_eq!(client.count(&server).await, 1_000, "{store}: one run each");
        // The client's window is the server's (64): the calls after a slow one waited for
        // the mark, and none was sent past it to be refused (each refusal had cost its call
        // an attempt; with a third of the answers lost, one call ran out of its attempts in
        // CI).
        let scrape = client.get(&server.url("/metrics")).await;
        let scrape = String::from_utf8_lossy(&scrape.body);
        assert_eq!(
            support::metric(
                &scrape,
                "idempotency_requests_total",
                &[("protocol", "http"), ("outcome", "session_window_full")]
            )
            .unwrap_or(0.0),
            0.0,
            "{store}: a call was sent past the session's window"
        );
        assert!(
            support::metric(
                &scrape,
                "idempotency_requests_total",
                &[("protocol", "http"), ("outcome", "fresh")]
            )
            .is_some_and(|fresh| fresh >= 1_000.0),
            "{store}: the scrape counts the requests: {scrape}"
        );
        eprintln!("{store}: {summary}, {lost} answers lost");
    }
}

/// A server that answers every `POST /payments` `503` with `Retry-After:
/// 18446744073709551615`: its URL, the `Idempotency-Session` header of each request it got, in
/// order, and its task.
async fn asking_to_wait_forever() -> (
    String,
    Arc<std::sync::Mutex<Vec<Option<String>>>>,
    tokio::task::JoinHandle<()>,
) {
    use axum::http::{HeaderMap, HeaderName, StatusCode, header::RETRY_AFTER};

    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&requests);
    let hostile = axum::Router::new().route(
        "/payments",
        axum::routing::post(move |headers: HeaderMap| {
            let session = headers
                .get("idempotency-session")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            seen.lock().unwrap().push(session);
            async {
                let forever: (HeaderName, String) = (RETRY_AFTER, u64::MAX.to_string());
                (StatusCode::SERVICE_UNAVAILABLE, [forever], "busy")
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, hostile).await.unwrap() });
    (url, requests, server)
}

// `--attempts` out of its range, or not a number, is refused with exit status 2 and a message
// naming it, before anything is sent.
#[tokio::test]
async fn payments_client_refuses_bad_attempts() {
    for bad in ["0", "1001", "-1", "many", ""] {
        let refused = support::refused_at_start(
            tokio::process::Command::new(support::example_binary("payments_client")).args([
                "--url",
                "http://127.0.0.1:9",
                "--attempts",
                bad,
            ]),
            &format!("--attempts {bad:?}"),
        )
        .await;
        assert!(
            refused
                .stderr
                .contains("--attempts takes a number from 1 to 1000"),
            "{bad:?}: {}",
            refused.stderr
        );
        assert!(refused.stdout.is_empty(), "{bad:?}");
    }
}

// Regression: a server answering `503` with `Retry-After: 18446744073709551615` made the
// client layer overflow an `Instant` ("overflow when adding duration to instant"): the worker
// panicked and `payments_client` died with exit status 101 and no summary. A delay beyond the
// deadline is not waited: each payment ends at once with the 503, counted as failed, and the
// client exits 1 with its summary, as documented for payments that do not succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_client_survives_a_server_asking_to_wait_forever() {
    let (url, requests, server) = asking_to_wait_forever().await;

    let started = std::time::Instant::now();
    // Its policy's deadline is 60 s: well under it means no payment waited.
    let output = tokio::time::timeout(Duration::from_secs(30), run_payments_client(&url, 6, 3))
        .await
        .expect("payments_client waited on the server's delay");
    server.abort();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(1), "{}: {stderr}", output.status);
    assert_eq!(
        summary(&output),
        serde_json::json!({"sent": 6, "succeeded": 0, "replayed": 0, "failed": 6, "attempts": 6}),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("payment answered 503").count(),
        6,
        "{stderr}"
    );
    assert_eq!(requests.lock().unwrap().len(), 6, "one attempt per payment");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

// In a session, a payment that ends without its answer (each of these 100: a 503 the client
// does not retry, which the server did not mark as its answer) is abandoned by
// `payments_client`, so that the session's mark passes it. Before, each held the mark: from
// payment 65 on (the window, 64), every payment waited its 60 s deadline for the mark, unsent,
// and this run did not end within its 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_session_payments_that_fail_do_not_hold_the_ones_after_them() {
    let (url, requests, server) = asking_to_wait_forever().await;
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        run_payments_client_with(&url, 100, 3, &["--session"]),
    )
    .await
    .expect("payments_client waited for the session's mark");
    server.abort();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{}: {stderr}", output.status);
    assert_eq!(
        summary(&output),
        serde_json::json!({"sent": 100, "succeeded": 0, "replayed": 0, "failed": 100, "attempts": 100}),
        "{stderr}"
    );
    let sessions = requests.lock().unwrap();
    assert_eq!(sessions.len(), 100, "one attempt per payment");
    // Every payment went in the session, numbered 1 to 100, the mark rising past the ones
    // abandoned.
    let mut seqs: Vec<u64> = sessions
        .iter()
        .map(|header| {
            let header = header.as_deref().expect("sent in the session");
            idempotent_tower::SessionHeader::parse(header.as_bytes())
                .unwrap()
                .seq()
        })
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=100).collect::<Vec<_>>());
}

/// A policy for a network losing a third of the answers (the `payments_client` example's).
fn lossy() -> RetryPolicy {
    RetryPolicy::new()
        .max_attempts(ATTEMPTS)
        .deadline(Duration::from_secs(60))
        .attempt_timeout(Duration::from_secs(5))
        .backoff(Duration::from_millis(20), Duration::from_secs(1))
        .budget(Duration::from_secs(10), 50, 1.0)
}

/// The client layer on hyper-util's client, as an application would use it.
fn client(policy: RetryPolicy) -> ClientService<HyperClient<HttpConnector, Full<Bytes>>> {
    let http = HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    ClientLayer::http().policy(policy).layer(http)
}

fn payment(url: &str, key: &str, body: &'static str) -> http::Request<Full<Bytes>> {
    let mut request = http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer alice")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    request
        .extensions_mut()
        .insert(IdempotencyKey::new(key).unwrap());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_waited_out_and_a_reused_key_is_not_retried() {
    let server = Server::payments(&[]).await;
    let key = format!("client-{}", std::process::id());
    let slow = server.url("/payments?delay_ms=1500");
    let first = {
        let (mut client, request) = (
            client(RetryPolicy::new()),
            payment(&slow, &key, r#"{"amount":1999,"currency":"EUR"}"#),
        );
        tokio::spawn(async move { client.ready().await.unwrap().call(request).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The same payment while the first still runs: 409 with Retry-After, waited out, then
    // the first one's answer replayed.
    let mut second = client(RetryPolicy::new());
    let answer = second
        .ready()
        .await
        .unwrap()
        .call(payment(&slow, &key, r#"{"amount":1999,"currency":"EUR"}"#))
        .await
        .unwrap();
    assert_eq!(answer.status(), http::StatusCode::CREATED);
    let delivery = answer.extensions().get::<Delivery>().unwrap();
    assert!(delivery.attempts() >= 2, "{delivery:?}");
    assert!(delivery.replayed(), "{delivery:?}");
    assert_eq!(
        first.await.unwrap().unwrap().status(),
        http::StatusCode::CREATED
    );

    // The same key for another payment: 422, answered at once, not retried.
    let answer = second
        .ready()
        .await
        .unwrap()
        .call(payment(
            &server.url("/payments"),
            &key,
            r#"{"amount":5,"currency":"EUR"}"#,
        ))
        .await
        .unwrap();
    assert_eq!(answer.status(), http::StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(answer.extensions().get::<Delivery>().unwrap().attempts(), 1);
    let client = Client::new(Protocol::Http1);
    assert_eq!(client.count(&server).await, 1, "one charge for the key");
}

mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("payments.v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_with_a_third_of_the_answers_lost_every_charge_runs_once() {
    use pb::payments_client::PaymentsClient;
    use pb::{ChargeRequest, CountRequest};

    let server = Server::start("grpc", &[], "listening on 127.0.0.1:").await;
    let proxy = FaultProxy::start(
        upstream(&server),
        Faults {
            delay: Duration::from_millis(5),
            wire: Wire::Http2,
            ..A_THIRD_LOST
        },
    )
    .await;
    let channel = tonic::transport::Endpoint::from_shared(proxy.url(""))
        .unwrap()
        .connect_lazy();
    let mut client = PaymentsClient::new(ClientLayer::grpc().policy(lossy()).layer(channel));
    let mut replayed = 0;
    for n in 0..300 {
        let mut request = tonic::Request::new(ChargeRequest {
            amount: 1999,
            currency: "EUR".into(),
            delay_ms: 0,
        });
        request
            .metadata_mut()
            .insert("authorization", "Bearer alice".parse().unwrap());
        let answer = client
            .charge(request)
            .await
            .unwrap_or_else(|status| panic!("charge {n}: {status:?}"));
        if answer
            .metadata()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
        {
            replayed += 1;
        }
    }
    let lost = proxy.lost.load(Ordering::SeqCst);
    let requests = proxy.requests.load(Ordering::SeqCst);
    assert!(
        lost >= 50,
        "the proxy lost {lost} answers: the fault did not happen"
    );
    // Each loss is one request's answer (never a connection's SETTINGS): every charge's
    // answer got through once, and each lost one cost a request of its own.
    assert!(
        requests >= 300 + lost,
        "{requests} requests, {lost} answers lost: a loss that was no request's answer"
    );
    assert!(
        lost * 2 < requests,
        "{lost} of {requests} answers lost: far more than a third"
    );
    assert!(replayed > 0, "no lost answer was replayed");
    let mut direct = PaymentsClient::connect(format!("http://127.0.0.1:{}", server.port))
        .await
        .unwrap();
    let count = direct
        .count(CountRequest {})
        .await
        .unwrap()
        .into_inner()
        .count;
    assert_eq!(count, 300, "one execution per charge");
    eprintln!(
        "gRPC: 300 charges, {requests} requests, {lost} answers lost, {replayed} answered by a replay"
    );
}

/// reqwest with the client's middleware, as an application would use it.
fn reqwest_client(policy: RetryPolicy) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new().policy(policy))
        .build()
}

/// The [`ClientError`] in a failed reqwest call.
fn client_error(error: &reqwest_middleware::Error) -> &ClientError {
    match error {
        reqwest_middleware::Error::Middleware(error) => error
            .downcast_ref::<ClientError>()
            .unwrap_or_else(|| panic!("not a ClientError: {error:?}")),
        other => panic!("not the middleware's error: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_reqwest_with_a_third_of_the_answers_lost_every_payment_is_charged_once() {
    let server = Server::payments(&[]).await;
    let proxy = FaultProxy::start(upstream(&server), A_THIRD_LOST).await;
    let client = reqwest_client(lossy());
    let url = proxy.url("/payments");
    let mut calls = tokio::task::JoinSet::new();
    let (mut attempts, mut replayed) = (0, 0);
    for n in 0..300u32 {
        if calls.len() == 8 {
            let delivery: Delivery = calls.join_next().await.unwrap().unwrap();
            attempts += delivery.attempts();
            replayed += u32::from(delivery.replayed());
        }
        let (client, url) = (client.clone(), url.clone());
        calls.spawn(async move {
            let answer = client
                .post(url)
                .header("content-type", "application/json")
                .header("authorization", "Bearer alice")
                .body(r#"{"amount":1999,"currency":"EUR"}"#)
                .send()
                .await
                .unwrap_or_else(|error| panic!("payment {n}: {error:?}"));
            assert_eq!(answer.status(), reqwest::StatusCode::CREATED, "payment {n}");
            answer.extensions().get::<Delivery>().unwrap().clone()
        });
    }
    while let Some(delivery) = calls.join_next().await {
        let delivery = delivery.unwrap();
        attempts += delivery.attempts();
        replayed += u32::from(delivery.replayed());
    }
    let lost = proxy.lost.load(Ordering::SeqCst);
    assert!(
        lost >= 50,
        "the proxy lost {lost} answers: the fault did not happen"
    );
    assert!(
        u64::from(attempts) >= 300 + lost,
        "{attempts} attempts, {lost} lost"
    );
    assert!(replayed > 0, "no lost answer was replayed");
    let direct = Client::new(Protocol::Http1);
    assert_eq!(direct.count(&server).await, 300, "one charge per payment");
    eprintln!(
        "reqwest: 300 payments, {attempts} attempts, {lost} answers lost, {replayed} replays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_reqwest_a_duplicate_is_waited_out_and_what_cannot_be_resent_is_not_sent() {
    let server = Server::payments(&[]).await;
    let key = format!("reqwest-{}", std::process::id());
    let client = reqwest_client(RetryPolicy::new().max_request_body(1024));
    let pay = |url: String, body: &'static str| {
        client
            .post(url)
            .header("content-type", "application/json")
            .header("authorization", "Bearer alice")
            .body(body)
            .with_extension(IdempotencyKey::new(key.clone()).unwrap())
    };
    let slow = server.url("/payments?delay_ms=1500");
    let first = tokio::spawn(pay(slow.clone(), r#"{"amount":1999,"currency":"EUR"}"#).send());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The same payment while the first runs: 409 with Retry-After, waited out, replayed.
    let answer = pay(slow, r#"{"amount":1999,"currency":"EUR"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::CREATED);
    let delivery = answer.extensions().get::<Delivery>().unwrap();
    assert_eq!(delivery.key(), key, "the caller's key");
    assert!(delivery.attempts() >= 2, "{delivery:?}");
    assert!(delivery.replayed(), "{delivery:?}");
    assert_eq!(
        first.await.unwrap().unwrap().status(),
        reqwest::StatusCode::CREATED
    );

    // The key reused for another payment: 422 at once, not retried.
    let answer = pay(server.url("/payments"), r#"{"amount":5,"currency":"EUR"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(answer.extensions().get::<Delivery>().unwrap().attempts(), 1);

    // A body over the limit, and a streamed body, are refused before anything is sent.
    let error = client
        .post(server.url("/payments"))
        .header("authorization", "Bearer alice")
        .body(vec![b' '; 2048])
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(
            client_error(&error),
            ClientError::BodyTooLarge { limit: 1024 }
        ),
        "{error:?}"
    );
    let streamed = reqwest::Body::wrap(Full::new(Bytes::from_static(
        br#"{"amount":7,"currency":"EUR"}"#,
    )));
    let error = client
        .post(server.url("/payments"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer alice")
        .body(streamed)
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(client_error(&error), ClientError::Body(_)),
        "{error:?}"
    );
    assert_eq!(
        Client::new(Protocol::Http1).count(&server).await,
        1,
        "one charge: the duplicate replayed, the rest never sent"
    );

    // A GET is not the middleware's: no key, no retries.
    let answer = client
        .get(server.url("/payments/count"))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    assert!(answer.extensions().get::<Delivery>().is_none());
}
