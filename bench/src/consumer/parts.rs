//! `--parts`: the pieces the runtime adds per message (decoding, the claim and completion in
//! the memory store, a spawned task, a handler slot, a keep-alive interval), timed in process.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_consumer::{Decode, Failure, Message};
use idempotent_core::memory::MemoryStore;
use idempotent_core::{Call, Execution, Idempotency, Retain};
use tokio::sync::Semaphore;

use super::postings::{Posting, backlog};
use super::runtime::Postings;

/// Nanoseconds per iteration of `f`, over `n` iterations after `n / 10` of warm-up.
async fn per_iteration<F, Fut>(n: usize, mut f: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = ()>,
{
    for i in 0..n / 10 {
        f(i).await;
    }
    let start = Instant::now();
    for i in 0..n {
        f(n + i).await;
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// Times each piece the runtime adds per message and prints one JSON object per piece.
pub(crate) async fn parts() {
    const N: usize = 100_000;
    let postings: Vec<Posting> = backlog("parts", N * 2, 0).0;
    let json: Vec<Message> = postings
        .iter()
        .enumerate()
        .map(|(n, p)| Message::new(n.to_string(), p.body()))
        .collect();
    let fields: Vec<Message> = postings
        .iter()
        .enumerate()
        .map(|(n, p)| {
            Message::new(n.to_string(), Bytes::new())
                .with_field("id", p.id.clone())
                .with_field("account", p.account.clone())
                .with_field("amount", p.amount.to_string())
        })
        .collect();
    let decoder = Postings::default();
    let prepare = |message: &Message| {
        let input = decoder.decode(message).unwrap();
        let key = decoder.key(message, &input).unwrap();
        let fingerprint = decoder.fingerprint(message, &input).unwrap();
        (input, Call::new(key).fingerprint(fingerprint))
    };
    let mut rows = Vec::new();
    rows.push((
        "decode + key + fingerprint (JSON body, NATS/RabbitMQ)",
        per_iteration(N, |i| {
            let _ = std::hint::black_box(prepare(&json[i]));
            async {}
        })
        .await,
    ));
    rows.push((
        "decode + key + fingerprint (Redis fields)",
        per_iteration(N, |i| {
            let _ = std::hint::black_box(prepare(&fields[i]));
            async {}
        })
        .await,
    ));
    let calls: Vec<Call> = json.iter().map(|m| prepare(m).1).collect();
    let idempotency = Idempotency::new(MemoryStore::new());
    rows.push((
        "Idempotency::execute, fresh key, memory store (claim + completion)",
        per_iteration(N, |i| {
            let (idempotency, call) = (&idempotency, &calls[i]);
            async move {
                let execution = idempotency
                    .execute(
                        call,
                        async { Ok::<(), Failure>(()) },
                        |_| Retain::Keep,
                        |result| {
                            serde_json::to_vec(&result.as_ref().ok())
                                .ok()
                                .map(Bytes::from)
                        },
                    )
                    .await
                    .unwrap();
                assert!(matches!(execution, Execution::Fresh(Ok(()))));
            }
        })
        .await,
    ));
    rows.push((
        "tokio::spawn of a no-op task, awaited",
        per_iteration(N, |_| async {
            tokio::spawn(async {}).await.unwrap();
        })
        .await,
    ));
    let slots = Arc::new(Semaphore::new(16));
    rows.push((
        "Semaphore::acquire_owned + release",
        per_iteration(N, |_| {
            let slots = Arc::clone(&slots);
            async move {
                drop(slots.acquire_owned().await.unwrap());
            }
        })
        .await,
    ));
    rows.push((
        "keep-alive interval made and dropped (Redis, NATS)",
        per_iteration(N, |_| async {
            let every = Duration::from_secs(10);
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tokio::select! {
                biased;
                () = async {} => {}
                _ = ticks.tick() => {}
            }
        })
        .await,
    ));
    for (name, ns) in rows {
        println!(
            "{}",
            serde_json::json!({"part": name, "ns_per_message": ns.round()})
        );
    }
}
