//! The client layer against a scripted inner client: which answers are retried, with which
//! key and body, how long it waits, and when it gives up.
//!
//! (Longer than most files here, on purpose: one scripted client and one case per retry rule
//! of the layer, which read best side by side.)

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::metrics::Recorded;
use idempotent_tower::BoxError;
use idempotent_tower::client::{
    CLIENT_ATTEMPTS, CLIENT_CALLS, CLIENT_RETRIES, ClientError, ClientLayer, ClientProtocol,
    Delivery, GiveUp, IdempotencyKey, RetryPolicy,
};
use tower::{Layer, Service, ServiceExt};

/// What the scripted client does for one attempt.
enum Step {
    Answer(u16, &'static [(&'static str, &'static str)]),
    Fail,
    Hang,
}

/// A request as the inner client received it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    key: Option<String>,
    body: Bytes,
    at: tokio::time::Instant,
}

#[derive(Clone)]
struct Scripted {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    fn new(steps: Vec<Step>) -> Self {
        Scripted {
            steps: Arc::new(Mutex::new(steps.into())),
            seen: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Service<Request<Full<Bytes>>> for Scripted {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            this.seen.lock().unwrap().push(Seen {
                method: parts.method,
                key: parts
                    .headers
                    .get("idempotency-key")
                    .map(|v| v.to_str().unwrap().to_owned()),
                body,
                at: tokio::time::Instant::now(),
            });
            let step = this
                .steps
                .lock()
                .unwrap()
                .pop_front()
                .expect("no more steps scripted");
            match step {
                Step::Answer(status, headers) => {
                    let mut response = Response::new(Full::new(Bytes::from_static(b"answer")));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    for (name, value) in headers {
                        response.headers_mut().insert(*name, value.parse().unwrap());
                    }
                    Ok(response)
                }
                Step::Fail => Err("connection reset".into()),
                Step::Hang => {
                    std::future::pending::<()>().await;
                    unreachable!()
                }
            }
        })
    }
}

fn payment() -> Request<Full<Bytes>> {
    Request::post("http://server/payments")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
        .unwrap()
}

/// A fast policy for the tests: no jitter wait worth speaking of.
fn policy() -> RetryPolicy {
    RetryPolicy::new().backoff(Duration::from_millis(10), Duration::from_millis(50))
}

async fn send<P: ClientProtocol>(
    layer: ClientLayer<P>,
    steps: Vec<Step>,
    request: Request<Full<Bytes>>,
) -> (Result<Response<Full<Bytes>>, ClientError>, Vec<Seen>) {
    let inner = Scripted::new(steps);
    let mut client = layer.layer(inner.clone());
    let answer = client.ready().await.unwrap().call(request).await;
    (answer, inner.seen())
}

fn delivery(response: &Response<Full<Bytes>>) -> Delivery {
    response.extensions().get::<Delivery>().unwrap().clone()
}

#[tokio::test(start_paused = true)]
async fn retryable_answers_are_retried_with_the_same_key_and_body() {
    let (answer, seen) = send(
        ClientLayer::http().policy(policy()),
        vec![
            Step::Answer(503, &[]),
            Step::Fail,
            Step::Answer(502, &[]),
            Step::Answer(504, &[]),
            Step::Answer(429, &[]),
            Step::Answer(201, &[("idempotent-replayed", "true")]),
        ],
        payment(),
    )
    .await;
    let answer = answer.unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 6);
    let key = seen[0].key.clone().unwrap();
    // A fresh UUID, sent as an RFC 8941 string.
    assert_eq!(key.len(), 38, "{key}");
    assert!(key.starts_with('"') && key.ends_with('"'));
    for attempt in &seen {
        assert_eq!(attempt.key.as_ref(), Some(&key));
        assert_eq!(attempt.body, "{\"amount\":1999}");
    }
    let delivery = delivery(&answer);
    assert_eq!(delivery.key(), key.trim_matches('"'));
    assert_eq!(delivery.attempts(), 6);
    assert!(delivery.replayed());
}

#[tokio::test(start_paused = true)]
async fn every_call_gets_its_own_key_and_a_given_key_is_kept() {
    let layer = ClientLayer::http().policy(policy());
    let (_, first) = send(layer.clone(), vec![Step::Answer(201, &[])], payment()).await;
    let (_, second) = send(layer.clone(), vec![Step::Answer(201, &[])], payment()).await;
    assert_ne!(first[0].key, second[0].key);

    let mut chosen = payment();
    chosen
        .extensions_mut()
        .insert(IdempotencyKey::new("order-7").unwrap());
    let (answer, seen) = send(layer.clone(), vec![Step::Answer(201, &[])], chosen).await;
    assert_eq!(seen[0].key.as_deref(), Some("\"order-7\""));
    assert_eq!(delivery(&answer.unwrap()).key(), "order-7");

    let mut carried = payment();
    carried
        .headers_mut()
        .insert("idempotency-key", "\"mine\"".parse().unwrap());
    let (answer, seen) = send(
        layer,
        vec![Step::Answer(503, &[]), Step::Answer(201, &[])],
        carried,
    )
    .await;
    assert_eq!(seen[0].key.as_deref(), Some("\"mine\""));
    assert_eq!(seen[1].key.as_deref(), Some("\"mine\""));
    let delivery = delivery(&answer.unwrap());
    assert_eq!(delivery.key(), "\"mine\"");
    assert!(!delivery.replayed());
}

#[tokio::test(start_paused = true)]
async fn a_duplicate_in_flight_is_waited_out_for_its_retry_after() {
    let (answer, seen) = send(
        ClientLayer::http().policy(policy()),
        vec![
            Step::Answer(409, &[("retry-after", "2")]),
            Step::Answer(201, &[("idempotent-replayed", "true")]),
        ],
        payment(),
    )
    .await;
    assert_eq!(answer.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 2);
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn other_answers_are_not_retried() {
    for status in [400u16, 401, 404, 409, 422, 500, 501] {
        let (answer, seen) = send(
            ClientLayer::http().policy(policy()),
            vec![Step::Answer(status, &[])],
            payment(),
        )
        .await;
        let answer = answer.unwrap();
        assert_eq!(answer.status().as_u16(), status);
        assert_eq!(seen.len(), 1, "{status} was retried");
        assert_eq!(delivery(&answer).attempts(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn unprotected_methods_pass_through_without_a_key() {
    let get = Request::get("http://server/payments/count")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (answer, seen) = send(
        ClientLayer::http().policy(policy()),
        vec![Step::Answer(503, &[])],
        get,
    )
    .await;
    assert_eq!(answer.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, Method::GET);
    assert_eq!(seen[0].key, None);

    let put = Request::put("http://server/x")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, seen) = send(
        ClientLayer::http().methods([Method::PUT]).policy(policy()),
        vec![Step::Answer(201, &[])],
        put,
    )
    .await;
    assert!(seen[0].key.is_some());
}

#[tokio::test(start_paused = true)]
async fn attempts_run_out_with_the_last_answer_or_a_clear_error() {
    let (answer, seen) = send(
        ClientLayer::http().policy(policy().max_attempts(3)),
        vec![
            Step::Answer(503, &[]),
            Step::Answer(503, &[]),
            Step::Answer(503, &[]),
        ],
        payment(),
    )
    .await;
    let answer = answer.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(delivery(&answer).attempts(), 3);
    assert_eq!(seen.len(), 3);

    let (answer, seen) = send(
        ClientLayer::http().policy(policy().max_attempts(2)),
        vec![Step::Fail, Step::Fail],
        payment(),
    )
    .await;
    match answer {
        Err(ClientError::GaveUp {
            key,
            seq: None,
            attempts: 2,
            reason: GiveUp::Attempts,
            last,
        }) => {
            assert_eq!(Some(format!("\"{key}\"")), seen[0].key);
            assert_eq!(last.to_string(), "connection reset");
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_abandoned_and_retried() {
    let started = tokio::time::Instant::now();
    let (answer, seen) = send(
        ClientLayer::http().policy(policy().attempt_timeout(Duration::from_secs(1))),
        vec![Step::Hang, Step::Answer(201, &[])],
        payment(),
    )
    .await;
    assert_eq!(answer.unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.len(), 2);
    assert!(seen[1].at - started >= Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn no_wait_outlasts_the_deadline() {
    let started = tokio::time::Instant::now();
    let (answer, seen) = send(
        ClientLayer::http().policy(policy().deadline(Duration::from_secs(5))),
        vec![Step::Answer(503, &[("retry-after", "10")])],
        payment(),
    )
    .await;
    // The server's delay would end after the deadline: its answer is the call's, at once.
    assert_eq!(answer.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert!(tokio::time::Instant::now() - started < Duration::from_secs(1));

    let (answer, _) = send(
        ClientLayer::http().policy(
            policy()
                .deadline(Duration::from_secs(3))
                .attempt_timeout(Duration::from_secs(2)),
        ),
        vec![Step::Hang, Step::Hang],
        payment(),
    )
    .await;
    assert!(matches!(
        answer,
        Err(ClientError::GaveUp {
            reason: GiveUp::Deadline,
            ..
        })
    ));
}

#[tokio::test(start_paused = true)]
async fn the_budget_bounds_retries_across_calls() {
    // No retries beyond 1 per second and none as a share of calls.
    let layer = ClientLayer::http().policy(policy().budget(Duration::from_secs(1), 1, 0.0));
    let (first, seen) = send(
        layer.clone(),
        vec![
            Step::Answer(503, &[]),
            Step::Answer(503, &[]),
            Step::Answer(503, &[]),
        ],
        payment(),
    )
    .await;
    assert_eq!(first.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 2, "one retry, the budget's only one");
    let (second, seen) = send(layer, vec![Step::Fail, Step::Answer(201, &[])], payment()).await;
    // The one retry the budget held went to the first call.
    assert!(
        matches!(
            second,
            Err(ClientError::GaveUp {
                reason: GiveUp::Budget,
                attempts: 1,
                ..
            })
        ),
        "{second:?}"
    );
    assert_eq!(seen.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_is_refused_before_anything_is_sent() {
    let big = Request::post("http://server/payments")
        .body(Full::new(Bytes::from(vec![b'x'; 2048])))
        .unwrap();
    let (answer, seen) = send(
        ClientLayer::http().policy(policy().max_request_body(1024)),
        vec![],
        big,
    )
    .await;
    assert!(matches!(
        answer,
        Err(ClientError::BodyTooLarge { limit: 1024 })
    ));
    assert!(seen.is_empty());
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_and_aborted_are_retried_after_their_pushback() {
    let call = || {
        Request::post("http://server/payments.Payments/Pay")
            .header("content-type", "application/grpc")
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
            .unwrap()
    };
    let (answer, seen) = send(
        ClientLayer::grpc().policy(policy()),
        vec![
            Step::Answer(
                200,
                &[("grpc-status", "10"), ("grpc-retry-pushback-ms", "1500")],
            ),
            Step::Answer(200, &[("grpc-status", "14")]),
            Step::Answer(200, &[]),
        ],
        call(),
    )
    .await;
    assert_eq!(delivery(&answer.unwrap()).attempts(), 3);
    assert!(seen[1].at - seen[0].at >= Duration::from_millis(1500));
    assert!(seen.iter().all(|s| s.key == seen[0].key && s.key.is_some()));

    // A negative pushback: the server says not to retry.
    let (answer, seen) = send(
        ClientLayer::grpc().policy(policy()),
        vec![Step::Answer(
            200,
            &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")],
        )],
        call(),
    )
    .await;
    assert_eq!(seen.len(), 1);
    let answer = answer.unwrap();
    let headers: &HeaderMap = answer.headers();
    assert_eq!(headers["grpc-status"], "14");

    // A reused key and other statuses are answers.
    for status in ["3", "9", "13"] {
        let (_, seen) = send(
            ClientLayer::grpc().policy(policy()),
            vec![Step::Answer(
                200,
                Box::leak(vec![("grpc-status", status)].into_boxed_slice()),
            )],
            call(),
        )
        .await;
        assert_eq!(seen.len(), 1, "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_default_budget_retries_a_fifth_of_the_calls_plus_ten_a_second() {
    // 50 calls in a row, each answered 503 every time, with the default budget: 10 retries a
    // second over its 10-second window (100), plus one retry for every 5 calls (10).
    let (layer, recorded) =
        Recorded::capture(|| ClientLayer::http().policy(policy().max_attempts(6)));
    let mut sent = 0;
    let mut ends = Vec::new();
    for _ in 0..50 {
        let (answer, seen) = send(
            layer.clone(),
            (0..6).map(|_| Step::Answer(503, &[])).collect(),
            payment(),
        )
        .await;
        assert_eq!(answer.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
        sent += seen.len();
        ends.push(seen.len());
    }
    assert_eq!(sent, 50 + 110, "{ends:?}");
    // The reserve pays the first 20 calls' 5 retries each; then the calls' own deposits.
    assert!(ends[..20].iter().all(|&n| n == 6), "{ends:?}");
    assert_eq!(ends[20], 5, "{ends:?}");

    let http = [("protocol", "http")];
    assert_eq!(recorded.counter(CLIENT_ATTEMPTS, &http), 160);
    assert_eq!(
        recorded.counter(
            CLIENT_RETRIES,
            &[("protocol", "http"), ("reason", "unavailable")]
        ),
        110
    );
    assert_eq!(recorded.counter(CLIENT_RETRIES, &http), 110);
    let calls =
        |outcome| recorded.counter(CLIENT_CALLS, &[("protocol", "http"), ("outcome", outcome)]);
    assert_eq!(calls("attempts_exhausted"), 20);
    assert_eq!(calls("budget_spent"), 30);
    assert_eq!(recorded.counter(CLIENT_CALLS, &http), 50);
}

#[tokio::test(start_paused = true)]
async fn calls_attempts_and_retries_are_counted_by_outcome_and_reason() {
    let (layer, recorded) = Recorded::capture(|| ClientLayer::http().policy(policy()));
    let layer = layer.policy(policy().max_attempts(3));
    let script: Vec<(Vec<Step>, usize)> = vec![
        (vec![Step::Answer(201, &[])], 1),
        (
            vec![
                Step::Fail,
                Step::Answer(409, &[("retry-after", "1")]),
                Step::Answer(201, &[("idempotent-replayed", "true")]),
            ],
            3,
        ),
        (vec![Step::Answer(422, &[])], 1),
        (vec![Step::Hang, Step::Answer(502, &[]), Step::Fail], 3),
        (vec![Step::Answer(429, &[]), Step::Answer(400, &[])], 2),
    ];
    for (steps, attempts) in script {
        let (_, seen) = send(layer.clone(), steps, payment()).await;
        assert_eq!(seen.len(), attempts);
    }
    let big = Request::post("http://server/payments")
        .body(Full::new(Bytes::from(vec![0u8; 2 << 20])))
        .unwrap();
    let (answer, seen) = send(layer.clone(), vec![], big).await;
    assert!(matches!(answer, Err(ClientError::BodyTooLarge { .. })));
    assert!(seen.is_empty());
    // A GET is not protected, and not counted.
    let get = Request::get("http://server/payments")
        .body(Full::new(Bytes::new()))
        .unwrap();
    send(layer, vec![Step::Answer(200, &[])], get)
        .await
        .0
        .unwrap();

    let counter = |name, labels: &[(&str, &str)]| {
        let mut all = vec![("protocol", "http")];
        all.extend_from_slice(labels);
        recorded.counter(name, &all)
    };
    assert_eq!(counter(CLIENT_ATTEMPTS, &[]), 10);
    for (reason, n) in [
        ("error", 1),
        ("in_flight", 1),
        ("timeout", 1),
        ("bad_gateway", 1),
        ("throttled", 1),
        ("unavailable", 0),
        ("aborted", 0),
    ] {
        assert_eq!(
            counter(CLIENT_RETRIES, &[("reason", reason)]),
            n,
            "{reason}"
        );
    }
    for (outcome, n) in [
        ("answered", 2),
        ("replayed", 1),
        ("key_reused", 1),
        ("attempts_exhausted", 1),
        ("deadline_reached", 0),
        ("budget_spent", 0),
        ("not_sent", 1),
    ] {
        assert_eq!(
            counter(CLIENT_CALLS, &[("outcome", outcome)]),
            n,
            "{outcome}"
        );
    }
    assert_eq!(counter(CLIENT_CALLS, &[]), 6);
}

// ---------------------------------------------------------------------------------------------
// A hostile peer and extreme settings, against a real server on loopback: a typed outcome,
// never a panic.

/// A server on loopback that answers every request with the next of its answers (the last one
/// again once they run out): a status and raw headers, whatever a hostile peer sends.
struct Peer {
    url: String,
    requests: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Answers = Arc<Mutex<VecDeque<(u16, Vec<(&'static str, String)>)>>>;

impl Peer {
    async fn start(answers: Vec<(u16, Vec<(&'static str, String)>)>) -> Peer {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let requests = Arc::new(AtomicUsize::new(0));
        let state = (
            Answers::new(Mutex::new(answers.into())),
            Arc::clone(&requests),
        );
        let handler = |axum::extract::State((answers, requests)): axum::extract::State<(
            Answers,
            Arc<AtomicUsize>,
        )>| async move {
            requests.fetch_add(1, Ordering::SeqCst);
            let (status, headers) = {
                let mut answers = answers.lock().unwrap();
                if answers.len() > 1 {
                    answers.pop_front().unwrap()
                } else {
                    answers.front().cloned().expect("an answer")
                }
            };
            let mut response = Response::new(axum::body::Body::from("hostile"));
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            for (name, value) in headers {
                response
                    .headers_mut()
                    .append(name, http::HeaderValue::from_str(&value).unwrap());
            }
            response
        };
        let app = axum::Router::new()
            .route("/payments", axum::routing::post(handler))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Peer {
            url,
            requests,
            task,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The largest `Retry-After` a `u64` holds, one too large for it, and 64 KiB of nines.
fn endless_delays() -> Vec<String> {
    vec![
        u64::MAX.to_string(),
        "18446744073709551616".into(),
        "9".repeat(64 * 1024),
    ]
}

/// Anything the call may take: a hang is a failure, not a stuck test.
const QUICKLY: Duration = Duration::from_secs(5);

/// One payment through the layer on hyper-util's client, against `url`; `Err` if it took
/// longer than [`QUICKLY`].
async fn pay_over_http(
    layer: ClientLayer,
    url: &str,
) -> Result<Result<Response<hyper::body::Incoming>, ClientError>, tokio::time::error::Elapsed> {
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut client = layer.layer(http);
    let request = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
        .unwrap();
    tokio::time::timeout(QUICKLY, async {
        client.ready().await.unwrap().call(request).await
    })
    .await
}

fn outcome(recorded: &Recorded, outcome: &str) -> u64 {
    recorded.counter(CLIENT_CALLS, &[("protocol", "http"), ("outcome", outcome)])
}

// Regression: `Retry-After: 18446744073709551615` on a 503, 409 or 429 made the client compute
// `Instant + Duration` and panic ("overflow when adding duration to instant"). A delay that
// would end after the deadline is not waited: the call ends at once with the server's answer,
// counted as `deadline_reached`.
#[tokio::test]
async fn a_retry_after_beyond_any_deadline_ends_the_call_at_once() {
    for status in [503u16, 409, 429] {
        for delay in endless_delays() {
            for no_deadline in [false, true] {
                let policy = if no_deadline {
                    policy().deadline(Duration::MAX)
                } else {
                    policy()
                };
                let (layer, recorded) = Recorded::capture(|| ClientLayer::http().policy(policy));
                let peer = Peer::start(vec![(status, vec![("retry-after", delay.clone())])]).await;
                let case = format!(
                    "{status}, {} digits, no deadline: {no_deadline}",
                    delay.len()
                );
                let answer = pay_over_http(layer, &peer.url)
                    .await
                    .unwrap_or_else(|_| panic!("{case}: the call waited"))
                    .unwrap_or_else(|error| panic!("{case}: {error:?}"));
                assert_eq!(answer.status().as_u16(), status, "{case}");
                let delivery = answer.extensions().get::<Delivery>().unwrap();
                assert_eq!(delivery.attempts(), 1, "{case}");
                assert_eq!(peer.requests(), 1, "{case}");
                assert_eq!(outcome(&recorded, "deadline_reached"), 1, "{case}");
            }
        }
    }
}

// Regression: `RetryPolicy::deadline(Duration::MAX)` panicked on the first call ("overflow
// when adding duration to instant"), and `backoff(Duration::MAX, _)` on the first retry. Each
// Duration setting at its maximum now means "none" (deadline, attempt timeout) or a wait
// beyond the deadline (backoff), and the calls still work.
#[tokio::test]
async fn every_setting_at_its_maximum_is_safe() {
    let extreme = || {
        RetryPolicy::new()
            .max_attempts(u32::MAX)
            .deadline(Duration::MAX)
            .attempt_timeout(Duration::MAX)
            .backoff(Duration::MAX, Duration::MAX)
            .budget(Duration::MAX, u32::MAX, f32::MAX)
            .max_request_body(usize::MAX)
    };
    // Odd budgets are clamped, not asserted on.
    for percent in [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -1.0,
        f32::MIN_POSITIVE,
    ] {
        let _ = RetryPolicy::new().budget(Duration::ZERO, 0, percent);
    }

    let ok = Peer::start(vec![(201, vec![])]).await;
    let answer = pay_over_http(ClientLayer::http().policy(extreme()), &ok.url)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);

    // With a retry: the server asks for none, or for one second.
    for wait in ["0", "1"] {
        for (setting, policy) in [
            ("deadline", policy().deadline(Duration::MAX)),
            ("attempt timeout", policy().attempt_timeout(Duration::MAX)),
            ("all", extreme()),
        ] {
            let peer = Peer::start(vec![
                (503, vec![("retry-after", wait.into())]),
                (201, vec![("idempotent-replayed", "true".into())]),
            ])
            .await;
            let answer = pay_over_http(ClientLayer::http().policy(policy), &peer.url)
                .await
                .unwrap_or_else(|_| panic!("{setting}: the call waited"))
                .unwrap_or_else(|error| panic!("{setting}: {error:?}"));
            assert_eq!(answer.status(), StatusCode::CREATED, "{setting}");
            let delivery = answer.extensions().get::<Delivery>().unwrap();
            assert_eq!(delivery.attempts(), 2, "{setting}");
            assert!(delivery.replayed(), "{setting}");
        }
    }

    // A backoff longer than any deadline is not waited: the 503 is the answer, at once.
    for policy in [
        policy().backoff(Duration::MAX, Duration::MAX),
        policy().backoff(Duration::from_secs(u64::MAX / 2), Duration::MAX),
        extreme(),
    ] {
        let (layer, recorded) = Recorded::capture(|| ClientLayer::http().policy(policy));
        let peer = Peer::start(vec![(503, vec![]), (201, vec![])]).await;
        let answer = pay_over_http(layer, &peer.url)
            .await
            .expect("no wait")
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(peer.requests(), 1);
        assert_eq!(outcome(&recorded, "deadline_reached"), 1);
    }
}

// A `Retry-After` that is not `delay-seconds` (a date, a sign, a fraction, garbage, 32 KiB of
// it) is ignored: the backoff applies. `+5` used to be read as 5 seconds (`u64::from_str`
// takes a sign).
#[tokio::test]
async fn a_retry_after_that_is_not_a_number_of_seconds_is_ignored() {
    let garbage = [
        "",
        "-1",
        "+5",
        "1.5",
        "1e3",
        "-18446744073709551615",
        "Fri, 31 Dec 9999 23:59:59 GMT",
        "Thu, 01 Jan 1970 00:00:00 GMT",
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "soon",
    ]
    .map(String::from)
    .into_iter()
    .chain([format!("1{}", "x".repeat(32 * 1024))]);
    for value in garbage {
        let case: String = value.chars().take(40).collect();
        let started = tokio::time::Instant::now();
        let peer = Peer::start(vec![
            (503, vec![("retry-after", value.clone())]),
            (201, vec![]),
        ])
        .await;
        let answer = pay_over_http(ClientLayer::http().policy(policy()), &peer.url)
            .await
            .unwrap_or_else(|_| panic!("{case:?}: the call waited"))
            .unwrap_or_else(|error| panic!("{case:?}: {error:?}"));
        assert_eq!(answer.status(), StatusCode::CREATED, "{case:?}");
        assert_eq!(peer.requests(), 2, "{case:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{case:?}: waited {:?}",
            started.elapsed()
        );

        // On a 409, no delay: the application's own conflict, returned as it is.
        let peer = Peer::start(vec![(409, vec![("retry-after", value.clone())])]).await;
        let answer = pay_over_http(ClientLayer::http().policy(policy()), &peer.url)
            .await
            .unwrap_or_else(|_| panic!("{case:?}: the call waited"))
            .unwrap();
        assert_eq!(answer.status(), StatusCode::CONFLICT, "{case:?}");
        assert_eq!(peer.requests(), 1, "{case:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_grpc_pushback_beyond_the_deadline_ends_the_call_at_once() {
    let call = || {
        Request::post("http://server/payments.Payments/Pay")
            .header("content-type", "application/grpc")
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
            .unwrap()
    };
    for (pushback, no_deadline) in [
        ("9223372036854775807", false),
        ("9223372036854775807", true),
        ("86400000", false),
        // Unreadable (beyond an i64): "do not retry".
        ("99999999999999999999", false),
    ] {
        let policy = if no_deadline {
            policy().deadline(Duration::MAX)
        } else {
            policy()
        };
        let started = tokio::time::Instant::now();
        let (answer, seen) = send(
            ClientLayer::grpc().policy(policy),
            vec![Step::Answer(
                200,
                Box::leak(
                    vec![("grpc-status", "14"), ("grpc-retry-pushback-ms", pushback)]
                        .into_boxed_slice(),
                ),
            )],
            call(),
        )
        .await;
        assert_eq!(answer.unwrap().headers()["grpc-status"], "14", "{pushback}");
        assert_eq!(seen.len(), 1, "{pushback}");
        assert_eq!(tokio::time::Instant::now(), started, "{pushback}: waited");
    }
}

#[cfg(feature = "reqwest")]
mod over_reqwest {
    use super::*;
    use idempotent_tower::client::IdempotencyMiddleware;

    /// One payment through reqwest with the middleware; `Err` if it took longer than
    /// [`QUICKLY`].
    async fn pay(
        policy: RetryPolicy,
        url: &str,
    ) -> (
        Result<reqwest_middleware::Result<reqwest::Response>, tokio::time::error::Elapsed>,
        Recorded,
    ) {
        let (middleware, recorded) =
            Recorded::capture(|| IdempotencyMiddleware::new().policy(policy));
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(middleware)
            .build();
        let call = client
            .post(url)
            .header("content-type", "application/json")
            .body(r#"{"amount":1999}"#)
            .send();
        (tokio::time::timeout(QUICKLY, call).await, recorded)
    }

    // Regression: the same overflow through the reqwest middleware: `Retry-After:
    // 18446744073709551615` on 503, 409 and 429 panicked the caller's task.
    #[tokio::test]
    async fn a_retry_after_beyond_any_deadline_ends_the_call_at_once() {
        for status in [503u16, 409, 429] {
            for delay in endless_delays() {
                for policy in [policy(), policy().deadline(Duration::MAX)] {
                    let peer =
                        Peer::start(vec![(status, vec![("retry-after", delay.clone())])]).await;
                    let case = format!("{status}, {} digits", delay.len());
                    let (answer, recorded) = pay(policy, &peer.url).await;
                    let answer = answer
                        .unwrap_or_else(|_| panic!("{case}: the call waited"))
                        .unwrap_or_else(|error| panic!("{case}: {error:?}"));
                    assert_eq!(answer.status().as_u16(), status, "{case}");
                    assert_eq!(
                        answer.extensions().get::<Delivery>().unwrap().attempts(),
                        1,
                        "{case}"
                    );
                    assert_eq!(peer.requests(), 1, "{case}");
                    assert_eq!(outcome(&recorded, "deadline_reached"), 1, "{case}");
                }
            }
        }
    }

    // Regression: `deadline(Duration::MAX)` and `backoff(Duration::MAX, _)` panicked through
    // the middleware too.
    #[tokio::test]
    async fn every_setting_at_its_maximum_is_safe() {
        let extreme = || {
            RetryPolicy::new()
                .max_attempts(u32::MAX)
                .deadline(Duration::MAX)
                .attempt_timeout(Duration::MAX)
                .backoff(Duration::MAX, Duration::MAX)
                .budget(Duration::MAX, u32::MAX, f32::MAX)
                .max_request_body(usize::MAX)
        };
        for policy in [
            policy().deadline(Duration::MAX),
            policy().attempt_timeout(Duration::MAX),
            extreme(),
        ] {
            let peer = Peer::start(vec![
                (503, vec![("retry-after", "0".into())]),
                (201, vec![]),
            ])
            .await;
            let (answer, _) = pay(policy, &peer.url).await;
            let answer = answer.expect("answered").unwrap();
            assert_eq!(answer.status(), reqwest::StatusCode::CREATED);
            assert_eq!(answer.extensions().get::<Delivery>().unwrap().attempts(), 2);
        }
        for policy in [policy().backoff(Duration::MAX, Duration::MAX), extreme()] {
            let peer = Peer::start(vec![(503, vec![]), (201, vec![])]).await;
            let (answer, recorded) = pay(policy, &peer.url).await;
            let answer = answer.expect("no wait").unwrap();
            assert_eq!(answer.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(peer.requests(), 1);
            assert_eq!(outcome(&recorded, "deadline_reached"), 1);
        }
    }
}
