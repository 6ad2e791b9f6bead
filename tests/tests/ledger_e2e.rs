//! The `ledger` consumer with real Redis, PostgreSQL and processes (the fixture: a database
//! and a stream of the test's own, `support::ledger_stream`; the notifier, `support::notifier`).
//!
//! - 1,000 stream entries over 200 accounts, 20% of them duplicate ids (some adjacent, some far
//!   apart) and a few malformed, consumed by two consumers, with notifications relayed by the
//!   first consumer and two relay processes; consumers and relays are killed with SIGKILL at
//!   random moments and restarted. When the group has nothing pending and nothing unread, every
//!   balance must equal the sum over distinct ids, the dead-letter stream must hold exactly
//!   the malformed entries and the one PostgreSQL rejects, and the notifier (deduplicating by
//!   `Idempotency-Key`) must have acted once on each applied posting and on nothing else.
//! - Six consumers and two relays started in the same instant on an empty database all come
//!   up (the idempotency, accounts and outbox tables each created once).
//! - Entries PostgreSQL rejects, and malformed ones, are dead-lettered (after `MAX_DELIVERIES`
//!   deliveries counted across restarts, and at once, respectively) while the entries around
//!   them are applied once.
//! - A pending list longer than one `XAUTOCLAIM` page is processed to its tail although its
//!   head keeps failing.
//! - An entry whose idempotency record cannot be decoded is dead-lettered once, and the
//!   entries after it are applied.
//!
//! Hung transactions and bad settings are in `ledger_faults_e2e`, the relays and the notifier
//! in `ledger_relay_e2e`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use support::ledger::{Consumer, Deadline, Posting, Rng, expected_balances, postings};
use support::ledger_stream::{ACCOUNTS_TABLE, DeadLetter, Fixture};
use support::notifier::{Notifier, outbox_states};

enum Entry {
    Posting(Posting),
    Malformed(Vec<(&'static str, String)>),
}

/// 800 distinct postings, 200 duplicates (half right after their original, half at least 100
/// entries later), and 6 malformed entries, in publication order.
fn workload(rng: &mut Rng) -> Vec<Entry> {
    let mut entries: Vec<Entry> = postings(800, 200, rng)
        .into_iter()
        .map(Entry::Posting)
        .collect();
    let malformed: [Vec<(&'static str, String)>; 6] = [
        vec![("id", "bad-1".into()), ("amount", "5".into())],
        vec![
            ("id", "bad-2".into()),
            ("account", "acct-1".into()),
            ("amount", "12.5".into()),
        ],
        vec![
            ("id", "bad-3".into()),
            ("account", "acct-2".into()),
            ("amount", "abc".into()),
        ],
        vec![("account", "acct-3".into()), ("amount", "7".into())],
        vec![
            ("id", "".into()),
            ("account", "acct-4".into()),
            ("amount", "7".into()),
        ],
        vec![
            ("id", "bad-6".into()),
            ("account", "acct-5".into()),
            ("amount", "99999999999999999999".into()),
        ],
    ];
    for (n, fields) in malformed.into_iter().enumerate() {
        let at = (n + 1) * entries.len() / 7;
        entries.insert(at, Entry::Malformed(fields));
    }
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_are_exact_after_duplicates_malformed_entries_and_kills() {
    let Some(mut fx) = Fixture::new("kills").await else {
        return;
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("ledger e2e seed: {seed}");
    let mut rng = Rng(seed);

    let entries = workload(&mut rng);
    assert_eq!(entries.len(), 1006);
    let (expected, seen) = expected_balances(entries.iter().filter_map(|entry| match entry {
        Entry::Posting(posting) => Some(posting),
        Entry::Malformed(_) => None,
    }));
    assert_eq!(seen.len(), 800);

    // Each applied posting notifies the notifier through the outbox: relays run inside the
    // first consumer and on their own, and are killed too.
    let notifier = Notifier::start().await;
    let notify = [
        ("NOTIFY_URL", notifier.url()),
        ("RELAY_BACKOFF", "100ms".into()),
        ("RELAY_POLL", "200ms".into()),
        ("RELAY_MAX_ATTEMPTS", "1000".into()),
    ];
    let settings: Vec<(&str, &str)> = [("CLAIM_IDLE", "1s"), ("EFFECT_DELAY_MS", "3")]
        .into_iter()
        .chain(notify.iter().map(|(k, v)| (*k, v.as_str())))
        .collect();
    let env = fx.env(&settings);
    let mut without_relay = env.clone();
    without_relay.push(("RELAY", "0".into()));
    let mut consumers = [
        Consumer::start(&env, "c0-0").await,
        Consumer::start(&without_relay, "c1-0").await,
    ];
    let mut relays = [
        Consumer::relay(&env, "r0-0").await,
        Consumer::relay(&env, "r1-0").await,
    ];

    // Publish while the consumers run.
    let publisher = tokio::spawn({
        let mut redis = fx.redis.clone();
        let stream = fx.stream.clone();
        async move {
            let (mut malformed_ids, mut last) = (BTreeSet::new(), String::new());
            for (n, entry) in entries.iter().enumerate() {
                if n == 500 {
                    // PostgreSQL rejects this one (a NUL byte in the account) after its
                    // notification was enqueued: every attempt rolls both back, and the entry
                    // is dead-lettered after MAX_DELIVERIES.
                    let rejected: String = redis::cmd("XADD")
                        .arg(&stream)
                        .arg("*")
                        .arg("id")
                        .arg("pay-rejected")
                        .arg("account")
                        .arg("acct-\0")
                        .arg("amount")
                        .arg(1)
                        .query_async(&mut redis)
                        .await
                        .unwrap();
                    malformed_ids.insert(rejected);
                }
                let mut cmd = redis::cmd("XADD");
                cmd.arg(&stream).arg("*");
                match entry {
                    Entry::Posting(Posting {
                        id,
                        account,
                        amount,
                    }) => {
                        cmd.arg("id")
                            .arg(id)
                            .arg("account")
                            .arg(account)
                            .arg("amount")
                            .arg(amount);
                    }
                    Entry::Malformed(fields) => {
                        for (k, v) in fields {
                            cmd.arg(*k).arg(v);
                        }
                    }
                }
                last = cmd.query_async(&mut redis).await.unwrap();
                if matches!(entry, Entry::Malformed(_)) {
                    malformed_ids.insert(last.clone());
                }
                if n % 50 == 49 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            (malformed_ids, last)
        }
    });

    // Kill consumers and relays at random moments, and restart them.
    for round in 1..=8 {
        tokio::time::sleep(Duration::from_millis(150 + rng.below(500))).await;
        let victim = rng.below(2) as usize;
        if rng.below(2) == 0 {
            consumers[victim].kill().await;
            eprintln!("killed {} in round {round}", consumers[victim].name);
            let env = if victim == 0 { &env } else { &without_relay };
            consumers[victim] = Consumer::start(env, format!("c{victim}-{round}")).await;
        } else {
            relays[victim].kill().await;
            eprintln!("killed {} in round {round}", relays[victim].name);
            relays[victim] = Consumer::relay(&env, format!("r{victim}-{round}")).await;
        }
    }

    let (malformed_ids, last_id) = publisher.await.unwrap();
    fx.wait_drained(&last_id, Duration::from_secs(90)).await;
    notifier.wait_for(&seen, Duration::from_secs(90)).await;
    // A notification whose relay was killed after the notifier had it is delivered again, and
    // recorded, by another relay once the killed relay's hold on it is over (5 s).
    let db = fx.db().await;
    let deadline = Deadline::after(Duration::from_secs(60), "the outbox never drained");
    while outbox_states(&db).await.contains_key("pending") {
        deadline.tick().await;
    }
    for process in consumers.iter_mut().chain(&mut relays) {
        process.stop().await;
    }
    // Exactly one notification acted on per distinct applied posting (at least one delivery
    // each; duplicates deduplicated by key), none for the rejected entry whose transactions
    // rolled back, none for malformed ones.
    notifier.assert_once_each(&seen);

    assert_eq!(
        outbox_states(&db).await,
        BTreeMap::from([("delivered".to_owned(), 800)]),
        "one message per applied posting, all delivered"
    );
    let balances = fx.balances(&db).await;
    assert_eq!(balances.len(), 200);
    assert_eq!(
        balances, expected,
        "every balance is the sum over distinct ids"
    );

    let dead = fx.dead_letters().await;
    let dead_entries: Vec<String> = dead.iter().map(|d| d.field("entry")).collect();
    assert_eq!(
        dead_entries.len(),
        malformed_ids.len(),
        "each malformed entry dead-lettered once"
    );
    assert_eq!(
        dead_entries.into_iter().collect::<BTreeSet<_>>(),
        malformed_ids
    );
    assert!(dead.iter().all(|d| !d.field("reason").is_empty()));

    drop(db);
    fx.drop_database().await;
}

/// Regression: consumers started at the same moment on an empty database failed with
/// `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`, because
/// concurrent `CREATE TABLE IF NOT EXISTS` statements race in PostgreSQL's catalog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_started_at_once_on_an_empty_database_all_come_up() {
    // Each round on a fresh database: the race is between the first table creations, and
    // does not show every time.
    for round in 0..5 {
        let Some(mut fx) = Fixture::new(&format!("start{round}")).await else {
            return;
        };
        // With notifications on, each also creates the outbox table; two relays start with them.
        let notifier = Notifier::start().await;
        let url = notifier.url();
        let env = fx.env(&[("CLAIM_IDLE", "1s"), ("NOTIFY_URL", &url)]);
        // All processes first, then the waits: they start in the same instant.
        let mut consumers: Vec<Consumer> = (0..6)
            .map(|n| Consumer::spawn(&env, format!("s{round}-{n}")))
            .chain((0..2).map(|n| {
                Consumer::spawn_example("relay", "relaying to ", &env, format!("r{round}-{n}"))
            }))
            .collect();
        for consumer in &mut consumers {
            consumer.ready().await;
        }

        // 200 distinct ids over 20 accounts, the first 40 published twice.
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        let mut last = String::new();
        for i in 0..240i64 {
            let n = i % 200;
            let account = format!("acct-{}", n % 20);
            if i < 200 {
                *expected.entry(account.clone()).or_default() += n - 100;
            }
            last = fx.post(&format!("pay-{n}"), &account, n - 100).await;
        }
        fx.wait_drained(&last, Duration::from_secs(60)).await;
        let ids: BTreeSet<String> = (0..200).map(|n| format!("pay-{n}")).collect();
        notifier.wait_for(&ids, Duration::from_secs(60)).await;
        for consumer in &mut consumers {
            consumer.stop().await;
        }
        notifier.assert_once_each(&ids);
        let db = fx.db().await;
        assert_eq!(fx.balances(&db).await, expected);
        assert!(fx.dead_letters().await.is_empty());
        drop(db);
        fx.drop_database().await;
    }
}

/// Publishes `n` good postings numbered from `next` (every fifth twice, as a producer retry),
/// adding them to `expected`.
async fn publish_goods(
    fx: &mut Fixture,
    expected: &mut BTreeMap<String, i64>,
    next: &mut i64,
    n: i64,
) {
    for _ in 0..n {
        let account = format!("acct-{}", *next % 6);
        let amount = *next * 13 - 300;
        fx.post(&format!("good-{next}"), &account, amount).await;
        if *next % 5 == 0 {
            fx.post(&format!("good-{next}"), &account, amount).await;
        }
        *expected.entry(account).or_default() += amount;
        *next += 1;
    }
}

/// Regression: entries PostgreSQL rejects for their data were delivered again forever, and a
/// malformed entry with thousands of fields could not be dead-lettered (the dead-letter script
/// failed), so it was too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_entries_are_dead_lettered_and_the_entries_around_them_applied_once() {
    let Some(mut fx) = Fixture::new("poison").await else {
        return;
    };
    const MAX_DELIVERIES: u64 = 3;
    let env = fx.env(&[("CLAIM_IDLE", "1s"), ("MAX_DELIVERIES", "3")]);
    let mut consumer = Consumer::start(&env, "p-0").await;
    let db = fx.db().await;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();

    // An account at the top of `bigint`, first, so that adding to it overflows.
    let last = fx.post("max-1", "big", i64::MAX).await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    expected.insert("big".into(), i64::MAX);

    // A rule of the deployment's own, which PostgreSQL enforces.
    sqlx::query("ALTER TABLE accounts ADD CONSTRAINT no_overdraft CHECK (balance >= -1000000)")
        .execute(&db)
        .await
        .unwrap();

    let mut next = 0;
    // Malformed, or an id reused for another posting: dead-lettered at their first delivery.
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let mut wide_fields: Vec<(String, String)> = vec![
        ("id".into(), "wide-1".into()),
        ("account".into(), "acct-0".into()),
        ("amount".into(), "1".into()),
    ];
    wide_fields.extend((0..5000).map(|i| (format!("f{i}"), format!("v{i}"))));
    let wide_refs: Vec<(&str, &[u8])> = wide_fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_bytes()))
        .collect();
    let wide = fx.publish(&wide_refs).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let twice = fx
        .publish(&[
            ("id", b"twice-1"),
            ("account", b"acct-1"),
            ("amount", b"1"),
            ("amount", b"2"),
        ])
        .await;
    let reused = fx.post("max-1", "big", 5).await;

    // Rejected by PostgreSQL: dead-lettered at their MAX_DELIVERIES-th delivery.
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let overflow = fx.post("over-1", "big", 1).await;
    let overdraft = fx.post("overdraft-1", "acct-new", -2_000_000).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    // Random letters barely compress: too long for a B-tree index entry (SQLSTATE 54000).
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let long_account: String = (0..20_000)
        .map(|_| char::from(b'a' + rng.below(26) as u8))
        .collect();
    let long = fx.post("long-1", &long_account, 1).await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;
    let nul = fx
        .publish(&[
            ("id", b"nul-1"),
            ("account", b"acct\0nul"),
            ("amount", b"5"),
        ])
        .await;
    publish_goods(&mut fx, &mut expected, &mut next, 10).await;

    // A new process for each delivery of `nul` but its last: the delivery count that bounds
    // the attempts is Redis's, and survives restarts.
    for restart in 1..MAX_DELIVERIES {
        consumer
            .wait_for_log(
                &format!("entry {nul} left pending"),
                Duration::from_secs(30),
            )
            .await;
        consumer.kill().await;
        consumer = Consumer::start(&env, format!("p-{restart}")).await;
    }
    let last = fx.post("good-last", "acct-0", 1).await;
    *expected.entry("acct-0".into()).or_default() += 1;
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    consumer.stop().await;

    assert_eq!(
        fx.balances(&db).await,
        expected,
        "every good entry applied once"
    );

    let dead = fx.dead_letters().await;
    let by_entry: BTreeMap<String, &DeadLetter> =
        dead.iter().map(|d| (d.field("entry"), d)).collect();
    assert_eq!(by_entry.len(), dead.len(), "each entry dead-lettered once");
    assert_eq!(
        by_entry.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            wide.clone(),
            twice.clone(),
            reused.clone(),
            overflow.clone(),
            overdraft.clone(),
            long.clone(),
            nul.clone()
        ])
    );
    let assert_dead_letter = |entry: &str, deliveries: u64, reason: &str| {
        let letter = by_entry[entry];
        assert_eq!(
            letter.field("deliveries"),
            deliveries.to_string(),
            "{entry}"
        );
        assert!(
            letter.field("reason").contains(reason),
            "{entry}: {:?} should contain {reason:?}",
            letter.field("reason")
        );
    };
    assert_dead_letter(&wide, 1, "the entry has 5003 fields, more than 64");
    assert_dead_letter(&twice, 1, "field `amount` is repeated");
    assert_dead_letter(
        &reused,
        1,
        "fingerprint mismatch: the key was already used for a message with other content",
    );
    assert_dead_letter(&overflow, MAX_DELIVERIES, "(SQLSTATE 22003)");
    assert_dead_letter(&overdraft, MAX_DELIVERIES, "(SQLSTATE 23514)");
    assert_dead_letter(&long, MAX_DELIVERIES, "(SQLSTATE 54000)");
    assert_dead_letter(&nul, MAX_DELIVERIES, "(SQLSTATE 22021)");

    // The dead letter carries the original fields, bytes as published; at most 64 of them.
    let copied =
        |entry: &str| -> Vec<(String, Vec<u8>)> { by_entry[entry].original_fields().to_vec() };
    let nul_fields: Vec<(String, Vec<u8>)> = vec![
        ("id".into(), b"nul-1".to_vec()),
        ("account".into(), b"acct\0nul".to_vec()),
        ("amount".into(), b"5".to_vec()),
    ];
    assert_eq!(copied(&nul), nul_fields);
    let wide_first: Vec<(String, Vec<u8>)> = wide_fields
        .iter()
        .take(64)
        .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
        .collect();
    assert_eq!(copied(&wide), wide_first);

    drop(db);
    fx.drop_database().await;
}

/// Regression: `XAUTOCLAIM` always started from `0-0`, so when the first page of the pending
/// list kept failing, the entries after it were never claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_list_longer_than_a_claim_page_is_processed_to_its_tail() {
    let Some(mut fx) = Fixture::new("tail").await else {
        return;
    };
    // The head: 70 entries (more than one 64-entry page) on an account whose row the test
    // keeps locked, so each of them fails with a lock timeout.
    let db = fx.db().await;
    sqlx::query(ACCOUNTS_TABLE).execute(&db).await.unwrap();
    sqlx::query("INSERT INTO accounts VALUES ('held', 0)")
        .execute(&db)
        .await
        .unwrap();
    let mut holder = db.begin().await.unwrap();
    sqlx::query("SELECT balance FROM accounts WHERE account = 'held' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut held_total = 0;
    for i in 0..70 {
        fx.post(&format!("held-{i}"), "held", i + 1).await;
        held_total += i + 1;
    }
    // The tail: 300 entries on other accounts.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut last = String::new();
    for i in 0..300i64 {
        let account = format!("acct-{}", i % 10);
        last = fx.post(&format!("tail-{i}"), &account, i).await;
        *expected.entry(account).or_default() += i;
    }
    fx.deliver_to_dead_consumer("gone").await;

    let env = fx.env(&[("CLAIM_IDLE", "1s"), ("LOCK_TIMEOUT", "30ms")]);
    let mut consumer = Consumer::start(&env, "t-0").await;

    // The whole tail is applied while the head still fails.
    let deadline = Deadline::after(
        Duration::from_secs(60),
        "the tail of the pending list was never processed",
    );
    loop {
        let mut balances = fx.balances(&db).await;
        assert_eq!(balances.remove("held"), Some(0));
        if balances == expected {
            break;
        }
        deadline.tick().await;
    }
    assert!(fx.dead_letters().await.is_empty());

    holder.rollback().await.unwrap();
    fx.wait_drained(&last, Duration::from_secs(60)).await;
    consumer.stop().await;
    expected.insert("held".into(), held_total);
    assert_eq!(fx.balances(&db).await, expected);
    assert!(fx.dead_letters().await.is_empty());
    drop(db);
    fx.drop_database().await;
}

// Regression: an entry whose idempotency record could not be decoded (`Error::CorruptRecord`)
// counted as a transient failure: it was left pending and delivered again forever, every
// delivery meeting the same record. Now it is dead-lettered at once with that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_whose_record_cannot_be_decoded_is_dead_lettered_once() {
    let Some(mut fx) = Fixture::new("corrupt").await else {
        return;
    };
    let env = fx.env(&[("CLAIM_IDLE", "1s")]);
    let mut consumer = Consumer::start(&env, "corrupt-0").await;
    let db = fx.db().await;
    let first = fx.post("pay-1", "acct-1", 100).await;
    fx.wait_drained(&first, Duration::from_secs(30)).await;
    // Its record, the only one so far, damaged in the table.
    let damaged = sqlx::query("UPDATE idempotent_records SET payload = '\\xdeadbeef'::bytea")
        .execute(&db)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(damaged, 1);
    // The same posting again (a producer retry), then others.
    let replay = fx.post("pay-1", "acct-1", 100).await;
    fx.post("pay-2", "acct-2", 7).await;
    fx.post("pay-3", "acct-1", 5).await;
    let last = fx.post("pay-4", "acct-2", -2).await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    consumer.stop().await;

    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1, "dead-lettered once");
    assert_eq!(dead[0].field("entry"), replay);
    assert_eq!(dead[0].field("deliveries"), "1");
    let reason = dead[0].field("reason");
    assert!(
        reason.contains("cannot be decoded") && reason.contains("corrupt_record"),
        "{reason}"
    );
    assert_eq!(
        fx.balances(&db).await,
        BTreeMap::from([("acct-1".to_owned(), 105), ("acct-2".to_owned(), 5)]),
        "pay-1 applied once, the others after it applied"
    );
    drop(db);
    fx.drop_database().await;
}
