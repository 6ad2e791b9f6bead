//! The `ledger` consumer against database faults and bad settings, with real Redis,
//! PostgreSQL and processes (fixture: `support::ledger_stream`):
//!
//! - A row locked by a hung transaction costs one entry a lock or statement timeout, not the
//!   consumer its progress; the entry is applied once the lock is released. Those failures, a
//!   lost connection, a serialization failure and a deadlock are transient: retried past
//!   `MAX_DELIVERIES`, never dead-lettered.
//! - An idempotency record the store reports as corrupt dead-letters the entry at once.
//! - Bad settings make the consumer exit with status 2.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgPool;
use support::ledger::{Consumer, Deadline};
use support::ledger_stream::Fixture;
use tokio::process::Command;

/// What ends the consumer's wait for the row the test holds, short of releasing it.
#[derive(Clone, Copy, PartialEq)]
enum Unblock {
    /// The consumer's own `LOCK_TIMEOUT` or `STATEMENT_TIMEOUT`.
    Timeout,
    /// The test terminates the waiting backend: the consumer loses its connection.
    TerminateBackend,
    /// The consumer's transactions run under `REPEATABLE READ`, and the test commits its
    /// update of the row while the consumer waits: a serialization failure.
    ConcurrentUpdate,
    /// The test waits for a lock the consumer's transaction holds: a deadlock, and
    /// PostgreSQL picks the consumer's transaction to abort.
    Deadlock,
}

/// The test's transaction on the `held` account's row. The row stays locked from `new` to
/// `release`: whatever ends the consumer's waits, no attempt of the blocked entry can succeed
/// before the release.
struct Holder {
    db: PgPool,
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
    unblock: Unblock,
}

impl Holder {
    async fn new(db: &PgPool, unblock: Unblock) -> Holder {
        let tx = Holder::lock(db.clone()).await;
        Holder {
            db: db.clone(),
            tx: Some(tx),
            unblock,
        }
    }

    /// A transaction that has locked the row (waiting for it if need be), and updated it: a
    /// transaction under `REPEATABLE READ` that then writes the row fails to serialize.
    async fn lock(db: PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = db.begin().await.unwrap();
        // Whatever the database's default: it waits for the previous holder and then
        // updates the row, where `REPEATABLE READ` would fail.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *tx)
            .await
            .unwrap();
        // So that in a deadlock, the consumer's transaction is the one PostgreSQL aborts.
        sqlx::query("SET LOCAL deadlock_timeout = '30s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("UPDATE accounts SET balance = balance WHERE account = 'held'")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    }

    /// How many sessions wait for a lock.
    async fn waiting(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&self.db)
        .await
        .unwrap()
    }

    /// Ends the consumer's current wait, if the test's part is to end it.
    async fn disturb(&mut self) {
        match self.unblock {
            Unblock::Timeout => {}
            Unblock::TerminateBackend => {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .execute(&self.db)
                .await
                .unwrap();
            }
            Unblock::ConcurrentUpdate => {
                if self.waiting().await == 0 {
                    return;
                }
                // The next holder queues for the row behind the consumer before this one
                // commits, so the row is never free; the consumer's transaction, whose
                // snapshot predates the commit, fails to serialize.
                let next = tokio::spawn(Holder::lock(self.db.clone()));
                let deadline = Deadline::after(Duration::from_secs(10), "the next holder waits");
                while self.waiting().await < 2 {
                    deadline.tick().await;
                }
                self.tx.take().unwrap().commit().await.unwrap();
                self.tx = Some(next.await.unwrap());
            }
            Unblock::Deadlock => {
                if self.waiting().await == 0 {
                    return;
                }
                // The consumer's transaction wrote the idempotency table and waits for our
                // row; this waits for the consumer's transaction. Under a savepoint, so that
                // the table lock goes and the row lock stays.
                let tx = self.tx.as_mut().unwrap();
                for statement in [
                    "SAVEPOINT deadlock",
                    "SET LOCAL lock_timeout = '20s'",
                    "LOCK TABLE idempotent_records IN SHARE MODE",
                    "ROLLBACK TO SAVEPOINT deadlock",
                ] {
                    sqlx::query(statement).execute(&mut **tx).await.unwrap();
                }
            }
        }
    }

    async fn release(mut self) {
        self.tx.take().unwrap().rollback().await.unwrap();
    }
}

/// Holds the lock on one account's row from an open transaction while the consumer runs with
/// `settings`, and ends each of the consumer's waits by `unblock`: the consumer keeps applying
/// the other entries, delivers the blocked one again and again (more often than
/// `MAX_DELIVERIES`: the failure, `sqlstate`, is not the entry's fault), and applies it once
/// the lock is released.
async fn blocked_entry(
    name: &str,
    settings: &[(&'static str, &str)],
    unblock: Unblock,
    sqlstate: &str,
) {
    let Some(mut fx) = Fixture::new(name).await else {
        return;
    };
    // For the consumer's sessions.
    let database_setting = match unblock {
        Unblock::ConcurrentUpdate => Some("default_transaction_isolation = 'repeatable read'"),
        // PostgreSQL looks for a deadlock once, this long after a session begins to wait: the
        // test must close the cycle before the consumer's session looks.
        Unblock::Deadlock => Some("deadlock_timeout = '2s'"),
        Unblock::Timeout | Unblock::TerminateBackend => None,
    };
    if let Some(setting) = database_setting {
        sqlx::query(&format!("ALTER DATABASE {} SET {setting}", fx.db.name))
            .execute(&fx.db.admin)
            .await
            .unwrap();
    }
    let mut env_settings = vec![("CLAIM_IDLE", "1s"), ("MAX_DELIVERIES", "2")];
    env_settings.extend_from_slice(settings);
    let env = fx.env(&env_settings);
    let mut consumer = Consumer::start(&env, format!("{name}-0")).await;

    // The consumer has created the table.
    let db = fx.db().await;
    sqlx::query("INSERT INTO accounts VALUES ('held', 0)")
        .execute(&db)
        .await
        .unwrap();
    let mut holder = Holder::new(&db, unblock).await;

    let blocked = fx.post("held-1", "held", 7).await;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut last = String::new();
    for i in 0..20i64 {
        let account = format!("acct-{}", i % 4);
        last = fx.post(&format!("other-{i}"), &account, i + 1).await;
        *expected.entry(account).or_default() += i + 1;
    }

    let deadline = Deadline::after(
        Duration::from_secs(30),
        "the entries after the blocked one were not applied",
    );
    loop {
        holder.disturb().await;
        let mut balances = fx.balances(&db).await;
        assert_eq!(balances.remove("held"), Some(0));
        if balances == expected {
            break;
        }
        deadline.tick().await;
    }
    let deadline = Deadline::after(
        Duration::from_secs(30),
        "the blocked entry was not delivered again",
    );
    while fx.deliveries(&blocked).await.unwrap_or(0) < 3 {
        holder.disturb().await;
        deadline.tick().await;
    }
    let log = consumer.log();
    assert!(
        log.contains(&format!("entry {blocked} left pending"))
            && log.contains(&format!("(SQLSTATE {sqlstate})")),
        "{log}"
    );
    assert!(fx.dead_letters().await.is_empty());

    holder.release().await;
    fx.wait_drained(&last, Duration::from_secs(30)).await;
    consumer.stop().await;
    expected.insert("held".into(), 7);
    assert_eq!(fx.balances(&db).await, expected);
    assert!(fx.dead_letters().await.is_empty());
    drop(db);
    fx.drop_database().await;
}

/// Regression: a transaction blocked on a row lock held by a hung transaction stalled the
/// consumer for as long as the lock was held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_timeout_keeps_a_hung_transaction_from_stalling_the_consumer() {
    let settings = [("LOCK_TIMEOUT", "200ms")];
    blocked_entry("lock", &settings, Unblock::Timeout, "55P03").await;
}

/// The same with only `STATEMENT_TIMEOUT` short enough to end the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_keeps_a_hung_transaction_from_stalling_the_consumer() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "300ms")];
    blocked_entry("statement", &settings, Unblock::Timeout, "57014").await;
}

/// A connection lost mid-transaction is transient: retried without bound, then applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("lost", &settings, Unblock::TerminateBackend, "57P01").await;
}

/// A serialization failure is transient: retried without bound, then applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("serial", &settings, Unblock::ConcurrentUpdate, "40001").await;
}

/// A deadlock is transient: retried without bound, then applied. Each attempt waits two
/// seconds for the deadlock to be found, longer than `CLAIM_IDLE / 2`: entries published after
/// the blocked one are still read between the sweeps that deliver it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_is_retried_without_bound() {
    let settings = [("LOCK_TIMEOUT", "1h"), ("STATEMENT_TIMEOUT", "1h")];
    blocked_entry("deadlock", &settings, Unblock::Deadlock, "40P01").await;
}

/// Bad settings are refused before anything is touched: exit status 2, the variable named.
#[tokio::test]
async fn bad_settings_exit_with_status_2_naming_the_variable() {
    for (name, value) in [
        ("MAX_DELIVERIES", "0"),
        ("MAX_DELIVERIES", "three"),
        ("LOCK_TIMEOUT", "25d"),
        ("STATEMENT_TIMEOUT", "0s"),
        ("CLAIM_IDLE", "soon"),
        ("RELAY", "yes"),
        ("NOTIFY_URL", "https://notifier.example/notify"),
        ("NOTIFY_URL", "not a url"),
        ("RELAY_MAX_ATTEMPTS", "0"),
        ("RELAY_BACKOFF", "fast"),
        ("RELAY_POLL", "0ms"),
    ] {
        for example in ["ledger", "relay"] {
            if example == "relay"
                && matches!(
                    name,
                    "MAX_DELIVERIES"
                        | "LOCK_TIMEOUT"
                        | "STATEMENT_TIMEOUT"
                        | "CLAIM_IDLE"
                        | "RELAY"
                )
            {
                continue;
            }
            let mut command = Command::new(support::example_binary(example));
            if name.starts_with("RELAY_") {
                command.env("NOTIFY_URL", "http://127.0.0.1:9/notify");
            }
            let stderr = support::refused_at_start(
                command.env(name, value),
                &format!("{example}: {name}={value}"),
            )
            .await
            .stderr;
            assert!(
                stderr.contains(&format!("{name}=")),
                "{example}: {name}={value}: {stderr}"
            );
        }
    }
    // The relay has nothing to do without NOTIFY_URL.
    let stderr = support::refused_at_start(
        Command::new(support::example_binary("relay")).env_remove("NOTIFY_URL"),
        "relay without NOTIFY_URL",
    )
    .await
    .stderr;
    assert!(stderr.contains("NOTIFY_URL"), "{stderr}");
}

/// An idempotency record the store reports as corrupt (its `state` damaged by SQL: the store
/// never takes it for absent, so every delivery meets it again) is the message's problem, not
/// a passing one: the entry is dead-lettered at its first delivery with the store's reason,
/// never applied again, never left pending. It used to be sorted as transient and stay
/// pending for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_meeting_a_corrupt_record_is_dead_lettered_at_its_first_delivery() {
    let Some(mut fx) = Fixture::new("corrupt").await else {
        return;
    };
    let env = fx.env(&[("CLAIM_IDLE", "1s"), ("MAX_DELIVERIES", "3")]);
    let mut consumer = Consumer::start(&env, "c-0").await;
    let db = fx.db().await;
    let first = fx.post("pay-1", "alice", 250).await;
    fx.wait_drained(&first, Duration::from_secs(30)).await;
    let damaged = sqlx::query("UPDATE idempotent_records SET state = 'x'")
        .execute(&db)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(damaged, 1, "pay-1's record");

    let again = fx.post("pay-1", "alice", 250).await;
    fx.wait_drained(&again, Duration::from_secs(30)).await;
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1, "the resent entry, dead-lettered");
    assert_eq!(dead[0].field("entry"), again);
    assert_eq!(dead[0].field("deliveries"), "1");
    let reason = dead[0].field("reason");
    assert!(reason.contains("corrupt_record"), "{reason}");
    let balances = fx.balances(&db).await;
    assert_eq!(balances, BTreeMap::from([("alice".to_owned(), 250)]));
    consumer.stop().await;
}
