//! A client of the `payments` example that pays N distinct payments through the client layer
//! (`idempotent_tower::client::ClientLayer`): each payment gets its own key, and every retry
//! of a payment carries that key, so a lost answer never becomes a second charge.
//!
//! ```text
//! cargo run --release --example payments                  # in one terminal
//! cargo run --release --example payments_client -- --url http://127.0.0.1:3000 --payments 100 --concurrency 8
//! ```
//!
//! Payments are made as the user `--user` (default `alice`; the `payments` example scopes keys
//! by user).
//!
//! With `--session` (no value), every payment goes through one client session
//! (`idempotent_tower::client::ClientSession`) instead of a key each: payment `n` is call `n`
//! of the session, sent as `Idempotency-Session: id="…", seq=n, ack=…`, and every retry of it
//! carries the same number and the newest acknowledged mark. The session's id is printed to
//! stderr at the start (`session <id>`). The `payments` server accepts sessions on its
//! protected routes. The session's window is 64, the server's default
//! (`IDEMPOTENCY_SESSION_WINDOW`; the client does not read it): a payment numbered more than
//! 64 past the session's acknowledged mark (every payment numbered at or below the mark has
//! its answer) waits, unsent, for the payments before it, instead of being refused with
//! `429 session_window_full` and spending its attempts on refusals. A payment that fails
//! without its answer is abandoned (`ClientSession::abandon`): this client never sends it
//! again, and the payments after it do not wait for it.
//!
//! The last line printed is one JSON object:
//! `{"sent": N, "succeeded": S, "replayed": R, "failed": F, "attempts": A}`: `succeeded` counts
//! payments answered 201, `replayed` those whose answer was a replay (an earlier attempt ran
//! and its answer was lost), `failed` the rest, and `attempts` every request sent, retries
//! included. The exit status is 0 only if every payment succeeded.
//!
//! The retry policy (up to 12 attempts in 60 s, backoff from 50 ms to 2 s, a budget of one
//! retry per payment plus 50 a second) completes every payment on a network that loses a
//! third of all answers: the chance that one payment loses 12 answers in a row is 1 in
//! 531,441. `--attempts N` (1 to 1000; a bad value exits with status 2) sets the attempts
//! instead: the end-to-end tests, which make thousands of payments a run, give 20 (1 in 3.5
//! billion a payment).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_tower::client::{ClientLayer, ClientSession, Delivery, RetryPolicy};
use tower::{Layer, Service, ServiceExt};

struct Args {
    url: String,
    user: String,
    payments: u64,
    concurrency: u64,
    session: bool,
    attempts: u32,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        url: "http://127.0.0.1:3000".into(),
        user: "alice".into(),
        payments: 100,
        concurrency: 8,
        session: false,
        attempts: 12,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => args.url = value()?.trim_end_matches('/').to_owned(),
            "--user" => args.user = value()?,
            "--payments" => {
                args.payments = value()?
                    .parse()
                    .map_err(|_| "--payments takes a number".to_owned())?;
            }
            "--concurrency" => {
                args.concurrency = value()?
                    .parse::<u64>()
                    .map_err(|_| "--concurrency takes a number".to_owned())?
                    .max(1);
            }
            "--session" => args.session = true,
            "--attempts" => {
                args.attempts = value()?
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| "--attempts takes a number from 1 to 1000".to_owned())?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other}; usage: payments_client --url URL --payments N --concurrency C [--user NAME] [--session] [--attempts N]"
                ));
            }
        }
    }
    Ok(args)
}

#[derive(Default)]
struct Tally {
    succeeded: AtomicU64,
    replayed: AtomicU64,
    failed: AtomicU64,
    attempts: AtomicU64,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = match args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    let policy = RetryPolicy::new()
        .max_attempts(args.attempts)
        .deadline(Duration::from_secs(60))
        .attempt_timeout(Duration::from_secs(5))
        .backoff(Duration::from_millis(50), Duration::from_secs(2))
        .budget(Duration::from_secs(10), 50, 1.0);
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut layer = ClientLayer::http().policy(policy);
    let session = args.session.then(ClientSession::new);
    if let Some(session) = &session {
        eprintln!("session {}", session.id().as_str());
        layer = layer.session(session.clone());
    }
    let client = layer.layer(http);
    let url = format!("{}/payments", args.url);
    let authorization = format!("Bearer {}", args.user);
    let tally = Arc::new(Tally::default());
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.min(args.payments.max(1)) {
        let (mut client, url, authorization, tally, next, session) = (
            client.clone(),
            url.clone(),
            authorization.clone(),
            Arc::clone(&tally),
            Arc::clone(&next),
            session.clone(),
        );
        // A payment that ends without its answer is never sent again: its number is
        // abandoned, so that the session's mark passes it and the payments after it go.
        let abandon = move |seq: Option<u64>| {
            if let (Some(session), Some(seq)) = (&session, seq) {
                session.abandon(seq);
            }
        };
        let payments = args.payments;
        workers.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < payments {
                let request = http::Request::post(url.as_str())
                    .header("content-type", "application/json")
                    .header("authorization", authorization.as_str())
                    .body(Full::new(Bytes::from_static(
                        br#"{"amount":1999,"currency":"EUR"}"#,
                    )))
                    .expect("a valid request");
                let answer = match client.ready().await {
                    Ok(ready) => ready.call(request).await,
                    Err(error) => Err(error),
                };
                match answer {
                    Ok(response) => {
                        let delivery = response.extensions().get::<Delivery>().cloned();
                        let attempts = delivery.as_ref().map_or(1, Delivery::attempts);
                        tally
                            .attempts
                            .fetch_add(u64::from(attempts), Ordering::SeqCst);
                        if response.status() == http::StatusCode::CREATED {
                            tally.succeeded.fetch_add(1, Ordering::SeqCst);
                            if delivery.as_ref().is_some_and(Delivery::replayed) {
                                tally.replayed.fetch_add(1, Ordering::SeqCst);
                            }
                        } else {
                            eprintln!("payment answered {}", response.status());
                            tally.failed.fetch_add(1, Ordering::SeqCst);
                        }
                        if let Some(delivery) = delivery.filter(|d| !d.session_answered()) {
                            abandon(delivery.session_seq());
                        }
                    }
                    Err(error) => {
                        eprintln!("payment failed: {error}");
                        if let idempotent_tower::client::ClientError::GaveUp {
                            attempts, seq, ..
                        } = &error
                        {
                            tally
                                .attempts
                                .fetch_add(u64::from(*attempts), Ordering::SeqCst);
                            abandon(*seq);
                        }
                        tally.failed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
    // In the documented order.
    let summary = format!(
        r#"{{"sent": {}, "succeeded": {}, "replayed": {}, "failed": {}, "attempts": {}}}"#,
        args.payments,
        tally.succeeded.load(Ordering::SeqCst),
        tally.replayed.load(Ordering::SeqCst),
        tally.failed.load(Ordering::SeqCst),
        tally.attempts.load(Ordering::SeqCst),
    );
    println!("{summary}");
    if tally.succeeded.load(Ordering::SeqCst) != args.payments {
        std::process::exit(1);
    }
}
