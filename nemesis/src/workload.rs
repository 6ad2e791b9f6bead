//! The workload: clients with known keys, each retrying its operation through both `payments`
//! instances until it has a final answer, and a producer publishing postings to the broker.
//! Every operation, attempt and answer goes into the history.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::check::account_of;
use crate::history::{Event, Kind, Recorder, digest};

/// How long one HTTP attempt may take before the client stops waiting (the checker's bound is
/// lower: an attempt this long is an anomaly either way).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// What every client shares.
pub(crate) struct Workload {
    pub(crate) recorder: Recorder,
    /// Each instance's name and `http://127.0.0.1:PORT`.
    pub(crate) targets: Vec<(String, String)>,
    pub(crate) seed: u64,
    client: HyperClient<HttpConnector, Full<Bytes>>,
    next_op: AtomicU64,
    /// Cleared at the end of the run: no new operation begins.
    sending: AtomicBool,
    /// Set once the faults healed: an operation not answered by then is given up.
    give_up: Mutex<Option<Instant>>,
    /// The orders answered (op, key header, body, the answer's body), for the replays at
    /// the end.
    answered: Mutex<Vec<Answered>>,
}

/// An answered request, to send again.
#[derive(Clone)]
pub(crate) struct Answered {
    op: u64,
    request: Call,
}

/// A request of the workload, as sent again and again.
#[derive(Clone)]
struct Call {
    path: &'static str,
    header: (&'static str, String),
    body: String,
    patience: Patience,
}

/// How long a client waits for one attempt's answer: the order and session clients are
/// patient (the checker's bound on an attempt is what they measure); the payment clients
/// give up after a second, as a client with a short timeout does, so that a paused
/// instance's operation is taken over by the other instance while it is paused.
#[derive(Clone, Copy)]
enum Patience {
    Patient,
    Impatient,
}

impl Patience {
    fn timeout(self) -> Duration {
        match self {
            Patience::Patient => ATTEMPT_TIMEOUT,
            Patience::Impatient => Duration::from_secs(1),
        }
    }
}

/// A final answer.
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

impl Workload {
    pub(crate) fn new(recorder: Recorder, targets: Vec<(String, String)>, seed: u64) -> Workload {
        let client = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(5))
            .build_http();
        Workload {
            recorder,
            targets,
            seed,
            client,
            next_op: AtomicU64::new(0),
            sending: AtomicBool::new(true),
            give_up: Mutex::new(None),
            answered: Mutex::new(Vec::new()),
        }
    }

    /// Operations started so far.
    pub(crate) fn started(&self) -> u64 {
        self.next_op.load(Ordering::SeqCst)
    }

    /// Whether new operations still begin.
    pub(crate) fn sending(&self) -> bool {
        self.sending.load(Ordering::SeqCst)
    }

    /// No new operation from now on.
    pub(crate) fn stop_sending(&self) {
        self.sending.store(false, Ordering::SeqCst);
    }

    /// Operations still unanswered at `at` are given up.
    pub(crate) fn give_up_at(&self, at: Instant) {
        *self.give_up.lock().unwrap_or_else(PoisonError::into_inner) = Some(at);
    }

    fn past_giving_up(&self) -> bool {
        self.give_up
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|at| Instant::now() >= at)
    }

    /// Begins operation number `op` (the next), described by `describe(op)`: its key and a
    /// posting's amount. `None` once the run stops sending or `limit` operations were begun.
    fn begin(
        &self,
        kind: Kind,
        limit: u64,
        describe: impl FnOnce(u64) -> (String, Option<i64>),
    ) -> Option<(u64, String)> {
        if !self.sending.load(Ordering::SeqCst) {
            return None;
        }
        let op = self.next_op.fetch_add(1, Ordering::SeqCst);
        if op >= limit {
            return None;
        }
        let (key, amount) = describe(op);
        self.recorder.record(Event::Invoke {
            t: self.recorder.now(),
            op,
            kind,
            key: key.clone(),
            amount,
        });
        Some((op, key))
    }

    /// An order client: a new key per order, until the run stops sending or `limit`
    /// operations were begun.
    pub(crate) async fn order_client(self: Arc<Self>, limit: u64) {
        self.keyed_client(Kind::Order, limit).await;
    }

    /// A payment client: `POST /payments` with a new key each, impatient (see [`Patience`]).
    pub(crate) async fn payment_client(self: Arc<Self>, limit: u64) {
        self.keyed_client(Kind::Payment, limit).await;
    }

    async fn keyed_client(&self, kind: Kind, limit: u64) {
        let (letter, path, patience) = match kind {
            Kind::Payment => ('y', "/payments", Patience::Impatient),
            _ => ('o', "/orders", Patience::Patient),
        };
        loop {
            let seed = self.seed;
            let Some((op, key)) =
                self.begin(kind, limit, |op| (format!("nem-{seed}-{letter}{op}"), None))
            else {
                return;
            };
            let request = Call {
                path,
                header: ("idempotency-key", format!("\"{key}\"")),
                body: match kind {
                    Kind::Payment => payment_body(op),
                    _ => order_body(op),
                },
                patience,
            };
            let Some(answered) = self.call(op, request).await else {
                continue;
            };
            // Every payment and one order in eight is sent again at once, through the other
            // instance: a client that retried after an answer it did not see. A payment's
            // record is then known early, so that a stale owner's overwrite of it later (its
            // instance paused past the lease) shows.
            if kind == Kind::Payment || op % 8 == 3 {
                self.replay(&answered, 1).await;
            }
        }
    }

    /// A session client: one session, its requests numbered from 1, each acknowledging the
    /// one before.
    pub(crate) async fn session_client(self: Arc<Self>, client: u64, limit: u64) {
        let session = format!("nem-{}-s{client}", self.seed);
        let mut seq = 0u64;
        loop {
            seq += 1;
            let key = format!("{session}:{seq}");
            let Some((op, _)) = self.begin(Kind::Session, limit, |_| (key, None)) else {
                return;
            };
            let request = Call {
                path: "/orders",
                header: (
                    "idempotency-session",
                    format!("id=\"{session}\", seq={seq}, ack={}", seq - 1),
                ),
                body: order_body(op),
                patience: Patience::Patient,
            };
            if self.call(op, request).await.is_none() {
                // Never answered: the session's next number would find this one unanswered,
                // which the checker already reports; stop this session.
                return;
            }
        }
    }

    /// Sends a request until it has a final answer, and records it; `None` when given up.
    async fn call(&self, op: u64, request: Call) -> Option<Answered> {
        let answer = self.until_final(op, &request, op as usize).await?;
        // An order's answer names its operation: `ord_` and the operation key's first 24
        // characters.
        let id = serde_json::from_slice::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|json| json["order_id"].as_str().map(str::to_owned))
            .and_then(|id| id.strip_prefix("ord_").map(str::to_owned))
            .unwrap_or_default();
        self.recorder.record(Event::Ok {
            t: self.recorder.now(),
            op,
            status: answer.status.as_u16(),
            body: digest(&answer.body),
            id,
            replayed: answer.replayed,
        });
        let answered = Answered { op, request };
        if answer.status == StatusCode::CREATED {
            self.answered
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(answered.clone());
        }
        Some(answered)
    }

    /// Sends an answered request again (through the instance `shift` from the first) and
    /// records what came back.
    async fn replay(&self, answered: &Answered, shift: usize) {
        // An answer that ran again (its record was never written) is asked for once more, up
        // to three times, to see the record the run left.
        for again in 0..4 {
            let first = answered.op as usize + shift + again;
            let Some(answer) = self
                .until_final(answered.op, &answered.request, first)
                .await
            else {
                return;
            };
            self.recorder.record(Event::Replay {
                t: self.recorder.now(),
                op: answered.op,
                status: answer.status.as_u16(),
                body: digest(&answer.body),
                replayed: answer.replayed,
            });
            if answer.replayed || answer.status != StatusCode::CREATED {
                return;
            }
        }
    }

    /// Every request answered with a key sent once more, and each session's last answer (the
    /// one it still holds): all must replay.
    pub(crate) async fn replay_all(self: Arc<Self>, clients: usize) {
        let answered = self
            .answered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut last_of_session = std::collections::BTreeMap::new();
        let mut todo = Vec::new();
        for a in answered {
            if a.request.header.0 == "idempotency-session" {
                let value = &a.request.header.1;
                let session = value.split(',').next().unwrap_or_default().to_owned();
                last_of_session.insert(session, a);
            } else {
                todo.push(a);
            }
        }
        todo.extend(last_of_session.into_values());
        let todo = Arc::new(Mutex::new(todo));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..clients {
            let (me, todo) = (Arc::clone(&self), Arc::clone(&todo));
            tasks.spawn(async move {
                loop {
                    let next = todo.lock().unwrap_or_else(PoisonError::into_inner).pop();
                    let Some(a) = next else { return };
                    me.replay(&a, 0).await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Attempts through the instances in turn (beginning with `first`) until an answer that
    /// is final: anything but no answer, `409` (in flight), `429` and `5xx`. `None` once
    /// given up.
    async fn until_final(&self, op: u64, request: &Call, first: usize) -> Option<Answer> {
        let mut attempt = 0usize;
        let timeout = request.patience.timeout();
        loop {
            let (name, url) = &self.targets[(first + attempt) % self.targets.len()];
            attempt += 1;
            let started = Instant::now();
            let result = tokio::time::timeout(
                timeout,
                self.send(&format!("{url}{}", request.path), request),
            )
            .await;
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            let outcome = match &result {
                Ok(Ok(answer)) => answer.status.as_u16().to_string(),
                Ok(Err(error)) => format!("error: {error}"),
                Err(_) => format!("timeout: no answer within {timeout:?}"),
            };
            self.recorder.record(Event::Attempt {
                t: self.recorder.now(),
                op,
                target: name.clone(),
                ms,
                outcome,
            });
            if let Ok(Ok(answer)) = result {
                let status = answer.status;
                let again = status == StatusCode::CONFLICT
                    || status == StatusCode::TOO_MANY_REQUESTS
                    || status.is_server_error();
                if !again {
                    return Some(answer);
                }
            }
            if self.past_giving_up() {
                self.recorder.record(Event::Fail {
                    t: self.recorder.now(),
                    op,
                    why: format!("no final answer after {attempt} attempts"),
                });
                return None;
            }
            let pause = 50 * u64::try_from(attempt.min(8)).unwrap_or(8);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    }

    async fn send(&self, url: &str, call: &Call) -> Result<Answer, String> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header("content-type", "application/json")
            .header("authorization", "Bearer nemesis")
            .header(call.header.0, call.header.1.as_str())
            .body(Full::new(Bytes::from(call.body.clone())))
            .map_err(|e| e.to_string())?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        let replayed = parts
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes() == b"true");
        Ok(Answer {
            status: parts.status,
            replayed,
            body,
        })
    }

    /// The producer: a posting every `every`, each published until the broker acknowledged
    /// it (an `XADD` whose answer was lost is published again: the consumers deduplicate by
    /// the posting's id).
    pub(crate) async fn producer(
        self: Arc<Self>,
        broker: String,
        stream: String,
        every: Duration,
        limit: u64,
    ) {
        let mut connection: Option<redis::aio::MultiplexedConnection> = None;
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let seed = self.seed;
            let Some((op, id)) = self.begin(Kind::Posting, limit, |op| {
                (format!("nem-{seed}-p{op}"), Some(posting_amount(op)))
            }) else {
                return;
            };
            let amount = posting_amount(op);
            let mut attempt = 0;
            loop {
                attempt += 1;
                let started = Instant::now();
                let result = tokio::time::timeout(
                    Duration::from_secs(2),
                    publish(&mut connection, &broker, &stream, &id, amount),
                )
                .await;
                let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                let outcome = match &result {
                    Ok(Ok(())) => "published".to_owned(),
                    Ok(Err(error)) => format!("error: {error}"),
                    Err(_) => "error: no answer within 2 s".to_owned(),
                };
                self.recorder.record(Event::Attempt {
                    t: self.recorder.now(),
                    op,
                    target: "broker".into(),
                    ms,
                    outcome,
                });
                if let Ok(Ok(())) = result {
                    self.recorder.record(Event::Ok {
                        t: self.recorder.now(),
                        op,
                        status: 0,
                        body: String::new(),
                        id: id.clone(),
                        replayed: false,
                    });
                    break;
                }
                connection = None;
                if self.past_giving_up() {
                    self.recorder.record(Event::Fail {
                        t: self.recorder.now(),
                        op,
                        why: format!("not published after {attempt} attempts"),
                    });
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A posting's amount: never 0, so that a posting applied twice shows as twice the amount.
pub(crate) fn posting_amount(op: u64) -> i64 {
    i64::try_from(op % 997).unwrap_or(0) + 1
}

/// The account of posting `id`, which only it moves.
pub(crate) fn posting_account(id: &str) -> String {
    account_of(id)
}

async fn publish(
    connection: &mut Option<redis::aio::MultiplexedConnection>,
    broker: &str,
    stream: &str,
    id: &str,
    amount: i64,
) -> Result<(), String> {
    if connection.is_none() {
        let client = redis::Client::open(broker).map_err(|e| e.to_string())?;
        *connection = Some(
            client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let Some(connection) = connection.as_mut() else {
        return Err("no connection".into());
    };
    redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("id")
        .arg(id)
        .arg("account")
        .arg(posting_account(id))
        .arg("amount")
        .arg(amount)
        .query_async::<String>(connection)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The body of payment `op`: an amount of its own (never 0, which the provider declines).
fn payment_body(op: u64) -> String {
    format!(r#"{{"amount":{},"currency":"EUR"}}"#, 1 + op % 1000)
}

/// The body of order `op`: a request of its own, so that no two orders share a fingerprint.
fn order_body(op: u64) -> String {
    format!(
        r#"{{"sku":"sku-{op}","quantity":{},"amount":{},"currency":"EUR"}}"#,
        1 + op % 3,
        100 + op
    )
}
