//! The transactional mode of `PostgresStore` against a real PostgreSQL server: the claim, the
//! work and the completed record commit together or not at all, and concurrent duplicates
//! wait on the row and replay.

use std::sync::Arc;
use std::time::Duration;

use idempotent_core::{
    BoxError, Call, CallOptions, Defaults, Error, Fingerprint, Idempotency, InFlightPolicy, Outcome,
};
use idempotent_postgres::{PendingRecord, PostgresStore, Transactional, TransactionalClaim};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::shared_pool;
use sqlx::postgres::{PgConnection, PgPool};

/// A fresh records table and a fresh `accounts` table with one account at balance 0.
struct Bank {
    pool: PgPool,
    store: PostgresStore,
    transactional: Transactional,
    accounts: String,
}

impl Bank {
    async fn open() -> Option<Bank> {
        let pool = shared_pool(24).await?;
        let suffix = unique("t");
        let store = PostgresStore::builder(pool.clone())
            .table(format!("records_{suffix}"))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let accounts = format!("accounts_{suffix}");
        sqlx::query(&format!(
            "CREATE TABLE \"{accounts}\" (id text PRIMARY KEY, balance bigint NOT NULL)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(&format!("INSERT INTO \"{accounts}\" VALUES ('alice', 0)"))
            .execute(&pool)
            .await
            .unwrap();
        let transactional = idempotent_postgres::Transactional::new(&store);
        Some(Bank {
            pool,
            store,
            transactional,
            accounts,
        })
    }

    /// The effect under test: `balance = balance + 100`, returning the new balance.
    async fn deposit(&self, tx: &mut PgConnection) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar(&format!(
            "UPDATE \"{}\" SET balance = balance + 100 WHERE id = 'alice' RETURNING balance",
            self.accounts
        ))
        .fetch_one(tx)
        .await?)
    }

    /// The guarded deposit: claim, effect and record in `tx`; a replay writes nothing.
    async fn deposit_once(
        &self,
        tx: &mut PgConnection,
        key: &str,
    ) -> Result<Outcome<i64>, BoxError> {
        let call = Call::new(key.parse()?);
        self.deposit_with(tx, &self.transactional, &call, Duration::ZERO)
            .await
    }

    /// The guarded deposit for `call` through `transactional`, holding the row for `hold`
    /// after the effect.
    async fn deposit_with(
        &self,
        tx: &mut PgConnection,
        transactional: &Transactional,
        call: &Call,
        hold: Duration,
    ) -> Result<Outcome<i64>, BoxError> {
        match transactional.claim::<i64>(call, tx).await? {
            TransactionalClaim::Replay(balance) => Ok(Outcome::Replayed(balance)),
            TransactionalClaim::Run(pending) => {
                let balance = self.deposit(tx).await?;
                tokio::time::sleep(hold).await;
                pending.complete(tx, &balance).await?;
                Ok(Outcome::Fresh(balance))
            }
        }
    }

    /// Deposits once with `first` and commits, then checks that a retry with `retry` (the
    /// same key) is refused with `ResultNotRetained` and deposits nothing.
    async fn assert_not_retained(&self, transactional: &Transactional, first: &Call, retry: &Call) {
        let before = self.balance().await;
        let mut tx = self.pool.begin().await.unwrap();
        let fresh = self.deposit_with(&mut tx, transactional, first, Duration::ZERO);
        assert!(matches!(fresh.await.unwrap(), Outcome::Fresh(_)));
        tx.commit().await.unwrap();
        let mut tx = self.pool.begin().await.unwrap();
        let refused = transactional.claim::<i64>(retry, &mut tx).await;
        assert!(
            matches!(refused, Err(Error::ResultNotRetained)),
            "{refused:?}"
        );
        tx.rollback().await.unwrap();
        assert_eq!(self.balance().await, before + 100);
    }

    async fn balance(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT balance FROM \"{}\" WHERE id = 'alice'",
            self.accounts
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Committed rows in the records table, and how many of them are live.
    async fn records(&self) -> (i64, i64) {
        sqlx::query_as(&format!(
            "SELECT count(*), count(*) FILTER (WHERE expires_at > clock_timestamp()) FROM \"{}\"",
            self.store.table()
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

/// The pending record of `call`'s claim through `transactional` in `tx`: the claim must run.
async fn claimed(
    transactional: &Transactional,
    call: &Call,
    tx: &mut PgConnection,
) -> PendingRecord {
    match transactional.claim::<i64>(call, tx).await.unwrap() {
        TransactionalClaim::Run(pending) => pending,
        TransactionalClaim::Replay(balance) => panic!("expected to run, replayed {balance}"),
    }
}

#[tokio::test]
async fn commit_keeps_the_effect_and_the_record_and_retries_replay() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut tx = bank.pool.begin().await.unwrap();
    let first = bank.deposit_once(&mut tx, "deposit-1").await.unwrap();
    assert_eq!(first, Outcome::Fresh(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
    assert_eq!(bank.records().await, (1, 1));

    let mut tx = bank.pool.begin().await.unwrap();
    let retry = bank.deposit_once(&mut tx, "deposit-1").await.unwrap();
    assert_eq!(retry, Outcome::Replayed(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn rollback_leaves_neither_the_effect_nor_the_record() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut tx = bank.pool.begin().await.unwrap();
    let first = bank.deposit_once(&mut tx, "deposit-2").await.unwrap();
    assert_eq!(first, Outcome::Fresh(100));
    tx.rollback().await.unwrap();
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await, (0, 0));

    // Dropping the transaction is a rollback too.
    {
        let mut tx = bank.pool.begin().await.unwrap();
        bank.deposit_once(&mut tx, "deposit-2").await.unwrap();
    }
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await, (0, 0));

    let mut tx = bank.pool.begin().await.unwrap();
    let retry = bank.deposit_once(&mut tx, "deposit-2").await.unwrap();
    assert_eq!(retry, Outcome::Fresh(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn release_undoes_the_work_and_frees_the_key_even_if_committed() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &bank.transactional,
        &Call::new("deposit-3".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    pending.release(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        bank.balance().await,
        0,
        "the released work's write committed"
    );
    assert_eq!(bank.records().await.1, 0, "a live record after a release");

    let mut tx = bank.pool.begin().await.unwrap();
    let retry = bank.deposit_once(&mut tx, "deposit-3").await.unwrap();
    assert_eq!(retry, Outcome::Fresh(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn release_after_work_that_aborted_the_transaction_leaves_it_usable() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &bank.transactional,
        &Call::new("deposit-4".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
    assert!(failed.unwrap_err().to_string().contains("division by zero"));
    pending.release(&mut tx).await.unwrap();
    let alive: i32 = sqlx::query_scalar("SELECT 7")
        .fetch_one(&mut *tx)
        .await
        .expect("the transaction is usable after a released call");
    assert_eq!(alive, 7);
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await.1, 0);
}

#[tokio::test]
async fn a_result_that_cannot_be_recorded_is_undone() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &bank.transactional,
        &Call::new("deposit-5".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    // The work left the transaction aborted but reports success: the record cannot be
    // written, so the work is undone and the call fails.
    assert!(sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.is_err());
    let result = pending.complete(&mut tx, &100).await;
    assert!(matches!(result, Err(Error::Store(_))), "{result:?}");
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await.1, 0);
}

#[tokio::test]
async fn replays_check_the_fingerprint() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let call = |amount: u32| {
        Call::new("deposit-6".parse().unwrap())
            .fingerprint(Fingerprint::of(&("alice", amount)).unwrap())
    };
    let transactional = &bank.transactional;
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(transactional, &call(100), &mut tx).await;
    let balance = bank.deposit(&mut tx).await.unwrap();
    pending.complete(&mut tx, &balance).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = bank.pool.begin().await.unwrap();
    match transactional
        .claim::<i64>(&call(100), &mut tx)
        .await
        .unwrap()
    {
        TransactionalClaim::Replay(balance) => assert_eq!(balance, 100),
        TransactionalClaim::Run(_) => panic!("completed key ran again"),
    }
    let mismatch = transactional.claim::<i64>(&call(999), &mut tx).await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch)),
        "{mismatch:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn a_result_too_large_to_retain_is_recorded_without_it() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = idempotent_postgres::Transactional::new(&bank.store)
        .defaults(Defaults::new().max_result_bytes(2));
    let call = Call::new("deposit-11".parse().unwrap());
    bank.assert_not_retained(&transactional, &call, &call).await;
}

/// The transactional mode takes the same `Call` as the standalone runtime: the call's own
/// `CallOptions` override the mode's `Defaults`, here the largest retained result.
#[tokio::test]
async fn a_calls_options_override_the_transactional_defaults() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let small =
        Call::new("deposit-12".parse().unwrap()).options(CallOptions::new().max_result_bytes(2));
    // The retry without the override still finds the call recorded without its result.
    let plain = Call::new("deposit-12".parse().unwrap());
    bank.assert_not_retained(&bank.transactional, &small, &plain)
        .await;

    // Without the override the mode's default (1 MiB) keeps the same result.
    let call = Call::new("deposit-13".parse().unwrap());
    let mut tx = bank.pool.begin().await.unwrap();
    let fresh = bank.deposit_with(&mut tx, &bank.transactional, &call, Duration::ZERO);
    assert_eq!(fresh.await.unwrap(), Outcome::Fresh(200));
    tx.commit().await.unwrap();
    let mut tx = bank.pool.begin().await.unwrap();
    let replayed = bank.deposit_with(&mut tx, &bank.transactional, &call, Duration::ZERO);
    assert_eq!(replayed.await.unwrap(), Outcome::Replayed(200));
    tx.rollback().await.unwrap();
    assert_eq!(bank.balance().await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_on_the_row_then_replays() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let bank = Arc::new(bank);
    let mut first = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &bank.transactional,
        &Call::new("deposit-7".parse().unwrap()),
        &mut first,
    )
    .await;
    let balance = bank.deposit(&mut first).await.unwrap();

    let duplicate = tokio::spawn({
        let bank = Arc::clone(&bank);
        async move {
            let mut tx = bank.pool.begin().await.unwrap();
            let outcome = bank.deposit_once(&mut tx, "deposit-7").await.unwrap();
            tx.commit().await.unwrap();
            outcome
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate did not wait for the first transaction"
    );
    pending.complete(&mut first, &balance).await.unwrap();
    first.commit().await.unwrap();

    let outcome = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("the duplicate is still blocked after the commit")
        .unwrap();
    assert_eq!(outcome, Outcome::Replayed(100));
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_runs_when_the_first_rolls_back() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let bank = Arc::new(bank);
    let mut first = bank.pool.begin().await.unwrap();
    let _pending = claimed(
        &bank.transactional,
        &Call::new("deposit-8".parse().unwrap()),
        &mut first,
    )
    .await;
    bank.deposit(&mut first).await.unwrap();
    let duplicate = tokio::spawn({
        let bank = Arc::clone(&bank);
        async move {
            let mut tx = bank.pool.begin().await.unwrap();
            let outcome = bank.deposit_once(&mut tx, "deposit-8").await.unwrap();
            tx.commit().await.unwrap();
            outcome
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!duplicate.is_finished());
    first.rollback().await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("the duplicate is still blocked after the rollback")
        .unwrap();
    assert_eq!(outcome, Outcome::Fresh(100));
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_duplicates_apply_the_effect_once() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let bank = Arc::new(bank);
    let start = Arc::new(tokio::sync::Barrier::new(20));
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let (bank, start) = (Arc::clone(&bank), Arc::clone(&start));
            tokio::spawn(async move {
                let mut tx = bank.pool.begin().await.unwrap();
                start.wait().await;
                // The owner holds the row long enough for every duplicate to arrive.
                let call = Call::new("deposit-9".parse().unwrap());
                let outcome = bank
                    .deposit_with(
                        &mut tx,
                        &bank.transactional,
                        &call,
                        Duration::from_millis(100),
                    )
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                outcome
            })
        })
        .collect();
    let mut fresh = 0;
    for call in calls {
        let outcome = call.await.unwrap();
        assert_eq!(*outcome.get(), 100);
        fresh += usize::from(!outcome.is_replayed());
    }
    assert_eq!(fresh, 1);
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn outside_a_transaction_the_claim_is_refused_and_released() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let mut autocommit = bank.pool.acquire().await.unwrap();
    let result = bank
        .transactional
        .claim::<i64>(&Call::new("deposit-10".parse().unwrap()), &mut autocommit)
        .await;
    match result {
        Err(Error::Store(error)) => assert!(
            format!("{error:?}").contains("inside a transaction"),
            "{error:?}"
        ),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(
        bank.records().await.1,
        0,
        "the autocommitted claim was kept"
    );
}

#[tokio::test]
async fn standalone_and_transactional_calls_share_records() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let standalone = Idempotency::builder(bank.store.clone())
        .namespace("bank")
        .build();
    let transactional = idempotent_postgres::Transactional::of(&standalone, &bank.store);
    let fingerprint = Fingerprint::of(&100).unwrap();

    let mut tx = bank.pool.begin().await.unwrap();
    let call = Call::new("shared-1".parse().unwrap()).fingerprint(fingerprint);
    bank.deposit_with(&mut tx, &transactional, &call, Duration::ZERO)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let call = Call::new("shared-1".parse().unwrap()).fingerprint(fingerprint);
    let replayed = standalone.run(&call, async { -1i64 }).await.unwrap();
    assert_eq!(replayed, Outcome::Replayed(100));

    let call = Call::new("shared-2".parse().unwrap()).fingerprint(fingerprint);
    standalone.run(&call, async { 42i64 }).await.unwrap();
    let mut tx = bank.pool.begin().await.unwrap();
    let call = Call::new("shared-2".parse().unwrap()).fingerprint(fingerprint);
    let replayed = bank
        .deposit_with(&mut tx, &transactional, &call, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(replayed, Outcome::Replayed(42));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);

    // Another namespace is another key space.
    let mut tx = bank.pool.begin().await.unwrap();
    let call = Call::new("shared-1".parse().unwrap()).fingerprint(fingerprint);
    let other = bank
        .deposit_with(&mut tx, &bank.transactional, &call, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(other, Outcome::Fresh(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_claim_in_flight_is_rejected_or_waited_for() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    // A standalone call holds the key for 400 ms, then completes with 7.
    let standalone = Idempotency::new(bank.store.clone());
    let holder = tokio::spawn(async move {
        let call = Call::new("held-1".parse().unwrap());
        standalone
            .run(&call, async {
                tokio::time::sleep(Duration::from_millis(400)).await;
                7i64
            })
            .await
            .unwrap()
    });
    while bank.records().await.1 == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut tx = bank.pool.begin().await.unwrap();
    let rejected = bank.deposit_once(&mut tx, "held-1").await;
    let rejected = rejected.unwrap_err().downcast::<Error>().unwrap();
    assert!(
        matches!(*rejected, Error::InFlight { retry_after } if retry_after <= Duration::from_secs(1)),
        "{rejected:?}"
    );

    let call = Call::new("held-1".parse().unwrap()).options(CallOptions::new().in_flight(
        InFlightPolicy::Wait {
            max: Duration::from_secs(5),
        },
    ));
    let waited = bank
        .deposit_with(&mut tx, &bank.transactional, &call, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(waited, Outcome::Replayed(7));
    tx.commit().await.unwrap();
    assert_eq!(holder.await.unwrap(), Outcome::Fresh(7));
    assert_eq!(bank.balance().await, 0);
}

/// The SQLSTATE of the error `statement` gets in `tx`.
async fn sqlstate(tx: &mut PgConnection, statement: &str) -> Option<String> {
    match sqlx::query(statement).execute(tx).await {
        Err(sqlx::Error::Database(error)) => error.code().map(|code| code.into_owned()),
        other => panic!("expected a database error from {statement:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn without_a_savepoint_a_claim_takes_none_and_commits_and_replays_as_usual() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = bank.transactional.clone().without_savepoint();
    let call = Call::new("deposit-ns-1".parse().unwrap());
    // No savepoint after the claim: releasing one fails with 3B001 (no such savepoint).
    let mut tx = bank.pool.begin().await.unwrap();
    let _pending = claimed(&transactional, &call, &mut tx).await;
    let code = sqlstate(&mut tx, "RELEASE SAVEPOINT idempotent_work").await;
    assert_eq!(code.as_deref(), Some("3B001"), "a savepoint was taken");
    tx.rollback().await.unwrap();
    assert_eq!(bank.records().await, (0, 0));

    let mut tx = bank.pool.begin().await.unwrap();
    let first = bank.deposit_with(&mut tx, &transactional, &call, Duration::ZERO);
    assert_eq!(first.await.unwrap(), Outcome::Fresh(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
    assert_eq!(bank.records().await, (1, 1));
    // Replayed by either mode.
    for transactional in [&transactional, &bank.transactional] {
        let mut tx = bank.pool.begin().await.unwrap();
        let retry = bank.deposit_with(&mut tx, transactional, &call, Duration::ZERO);
        assert_eq!(retry.await.unwrap(), Outcome::Replayed(100));
        tx.commit().await.unwrap();
    }
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn without_a_savepoint_a_release_aborts_the_transaction_so_nothing_commits() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = bank.transactional.clone().without_savepoint();
    let call = Call::new("deposit-ns-2".parse().unwrap());
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(&transactional, &call, &mut tx).await;
    bank.deposit(&mut tx).await.unwrap();
    pending.release(&mut tx).await.unwrap();
    // 25P02: the transaction is aborted; its COMMIT rolls back.
    let code = sqlstate(&mut tx, "SELECT 7").await;
    assert_eq!(code.as_deref(), Some("25P02"));
    let _ = tx.commit().await;
    assert_eq!(
        bank.balance().await,
        0,
        "the released work's write committed"
    );
    assert_eq!(bank.records().await, (0, 0), "the released claim committed");

    let mut tx = bank.pool.begin().await.unwrap();
    let retry = bank.deposit_with(&mut tx, &transactional, &call, Duration::ZERO);
    assert_eq!(retry.await.unwrap(), Outcome::Fresh(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test]
async fn without_a_savepoint_a_result_that_cannot_be_recorded_leaves_nothing_to_commit() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = bank.transactional.clone().without_savepoint();
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &transactional,
        &Call::new("deposit-ns-3".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    // A result JSON cannot encode (a map with keys that are not strings), in a transaction
    // that is still healthy: the completion fails and aborts it.
    let unencodable = std::collections::HashMap::from([((1, 2), 3)]);
    let result = pending.complete(&mut tx, &unencodable).await;
    assert!(matches!(result, Err(Error::Payload(_))), "{result:?}");
    let code = sqlstate(&mut tx, "SELECT 7").await;
    assert_eq!(
        code.as_deref(),
        Some("25P02"),
        "the transaction was not aborted"
    );
    let _ = tx.commit().await;
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await, (0, 0));

    // Work that aborted the transaction itself: the completion fails, nothing commits.
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &transactional,
        &Call::new("deposit-ns-3".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    assert!(sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.is_err());
    let result = pending.complete(&mut tx, &100).await;
    assert!(matches!(result, Err(Error::Store(_))), "{result:?}");
    let _ = tx.commit().await;
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await, (0, 0));
}

#[tokio::test]
async fn without_a_savepoint_a_release_in_a_nested_transaction_fails_and_says_to_roll_back() {
    use sqlx::Connection as _;
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = bank.transactional.clone().without_savepoint();
    let mut tx = bank.pool.begin().await.unwrap();
    let pending = claimed(
        &transactional,
        &Call::new("deposit-ns-6".parse().unwrap()),
        &mut tx,
    )
    .await;
    bank.deposit(&mut tx).await.unwrap();
    let mut nested = tx.begin().await.unwrap();
    let result = pending.release(&mut nested).await;
    assert!(
        matches!(&result, Err(Error::Store(error)) if format!("{error:?}").contains("roll back the one it was made in")),
        "{result:?}"
    );
    drop(nested);
    tx.rollback().await.unwrap();
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await, (0, 0));
}

#[tokio::test]
async fn without_a_savepoint_a_connection_sqlx_sees_outside_a_transaction_still_gets_one() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let transactional = bank.transactional.clone().without_savepoint();
    // Autocommit: refused and released, as with the savepoint.
    let mut connection = bank.pool.acquire().await.unwrap();
    let result = transactional
        .claim::<i64>(&Call::new("deposit-ns-4".parse().unwrap()), &mut connection)
        .await;
    assert!(
        matches!(&result, Err(Error::Store(error)) if format!("{error:?}").contains("inside a transaction")),
        "{result:?}"
    );
    assert_eq!(
        bank.records().await.1,
        0,
        "the autocommitted claim was kept"
    );
    // A transaction begun with a plain `BEGIN`: the savepoint is taken, so a release undoes
    // the work alone and the transaction goes on.
    sqlx::query("BEGIN")
        .execute(&mut *connection)
        .await
        .unwrap();
    let pending = claimed(
        &transactional,
        &Call::new("deposit-ns-5".parse().unwrap()),
        &mut connection,
    )
    .await;
    bank.deposit(&mut connection).await.unwrap();
    pending.release(&mut connection).await.unwrap();
    let alive: i32 = sqlx::query_scalar("SELECT 7")
        .fetch_one(&mut *connection)
        .await
        .expect("the transaction is usable after the release");
    assert_eq!(alive, 7);
    sqlx::query("COMMIT")
        .execute(&mut *connection)
        .await
        .unwrap();
    assert_eq!(bank.balance().await, 0);
    assert_eq!(bank.records().await.1, 0);
}
