//! The `ledger` example's outbox relays and the notifier they deliver to, with real Redis,
//! PostgreSQL and processes (fixtures: `support::ledger_stream`, `support::notifier`):
//!
//! - A notifier that is down delays notifications and loses none; one it refuses is
//!   dead-lettered; three relays never deliver one notification at the same time.
//! - A relay frozen mid-batch gives the batch up to another once PostgreSQL ends its
//!   transaction.
//! - A notification that kills every relay delivering it (SIGKILLed by the test each time the
//!   notifier receives it) is dead-lettered as `relay_crashed` after `RELAY_MAX_ATTEMPTS`
//!   crashes, and the notifications behind it on its ordering key, and the others, are
//!   delivered.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use idempotent_core::Key;
use idempotent_postgres::outbox::{Outbox, Outgoing};
use support::ledger::{Consumer, Deadline};
use support::ledger_stream::Fixture;
use support::notifier::{HANGING_KEY_PREFIX, Notifier, REFUSED_ACCOUNT, outbox_states};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notifier_that_is_down_delays_notifications_and_loses_none() {
    let Some(mut fx) = Fixture::new("notify_down").await else {
        return;
    };
    let mut notifier = Notifier::start().await;
    notifier.down().await;
    let env = fx.env(&[
        ("NOTIFY_URL", &notifier.url()),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
        ("RELAY_MAX_ATTEMPTS", "1000"),
    ]);
    // Three relays: the consumer's and two on their own.
    let mut processes = vec![
        Consumer::start(&env, "c0").await,
        Consumer::relay(&env, "relay-0").await,
        Consumer::relay(&env, "relay-1").await,
    ];
    let mut ids = BTreeSet::new();
    let mut last = String::new();
    for n in 0..60 {
        let id = format!("pay-{n}");
        last = fx.post(&id, &format!("acct-{}", n % 7), 10 + n).await;
        ids.insert(id);
    }
    fx.post("pay-refused", REFUSED_ACCOUNT, 5).await;
    let last_id = fx.post("pay-last", "acct-0", 1).await;
    ids.insert("pay-last".to_owned());
    fx.wait_drained(&last_id, Duration::from_secs(60)).await;
    let _ = last;
    let db = fx.db().await;
    // Applied, and their notifications waiting: attempts failed while the notifier is down.
    let deadline = Deadline::after(Duration::from_secs(30), "no delivery attempt failed");
    loop {
        let failed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotent_outbox WHERE state = 'pending' AND attempts > 0 \
             AND last_error IS NOT NULL",
        )
        .fetch_one(&db)
        .await
        .unwrap();
        if failed > 0 {
            break;
        }
        deadline.tick().await;
    }
    assert!(notifier.seen().acted.is_empty());
    assert_eq!(outbox_states(&db).await.get("pending"), Some(&62));

    notifier.up().await;
    notifier.wait_for(&ids, Duration::from_secs(60)).await;
    // The refused one is dead-lettered at once, with the answer kept.
    let deadline = Deadline::after(Duration::from_secs(30), "the refusal was not dead-lettered");
    while outbox_states(&db).await.get("dead") != Some(&1) {
        deadline.tick().await;
    }
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM idempotent_outbox WHERE state = 'dead'")
            .fetch_one(&db)
            .await
            .unwrap();
    assert!(error.contains("400"), "{error}");
    for process in &mut processes {
        process.stop().await;
    }
    notifier.assert_once_each(&ids);
    assert_eq!(outbox_states(&db).await.get("pending"), None);
    assert!(
        !notifier.seen().overlapped,
        "two relays delivered one notification at the same time"
    );
    drop(db);
    fx.drop_database().await;
}

/// A relay frozen (SIGSTOP) in the middle of a batch keeps its notifications locked only until
/// PostgreSQL ends its idle transaction (twice the delivery timeout plus 5 s, its 20 messages
/// being one turn of deliveries); another relay
/// then delivers them, and the receiver acts on each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_gives_its_batch_up_to_another() {
    let Some(mut fx) = Fixture::new("relay_frozen").await else {
        return;
    };
    let notifier = Notifier::start_holding(Duration::from_millis(200)).await;
    let url = notifier.url();
    let relay_env = fx.env(&[
        ("NOTIFY_URL", &url),
        ("RELAY_DELIVERY_TIMEOUT", "1s"),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
    ]);
    let mut consumer_env = relay_env.clone();
    consumer_env.push(("RELAY", "0".into()));
    let mut consumer = Consumer::start(&consumer_env, "c0").await;
    let mut ids = BTreeSet::new();
    let mut last = String::new();
    for n in 0..20 {
        let id = format!("pay-{n}");
        last = fx.post(&id, "acct-0", n).await;
        ids.insert(id);
    }
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    // One relay takes all 20 in its first batch; freeze it while it delivers them.
    let mut frozen = Consumer::relay(&relay_env, "relay-frozen").await;
    let deadline = Deadline::after(Duration::from_secs(30), "the relay never delivered");
    while notifier.seen().attempts.is_empty() {
        deadline.tick().await;
    }
    frozen.signal("STOP");
    let mut other = Consumer::relay(&relay_env, "relay-other").await;
    // While the first relay stays frozen, the other one gets the batch once PostgreSQL has
    // ended the frozen relay's transaction, and records every notification delivered.
    let db = fx.db().await;
    let deadline = Deadline::after(
        Duration::from_secs(60),
        "the frozen relay's batch was never delivered by the other",
    );
    while outbox_states(&db).await != BTreeMap::from([("delivered".to_owned(), 20)]) {
        deadline.tick().await;
    }
    let redelivered = notifier
        .seen()
        .attempts
        .values()
        .filter(|n| **n >= 2)
        .count();
    assert!(redelivered > 0, "the other relay delivered the batch again");
    frozen.signal("CONT");
    for process in [&mut consumer, &mut frozen, &mut other] {
        process.stop().await;
    }
    notifier.assert_once_each(&ids);
    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("delivered".to_owned(), 20)])
    );
    drop(db);
    fx.drop_database().await;
}

// Regression: a notification whose delivery killed its relay was delivered again forever: the
// relay counted the attempt in its batch's transaction, which died with it, so the next relay
// took the same notification first, died too, and the later notifications of its ordering key
// waited behind it. Here the test SIGKILLs the relay process each time the notifier receives
// that notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_relay_is_dead_lettered_and_the_rest_flows() {
    let Some(fx) = Fixture::new("relay_crash").await else {
        return;
    };
    const MAX_ATTEMPTS: u32 = 3;
    let poison_key = format!("{HANGING_KEY_PREFIX}pay-poison");
    let notifier = Notifier::start().await;
    let db = fx.db().await;
    let outbox = Outbox::new();
    outbox.migrate(&db).await.unwrap();
    // Notifications as the ledger enqueues them, six in order on one account (the poison one
    // second), four without an ordering key.
    let mut ids = BTreeSet::new();
    let mut in_order = Vec::new();
    let mut tx = db.begin().await.unwrap();
    for n in 0..10 {
        let id = if n == 1 {
            "pay-poison".to_owned()
        } else {
            format!("pay-{n}")
        };
        let body = serde_json::json!({"id": id, "account": "acct-0", "amount": n});
        let key = if n == 1 {
            poison_key.clone()
        } else {
            format!("note-{n}")
        };
        let mut message = Outgoing::new("notifications", body.to_string())
            .key(Key::new(key).unwrap())
            .header("content-type", "application/json");
        if n < 6 {
            message = message.ordering_key("acct-0");
            if n != 1 {
                in_order.push(id.clone());
            }
        }
        outbox.enqueue(&mut tx, &message).await.unwrap();
        if n != 1 {
            ids.insert(id);
        }
    }
    tx.commit().await.unwrap();

    let env = fx.env(&[
        ("NOTIFY_URL", &notifier.url()),
        ("RELAY_MAX_ATTEMPTS", &MAX_ATTEMPTS.to_string()),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
    ]);
    // Each time the notifier receives it, the relay delivering it is killed, and another
    // started. Its relays crash MAX_ATTEMPTS times; then it is dead-lettered, not delivered
    // again.
    let mut relay = Consumer::relay(&env, "relay-0").await;
    let mut crashes = 0;
    let deadline = Deadline::after(
        Duration::from_secs(90),
        "the poison notification was never dead-lettered",
    );
    let dead = loop {
        if notifier.attempts(&poison_key) > crashes {
            crashes += 1;
            assert!(
                crashes <= MAX_ATTEMPTS,
                "delivered again after {MAX_ATTEMPTS} relays died delivering it: their \
                 attempts were not counted"
            );
            relay.kill().await;
            relay = Consumer::relay(&env, format!("relay-{crashes}")).await;
            continue;
        }
        let dead = outbox.dead_letters(&db, 10).await.unwrap();
        if !dead.is_empty() {
            break dead;
        }
        deadline.tick().await;
    };
    assert_eq!(crashes, MAX_ATTEMPTS);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].key, poison_key);
    assert_eq!(dead[0].attempts, MAX_ATTEMPTS as i32);
    let error = dead[0].last_error.clone().unwrap_or_default();
    assert!(
        error.starts_with("relay_crashed: a relay died while delivering it (attempt 3)"),
        "{error}"
    );
    // The rest flows, its ordering key in order.
    notifier.wait_for(&ids, Duration::from_secs(60)).await;
    relay.stop().await;
    notifier.assert_once_each(&ids);
    let acted: Vec<String> = notifier
        .seen()
        .acted
        .iter()
        .map(|(_, body)| body["id"].as_str().unwrap().to_owned())
        .filter(|id| in_order.contains(id))
        .collect();
    assert_eq!(acted, in_order, "acct-0's notifications out of order");
    assert_eq!(
        notifier.attempts(&poison_key),
        MAX_ATTEMPTS,
        "one delivery per attempt, none after the last"
    );
    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("dead".to_owned(), 1), ("delivered".to_owned(), 9)])
    );
    drop(db);
    fx.drop_database().await;
}
