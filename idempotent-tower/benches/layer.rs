//! What the server layer costs a request in process, without sockets: the layer over the
//! memory store in front of a handler that reads a JSON body and answers 201 with a small
//! JSON body, against that handler alone. Fresh keys (each request claims, runs the handler
//! and records) and replays (each request finds its answer). See `BENCHMARKS.md`.
//!
//! `cargo bench -p idempotent-tower --bench layer` runs criterion; `layer --loop N MODE` runs
//! N requests of one kind (`bare`, `fresh`, `replay`, `replay-uuid` and `replay-quoted` (one
//! UUID-shaped key, bare and as a quoted string), or `empty` iterations) and exits, for
//! `valgrind --tool=callgrind` (instructions per request, which do not move with the machine's
//! load). `layer --threads T N bare|replay` sends N requests on each of T threads at once
//! (replays of keys the threads share) and prints the time a request took on each: what
//! several cores working on the same records cost, which callgrind cannot show.

use std::convert::Infallible;
use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::Idempotency;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::IdempotencyLayer;
use tower::{Layer, Service, ServiceExt, service_fn};

const BODY: &[u8] = br#"{"amount":1999,"currency":"EUR","customer":"cus_8f14e45f"}"#;
const ANSWER: &[u8] = br#"{"id":"ch_3PZx8rLk2eZvKYlo","status":"succeeded","amount":1999}"#;
/// A UUID-shaped key, and the same key as an RFC 8941 string (the header's structured form).
const UUID: &str = "0b6a3c52-9e41-4f7d-8c2a-5d1e7f906b38";
const QUOTED_UUID: &str = "\"0b6a3c52-9e41-4f7d-8c2a-5d1e7f906b38\"";
/// Fresh keys per store generation: the store never meets its bounds.
const CHUNK: u64 = 200_000;

async fn handler<B>(req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible>
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let body = req
        .into_body()
        .collect()
        .await
        .expect("a full body")
        .to_bytes();
    black_box(body);
    let mut response = Response::new(Full::new(Bytes::from_static(ANSWER)));
    *response.status_mut() = StatusCode::CREATED;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

fn request(key: Option<&str>) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri("/payments")
        .header(CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from_static(BODY)))
        .expect("a request")
}

fn layer() -> IdempotencyLayer {
    let idempotency = Idempotency::builder(MemoryStore::new()).build();
    IdempotencyLayer::http(idempotency).allow_anonymous(true)
}

/// One request through `service`, its response body read to the end.
async fn send<S>(service: &mut S, key: Option<&str>) -> StatusCode
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<idempotent_tower::ResponseBody<Full<Bytes>>>,
        >,
    S::Error: std::fmt::Debug,
{
    let response = service
        .ready()
        .await
        .expect("ready")
        .call(request(key))
        .await
        .expect("a response");
    let status = response.status();
    black_box(response.into_body().collect().await.expect("a body"));
    status
}

fn bare(runtime: &tokio::runtime::Runtime, c: &mut Criterion) {
    c.bench_function("bare handler", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let response = service_fn(handler::<_>)
                    .oneshot(request(None))
                    .await
                    .expect("a response");
                black_box(response.into_body().collect().await.expect("a body"));
            })
        })
    });
}

fn layered(runtime: &tokio::runtime::Runtime, c: &mut Criterion) {
    c.bench_function("layer, fresh key", |b| {
        let mut n = 0u64;
        let mut service = runtime.block_on(async { layer().layer(service_fn(handler::<_>)) });
        b.iter(|| {
            n += 1;
            if n.is_multiple_of(CHUNK) {
                service = layer().layer(service_fn(handler::<_>));
            }
            let key = format!("k{n}");
            runtime.block_on(async {
                assert_eq!(send(&mut service, Some(&key)).await, StatusCode::CREATED);
            })
        })
    });
    c.bench_function("layer, replay, quoted UUID key", |b| {
        let mut service = layer().layer(service_fn(handler::<_>));
        runtime.block_on(send(&mut service, Some(QUOTED_UUID)));
        b.iter(|| {
            runtime.block_on(async {
                assert_eq!(
                    send(&mut service, Some(QUOTED_UUID)).await,
                    StatusCode::CREATED
                );
            })
        })
    });
    c.bench_function("layer, replay", |b| {
        let mut service = layer().layer(service_fn(handler::<_>));
        runtime.block_on(send(&mut service, Some("replayed")));
        b.iter(|| {
            runtime.block_on(async {
                assert_eq!(
                    send(&mut service, Some("replayed")).await,
                    StatusCode::CREATED
                );
            })
        })
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

fn benches(c: &mut Criterion) {
    let runtime = runtime();
    bare(&runtime, c);
    layered(&runtime, c);
}

criterion_group!(group, benches);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--loop") {
        const USAGE: &str = "--loop N bare|fresh|replay|replay-uuid|replay-quoted|empty";
        let n: u64 = argument(&args, at + 1, USAGE);
        let mode = args.get(at + 2).map(String::as_str).unwrap_or("fresh");
        runtime().block_on(looped(n, mode));
        return;
    }
    if let Some(at) = args.iter().position(|a| a == "--threads") {
        const USAGE: &str = "--threads T N bare|replay";
        let threads: usize = argument(&args, at + 1, USAGE);
        assert!(threads > 0, "{USAGE}: at least one thread");
        let n: usize = argument(&args, at + 2, USAGE);
        let mode = args.get(at + 3).map(String::as_str).unwrap_or("replay");
        threaded(threads, n, mode);
        return;
    }
    group();
    Criterion::default().configure_from_args().final_summary();
}

/// The number at `args[at]`; the usage `usage` if there is none.
fn argument<T: std::str::FromStr>(args: &[String], at: usize, usage: &str) -> T {
    args.get(at)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{usage}"))
}

/// `threads` threads, each on a runtime of its own, each sending `n` requests of `mode` at
/// once: `bare` to the handler alone, `replay` through clones of one layered service (as a
/// server clones its service for each request), over 256 UUID-shaped keys completed before,
/// which the threads take in different orders, so that they share the store's records and its
/// shards as a server's worker threads do. Prints the time a request on each thread.
fn threaded(threads: usize, n: usize, mode: &str) {
    let keys: Vec<String> = (0..256)
        .map(|i| format!("0b6a3c52-9e41-4f7d-8c2a-{i:012}"))
        .collect();
    let service = layer().layer(service_fn(handler::<_>));
    runtime().block_on(async {
        for key in &keys {
            let response = service
                .clone()
                .oneshot(request(Some(key)))
                .await
                .expect("a response");
            assert_eq!(response.status(), StatusCode::CREATED);
        }
    });
    let start = std::sync::Barrier::new(threads);
    let per_request: Vec<f64> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (service, keys, start) = (service.clone(), &keys, &start);
                scope.spawn(move || {
                    runtime().block_on(async move {
                        start.wait();
                        let began = std::time::Instant::now();
                        for i in 0..n {
                            let key = &keys[(i * 7 + t * 131) % keys.len()];
                            let response = match mode {
                                "bare" => service_fn(handler::<_>)
                                    .oneshot(request(Some(key)))
                                    .await
                                    .expect("a response")
                                    .map(http_body_util::Either::Left),
                                "replay" => service
                                    .clone()
                                    .oneshot(request(Some(key)))
                                    .await
                                    .expect("a response")
                                    .map(http_body_util::Either::Right),
                                other => panic!("--threads T N bare|replay, not {other}"),
                            };
                            assert_eq!(response.status(), StatusCode::CREATED);
                            black_box(response.into_body().collect().await.expect("a body"));
                        }
                        began.elapsed().as_secs_f64() * 1e9 / n as f64
                    })
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("a worker thread"))
            .collect()
    });
    let shown: Vec<String> = per_request.iter().map(|ns| format!("{ns:.0}")).collect();
    println!(
        "{mode}, {threads} thread(s): {} ns a request on each",
        shown.join(", ")
    );
}

/// `n` requests of `mode`, for callgrind: its instructions less those of an empty loop of
/// the same `n` (`--loop n empty`) are what `n` requests cost.
async fn looped(n: u64, mode: &str) {
    let mut service = layer().layer(service_fn(handler::<_>));
    // The key a replay mode sends, answered once before the loop: a short one, and a key as
    // clients usually make one, unquoted and as the header's structured form writes it (a
    // string): the same key either way.
    let replayed = match mode {
        "replay" => Some("replayed"),
        "replay-uuid" => Some(UUID),
        "replay-quoted" => Some(QUOTED_UUID),
        _ => None,
    };
    if let Some(key) = replayed {
        send(&mut service, Some(key)).await;
    }
    for i in 0..n {
        match mode {
            "empty" => {
                black_box(i);
            }
            "bare" => {
                let response = service_fn(handler::<_>)
                    .oneshot(request(None))
                    .await
                    .expect("a response");
                black_box(response.into_body().collect().await.expect("a body"));
            }
            "fresh" => {
                let key = format!("k{i}");
                assert_eq!(send(&mut service, Some(&key)).await, StatusCode::CREATED);
            }
            _ if replayed.is_some() => {
                assert_eq!(send(&mut service, replayed).await, StatusCode::CREATED);
            }
            other => {
                panic!("--loop N bare|fresh|replay|replay-uuid|replay-quoted|empty, not {other}")
            }
        }
    }
}
