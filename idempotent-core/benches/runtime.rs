//! Per-operation cost of the core runtime over the memory store; see `BENCHMARKS.md`.
//!
//! Every benchmark checks the outcome of every operation (`Execution::Fresh`, `Replayed`, ...),
//! so a broken setup panics instead of reporting a fast number. Benchmarks that create records
//! build a new store every [`CHUNK`] operations, outside the timed region, so they never meet
//! the store's bounds and never time the teardown of a large map.

use std::future::Future;
use std::hint::black_box;
use std::pin::Pin;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, Claim, Error, Execution, Fingerprint, Idempotency, Key, Outcome, Retain, Scope,
    StorageKey, Store,
};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;

/// Operations per store generation in the fresh-key benchmarks.
const CHUNK: u64 = 50_000;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// A held claim outlives the whole run.
const HELD_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
/// Keys in the contended hot-key benchmark: even ones completed, odd ones held in flight.
const HOT_KEYS: usize = 8;

/// The retained result: 100 bytes.
static PAYLOAD: [u8; 100] = *b"{\"id\":\"ch_3PZx8rLk2eZvKYlo2C0b7rQk\",\"status\":\"succeeded\",\"amount\":1999,\"currency\":\"eur\",\"live\":true}";

/// The result of the `run` benchmarks; about 100 bytes of JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: u64,
    amount_cents: u64,
    currency: String,
    status: String,
    reference: String,
}

fn receipt() -> Receipt {
    Receipt {
        id: 4_218_907,
        amount_cents: 1999,
        currency: "EUR".into(),
        status: "succeeded".into(),
        reference: "inv-2026-000042".into(),
    }
}

fn payload() -> Bytes {
    Bytes::from_static(&PAYLOAD)
}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// A store without a background sweep and with room for any number of records.
fn store() -> MemoryStore {
    MemoryStore::builder()
        .max_entries(usize::MAX)
        .max_bytes(usize::MAX)
        .sweep_interval(None)
        .build()
}

/// A key as clients send them: 36 characters, UUID-shaped, unique per `(thread, n)`.
fn key_string(thread: usize, n: u64) -> String {
    format!("{:08x}-0000-4000-8000-{n:012x}", thread + 1)
}

fn storage_key(n: u64) -> StorageKey {
    StorageKey::from_bytes(*blake3::hash(&n.to_le_bytes()).as_bytes())
}

/// Runs `iters` operations in chunks of [`CHUNK`]: `prepare(n)` builds a chunk's state outside
/// the timed region, `timed` runs the chunk and returns how long its operations took.
fn chunked<S>(
    iters: u64,
    mut prepare: impl FnMut(u64) -> S,
    mut timed: impl FnMut(&S) -> Duration,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let state = prepare(n);
        total += timed(&state);
        drop(state);
        left -= n;
    }
    total
}

/// Times `iters` runs of `op` inside one `block_on`, as criterion's async `iter` does: the
/// runtime is entered once per sample, not once per operation (see `parts/block_on_ready`).
fn timed_loop<F: Future>(runtime: &Runtime, iters: u64, mut op: impl FnMut(u64) -> F) -> Duration {
    runtime.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            black_box(op(i).await);
        }
        start.elapsed()
    })
}

/// Splits `iters` operations between two threads, each with its own current-thread runtime.
/// `prepare(thread, n)` runs before the threads start together; `timed` runs the operations
/// (inside one `block_on` per thread). Returns the wall-clock time from the first thread's start
/// to the last thread's end.
fn on_two_threads<S, F: Future>(
    iters: u64,
    prepare: impl Fn(usize, u64) -> S + Sync,
    timed: impl Fn(usize, S) -> F + Sync,
) -> Duration {
    let barrier = Barrier::new(2);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|thread| {
                let (barrier, prepare, timed) = (&barrier, &prepare, &timed);
                let n = iters / 2 + if thread == 0 { iters % 2 } else { 0 };
                scope.spawn(move || {
                    let runtime = current_thread();
                    let state = prepare(thread, n);
                    runtime.block_on(async {
                        barrier.wait();
                        let start = Instant::now();
                        timed(thread, state).await;
                        (start, Instant::now())
                    })
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    let end = spans.iter().map(|s| s.1).max().unwrap();
    end - start
}

fn fresh_call(key: &str) -> Call {
    Call::new(Key::new(key).unwrap())
}

/// One fresh `execute`: key, call, storage key, claim, work, envelope, complete.
async fn execute_fresh(idempotency: &Idempotency, key: &str) {
    let call = fresh_call(key);
    let out = idempotency
        .execute(&call, async { 7u32 }, |_| Retain::Keep, |_| Some(payload()))
        .await;
    assert!(matches!(out, Ok(Execution::Fresh(7))), "{out:?}");
}

/// The raw memory store.
fn store_benches(c: &mut Criterion) {
    let runtime = current_thread();
    let fingerprint = Fingerprint::empty();
    let mut group = c.benchmark_group("store");

    group.bench_function("claim_complete", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                |n| (store(), (0..n).map(storage_key).collect::<Vec<_>>()),
                |(store, keys)| {
                    timed_loop(&runtime, keys.len() as u64, |i| {
                        let key = &keys[i as usize];
                        let fingerprint = &fingerprint;
                        async move {
                            let claim = store.claim(key, fingerprint, LEASE, LEASE).await;
                            let Ok(Claim::Claimed(token)) = claim else {
                                panic!("claim on a fresh key: {claim:?}");
                            };
                            store.complete(key, token, payload(), TTL).await.unwrap();
                        }
                    })
                },
            )
        });
    });

    let replay_store = store();
    let key = storage_key(u64::MAX);
    runtime.block_on(async {
        let claim = replay_store.claim(&key, &fingerprint, LEASE, LEASE).await;
        let Ok(Claim::Claimed(token)) = claim else {
            panic!("setup claim: {claim:?}");
        };
        replay_store
            .complete(&key, token, payload(), TTL)
            .await
            .unwrap();
    });
    group.bench_function("replay", |b| {
        b.iter_custom(|iters| {
            timed_loop(&runtime, iters, |_| async {
                match replay_store.claim(&key, &fingerprint, LEASE, LEASE).await {
                    Ok(Claim::Completed { payload, .. }) if payload.len() == PAYLOAD.len() => {
                        payload
                    }
                    other => panic!("replay: {other:?}"),
                }
            })
        });
    });
    group.finish();
}

/// `Idempotency::execute` and `Idempotency::run`, one call per iteration, key parsing included.
fn runtime_benches(c: &mut Criterion) {
    let runtime = current_thread();
    let mut group = c.benchmark_group("runtime");

    let fresh_keys = |n: u64| {
        let keys: Vec<String> = (0..n).map(|i| key_string(0, i)).collect();
        (Idempotency::new(store()), keys)
    };

    group.bench_function("fresh", |b| {
        b.iter_custom(|iters| {
            chunked(iters, fresh_keys, |(idempotency, keys)| {
                timed_loop(&runtime, keys.len() as u64, |i| {
                    execute_fresh(idempotency, &keys[i as usize])
                })
            })
        });
    });

    let idempotency = Idempotency::new(store());
    let replay_key = key_string(9, 0);
    runtime.block_on(execute_fresh(&idempotency, &replay_key));
    group.bench_function("replay", |b| {
        b.iter_custom(|iters| {
            timed_loop(&runtime, iters, |_| async {
                let call = fresh_call(&replay_key);
                let out = idempotency
                    .execute(
                        &call,
                        async { unreachable!("replay ran the work") },
                        |_: &u32| Retain::Release,
                        |_| None,
                    )
                    .await;
                match out {
                    Ok(Execution::Replayed(bytes)) if bytes.len() == PAYLOAD.len() => bytes,
                    other => panic!("replay: {other:?}"),
                }
            })
        });
    });

    group.bench_function("run_fresh", |b| {
        b.iter_custom(|iters| {
            chunked(iters, fresh_keys, |(idempotency, keys)| {
                timed_loop(&runtime, keys.len() as u64, |i| async move {
                    let call = fresh_call(&keys[i as usize]);
                    let out = idempotency.run(&call, async { receipt() }).await;
                    assert!(matches!(out, Ok(Outcome::Fresh(_))), "{out:?}");
                })
            })
        });
    });

    let run_key = key_string(9, 1);
    let first = runtime.block_on(idempotency.run(&fresh_call(&run_key), async { receipt() }));
    assert!(matches!(first, Ok(Outcome::Fresh(_))), "{first:?}");
    group.bench_function("run_replay", |b| {
        b.iter_custom(|iters| {
            timed_loop(&runtime, iters, |_| async {
                let call = fresh_call(&run_key);
                let out = idempotency
                    .run::<Receipt, _, _>(&call, async { unreachable!("replay ran the work") })
                    .await;
                match out {
                    Ok(Outcome::Replayed(r)) if r.id == 4_218_907 => r,
                    other => panic!("run replay: {other:?}"),
                }
            })
        });
    });
    group.finish();
}

/// Two threads on one shared store; wall-clock time per operation across both threads.
fn contention_benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("contention");
    group.throughput(Throughput::Elements(1));

    // Hot keys: even keys completed (replayed), odd keys held in flight (rejected).
    let hot_store = store();
    let idempotency = Idempotency::new(hot_store.clone());
    let hot: Vec<String> = (0..HOT_KEYS).map(|i| key_string(7, i as u64)).collect();
    current_thread().block_on(async {
        for (i, key) in hot.iter().enumerate() {
            if i % 2 == 0 {
                execute_fresh(&idempotency, key).await;
            } else {
                let storage_key = idempotency.storage_key(&fresh_call(key));
                let claim = hot_store
                    .claim(&storage_key, &Fingerprint::empty(), HELD_LEASE, HELD_LEASE)
                    .await;
                assert!(matches!(claim, Ok(Claim::Claimed(_))), "{claim:?}");
            }
        }
    });
    group.bench_function("hot_keys_2_threads", |b| {
        b.iter_custom(|iters| {
            on_two_threads(
                iters,
                |_, n| n,
                |thread, n| {
                    let (hot, idempotency) = (&hot, &idempotency);
                    async move {
                        for i in 0..n {
                            let k = (i as usize + thread * 3) % HOT_KEYS;
                            let call = fresh_call(&hot[k]);
                            let out = idempotency
                                .execute(
                                    &call,
                                    async { unreachable!("hot key ran the work") },
                                    |_: &u32| Retain::Release,
                                    |_| None,
                                )
                                .await;
                            match (k % 2, out) {
                                (0, Ok(Execution::Replayed(bytes))) => {
                                    black_box(bytes);
                                }
                                (1, Err(Error::InFlight { .. })) => {}
                                (_, other) => panic!("hot key {k}: {other:?}"),
                            }
                        }
                    }
                },
            )
        });
    });

    group.bench_function("fresh_2_threads", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                let idempotency = Idempotency::new(store());
                total += on_two_threads(
                    n,
                    |thread, n| (0..n).map(|i| key_string(thread, i)).collect::<Vec<_>>(),
                    |_, keys| {
                        let idempotency = &idempotency;
                        async move {
                            for key in &keys {
                                execute_fresh(idempotency, key).await;
                            }
                        }
                    },
                );
                left -= n;
            }
            total
        });
    });
    group.finish();
}

/// The pieces of one call, to read the totals against.
fn parts_benches(c: &mut Criterion) {
    let runtime = current_thread();
    let idempotency = Idempotency::new(store());
    let key = key_string(0, 42);
    let call = fresh_call(&key);
    let mut group = c.benchmark_group("parts");

    group.bench_function("block_on_ready", |b| {
        b.iter(|| runtime.block_on(async { black_box(1u32) }));
    });
    group.bench_function("box_ready_future", |b| {
        b.iter_custom(|iters| {
            timed_loop(&runtime, iters, |_| {
                let fut: Pin<Box<dyn Future<Output = u32> + Send>> =
                    Box::pin(async { black_box(1u32) });
                fut
            })
        });
    });
    group.bench_function("key_and_call", |b| {
        b.iter(|| fresh_call(black_box(&key)));
    });
    group.bench_function("storage_key", |b| {
        b.iter(|| idempotency.storage_key(black_box(&call)));
    });
    group.bench_function("storage_key_with_scope", |b| {
        let scoped = fresh_call(&key).scope(Scope::new().tenant("acme").operation("charge"));
        b.iter(|| idempotency.storage_key(black_box(&scoped)));
    });
    group.bench_function("fingerprint_empty", |b| {
        b.iter(Fingerprint::empty);
    });
    group.bench_function("blake3_100b", |b| {
        b.iter(|| blake3::hash(black_box(&PAYLOAD)));
    });
    group.bench_function("tokio_instant_now", |b| {
        b.iter(tokio::time::Instant::now);
    });
    group.bench_function("json_encode_receipt", |b| {
        let r = receipt();
        b.iter(|| serde_json::to_vec(black_box(&r)).unwrap());
    });
    group.bench_function("json_decode_receipt", |b| {
        let bytes = serde_json::to_vec(&receipt()).unwrap();
        assert!((90..=110).contains(&bytes.len()), "{}", bytes.len());
        b.iter(|| serde_json::from_slice::<Receipt>(black_box(&bytes)).unwrap());
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = store_benches, runtime_benches, contention_benches, parts_benches
}
criterion_main!(benches);
