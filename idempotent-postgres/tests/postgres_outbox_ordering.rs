//! The outbox's ordering keys against a real PostgreSQL server (fixture: `support::outbox`):
//! messages of one key are delivered in order, in commit order, and without a hot key holding
//! back the others, the keys taking turns.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).

mod support;

use std::time::Duration;

use idempotent_core::Key;
use idempotent_postgres::outbox::{Outgoing, Relay};
use support::outbox::*;
use tokio::time::timeout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_with_one_ordering_key_are_delivered_in_order() {
    let Some((pool, outbox)) = setup(8).await else {
        return;
    };
    // Three accounts, ten messages each, interleaved; every message fails once first.
    let mut tx = pool.begin().await.unwrap();
    for n in 0..30 {
        let account = format!("acct-{}", n % 3);
        let message = Outgoing::new("hook", format!("{account}:{n}"))
            .key(Key::new(format!("m-{n}")).unwrap())
            .ordering_key(account);
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let sink = Recorder {
        fail_first: 1,
        hold: Duration::from_millis(2),
        ..Recorder::default()
    };
    // Two relays at once.
    let relays: Vec<Relay> = (0..2)
        .map(|_| {
            Relay::builder(pool.clone(), outbox.clone())
                .sink("hook", sink.clone())
                .backoff(Duration::from_millis(5), Duration::from_millis(10))
                .build()
        })
        .collect();
    let done = {
        let sink = sink.clone();
        move || sink.delivered().len() == 30
    };
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            let done = done.clone();
            tokio::spawn(async move { drain(&relay, done).await })
        })
        .collect();
    for task in tasks {
        timeout(BOUND, task).await.unwrap().unwrap();
    }
    let delivered = sink.delivered();
    for account in 0..3 {
        let ids: Vec<i64> = delivered
            .iter()
            .copied()
            .filter(|id| {
                sink.seen().iter().any(|s| {
                    s.id == *id && s.payload.starts_with(format!("acct-{account}:").as_bytes())
                })
            })
            .collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids.len(), 10);
        assert_eq!(ids, sorted, "acct-{account} out of order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_ordering_key_is_delivered_in_commit_order() {
    let Some((pool, outbox)) = setup(8).await else {
        return;
    };
    let message = |n: u32| {
        Outgoing::new("hook", format!("m{n}"))
            .key(Key::new(format!("m{n}")).unwrap())
            .ordering_key("account-1")
    };
    // The first transaction enqueues and stays open; the second enqueues after it with the
    // same ordering key, and commits as soon as it can.
    let mut first = pool.begin().await.unwrap();
    outbox.enqueue(&mut first, &message(1)).await.unwrap();
    let second = {
        let (pool, outbox, m2) = (pool.clone(), outbox.clone(), message(2));
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            outbox.enqueue(&mut tx, &m2).await.unwrap();
            tx.commit().await.unwrap();
        })
    };
    // It waits for the first transaction's turn on the ordering key.
    eventually("the second enqueue waits", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        waiting > 0
    })
    .await;
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .build();
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "nothing committed yet"
    );
    first.commit().await.unwrap();
    timeout(BOUND, second).await.unwrap().unwrap();
    let done = sink.clone();
    drain(&relay, move || done.delivered().len() == 2).await;
    let order: Vec<Vec<u8>> = sink.seen().into_iter().map(|s| s.payload).collect();
    assert_eq!(order, [b"m1".to_vec(), b"m2".to_vec()]);
}

// A key with a backlog of thousands: only its oldest message is ever looked at, so the other
// keys and the messages without a key flow at full speed past it while it waits for a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_ordering_key_does_not_hold_back_the_other_messages() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (destination, message_key, payload, header_names, header_values, \
         ordering_key, available_at) \
         SELECT 'hook', 'hot-' || n, convert_to('poison ' || n, 'UTF8'), '{{}}', '{{}}', 'hot', \
         clock_timestamp() FROM generate_series(1, 5000) n",
        outbox.table()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    for n in 0..40 {
        let message = Outgoing::new("hook", format!("keyed {n}"))
            .key(Key::new(format!("keyed-{n}")).unwrap())
            .ordering_key(format!("k-{n:02}"));
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    for n in 0..10 {
        let message =
            Outgoing::new("hook", format!("free {n}")).key(Key::new(format!("free-{n}")).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .batch_size(16)
        .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .build();
    let mut batches = 0;
    while sink.delivered().len() < 50 {
        let batch = relay.run_once().await.unwrap();
        assert!(batch.taken > 0, "a batch took nothing with messages due");
        batches += 1;
        assert!(batches <= 5, "50 messages in batches of 16");
    }
    let hot: Vec<String> = sink
        .seen()
        .into_iter()
        .filter(|s| s.key.starts_with("hot-"))
        .map(|s| s.key)
        .collect();
    assert_eq!(hot, ["hot-1"], "only the hot key's oldest message, once");
    assert_eq!(
        relay.run_once().await.unwrap().taken,
        0,
        "the hot key waits"
    );
}

// Which keys a batch takes rotates: with more keys due than a batch holds, each gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_keys_take_turns() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    for key in ["a", "b", "c"] {
        for n in 1..=3 {
            let message = Outgoing::new("hook", format!("{key}{n}"))
                .key(Key::new(format!("{key}{n}")).unwrap())
                .ordering_key(key);
            outbox.enqueue(&mut tx, &message).await.unwrap();
        }
    }
    tx.commit().await.unwrap();
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .batch_size(1)
        .build();
    for _ in 0..9 {
        assert_eq!(relay.run_once().await.unwrap().delivered, 1);
    }
    let order: Vec<String> = sink.seen().into_iter().map(|s| s.key).collect();
    assert_eq!(
        order,
        ["a1", "b1", "c1", "a2", "b2", "c2", "a3", "b3", "c3"]
    );
}
