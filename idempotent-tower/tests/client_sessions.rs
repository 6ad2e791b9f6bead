//! Client sessions (`ClientLayer::session`) against the server layer in-process, over a
//! network that loses requests and answers: the numbers and marks every attempt carries, what
//! a call given up on leaves behind, the session's typed refusals, over HTTP and gRPC.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::Recorded;
use idempotent_core::{Defaults, Idempotency};
use idempotent_tower::client::{
    CLIENT_ATTEMPTS, CLIENT_CALLS, CLIENT_RETRIES, ClientError, ClientLayer, ClientProtocol,
    ClientService, ClientSession, Delivery, GiveUp, RetryPolicy, SessionSeq,
};
use idempotent_tower::{IdempotencyLayer, Principal, RequestBody, ResponseBody, SessionHeader};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Server =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, BoxError>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wire {
    Http,
    Grpc,
}

/// The application behind the server layer: it counts its runs by request body. `…/slow`
/// sleeps 500 ms first; `/gone` answers its own `410` problem document.
#[derive(Clone, Default)]
struct App {
    runs: Arc<Mutex<HashMap<Bytes, usize>>>,
}

impl App {
    fn runs(&self) -> HashMap<Bytes, usize> {
        self.runs.lock().unwrap().clone()
    }

    fn total(&self) -> usize {
        self.runs().values().sum()
    }

    /// A server layer over a fresh memory store with session window `window`, in front of
    /// this application.
    fn server(&self, wire: Wire, window: u64) -> Server {
        let idempotency = Idempotency::builder(MemoryStore::new())
            .defaults(Defaults::new().session_window(window))
            .build();
        let runs = Arc::clone(&self.runs);
        let handler = service_fn(move |request: Request<RequestBody<Full<Bytes>>>| {
            let runs = Arc::clone(&runs);
            async move {
                let path = request.uri().path().to_owned();
                let body = request.into_body().collect().await?.to_bytes();
                if path.ends_with("/slow") || path.ends_with("/Slow") {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                *runs.lock().unwrap().entry(body.clone()).or_default() += 1;
                let response = match (wire, path.as_str()) {
                    (Wire::Http, "/gone") => Response::builder()
                        .status(410)
                        .header(CONTENT_TYPE, "application/problem+json")
                        .body(Full::new(Bytes::from_static(
                            br#"{"title":"Order cancelled","status":410,"code":"order_cancelled"}"#,
                        ))),
                    (Wire::Http, _) => Response::builder().status(201).body(Full::new(body)),
                    (Wire::Grpc, _) => Response::builder()
                        .header(CONTENT_TYPE, "application/grpc")
                        .header("grpc-status", "0")
                        .body(Full::new(body)),
                };
                Ok::<_, BoxError>(response.unwrap())
            }
        });
        match wire {
            Wire::Http => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(IdempotencyLayer::http(idempotency))
                    .service(handler),
            ),
            Wire::Grpc => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(
                        IdempotencyLayer::grpc(idempotency)
                            .methods(["/pay.Payments/Charge", "/pay.Payments/Slow"]),
                    )
                    .service(handler),
            ),
        }
    }
}

/// What the network does to one attempt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    /// Carried both ways.
    None,
    /// The request never reaches the server.
    Lose,
    /// The server answers, and the answer is lost.
    Drop,
    /// A proxy on the way answers `500` itself; the server never sees the request.
    Proxy500,
    /// The server answers without marking its answer (`Idempotency-Session-Seq`), as a server
    /// from before the marker does.
    Unmarked,
}

/// One attempt as the network carried it.
#[derive(Clone, Debug)]
struct Sent {
    /// Its `Idempotency-Session` header (gRPC metadata), read.
    session: Option<SessionHeader>,
    /// Whether it carried an `Idempotency-Key`.
    keyed: bool,
    fault: Fault,
    /// The answer's status (HTTP), or its `grpc-status`, if the server answered.
    status: Option<String>,
}

impl Sent {
    fn seq(&self) -> u64 {
        self.session.as_ref().expect("sent in the session").seq()
    }

    fn ack(&self) -> u64 {
        self.session.as_ref().expect("sent in the session").ack()
    }
}

/// An attempt, as the network's faults see it.
struct Attempt {
    /// Its session number and mark (0 without a session).
    seq: u64,
    ack: u64,
    /// The how-manieth attempt with this number (from 1).
    of_seq: usize,
    /// The how-manieth attempt of all (from 1).
    n: u64,
}

/// Decides the fault of an attempt.
type Faults = Arc<dyn Fn(&Attempt) -> Fault + Send + Sync>;

/// The network between the client layer and a server: it logs every attempt, applies the
/// faults, and reads each answer whole (so the client gets a `Full` body).
#[derive(Clone)]
struct Network {
    server: Arc<Mutex<Server>>,
    faults: Faults,
    log: Arc<Mutex<Vec<Sent>>>,
    attempts: Arc<AtomicU64>,
}

impl Network {
    fn new(server: Server, faults: impl Fn(&Attempt) -> Fault + Send + Sync + 'static) -> Self {
        Network {
            server: Arc::new(Mutex::new(server)),
            faults: Arc::new(faults),
            log: Arc::default(),
            attempts: Arc::default(),
        }
    }

    /// Every attempt goes to `server` from now on (the old one, with its store, is gone).
    fn replace_server(&self, server: Server) {
        *self.server.lock().unwrap() = server;
    }

    fn log(&self) -> Vec<Sent> {
        self.log.lock().unwrap().clone()
    }

    /// The attempts that carried session number `seq`.
    fn of(&self, seq: u64) -> Vec<Sent> {
        self.log().into_iter().filter(|s| s.seq() == seq).collect()
    }

    fn last(&self) -> Sent {
        self.log().last().cloned().expect("an attempt")
    }
}

impl Service<Request<Full<Bytes>>> for Network {
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
            let session = request
                .headers()
                .get("idempotency-session")
                .map(|v| SessionHeader::parse(v.as_bytes()).expect("a valid session header"));
            let keyed = request.headers().contains_key("idempotency-key");
            let n = this.attempts.fetch_add(1, Ordering::SeqCst) + 1;
            let (fault, index) = {
                let mut log = this.log.lock().unwrap();
                let seq = session.as_ref().map_or(0, SessionHeader::seq);
                let before = log
                    .iter()
                    .filter(|s| s.session.as_ref().map_or(0, SessionHeader::seq) == seq)
                    .count();
                let fault = (this.faults)(&Attempt {
                    seq,
                    ack: session.as_ref().map_or(0, SessionHeader::ack),
                    of_seq: before + 1,
                    n,
                });
                log.push(Sent {
                    session,
                    keyed,
                    fault,
                    status: None,
                });
                (fault, log.len() - 1)
            };
            if fault == Fault::Lose {
                return Err("connection refused".into());
            }
            if fault == Fault::Proxy500 {
                this.log.lock().unwrap()[index].status = Some("500".to_owned());
                return Ok(Response::builder()
                    .status(StatusCode::INTERNAL_SERVER_ERROR)
                    .body(Full::new(Bytes::from_static(b"proxy error")))
                    .unwrap());
            }
            let server = this.server.lock().unwrap().clone();
            let (parts, body) = server.oneshot(request).await?.into_parts();
            let body = body.collect().await?.to_bytes();
            let status = match parts.headers.get("grpc-status") {
                Some(code) => code.to_str().unwrap().to_owned(),
                None => parts.status.as_str().to_owned(),
            };
            this.log.lock().unwrap()[index].status = Some(status);
            if fault == Fault::Drop {
                return Err("connection reset".into());
            }
            let mut parts = parts;
            if fault == Fault::Unmarked {
                parts.headers.remove("idempotency-session-seq");
            }
            Ok(Response::from_parts(parts, Full::new(body)))
        })
    }
}

/// A policy that outlasts every fault here: many attempts, no deadline worth speaking of, a
/// budget that never runs out, short backoffs.
fn patient() -> RetryPolicy {
    RetryPolicy::new()
        .max_attempts(100)
        .deadline(Duration::from_secs(3600))
        .backoff(Duration::from_millis(10), Duration::from_millis(200))
        .budget(Duration::from_secs(10), 1_000_000, 1000.0)
}

/// Payment `n` (its own body) to `path`, from the principal `alice`.
fn payment(path: &str, n: u64) -> Request<Full<Bytes>> {
    Request::post(path)
        .header(CONTENT_TYPE, "application/json")
        .extension(Principal::new("alice"))
        .body(Full::new(Bytes::from(format!(r#"{{"payment":{n}}}"#))))
        .unwrap()
}

/// Call `n` (its own message) of the gRPC method at `path`, from the principal `alice`.
fn grpc_call(path: &str, n: u8) -> Request<Full<Bytes>> {
    Request::post(path)
        .header(CONTENT_TYPE, "application/grpc")
        .extension(Principal::new("alice"))
        .body(Full::new(Bytes::from(vec![0, 0, 0, 0, 1, n])))
        .unwrap()
}

fn resend(mut request: Request<Full<Bytes>>, seq: u64) -> Request<Full<Bytes>> {
    request.extensions_mut().insert(SessionSeq(seq));
    request
}

/// The client layer over the network.
type Client<P> = ClientService<Network, P>;

async fn send<P: ClientProtocol>(
    client: &Client<P>,
    request: Request<Full<Bytes>>,
) -> Result<Response<Full<Bytes>>, ClientError> {
    client.clone().oneshot(request).await
}

fn delivery(response: &Response<Full<Bytes>>) -> Delivery {
    response.extensions().get::<Delivery>().unwrap().clone()
}

// 200 calls at once through one session, over a network that loses a request in 7 and drops
// two answers in 7 (after the server ran them), with the server's window of 64: every call is
// answered, the application ran each exactly once, the calls were numbered 1 to 200, each
// attempt carried its call's number and a mark that never went back, none was sent more
// than the window past its mark (so none was refused with `429`), and the next request
// carries the mark 200. (Before the client held calls past its window back, calls were sent
// past it and refused, and this test asserted that some were.)
//
// On a paused clock (one thread), and on two threads in real time (the client session's
// state shared by calls running in parallel).
#[tokio::test(start_paused = true)]
async fn two_hundred_concurrent_calls_in_one_session_each_run_once() {
    two_hundred_calls().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_calls_on_two_threads_each_run_once() {
    two_hundred_calls().await;
}

async fn two_hundred_calls() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 64), |a| match a.n % 7 {
        3 => Fault::Lose,
        0 | 5 => Fault::Drop,
        _ => Fault::None,
    });
    let session = ClientSession::new();
    let client = ClientLayer::http()
        .policy(patient())
        .session(session.clone())
        .layer(network.clone());
    let calls: Vec<_> = (1..=200)
        .map(|n| {
            let client = client.clone();
            tokio::spawn(async move { send(&client, payment("/payments", n)).await })
        })
        .collect();
    let mut seqs = BTreeSet::new();
    let mut replayed = 0;
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let delivery = delivery(&answer);
        assert_eq!(delivery.key(), session.id().as_str());
        assert!(seqs.insert(delivery.session_seq().unwrap()));
        replayed += usize::from(delivery.replayed());
    }
    assert_eq!(seqs, (1..=200).collect::<BTreeSet<u64>>());
    let runs = app.runs();
    assert_eq!(runs.len(), 200, "every payment ran");
    assert!(runs.values().all(|&n| n == 1), "one run per payment");
    assert_eq!(session.ack(), 200);
    assert_eq!(session.last_seq(), 200);

    // The faults happened: lost requests and dropped answers (answered by replays). No call
    // was sent past the window (the client's is the server's, 64): the calls after a slow one
    // waited for the mark instead of being refused with `429`.
    let log = network.log();
    assert!(
        log.iter()
            .all(|s| !s.keyed && s.session.as_ref().unwrap().id() == session.id())
    );
    assert!(log.iter().any(|s| s.fault == Fault::Lose));
    assert!(log.iter().any(|s| s.fault == Fault::Drop));
    assert!(replayed > 0, "no answer was a replay");
    let full = log
        .iter()
        .filter(|s| s.status.as_deref() == Some("429"))
        .count();
    assert_eq!(full, 0, "a call went past the window");
    // Every attempt of a call carried its number, and the mark only rose between them.
    for seq in 1..=200 {
        let attempts = network.of(seq);
        assert!(!attempts.is_empty());
        assert!(
            attempts.windows(2).all(|w| w[0].ack() <= w[1].ack()),
            "{seq}: {attempts:?}"
        );
        assert!(
            attempts
                .iter()
                .all(|s| s.ack() < seq && seq <= s.ack() + 64),
            "{seq}: {attempts:?}"
        );
    }

    let next = send(&client, payment("/payments", 201)).await.unwrap();
    assert_eq!(delivery(&next).session_seq(), Some(201));
    let last = network.last();
    assert_eq!((last.seq(), last.ack()), (201, 200));
}

// A retry carries the call's number again and the newest mark: call 2's answers are lost as
// long as its attempts carry ack=0 (call 1 is still running); the first attempt after call 1's
// answer carries ack=1, and gets the replay of the run the lost answers came from.
#[tokio::test(start_paused = true)]
async fn a_retry_carries_the_same_number_and_the_newest_mark() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 64), |a| {
        if a.seq == 2 && a.ack == 0 {
            Fault::Drop
        } else {
            Fault::None
        }
    });
    let session = ClientSession::new();
    let client = ClientLayer::http()
        .policy(patient())
        .session(session.clone())
        .layer(network.clone());
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, payment("/slow", 1)).await })
    };
    while network.log().is_empty() {
        tokio::task::yield_now().await;
    }
    let second = send(&client, payment("/payments", 2)).await.unwrap();
    let first = slow.await.unwrap().unwrap();
    assert_eq!(delivery(&first).session_seq(), Some(1));
    let delivered = delivery(&second);
    assert_eq!(delivered.session_seq(), Some(2));
    assert!(delivered.replayed(), "the first attempt ran");
    let attempts = network.of(2);
    assert!(attempts.len() >= 2, "{attempts:?}");
    assert_eq!(attempts.len() as u32, delivered.attempts());
    assert!(attempts.iter().all(|s| s.seq() == 2));
    assert_eq!(attempts[0].ack(), 0, "call 1 was running");
    assert_eq!(attempts.last().unwrap().ack(), 1, "{attempts:?}");
    assert!(
        attempts.windows(2).all(|w| w[0].ack() <= w[1].ack()),
        "{attempts:?}"
    );
    assert_eq!(app.total(), 2, "each call ran once");
    assert_eq!(session.ack(), 2);
}

// A call given up on leaves its number unanswered: later calls' marks stay below it. Sent
// again with `SessionSeq`, it gets the replay of the run its lost answers came from.
#[tokio::test(start_paused = true)]
async fn a_call_given_up_on_holds_the_mark_until_it_is_sent_again() {
    let app = App::default();
    let losing = Arc::new(AtomicBool::new(true));
    let lose = Arc::clone(&losing);
    let network = Network::new(app.server(Wire::Http, 64), move |a| {
        if a.seq == 2 && lose.load(Ordering::SeqCst) {
            Fault::Drop
        } else {
            Fault::None
        }
    });
    let session = ClientSession::new();
    let client = ClientLayer::http()
        .policy(patient().max_attempts(3))
        .session(session.clone())
        .layer(network.clone());
    send(&client, payment("/payments", 1)).await.unwrap();
    let given_up = send(&client, payment("/payments", 2)).await.unwrap_err();
    let ClientError::GaveUp {
        key,
        seq: Some(2),
        attempts: 3,
        reason: GiveUp::Attempts,
        ..
    } = &given_up
    else {
        panic!("expected GaveUp for call 2, got {given_up:?}");
    };
    assert_eq!(key, session.id().as_str());
    assert!(given_up.to_string().contains("SessionSeq(2)"), "{given_up}");
    assert_eq!(app.total(), 2, "call 2 ran, its answers were lost");

    for n in [3, 4] {
        let answer = send(&client, payment("/payments", n)).await.unwrap();
        assert_eq!(delivery(&answer).session_seq(), Some(n));
        assert_eq!(network.last().ack(), 1, "the mark stays below call 2");
    }
    assert_eq!(session.ack(), 1);

    losing.store(false, Ordering::SeqCst);
    // Sent again with another body, the number is refused with 422 (it ran for call 2's
    // body): the answer of call 2 is still to be had, so the mark does not pass it.
    let other = send(&client, resend(payment("/payments", 9), 2))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(session.ack(), 1, "a 422 leaves the number unanswered");
    let again = send(&client, resend(payment("/payments", 2), 2))
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    let delivered = delivery(&again);
    assert_eq!(delivered.session_seq(), Some(2));
    assert!(delivered.replayed());
    assert_eq!(delivered.attempts(), 1);
    assert_eq!(
        again.into_body().collect().await.unwrap().to_bytes(),
        r#"{"payment":2}"#
    );
    assert_eq!(app.total(), 4, "call 2 ran once");
    assert_eq!(session.ack(), 4);
    send(&client, payment("/payments", 5)).await.unwrap();
    assert_eq!((network.last().seq(), network.last().ack()), (5, 4));
    assert_eq!(session.last_seq(), 5);

    // A number the session never gave is refused, unsent.
    let sent = network.log().len();
    for unknown in [0, 6] {
        assert!(matches!(
            send(&client, resend(payment("/payments", 6), unknown)).await,
            Err(ClientError::UnknownSessionSeq { seq }) if seq == unknown
        ));
    }
    assert_eq!(network.log().len(), sent);
}

// `410 sequence_acknowledged` and `410 session_expired` are typed errors, never retried, and
// counted; an expired session fails every later call at once, unsent. A `429
// session_window_full` is retried, and `410` problem documents of the application are answers.
#[tokio::test(start_paused = true)]
async fn the_session_refusals_are_typed_errors_and_not_retried() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 64), |_| Fault::None);
    let session = ClientSession::new();
    let (layer, recorded) = Recorded::capture(|| {
        ClientLayer::http()
            .policy(patient())
            .session(session.clone())
    });
    let client = layer.layer(network.clone());
    for n in 1..=3 {
        send(&client, payment("/payments", n)).await.unwrap();
    }
    // Call 3 carried ack=2: the server dropped answers 1 and 2.
    let refused = send(&client, resend(payment("/payments", 1), 1)).await;
    assert!(
        matches!(refused, Err(ClientError::SequenceAcknowledged { seq: 1 })),
        "{refused:?}"
    );
    let attempts = network.of(1);
    assert_eq!(attempts.len(), 2, "sent once more, not retried");
    assert_eq!(attempts[1].status.as_deref(), Some("410"));
    assert!(!session.is_expired());
    assert_eq!(session.ack(), 3);

    // The application's own 410 problem document is the answer, body and all.
    let gone = send(&client, payment("/gone", 4)).await.unwrap();
    assert_eq!(gone.status(), StatusCode::GONE);
    assert_eq!(delivery(&gone).session_seq(), Some(4));
    let body = gone.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("order_cancelled"),
        "{body:?}"
    );
    assert_eq!(session.ack(), 4);

    // The server forgets the session (a new store): the next call says it holds answers.
    network.replace_server(app.server(Wire::Http, 64));
    let expired = send(&client, payment("/payments", 5)).await;
    assert!(
        matches!(expired, Err(ClientError::SessionExpired { seq: 5 })),
        "{expired:?}"
    );
    assert_eq!(network.of(5).len(), 1, "not retried");
    assert!(session.is_expired());
    let sent = network.log().len();
    let later = send(&client, payment("/payments", 6)).await;
    assert!(
        matches!(later, Err(ClientError::SessionExpired { seq: 6 })),
        "{later:?}"
    );
    assert_eq!(
        network.log().len(),
        sent,
        "an expired session sends nothing"
    );

    let calls =
        |outcome| recorded.counter(CLIENT_CALLS, &[("protocol", "http"), ("outcome", outcome)]);
    assert_eq!(calls("sequence_acknowledged"), 1);
    assert_eq!(calls("session_expired"), 2);
    assert_eq!(calls("answered"), 4);
    assert_eq!(
        recorded.counter(CLIENT_ATTEMPTS, &[("protocol", "http")]),
        6
    );
    assert_eq!(recorded.counter(CLIENT_RETRIES, &[("protocol", "http")]), 0);
    assert_eq!(app.total(), 4);
}

/// Call 1 of `session`, to `/slow` (500 ms), under way on the network to a server whose
/// session window is 1: what the window tests need next to it.
struct FirstCallSlow {
    app: App,
    network: Network,
    /// The client layer in `session`, its metrics recorded.
    client: Client<idempotent_tower::Http>,
    recorded: Recorded,
    slow: tokio::task::JoinHandle<Result<Response<Full<Bytes>>, ClientError>>,
}

async fn first_call_slow(session: ClientSession) -> FirstCallSlow {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 1), |_| Fault::None);
    let (layer, recorded) =
        Recorded::capture(|| ClientLayer::http().policy(patient()).session(session));
    let client = layer.layer(network.clone());
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, payment("/slow", 1)).await })
    };
    while network.log().is_empty() {
        tokio::task::yield_now().await;
    }
    FirstCallSlow {
        app,
        network,
        client,
        recorded,
        slow,
    }
}

// With a window of 1, a call numbered past it while the one before runs is refused with `429
// session_window_full`, retried after the server's delay with the newer mark, and runs.
#[tokio::test(start_paused = true)]
async fn a_full_window_is_waited_out() {
    let FirstCallSlow {
        app,
        network,
        client,
        recorded,
        slow,
    } = first_call_slow(ClientSession::new()).await;
    let second = send(&client, payment("/payments", 2)).await.unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    slow.await.unwrap().unwrap();
    let attempts = network.of(2);
    assert_eq!(attempts[0].status.as_deref(), Some("429"), "{attempts:?}");
    assert_eq!(attempts[0].ack(), 0);
    assert_eq!(attempts.last().unwrap().ack(), 1);
    assert!(
        recorded.counter(
            CLIENT_RETRIES,
            &[("protocol", "http"), ("reason", "throttled")]
        ) >= 1
    );
    assert_eq!(app.total(), 2);
}

// The client's own window: with the session's window at 1 (as the server's), call 2 is not
// sent while call 1 runs (no attempt, no `429`, no retry spent), and goes once, at once, when
// call 1's answer moves the mark. Before the client held such calls back, call 2 was sent,
// refused with `429 session_window_full` and retried after the server's second, an attempt
// spent on each refusal.
#[tokio::test(start_paused = true)]
async fn a_call_past_the_sessions_window_waits_unsent_for_the_mark() {
    let session = ClientSession::new().with_window(1);
    assert_eq!(session.window(), 1);
    let FirstCallSlow {
        app,
        network,
        client,
        recorded,
        slow,
    } = first_call_slow(session.clone()).await;
    let started = tokio::time::Instant::now();
    let second = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, payment("/payments", 2)).await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(network.of(2).is_empty(), "call 2 was sent past the window");
    assert_eq!(session.ack(), 0);
    let first = slow.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(
        started.elapsed() < Duration::from_millis(600),
        "call 2 went when call 1 was answered, not after a polling delay: {:?}",
        started.elapsed()
    );
    assert_eq!(delivery(&second).attempts(), 1);
    let attempts = network.of(2);
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0].status.as_deref(), Some("201"));
    assert_eq!(attempts[0].ack(), 1, "sent with the mark that admits it");
    assert_eq!(recorded.counter(CLIENT_RETRIES, &[("protocol", "http")]), 0);
    assert_eq!(app.total(), 2);
    assert_eq!(session.ack(), 2);
}

// A call past the window whose deadline comes first ends unsent: `GaveUp` after 0 attempts,
// reason deadline, its number unanswered like any call given up on; once the numbers holding
// the mark are abandoned, the next call goes at once. A window of 0 counts as 1, `u64::MAX`
// as the largest.
#[tokio::test(start_paused = true)]
async fn a_call_past_the_window_at_its_deadline_ends_unsent() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 64), |a| {
        if a.seq == 1 { Fault::Drop } else { Fault::None }
    });
    let session = ClientSession::new().with_window(2);
    assert_eq!(ClientSession::new().with_window(0).window(), 1);
    assert_eq!(
        ClientSession::new().with_window(u64::MAX).window(),
        idempotent_core::session::MAX_SESSION_WINDOW
    );
    let client = ClientLayer::http()
        .policy(patient().max_attempts(2).deadline(Duration::from_secs(5)))
        .session(session.clone())
        .layer(network.clone());
    let lost = send(&client, payment("/payments", 1)).await.unwrap_err();
    assert!(
        matches!(
            lost,
            ClientError::GaveUp {
                seq: Some(1),
                attempts: 2,
                ..
            }
        ),
        "{lost:?}"
    );
    // Call 2 is within the window (2 past the mark 0); call 3 is not.
    send(&client, payment("/payments", 2)).await.unwrap();
    let started = tokio::time::Instant::now();
    let waited = send(&client, payment("/payments", 3)).await.unwrap_err();
    let ClientError::GaveUp {
        seq: Some(3),
        attempts: 0,
        reason: GiveUp::Deadline,
        last,
        ..
    } = &waited
    else {
        panic!("expected GaveUp for call 3 after no attempt, got {waited:?}");
    };
    assert!(
        last.to_string()
            .contains("not sent: call 3 is more than 2 past the session's acknowledged mark 0"),
        "{last}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "it waited its deadline: {:?}",
        started.elapsed()
    );
    assert!(network.of(3).is_empty(), "call 3 was never sent");
    assert_eq!(session.ack(), 0);
    session.abandon(1);
    assert_eq!(session.ack(), 2);
    session.abandon(3);
    assert_eq!(session.ack(), 3);
    let fourth = send(&client, payment("/payments", 4)).await.unwrap();
    assert_eq!(delivery(&fourth).session_seq(), Some(4));
    assert_eq!(network.of(4).len(), 1);
    assert_eq!(app.total(), 3, "calls 1, 2 and 4 ran; 3 never went");
}

// A response body type that cannot be made from bytes (`RebuildBody` is `None` for a body
// mapped by `BodyExt::map_err`): the application's 410 problem document, read to learn its
// code, comes back as `Gone`, with its body, and counts as the call's answer.
#[tokio::test(start_paused = true)]
async fn a_problem_document_that_cannot_be_returned_comes_back_as_gone() {
    let app = App::default();
    let session = ClientSession::new();
    let opaque = app.server(Wire::Http, 64).map_response(|response| {
        response.map(|body| {
            body.map_err(|never: std::convert::Infallible| -> BoxError { match never {} })
        })
    });
    let mut client = ClientLayer::http()
        .policy(patient())
        .session(session.clone())
        .layer(opaque);
    let answer = client
        .ready()
        .await
        .unwrap()
        .call(payment("/gone", 1))
        .await;
    match answer {
        Err(ClientError::Gone { seq: 1, answer }) => {
            assert_eq!(answer.status(), StatusCode::GONE);
            assert_eq!(answer.headers()[CONTENT_TYPE], "application/problem+json");
            assert!(String::from_utf8_lossy(answer.body()).contains("order_cancelled"));
            assert_eq!(
                answer.extensions().get::<Delivery>().unwrap().session_seq(),
                Some(1)
            );
        }
        other => panic!("expected Gone, got {:?}", other.map(|r| r.status())),
    }
    assert_eq!(session.ack(), 1);
    // The layer's own refusal is still typed through it.
    let refused = client
        .ready()
        .await
        .unwrap()
        .call(resend(payment("/gone", 1), 1))
        .await;
    assert!(
        matches!(refused, Err(ClientError::SequenceAcknowledged { seq: 1 })),
        "{:?}",
        refused.map(|r| r.status())
    );
}

// gRPC: every attempt carries the `idempotency-session` metadata entry (and no key), a lost
// answer is retried with the same number, a full window is waited out, and the refusals come
// from `idempotent-error` as the same typed errors.
#[tokio::test(start_paused = true)]
async fn grpc_calls_carry_the_session_metadata() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Grpc, 1), |a| {
        if a.seq == 3 && a.of_seq == 1 {
            Fault::Drop
        } else {
            Fault::None
        }
    });
    let session = ClientSession::with_id("grpc-device-7".parse().unwrap());
    let client = ClientLayer::grpc()
        .policy(patient())
        .session(session.clone())
        .layer(network.clone());

    // Call 1 runs for a while; call 2 is past the window (1) until it is answered.
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, grpc_call("/pay.Payments/Slow", 1)).await })
    };
    while network.log().is_empty() {
        tokio::task::yield_now().await;
    }
    let second = send(&client, grpc_call("/pay.Payments/Charge", 2))
        .await
        .unwrap();
    assert_eq!(second.headers()["grpc-status"], "0");
    assert_eq!(
        delivery(&slow.await.unwrap().unwrap()).session_seq(),
        Some(1)
    );
    let attempts = network.of(2);
    assert_eq!(attempts[0].status.as_deref(), Some("8"), "{attempts:?}");
    assert_eq!(attempts.last().unwrap().ack(), 1);

    let third = send(&client, grpc_call("/pay.Payments/Charge", 3))
        .await
        .unwrap();
    let delivered = delivery(&third);
    assert_eq!(delivered.session_seq(), Some(3));
    assert!(delivered.replayed());
    let attempts = network.of(3);
    assert_eq!(attempts.len(), 2);
    assert!(attempts.iter().all(|s| s.ack() == 2), "{attempts:?}");

    let log = network.log();
    assert!(log.iter().all(|s| !s.keyed));
    assert!(
        log.iter()
            .all(|s| s.session.as_ref().unwrap().id().as_str() == "grpc-device-7")
    );
    assert_eq!(app.total(), 3);

    // Call 3 is answered: resent, it is at or below the mark the next call carries.
    send(&client, grpc_call("/pay.Payments/Charge", 4))
        .await
        .unwrap();
    let refused = send(&client, resend(grpc_call("/pay.Payments/Charge", 3), 3)).await;
    assert!(
        matches!(refused, Err(ClientError::SequenceAcknowledged { seq: 3 })),
        "{refused:?}"
    );
    assert_eq!(network.of(3).len(), 3, "sent once more, not retried");
    assert_eq!(network.last().status.as_deref(), Some("11"));

    network.replace_server(app.server(Wire::Grpc, 1));
    let expired = send(&client, grpc_call("/pay.Payments/Charge", 5)).await;
    assert!(
        matches!(expired, Err(ClientError::SessionExpired { seq: 5 })),
        "{expired:?}"
    );
    assert_eq!(network.last().status.as_deref(), Some("5"));
    assert_eq!(network.of(5).len(), 1);
    assert!(session.is_expired());
}

/// The application behind the server layer in an axum router on loopback: `/payments`
/// answers 201 with the body, `/gone` its own `410` problem document; every request comes
/// from the principal `alice`. Its URL, and the server's task.
async fn serve(app: &App) -> (String, tokio::task::JoinHandle<()>) {
    let runs = Arc::clone(&app.runs);
    let router = axum::Router::new()
        .route(
            "/payments",
            axum::routing::post(move |body: Bytes| {
                let runs = Arc::clone(&runs);
                async move {
                    *runs.lock().unwrap().entry(body.clone()).or_default() += 1;
                    (StatusCode::CREATED, body)
                }
            }),
        )
        .route(
            "/gone",
            axum::routing::post(|| async {
                (
                    StatusCode::GONE,
                    [(CONTENT_TYPE, "application/problem+json")],
                    r#"{"status":410,"code":"order_cancelled"}"#,
                )
            }),
        )
        .layer(IdempotencyLayer::http(Idempotency::new(MemoryStore::new())))
        .layer(tower::util::MapRequestLayer::new(
            |mut request: Request<axum::body::Body>| {
                request.extensions_mut().insert(Principal::new("alice"));
                request
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (url, server)
}

// Over hyper-util's client on loopback (the answer's body is hyper's `Incoming`): the layer's
// `410 sequence_acknowledged` read from its problem document as the typed error, and the
// application's own `410` problem document, which an `Incoming` cannot carry back once read,
// as `Gone`.
#[tokio::test]
async fn over_hyper_the_refusals_are_read_from_the_problem_documents() {
    let app = App::default();
    let (url, server) = serve(&app).await;
    let session = ClientSession::new();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let client = ClientLayer::http()
        .policy(patient())
        .session(session.clone())
        .layer(http);
    let pay = |path: &str, n| payment(&format!("{url}{path}"), n);
    for n in 1..=3 {
        let answer = client.clone().oneshot(pay("/payments", n)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let delivery = answer.extensions().get::<Delivery>().unwrap();
        assert_eq!(delivery.session_seq(), Some(n));
    }
    let refused = client.clone().oneshot(resend(pay("/payments", 1), 1)).await;
    assert!(
        matches!(refused, Err(ClientError::SequenceAcknowledged { seq: 1 })),
        "{:?}",
        refused.map(|r| r.status())
    );
    match client.clone().oneshot(pay("/gone", 4)).await {
        Err(ClientError::Gone { seq: 4, answer }) => {
            assert_eq!(answer.status(), StatusCode::GONE);
            assert!(String::from_utf8_lossy(answer.body()).contains("order_cancelled"));
        }
        other => panic!("expected Gone, got {:?}", other.map(|r| r.status())),
    }
    assert_eq!(session.ack(), 4);
    assert_eq!(app.total(), 3);
    server.abort();
}

#[cfg(feature = "reqwest")]
mod over_reqwest {
    use super::*;
    use idempotent_tower::client::IdempotencyMiddleware;

    // The reqwest middleware in a session: the header on every request, a `410
    // sequence_acknowledged` as the typed error (inside the middleware error), and the
    // application's own `410` problem document returned with its body.
    #[tokio::test]
    async fn the_middleware_sends_in_the_session_and_types_its_refusals() {
        let app = App::default();
        let (url, server) = serve(&app).await;
        let session = ClientSession::new();
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(
                IdempotencyMiddleware::new()
                    .policy(patient())
                    .session(session.clone()),
            )
            .build();
        let pay = |path: &str, n: u64| {
            client
                .post(format!("{url}{path}"))
                .header(CONTENT_TYPE, "application/json")
                .body(format!(r#"{{"payment":{n}}}"#))
        };
        for n in 1..=3 {
            let answer = pay("/payments", n).send().await.unwrap();
            assert_eq!(answer.status(), StatusCode::CREATED);
            let delivery = answer.extensions().get::<Delivery>().unwrap();
            assert_eq!(delivery.session_seq(), Some(n));
            assert_eq!(delivery.key(), session.id().as_str());
        }
        assert_eq!(session.ack(), 3);
        let refused = pay("/payments", 1)
            .with_extension(SessionSeq(1))
            .send()
            .await
            .unwrap_err();
        match &refused {
            reqwest_middleware::Error::Middleware(error) => assert!(
                matches!(
                    error.downcast_ref::<ClientError>(),
                    Some(ClientError::SequenceAcknowledged { seq: 1 })
                ),
                "{error:?}"
            ),
            other => panic!("expected the middleware's error, got {other:?}"),
        }
        let gone = pay("/gone", 4).send().await.unwrap();
        assert_eq!(gone.status(), StatusCode::GONE);
        assert_eq!(
            gone.extensions().get::<Delivery>().unwrap().session_seq(),
            Some(4)
        );
        assert!(gone.text().await.unwrap().contains("order_cancelled"));
        assert_eq!(session.ack(), 4);
        assert_eq!(app.total(), 3);
        server.abort();
    }
}

// A proxy answers `500` for call 1 without the server seeing it: the client returns that
// answer (a 500 is not retried) but does not acknowledge the number, since the server never
// marked an answer for it (`Idempotency-Session-Seq`). Later calls carry ack=0; sent again,
// call 1 runs, and then the mark passes it. The server marks its answers, replays too.
#[tokio::test(start_paused = true)]
async fn an_answer_the_server_never_gave_is_not_acknowledged() {
    for wire in [Wire::Http, Wire::Grpc] {
        let app = App::default();
        let network = Network::new(app.server(wire, 64), |a| {
            if a.seq == 1 && a.of_seq == 1 {
                Fault::Proxy500
            } else if a.seq == 2 && a.of_seq == 1 {
                Fault::Drop
            } else {
                Fault::None
            }
        });
        let session = ClientSession::new();
        let call = |n: u64| match wire {
            Wire::Http => payment("/payments", n),
            Wire::Grpc => grpc_call("/pay.Payments/Charge", u8::try_from(n).unwrap()),
        };
        let (first, second) = match wire {
            Wire::Http => {
                let client = ClientLayer::http()
                    .policy(patient())
                    .session(session.clone())
                    .layer(network.clone());
                let first = send(&client, call(1)).await.unwrap();
                let second = send(&client, call(2)).await.unwrap();
                assert!(delivery(&second).replayed(), "the replay is marked too");
                assert!(delivery(&second).session_answered());
                assert_eq!(second.headers()["idempotency-session-seq"], "2");
                let ack_before = session.ack();
                let again = send(&client, resend(call(1), 1)).await.unwrap();
                assert!(delivery(&again).session_answered());
                assert_eq!(again.status(), StatusCode::CREATED);
                assert!(!delivery(&again).replayed(), "call 1 runs now");
                (first, ack_before)
            }
            Wire::Grpc => {
                let client = ClientLayer::grpc()
                    .policy(patient())
                    .session(session.clone())
                    .layer(network.clone());
                let first = send(&client, call(1)).await.unwrap();
                let second = send(&client, call(2)).await.unwrap();
                assert!(delivery(&second).replayed(), "the replay is marked too");
                assert!(delivery(&second).session_answered());
                assert_eq!(second.headers()["idempotency-session-seq"], "2");
                let ack_before = session.ack();
                let again = send(&client, resend(call(1), 1)).await.unwrap();
                assert!(delivery(&again).session_answered());
                assert_eq!(again.headers()["grpc-status"], "0");
                assert!(!delivery(&again).replayed(), "call 1 runs now");
                (first, ack_before)
            }
        };
        assert_eq!(
            first.status(),
            StatusCode::INTERNAL_SERVER_ERROR,
            "{wire:?}"
        );
        assert_eq!(delivery(&first).session_seq(), Some(1));
        assert!(!delivery(&first).session_answered());
        assert_eq!(second, 0, "{wire:?}: the proxy's 500 is not acknowledged");
        let attempts = network.of(2);
        assert_eq!(attempts.len(), 2, "{wire:?}: {attempts:?}");
        assert!(
            attempts.iter().all(|s| s.ack() == 0),
            "{wire:?}: {attempts:?}"
        );
        assert_eq!(network.of(1).len(), 2, "{wire:?}");
        assert_eq!(app.total(), 2, "{wire:?}: each call ran once");
        assert!(app.runs().values().all(|&n| n == 1), "{wire:?}");
        assert_eq!(session.ack(), 2, "{wire:?}");
    }
}

// A server from before the marker: its answers carry no `Idempotency-Session-Seq`, so the
// client acknowledges none of them (it cannot tell them from a proxy's); the mark advances
// only as the caller abandons numbers whose answers it holds.
#[tokio::test(start_paused = true)]
async fn without_the_servers_marker_nothing_is_acknowledged() {
    let app = App::default();
    let network = Network::new(app.server(Wire::Http, 64), |_| Fault::Unmarked);
    let session = ClientSession::new();
    let client = ClientLayer::http()
        .policy(patient())
        .session(session.clone())
        .layer(network.clone());
    for n in 1..=3 {
        let answer = send(&client, payment("/payments", n)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert!(!delivery(&answer).session_answered());
    }
    assert_eq!(session.ack(), 0);
    assert!(network.log().iter().all(|s| s.ack() == 0));
    session.abandon(1);
    session.abandon(2);
    assert_eq!(session.ack(), 2);
    send(&client, payment("/payments", 4)).await.unwrap();
    assert_eq!((network.last().seq(), network.last().ack()), (4, 2));
    assert_eq!(app.total(), 4);
}

// A final refusal of a number that reached its session (here another request under a number
// already answered: 422) is the server's answer, marked, so the client acknowledges it and the
// number cannot hold the session's window back; a refusal made before the request reaches its
// session (no principal) is not marked.
#[tokio::test]
async fn final_refusals_in_a_session_are_marked_and_early_ones_are_not() {
    let app = App::default();
    let server = app.server(Wire::Http, 64);
    let in_session = |mut request: Request<Full<Bytes>>, seq: u64| {
        let header = format!("id=\"s-final\", seq={seq}, ack=0");
        request.headers_mut().insert(
            "idempotency-session",
            http::HeaderValue::from_str(&header).unwrap(),
        );
        request
    };
    let first = server
        .clone()
        .oneshot(in_session(payment("/payments", 1), 1))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(first.headers()["idempotency-session-seq"], "1");
    let other = server
        .clone()
        .oneshot(in_session(payment("/payments", 99), 1))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.headers()["idempotency-session-seq"],
        "1",
        "final: marked"
    );
    let mut anonymous = in_session(payment("/payments", 2), 2);
    anonymous.extensions_mut().remove::<Principal>();
    let early = server.clone().oneshot(anonymous).await.unwrap();
    assert_eq!(early.status(), StatusCode::FORBIDDEN, "missing_scope");
    assert!(
        early.headers().get("idempotency-session-seq").is_none(),
        "refused before its session: not marked"
    );
    assert_eq!(app.total(), 1, "only call 1 ran");
}
