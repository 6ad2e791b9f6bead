//! A notification that kills every `relay` process delivering it, among 49 innocent ones taken
//! in the same batches, with real PostgreSQL, Redis and processes (fixtures:
//! `support::ledger_stream`, `support::notifier`): only the poison notification is
//! dead-lettered, after `RELAY_MAX_ATTEMPTS` crashes, and every innocent one arrives and is
//! recorded as delivered, none dead.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use idempotent_core::Key;
use idempotent_postgres::outbox::{Outbox, Outgoing};
use support::ledger::{Consumer, Deadline};
use support::ledger_stream::Fixture;
use support::notifier::{HANGING_KEY_PREFIX, Notifier, outbox_states};

// Regression (issue 39, item 12): the batch statement counted an attempt for every message of
// a batch when it took it, so each crash of a relay delivering the poison message charged the
// whole batch: after 3 crashes (RELAY_MAX_ATTEMPTS=3) the 31 innocent notifications taken with
// it were dead-lettered too (outbox `dead=32 delivered=18`), some of them without ever being
// sent (the relay died before it got to them), others after the notifier had acted on them.
// Here the test SIGKILLs the relay process each time the notifier receives the poison
// notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_relay_dead_letters_itself_alone() {
    let Some(fx) = Fixture::new("relay_poison").await else {
        return;
    };
    const MAX_ATTEMPTS: u32 = 3;
    const MESSAGES: usize = 50;
    const POISON: usize = 7;
    let poison_key = format!("{HANGING_KEY_PREFIX}pay-poison");
    let notifier = Notifier::start().await;
    let db = fx.db().await;
    let outbox = Outbox::new();
    outbox.migrate(&db).await.unwrap();
    // Notifications as the ledger enqueues them (no ordering key), the poison one among the
    // first batch (the relay's batches are 256 since 0.4; 32 before).
    let mut ids = BTreeSet::new();
    let mut tx = db.begin().await.unwrap();
    for n in 0..MESSAGES {
        let (id, key) = if n == POISON {
            ("pay-poison".to_owned(), poison_key.clone())
        } else {
            (format!("pay-{n}"), format!("note-{n}"))
        };
        let body = serde_json::json!({"id": id, "account": format!("acct-{}", n % 7), "amount": n});
        let message = Outgoing::new("notifications", body.to_string())
            .key(Key::new(key).unwrap())
            .header("content-type", "application/json");
        outbox.enqueue(&mut tx, &message).await.unwrap();
        if n != POISON {
            ids.insert(id);
        }
    }
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 49);

    let env = fx.env(&[
        ("NOTIFY_URL", &notifier.url()),
        ("RELAY_MAX_ATTEMPTS", &MAX_ATTEMPTS.to_string()),
        ("RELAY_BACKOFF", "100ms"),
        ("RELAY_POLL", "200ms"),
    ]);
    // Each time the notifier receives the poison notification, the relay delivering it is
    // killed (SIGKILL), and another started.
    let mut relay = Consumer::relay(&env, "relay-0").await;
    let mut crashes = 0;
    let deadline = Deadline::after(
        Duration::from_secs(60),
        "the outbox never settled (the poison dead-lettered, nothing pending)",
    );
    loop {
        if notifier.attempts(&poison_key) > crashes {
            crashes += 1;
            assert!(
                crashes <= MAX_ATTEMPTS,
                "delivered again after {MAX_ATTEMPTS} relays died delivering it"
            );
            relay.kill().await;
            relay = Consumer::relay(&env, format!("relay-{crashes}")).await;
            continue;
        }
        let states = outbox_states(&db).await;
        if !states.contains_key("pending") && states.contains_key("dead") {
            break;
        }
        deadline.tick().await;
    }
    relay.stop().await;

    let states = outbox_states(&db).await;
    let dead = outbox.dead_letters(&db, 100).await.unwrap();
    let acted: BTreeSet<String> = notifier
        .seen()
        .acted
        .iter()
        .map(|(_, body)| body["id"].as_str().unwrap().to_owned())
        .collect();
    let never_arrived: Vec<&String> = ids.difference(&acted).collect();
    let twice = notifier
        .seen()
        .attempts
        .iter()
        .filter(|(key, n)| !key.contains(HANGING_KEY_PREFIX) && **n > 1)
        .count();
    eprintln!(
        "outbox {states:?}; crashes {crashes}; dead letters {}; innocent notifications never \
         arrived {}; innocent notifications sent more than once {twice}",
        dead.len(),
        never_arrived.len()
    );
    assert_eq!(
        crashes, MAX_ATTEMPTS,
        "the poison killed a relay on each attempt"
    );
    assert_eq!(
        states,
        BTreeMap::from([("dead".to_owned(), 1), ("delivered".to_owned(), 49)]),
        "only the poison notification is dead-lettered ({} dead letters: {:?})",
        dead.len(),
        dead.iter().map(|d| &d.key).collect::<Vec<_>>()
    );
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].key, poison_key);
    assert_eq!(dead[0].attempts, MAX_ATTEMPTS as i32);
    let error = dead[0].last_error.clone().unwrap_or_default();
    assert!(
        error.starts_with("relay_crashed: a relay died while delivering it (attempt 3)"),
        "{error}"
    );
    assert_eq!(
        notifier.attempts(&poison_key),
        MAX_ATTEMPTS,
        "one delivery per attempt, none after the last"
    );
    // Every innocent notification arrived: at least once on the wire (a relay killed after
    // sending one and before recording it sends it again), and acted on exactly once by the
    // notifier, which deduplicates on the key.
    assert!(never_arrived.is_empty(), "never arrived: {never_arrived:?}");
    notifier.assert_once_each(&ids);
    drop(db);
    fx.drop_database().await;
}
