//! The one load generator of every row: hyper HTTP/1.1 client connections with keep-alive,
//! each sending its next request as soon as the previous response is read (closed loop).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, COOKIE, HOST, SET_COOKIE};
use http::{HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use idempotent_bench::cpu::threads_cpu;
use idempotent_bench::machine;
use tokio::sync::Barrier;
use tokio::task::JoinSet;

use crate::app::SERVER_THREAD;
use crate::cache::RowTier;
use crate::fixture::{KeyId, PAYMENTS, REQUEST_BODY, SESSION};
use crate::measure::Traffic;
use crate::rows::Scenario;

/// The response headers that mark a replay: `Idempotent-Replayed` (idempotent-tower and
/// idempotent 2.0) and `Idempotency-Replayed` (axum-idempotent).
const REPLAY_HEADERS: [&str; 2] = ["idempotent-replayed", "idempotency-replayed"];

/// The name of the load generator's runtime threads.
pub(crate) const CLIENT_THREAD: &str = "bench-client";

/// What one row's timed load looks like.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) addr: SocketAddr,
    pub(crate) connections: usize,
    pub(crate) warmup: Duration,
    pub(crate) measure: Duration,
    pub(crate) scenario: Scenario,
    /// Keys per connection in the `replay` scenario.
    pub(crate) replay_keys: usize,
    /// Whether each client must open a session first (axum-idempotent).
    pub(crate) session: bool,
    /// The server's cache tier, whose lookups are read at the edges of the timed phase.
    pub(crate) cache: Option<Arc<RowTier>>,
}

/// One response, as far as the load generator cares.
struct Answer {
    status: u16,
    replayed: bool,
    set_cookie: Option<HeaderValue>,
}

/// A keep-alive HTTP/1.1 connection to the server.
struct Connection {
    sender: SendRequest<Full<Bytes>>,
    host: HeaderValue,
}

impl Connection {
    async fn open(addr: SocketAddr) -> Result<Connection, String> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("TCP_NODELAY: {e}"))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP/1.1 handshake with {addr}: {e}"))?;
        tokio::spawn(connection);
        let host = HeaderValue::from_str(&addr.to_string()).expect("an address is a valid host");
        Ok(Connection { sender, host })
    }

    async fn send(
        &mut self,
        path: &str,
        named: Option<&Named>,
        cookie: Option<&HeaderValue>,
        body: &'static [u8],
    ) -> Result<Answer, String> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(HOST, self.host.clone())
            .header(CONTENT_TYPE, "application/json");
        if let Some(named) = named {
            let (name, value) = named.header();
            request = request.header(name, value);
        }
        if let Some(cookie) = cookie {
            request = request.header(COOKIE, cookie.clone());
        }
        let request = request
            .body(Full::new(Bytes::from_static(body)))
            .map_err(|e| format!("request: {e}"))?;
        self.sender
            .ready()
            .await
            .map_err(|e| format!("connection closed: {e}"))?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = response.status().as_u16();
        let replayed = REPLAY_HEADERS
            .iter()
            .any(|name| response.headers().get(*name).is_some_and(|v| v == "true"));
        let set_cookie = response.headers().get(SET_COOKIE).cloned();
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("response body: {e}"))?;
        Ok(Answer {
            status,
            replayed,
            set_cookie,
        })
    }

    /// Opens a session and returns the `Cookie` value that carries it.
    async fn open_session(&mut self) -> Result<HeaderValue, String> {
        let answer = self.send(SESSION, None, None, b"").await?;
        let set_cookie = answer
            .set_cookie
            .ok_or_else(|| format!("POST {SESSION} answered {} without a cookie", answer.status))?;
        session_cookie(&set_cookie)
            .ok_or_else(|| format!("POST {SESSION}: unusable Set-Cookie {set_cookie:?}"))
    }
}

/// The `name=value` pair of a `Set-Cookie` header, to send back in `Cookie`.
fn session_cookie(set_cookie: &HeaderValue) -> Option<HeaderValue> {
    let pair = set_cookie.to_str().ok()?.split(';').next()?.trim();
    pair.contains('=')
        .then(|| HeaderValue::from_str(pair).ok())
        .flatten()
}

/// What a request names: an idempotency key, or its place in a client session (the
/// `Idempotency-Session` value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Named {
    Key(String),
    Session(String),
}

impl Named {
    /// `key` as the scenario sends it: its key, or in the `session` scenario its place in
    /// its session, acknowledging the request before it.
    pub(crate) fn of(key: KeyId, scenario: Scenario) -> Named {
        match scenario {
            Scenario::Session => {
                let (id, seq) = key.to_session();
                Named::Session(format!("id=\"{id}\", seq={seq}, ack={}", seq - 1))
            }
            Scenario::None | Scenario::Fresh | Scenario::Replay => Named::Key(key.to_key()),
        }
    }

    /// The request header that carries it.
    fn header(&self) -> (&'static str, &str) {
        match self {
            Named::Key(key) => ("idempotency-key", key),
            Named::Session(place) => ("idempotency-session", place),
        }
    }
}

/// The key of request number `n` of connection `lane`.
pub(crate) fn key_for(scenario: Scenario, replay_keys: usize, lane: usize, n: u64) -> KeyId {
    let index = match scenario {
        Scenario::Replay => (n % replay_keys as u64) as usize,
        Scenario::Fresh | Scenario::None | Scenario::Session => n as usize,
    };
    KeyId::Load { lane, index }
}

/// Runs `plan`: every connection connects (and opens its session, and creates its replay keys),
/// then all start together; requests started during the warm-up are not counted.
pub(crate) async fn run(plan: &Plan) -> Result<Traffic, String> {
    // The lanes and the CPU monitor start together.
    let barrier = Arc::new(Barrier::new(plan.connections + 1));
    let start = Arc::new(OnceLock::new());
    let mut lanes = JoinSet::new();
    for lane in 0..plan.connections {
        let (plan, barrier, start) = (plan.clone(), Arc::clone(&barrier), Arc::clone(&start));
        lanes.spawn(async move { drive(lane, &plan, &barrier, &start).await });
    }
    barrier.wait().await;
    let begin = *start.get_or_init(Instant::now);
    tokio::time::sleep_until((begin + plan.warmup).into()).await;
    let cpu_before = (threads_cpu(SERVER_THREAD), threads_cpu(CLIENT_THREAD));
    let machine_before = machine::Reading::now();
    let lookups_before = plan.cache.as_ref().map(|tier| tier.lookups());
    tokio::time::sleep_until((begin + plan.warmup + plan.measure).into()).await;
    let cpu_after = (threads_cpu(SERVER_THREAD), threads_cpu(CLIENT_THREAD));
    let machine_after = machine::Reading::now();
    let lookups_after = plan.cache.as_ref().map(|tier| tier.lookups());

    let mut total = Traffic::new();
    while let Some(lane) = lanes.join_next().await {
        let traffic = lane.map_err(|e| format!("load task failed: {e}"))??;
        total.merge(&traffic);
    }
    total.elapsed = plan.measure;
    total.server_cpu = cpu_after.0.since(&cpu_before.0);
    total.client_cpu = cpu_after.1.since(&cpu_before.1);
    if let (Some(before), Some(after)) = (machine_before, machine_after) {
        total.machine_cpu = after.busy_since(before);
        total.machine_busy = after.utilization_since(before);
    }
    if let (Some(tier), Some(before), Some(after)) = (&plan.cache, lookups_before, lookups_after) {
        total.cache = Some(tier.window(before, after));
    }
    Ok(total)
}

async fn drive(
    lane: usize,
    plan: &Plan,
    barrier: &Barrier,
    start: &OnceLock<Instant>,
) -> Result<Traffic, String> {
    let prepared = prepare(lane, plan).await;
    // Every lane reaches the barrier, even a failed one, so the others are not left waiting.
    barrier.wait().await;
    let (mut connection, cookie) = prepared?;

    let begin = *start.get_or_init(Instant::now);
    let (timed_from, end) = (begin + plan.warmup, begin + plan.warmup + plan.measure);
    let mut traffic = Traffic::new();
    let mut n = 0u64;
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let answer = send_next(&mut connection, lane, plan, n, cookie.as_ref()).await?;
        n += 1;
        let timed = sent >= timed_from;
        match answer {
            Some(answer) if timed => {
                if (200..300).contains(&answer.status) {
                    traffic.latencies.record(sent.elapsed());
                }
                *traffic.statuses.entry(answer.status).or_default() += 1;
                traffic.replayed += u64::from(answer.replayed);
            }
            Some(_) => {}
            None if timed => traffic.transport_errors += 1,
            None => {}
        }
    }
    Ok(traffic)
}

/// How two rows' loads take turns on the machine (`pair.rs`): slices of `slice` each, the
/// first row's and the second's by turns, `warmup` of each row's untimed, then `timed` of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turns {
    pub(crate) slice: Duration,
    pub(crate) warmup: usize,
    pub(crate) timed: usize,
}

impl Turns {
    /// The slices of both rows together.
    pub(crate) fn slices(&self) -> usize {
        2 * (self.warmup + self.timed)
    }

    /// Which row (0 or 1) has slice `k`: 0 1, then 1 0, then 0 1, and so on. Each pair of
    /// slices holds one turn of each row, and the order swaps from pair to pair, so that a
    /// machine speeding up or slowing down steadily favours neither row.
    pub(crate) fn owner(k: usize) -> usize {
        let half = k % 2;
        if (k / 2).is_multiple_of(2) {
            half
        } else {
            1 - half
        }
    }

    /// Whether slice `k` is timed.
    pub(crate) fn timed(&self, k: usize) -> bool {
        k >= 2 * self.warmup && k < self.slices()
    }

    /// The timed pairs of slices, by number (pair `p` is slices `2p` and `2p + 1`).
    pub(crate) fn timed_pairs(&self) -> std::ops::Range<usize> {
        self.warmup..self.warmup + self.timed
    }
}

/// What one row's connections did in their turns: 2xx responses to the requests sent in each
/// slice (the other row's slices stay 0), and the requests of timed slices that got another
/// status or none, and those marked as replays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TurnTraffic {
    pub(crate) successes: Vec<u64>,
    pub(crate) failures: u64,
    pub(crate) replayed: u64,
}

impl TurnTraffic {
    fn new(slices: usize) -> Self {
        TurnTraffic {
            successes: vec![0; slices],
            failures: 0,
            replayed: 0,
        }
    }

    fn merge(&mut self, other: &TurnTraffic) {
        for (total, n) in self.successes.iter_mut().zip(&other.successes) {
            *total += n;
        }
        self.failures += other.failures;
        self.replayed += other.replayed;
    }

    /// 2xx responses in pair of slices `pair`: the row's turn in it (its successes are 0 in
    /// the other row's slice).
    pub(crate) fn in_pair(&self, pair: usize) -> u64 {
        self.successes[2 * pair] + self.successes[2 * pair + 1]
    }

    /// 2xx responses in timed slices.
    pub(crate) fn timed_successes(&self, turns: &Turns) -> u64 {
        turns.timed_pairs().map(|pair| self.in_pair(pair)).sum()
    }
}

/// Runs two plans by turns (see [`Turns`]): every connection of both connects (opens its
/// session, creates its replay keys), then each row's connections send only in that row's
/// slices and wait through the other's.
pub(crate) async fn run_turns(plans: [&Plan; 2], turns: Turns) -> Result<[TurnTraffic; 2], String> {
    let barrier = Arc::new(Barrier::new(
        plans.iter().map(|plan| plan.connections).sum::<usize>() + 1,
    ));
    let start = Arc::new(OnceLock::new());
    let mut lanes = JoinSet::new();
    for (row, plan) in plans.into_iter().enumerate() {
        for lane in 0..plan.connections {
            let (plan, barrier, start) = (plan.clone(), Arc::clone(&barrier), Arc::clone(&start));
            lanes.spawn(async move {
                let traffic = drive_turns(row, lane, &plan, turns, &barrier, &start).await;
                (row, traffic)
            });
        }
    }
    barrier.wait().await;
    start.get_or_init(Instant::now);
    let mut total = [
        TurnTraffic::new(turns.slices()),
        TurnTraffic::new(turns.slices()),
    ];
    while let Some(lane) = lanes.join_next().await {
        let (row, traffic) = lane.map_err(|e| format!("load task failed: {e}"))?;
        total[row].merge(&traffic?);
    }
    Ok(total)
}

/// Connection `lane` of row `row` (0 or 1) of [`run_turns`].
async fn drive_turns(
    row: usize,
    lane: usize,
    plan: &Plan,
    turns: Turns,
    barrier: &Barrier,
    start: &OnceLock<Instant>,
) -> Result<TurnTraffic, String> {
    let prepared = prepare(lane, plan).await;
    barrier.wait().await;
    let (mut connection, cookie) = prepared?;

    let begin = *start.get_or_init(Instant::now);
    let slice_nanos = turns.slice.as_nanos().max(1);
    let slices = turns.slices();
    let mut traffic = TurnTraffic::new(slices);
    let mut n = 0u64;
    loop {
        let sent = Instant::now();
        let slice = usize::try_from(sent.duration_since(begin).as_nanos() / slice_nanos)
            .unwrap_or(usize::MAX);
        if slice >= slices {
            break;
        }
        if Turns::owner(slice) != row {
            let Some(next) = (slice + 1..slices).find(|&k| Turns::owner(k) == row) else {
                break;
            };
            let at = turns.slice * u32::try_from(next).unwrap_or(u32::MAX);
            tokio::time::sleep_until((begin + at).into()).await;
            continue;
        }
        let answer = send_next(&mut connection, lane, plan, n, cookie.as_ref()).await?;
        n += 1;
        if !turns.timed(slice) {
            continue;
        }
        match answer {
            Some(answer) if (200..300).contains(&answer.status) => {
                traffic.successes[slice] += 1;
                traffic.replayed += u64::from(answer.replayed);
            }
            Some(answer) => {
                traffic.failures += 1;
                traffic.replayed += u64::from(answer.replayed);
            }
            None => traffic.failures += 1,
        }
    }
    Ok(traffic)
}

/// Sends request number `n` of connection `lane` of `plan`: its answer, or `None` when it got
/// none (the connection is opened again).
async fn send_next(
    connection: &mut Connection,
    lane: usize,
    plan: &Plan,
    n: u64,
    cookie: Option<&HeaderValue>,
) -> Result<Option<Answer>, String> {
    let named = Named::of(
        key_for(plan.scenario, plan.replay_keys, lane, n),
        plan.scenario,
    );
    match connection
        .send(PAYMENTS, Some(&named), cookie, REQUEST_BODY)
        .await
    {
        Ok(answer) => Ok(Some(answer)),
        Err(_) => {
            *connection = Connection::open(plan.addr).await?;
            Ok(None)
        }
    }
}

/// Connection `lane` of `plan`, ready to send: connected, its session opened when the row
/// needs one (the `Cookie` value that carries it), its replay keys created.
async fn prepare(lane: usize, plan: &Plan) -> Result<(Connection, Option<HeaderValue>), String> {
    let mut connection = Connection::open(plan.addr).await?;
    let cookie = match plan.session {
        true => Some(connection.open_session().await?),
        false => None,
    };
    if plan.scenario == Scenario::Replay {
        seed(&mut connection, lane, plan, cookie.as_ref()).await?;
    }
    Ok((connection, cookie))
}

/// Creates connection `lane`'s replay keys, one request each.
async fn seed(
    connection: &mut Connection,
    lane: usize,
    plan: &Plan,
    cookie: Option<&HeaderValue>,
) -> Result<(), String> {
    for index in 0..plan.replay_keys {
        let key = KeyId::Load { lane, index }.to_key();
        let answer = connection
            .send(
                PAYMENTS,
                Some(&Named::Key(key.clone())),
                cookie,
                REQUEST_BODY,
            )
            .await?;
        if !(200..300).contains(&answer.status) {
            return Err(format!(
                "creating replay key {key} answered {}",
                answer.status
            ));
        }
    }
    Ok(())
}

/// The exactly-once probe: `keys` new keys, each sent by `duplicates` connections at once
/// (the handler holds a probe key for [`PROBE_HOLD`](crate::fixture::PROBE_HOLD), so they overlap),
/// then once more after all answered, as a client's retry. One client: the connections share
/// its session when the row needs one. In the `session` scenario the keys are the requests
/// of one client session, each acknowledging the one before. The server's tally says how
/// often each key ran.
pub(crate) async fn probe(
    addr: SocketAddr,
    session: bool,
    scenario: Scenario,
    keys: usize,
    duplicates: usize,
) -> Result<Traffic, String> {
    let mut connections = Vec::with_capacity(duplicates);
    for _ in 0..duplicates.max(1) {
        connections.push(Connection::open(addr).await?);
    }
    let cookie = match session {
        true => Some(connections[0].open_session().await?),
        false => None,
    };
    let mut traffic = Traffic::new();
    let mut tally = |answer: &Answer| {
        *traffic.statuses.entry(answer.status).or_default() += 1;
        traffic.replayed += u64::from(answer.replayed);
    };
    for n in 0..keys {
        let key = Named::of(KeyId::Probe(n), scenario);
        let mut burst = JoinSet::new();
        for mut connection in connections.drain(..) {
            let (key, cookie) = (key.clone(), cookie.clone());
            burst.spawn(async move {
                let answer = connection
                    .send(PAYMENTS, Some(&key), cookie.as_ref(), REQUEST_BODY)
                    .await;
                (connection, answer)
            });
        }
        while let Some(joined) = burst.join_next().await {
            let (connection, answer) = joined.map_err(|e| format!("probe task failed: {e}"))?;
            tally(&answer?);
            connections.push(connection);
        }
        let retry = connections[0]
            .send(PAYMENTS, Some(&key), cookie.as_ref(), REQUEST_BODY)
            .await?;
        tally(&retry);
    }
    Ok(traffic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_alternate_and_swap_order_each_pair() {
        let owners: Vec<usize> = (0..8).map(Turns::owner).collect();
        assert_eq!(owners, [0, 1, 1, 0, 0, 1, 1, 0]);
        let turns = Turns {
            slice: Duration::from_millis(100),
            warmup: 2,
            timed: 3,
        };
        assert_eq!(turns.slices(), 10);
        assert_eq!(
            (0..12).filter(|&k| turns.timed(k)).collect::<Vec<_>>(),
            [4, 5, 6, 7, 8, 9]
        );
        let mut traffic = TurnTraffic::new(turns.slices());
        traffic.successes = vec![100, 0, 0, 100, 7, 0, 0, 9, 11, 0];
        assert_eq!(traffic.timed_successes(&turns), 27);
    }

    #[test]
    fn keys_per_scenario() {
        let key = |scenario, lane, n| key_for(scenario, 4, lane, n).to_key();
        assert_eq!(key(Scenario::Fresh, 3, 0), "c3-0");
        assert_eq!(key(Scenario::Fresh, 3, 9), "c3-9");
        assert_eq!(key(Scenario::None, 3, 9), "c3-9");
        assert_eq!(key(Scenario::Replay, 3, 9), "c3-1");
        assert_eq!(key(Scenario::Replay, 0, 4), "c0-0");
        assert_eq!(key(Scenario::Session, 3, 9), "c3-9");
    }

    #[test]
    fn sessions_number_and_acknowledge() {
        let named = |n| Named::of(key_for(Scenario::Session, 4, 3, n), Scenario::Session);
        assert_eq!(named(0), Named::Session(r#"id="c3", seq=1, ack=0"#.into()));
        assert_eq!(named(9), Named::Session(r#"id="c3", seq=10, ack=9"#.into()));
        assert_eq!(
            Named::of(KeyId::Probe(2), Scenario::Session).header(),
            ("idempotency-session", r#"id="p", seq=3, ack=2"#)
        );
        assert_eq!(
            Named::of(KeyId::Probe(2), Scenario::Fresh).header(),
            ("idempotency-key", "p2")
        );
        // What the layer reads, and what the handler attributes.
        let Named::Session(value) = named(41) else {
            panic!("a session")
        };
        let header = idempotent_tower::SessionHeader::parse(value.as_bytes()).unwrap();
        assert_eq!(
            (header.id().as_str(), header.seq(), header.ack()),
            ("c3", 42, 41)
        );
        assert_eq!(
            KeyId::of_session(header.id().as_str(), header.seq()),
            Some(KeyId::Load { lane: 3, index: 41 })
        );
    }

    #[test]
    fn cookie_from_set_cookie() {
        let set = HeaderValue::from_static("session=abc123; Path=/; HttpOnly; SameSite=Lax");
        assert_eq!(
            session_cookie(&set),
            Some(HeaderValue::from_static("session=abc123"))
        );
        assert_eq!(session_cookie(&HeaderValue::from_static("garbage")), None);
    }
}
