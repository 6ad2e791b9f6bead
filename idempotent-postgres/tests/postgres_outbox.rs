//! The transactional outbox's table against a real PostgreSQL server (started by
//! `scripts/test.sh`; fixture: `support::outbox`): messages commit or roll back with the
//! caller's transaction, take the running claim's operation key, are refused when bad before
//! anything is written (an ordering key must be enqueued in a transaction), reaped once
//! delivered; a long table name gets a channel; the backlog is reported as gauges; and every
//! duration setting saturates. The relay is in `postgres_outbox_relay`, ordering keys in
//! `postgres_outbox_ordering`.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).

mod support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use idempotent_core::conformance::fresh_key;
use idempotent_core::metrics::Recorded;
use idempotent_core::{Call, ClaimHandle, Fingerprint, Idempotency, Key};
use idempotent_postgres::outbox::{
    OUTBOX_DEAD, OUTBOX_OLDEST_PENDING_AGE, OUTBOX_PENDING, Outbox, OutboxError, Outgoing, Relay,
};
use idempotent_postgres::{PostgresStore, TransactionalClaim};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool_bounding_locks as pool;
use support::outbox::*;
use tokio::time::timeout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_commits_or_rolls_back_with_the_transaction() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let key = Key::new("order-7-confirmation").unwrap();

    let mut tx = pool.begin().await.unwrap();
    let rolled_back = Outgoing::new("mail", "rolled back").key(key.clone());
    outbox.enqueue(&mut tx, &rolled_back).await.unwrap();
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let message = Outgoing::new("mail", r#"{"order":7}"#)
        .key(key.clone())
        .header("content-type", "application/json")
        .header("x-tenant", "acme");
    let id = outbox.enqueue(&mut tx, &message).await.unwrap();
    // Not visible to a relay before the commit.
    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("mail", sink.clone())
        .build();
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    tx.commit().await.unwrap();

    let batch = relay.run_once().await.unwrap();
    assert_eq!((batch.taken, batch.delivered), (1, 1));
    let seen = sink.seen();
    assert_eq!(seen.len(), 1, "only the committed message");
    assert_eq!(seen[0].id, id);
    assert_eq!(seen[0].key, "order-7-confirmation");
    assert_eq!(seen[0].payload, br#"{"order":7}"#);
    assert_eq!(
        seen[0].headers,
        [
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-tenant".to_owned(), "acme".to_owned())
        ]
    );
    assert_eq!(seen[0].attempt, 1);
    // Delivered once: nothing left.
    assert_eq!(relay.run_once().await.unwrap().taken, 0);
    assert_eq!(sink.seen().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_takes_the_running_claims_operation_key() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    let transactional = idempotent_postgres::Transactional::new(&store).namespace("outbox-test");

    // Outside a claim there is no key to default to.
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        outbox.enqueue(&mut tx, &Outgoing::new("mail", "x")).await,
        Err(OutboxError::NoKey)
    ));
    drop(tx);

    let client_key = unique("deposit");
    let call = || {
        Call::new(client_key.parse().unwrap())
            .fingerprint(Fingerprint::of(&("acct-1", 100)).unwrap())
    };
    // The first attempt enqueues and rolls back (a crash before the commit); the second
    // commits. Each enqueues with its claim's operation key.
    let mut keys = Vec::new();
    for commit in [false, true] {
        let mut tx = pool.begin().await.unwrap();
        let TransactionalClaim::Run(pending) =
            transactional.claim::<i64>(&call(), &mut tx).await.unwrap()
        else {
            panic!("nothing was committed yet: the work must run");
        };
        let claim = pending.claim();
        let receipt = Outgoing::new("mail", "receipt").claim(&claim);
        outbox.enqueue(&mut tx, &receipt).await.unwrap();
        let ledger = Outgoing::new("mail", "ledger").claim(&claim).part("ledger");
        outbox.enqueue(&mut tx, &ledger).await.unwrap();
        keys.push(claim.operation_key());
        pending.complete(&mut tx, &100i64).await.unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    }
    // The rolled-back attempt left no record, so no lifetime: the committed attempt began a
    // new one. Its messages went with the rollback, so no receiver ever sees the first key.
    assert_ne!(
        keys[0], keys[1],
        "a rolled-back attempt leaves no lifetime behind"
    );
    // A third attempt replays: nothing more is enqueued.
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        transactional.claim::<i64>(&call(), &mut tx).await.unwrap(),
        TransactionalClaim::Replay(100)
    ));
    tx.commit().await.unwrap();

    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("mail", sink.clone())
        .build();
    relay.run_once().await.unwrap();
    let seen: BTreeMap<Vec<u8>, String> = sink
        .seen()
        .into_iter()
        .map(|s| (s.payload, s.key))
        .collect();
    let operation = keys[1].as_str().to_owned();
    assert_eq!(
        seen,
        BTreeMap::from([
            (b"receipt".to_vec(), operation.clone()),
            (b"ledger".to_vec(), format!("{operation}.ledger")),
        ]),
        "one message of each, from the committed attempt, with the operation's key"
    );

    // Inside the runtime's work, the running claim gives the key (ClaimHandle::current).
    let idempotency = Idempotency::new(store.clone());
    let call = Call::new(unique("notify").parse().unwrap());
    let (pool2, outbox2) = (pool.clone(), outbox.clone());
    let outcome = idempotency
        .run(&call, async move {
            let claim = ClaimHandle::current().expect("inside run");
            let mut tx = pool2.begin().await.unwrap();
            outbox2
                .enqueue(&mut tx, &Outgoing::new("mail", "from run"))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            claim.operation_key().as_str().to_owned()
        })
        .await
        .unwrap();
    let expected = outcome.into_inner();
    relay.run_once().await.unwrap();
    let from_run: Vec<String> = sink
        .seen()
        .into_iter()
        .filter(|s| s.payload == b"from run")
        .map(|s| s.key)
        .collect();
    assert_eq!(from_run, [expected]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_messages_are_reaped_and_the_others_kept() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    for payload in ["ok-1", "ok-2", "refuse", "poison"] {
        let message = Outgoing::new("hook", payload).key(Key::new(payload).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", Recorder::default())
        .build();
    relay.run_once().await.unwrap();
    let count = |state: &'static str| {
        let (pool, table) = (pool.clone(), outbox.table().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT count(*) FROM \"{table}\" WHERE state = $1"
            ))
            .bind(state)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(count("delivered").await, 2);
    // The default retention is an hour.
    assert_eq!(relay.reap().await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let short = Relay::builder(pool.clone(), outbox.clone())
        .retain_delivered(Duration::from_millis(10))
        .build();
    assert_eq!(short.reap().await.unwrap(), 2);
    assert_eq!(count("delivered").await, 0);
    assert_eq!(count("dead").await, 1, "a dead letter is kept");
    assert_eq!(count("pending").await, 1, "a message to retry is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_refused_before_anything_is_written() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let key = Key::new("k").unwrap();
    let mut tx = pool.begin().await.unwrap();
    let cases = [
        (Outgoing::new("", "x").key(key.clone()), "destination"),
        (
            Outgoing::new("d".repeat(256), "x").key(key.clone()),
            "destination",
        ),
        (
            Outgoing::new("hook", "x")
                .key(key.clone())
                .header("bad name", "v"),
            "header",
        ),
        (
            Outgoing::new("hook", "x")
                .key(key.clone())
                .header("x-a", "line\nbreak"),
            "header",
        ),
        (
            Outgoing::new("hook", "x")
                .key(key.clone())
                .ordering_key("a\0b"),
            "header",
        ),
        (
            Outgoing::new("hook", "x")
                .key(key.clone())
                .header("Idempotency-Key", "other"),
            "header",
        ),
        (
            Outgoing::new("hook", vec![0u8; (16 << 20) + 1]).key(key.clone()),
            "payload",
        ),
    ];
    for (message, what) in cases {
        let error = outbox.enqueue(&mut tx, &message).await.unwrap_err();
        let matched = match what {
            "destination" => matches!(error, OutboxError::InvalidDestination),
            "header" => matches!(error, OutboxError::InvalidHeader),
            _ => matches!(error, OutboxError::PayloadTooLarge { .. }),
        };
        assert!(matched, "{what}: {error:?}");
    }
    // The transaction is still usable, and nothing was written.
    tx.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\"", outbox.table()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    assert!(Outbox::with_table("Outbox; DROP TABLE x").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_table_name_gets_a_channel_postgresql_accepts() {
    let Some(url) = postgres_url() else {
        return;
    };
    let pool = pool(&url, 4).await;
    let schema = format!("s{}", &fresh_key().to_hex()[..40]);
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
        .execute(&pool)
        .await
        .unwrap();
    let table = format!("{schema}.{}", "o".repeat(48));
    let outbox = Outbox::with_table(&table).unwrap();
    assert!(
        table.len() > 63 && outbox.channel().len() <= 63,
        "{}",
        outbox.channel()
    );
    outbox.migrate(&pool).await.unwrap();
    woken_by_notify(&pool, &outbox).await;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_is_read_and_reported_as_gauges() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let empty = outbox.backlog(&pool).await.unwrap();
    assert_eq!(
        (empty.pending, empty.dead, empty.oldest_pending),
        (0, 0, None)
    );
    let mut tx = pool.begin().await.unwrap();
    for payload in ["ok", "refuse", "poison"] {
        let message = Outgoing::new("hook", payload).key(Key::new(payload).unwrap());
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    // Not due for an hour: pending all along.
    let later = Outgoing::new("hook", "later")
        .key(Key::new("later").unwrap())
        .delay(Duration::from_secs(3600));
    outbox.enqueue(&mut tx, &later).await.unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (relay, recorded) = Recorded::capture(|| {
        Relay::builder(pool.clone(), outbox.clone())
            .sink("hook", Recorder::default())
            .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
            .reap_every(Duration::from_millis(10))
            .poll_interval(Duration::from_millis(20))
            .build()
    });
    let running = relay.spawn();
    // ok delivered, refuse dead, poison waiting for its retry, later not due.
    eventually("the gauges show the backlog", || async {
        let gauge = |name| recorded.gauge(name, &[]);
        (gauge(OUTBOX_PENDING), gauge(OUTBOX_DEAD)) == (2.0, 1.0)
    })
    .await;
    assert!(recorded.gauge(OUTBOX_OLDEST_PENDING_AGE, &[]) >= 0.05);
    timeout(BOUND, running.stop()).await.unwrap();
    let backlog = outbox.backlog(&pool).await.unwrap();
    assert_eq!((backlog.pending, backlog.dead), (2, 1));
    assert!(backlog.oldest_pending.unwrap() >= Duration::from_millis(50));
}

// Regression: `RelayBuilder::delivery_timeout(Duration::MAX)` panicked in every batch
// (`Duration::MAX * 2 + 5 s` overflowed), and a backoff of `Duration::MAX` could overflow the
// jitter. Every duration setting of the relay and the outbox now saturates: waits longer than
// the clock can express are "never", and what is written to the table is at most 365 days.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_max_in_every_relay_and_outbox_setting_does_not_panic() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let mut tx = pool.begin().await.unwrap();
    let mut ids = HashMap::new();
    for payload in ["ok", "poison"] {
        let message = Outgoing::new("hook", payload).key(Key::new(payload).unwrap());
        ids.insert(payload, outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    let later = Outgoing::new("hook", "later")
        .key(Key::new("later").unwrap())
        .delay(Duration::MAX);
    ids.insert("later", outbox.enqueue(&mut tx, &later).await.unwrap());
    tx.commit().await.unwrap();

    let sink = Recorder::default();
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .sink("hook", sink.clone())
        .delivery_timeout(Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX)
        .poll_interval(Duration::MAX)
        .reap_every(Duration::MAX)
        .retain_delivered(Duration::MAX)
        .build();
    let batch = relay.run_once().await.unwrap();
    assert_eq!(
        (batch.taken, batch.delivered, batch.retried),
        (2, 1, 1),
        "`later` is not due"
    );
    // The retry waits between half of 365 days and 365 days; `later` 365 days.
    let waits: BTreeMap<i64, f64> = sqlx::query_as::<_, (i64, f64)>(&format!(
        "SELECT id, EXTRACT(EPOCH FROM available_at - clock_timestamp())::float8 / 86400 \
         FROM \"{}\" WHERE state = 'pending'",
        outbox.table()
    ))
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let poison = waits[&ids["poison"]];
    assert!((182.0..=365.0).contains(&poison), "{poison} days");
    let later = waits[&ids["later"]];
    assert!((364.9..=365.0).contains(&later), "{later} days");
    // Nothing is older than 365 days.
    assert_eq!(relay.reap().await.unwrap(), 0);

    // Running: no poll (the NOTIFY wakes it), no reaping, no delivery timeout.
    let running = relay.spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut tx = pool.begin().await.unwrap();
    let woken = Outgoing::new("hook", "woken").key(Key::new("woken").unwrap());
    outbox.enqueue(&mut tx, &woken).await.unwrap();
    tx.commit().await.unwrap();
    eventually("the NOTIFY woke the relay", || async {
        sink.delivered().len() == 2
    })
    .await;
    timeout(BOUND, running.stop()).await.unwrap();
    let backlog = outbox.backlog(&pool).await.unwrap();
    assert_eq!((backlog.pending, backlog.dead), (2, 0));
}

// Regression: a message with an ordering key enqueued on a connection in autocommit mode took
// its turn on the key (a transaction-scoped advisory lock) for its own statement only, so
// per-key commit order silently broke; now it is refused before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordering_key_outside_a_transaction_is_refused() {
    let Some((pool, outbox)) = setup(4).await else {
        return;
    };
    let ordered = |n: u32| {
        Outgoing::new("hook", format!("m{n}"))
            .key(Key::new(format!("m{n}")).unwrap())
            .ordering_key("account-1")
    };
    let count = || {
        let (pool, table) = (pool.clone(), outbox.table().to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM \"{table}\""))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // A plain pooled connection: autocommit.
    let mut connection = pool.acquire().await.unwrap();
    let refused = outbox.enqueue(&mut connection, &ordered(1)).await;
    assert!(
        matches!(refused, Err(OutboxError::NotInTransaction)),
        "{refused:?}"
    );
    assert_eq!(count().await, 0, "nothing written");
    // The connection is fine, and a message without an ordering key still commits at once.
    let unordered = Outgoing::new("hook", "u").key(Key::new("u").unwrap());
    outbox.enqueue(&mut connection, &unordered).await.unwrap();
    assert_eq!(count().await, 1);
    // In a transaction: accepted, also one begun by hand.
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, &ordered(2)).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("BEGIN")
        .execute(&mut *connection)
        .await
        .unwrap();
    outbox.enqueue(&mut connection, &ordered(3)).await.unwrap();
    sqlx::query("COMMIT")
        .execute(&mut *connection)
        .await
        .unwrap();
    assert_eq!(count().await, 3);
    // In a transaction aborted by an earlier error: the statement's failure, not a refusal.
    let mut tx = pool.begin().await.unwrap();
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
    let failed = outbox.enqueue(&mut tx, &ordered(4)).await;
    assert!(matches!(failed, Err(OutboxError::Store(_))), "{failed:?}");
    tx.rollback().await.unwrap();
    assert_eq!(count().await, 3);
}
