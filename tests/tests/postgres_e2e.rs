//! The PostgreSQL store end to end, against real servers (the one `scripts/test.sh` starts, and
//! private ones for restarts): two payments servers sharing one database, the transactional
//! mode under a real SIGKILL and under concurrent duplicates, `#[idempotent(tx = ...)]`, and a
//! database restart under a running app.

mod support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use idempotent_core::{Call, ClaimHandle, Error, Key, Scope, idempotent};
use idempotent_postgres::{PostgresStore, Transactional};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::{PrivatePostgres, pool};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};
use support::{Client, Protocol, Server, example_binary};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const PAYMENT: &str = r#"{"amount":1999,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_payments_servers_sharing_one_database_run_40_duplicates_once() {
    let Some(url) = postgres_url() else {
        return;
    };
    let env = [("IDEMPOTENCY_STORE", url.as_str())];
    let servers = Arc::new([Server::payments(&env).await, Server::payments(&env).await]);
    let key = unique("pay");
    let client = Client::new(Protocol::Http1);
    let start = Arc::new(tokio::sync::Barrier::new(40));
    let requests: Vec<_> = (0..40)
        .map(|i| {
            let (servers, start, client, key) = (
                Arc::clone(&servers),
                Arc::clone(&start),
                client.clone(),
                key.clone(),
            );
            tokio::spawn(async move {
                // The first execution takes 500 ms, so the duplicates arrive while it runs.
                let url = servers[i % 2].url("/payments?delay_ms=500");
                start.wait().await;
                client.post(&url, Some(&key), Some("alice"), PAYMENT).await
            })
        })
        .collect();
    let mut fresh = Vec::new();
    let mut replayed = Vec::new();
    let mut in_flight = 0;
    for request in requests {
        let answer = request.await.unwrap();
        match answer.status {
            StatusCode::CREATED if answer.replayed() => replayed.push(answer.body),
            StatusCode::CREATED => fresh.push(answer.body),
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem_code(), "in_flight");
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
    }
    assert_eq!(fresh.len(), 1, "exactly one request executes");
    assert!(in_flight > 0, "no duplicate overlapped the first request");
    assert!(replayed.iter().all(|body| *body == fresh[0]));
    let executions = client.count(&servers[0]).await + client.count(&servers[1]).await;
    assert_eq!(executions, 1, "executions across both servers");

    // Once completed, both servers replay it (the same request: the query is in the
    // fingerprint).
    for server in servers.iter() {
        let url = server.url("/payments?delay_ms=500");
        let retry = client.post(&url, Some(&key), Some("alice"), PAYMENT).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed());
        assert_eq!(retry.body, fresh[0]);
    }
    let executions = client.count(&servers[0]).await + client.count(&servers[1]).await;
    assert_eq!(executions, 1);
}

/// A database with an `accounts` table holding one fresh account, and a fresh records table,
/// for the `pg_effect` example.
struct Bank {
    url: String,
    pool: PgPool,
    account: String,
    table: String,
}

impl Bank {
    async fn open() -> Option<Bank> {
        let url = postgres_url()?;
        let pool = pool(&url, 24).await;
        // Tests open banks concurrently: `CREATE TABLE IF NOT EXISTS` alone races on a fresh
        // database, so creation is serialised by an advisory lock.
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('tests bank accounts', 0))")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let account = unique("acct");
        sqlx::query("INSERT INTO accounts VALUES ($1, 0)")
            .bind(&account)
            .execute(&pool)
            .await
            .unwrap();
        let table = unique("records");
        let store = PostgresStore::builder(pool.clone())
            .table(&table)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        Some(Bank {
            url,
            pool,
            account,
            table,
        })
    }

    fn pg_effect(&self, key: &str, env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(example_binary("pg_effect"));
        command
            .arg(key)
            .env("DATABASE_URL", &self.url)
            .env("ACCOUNT", &self.account)
            .env("IDEMPOTENCY_TABLE", &self.table)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        command
    }

    /// Runs `pg_effect` to completion; its stdout lines.
    async fn run_pg_effect(&self, key: &str, env: &[(&str, &str)]) -> Vec<String> {
        let output =
            tokio::time::timeout(Duration::from_secs(60), self.pg_effect(key, env).output())
                .await
                .expect("pg_effect did not finish within 60 s")
                .expect("run pg_effect");
        assert!(output.status.success(), "pg_effect failed: {output:?}");
        String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    async fn balance(&self) -> i64 {
        sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
            .bind(&self.account)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Committed rows in the records table, by state.
    async fn records(&self) -> Vec<String> {
        sqlx::query_scalar(&format!("SELECT state FROM \"{}\"", self.table))
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_the_effect_and_the_commit_leaves_neither_and_the_retry_applies_once() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let key = unique("deposit");
    let mut child = bank
        .pg_effect(&key, &[("PG_EFFECT_PAUSE", "1")])
        .spawn()
        .expect("start pg_effect");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let marker = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("pg_effect did not reach its effect within 60 s")
        .unwrap();
    assert_eq!(marker.as_deref(), Some("effect applied"));
    // The UPDATE ran in the child's open transaction; kill it before it commits.
    child.kill().await.expect("SIGKILL pg_effect");
    let status = child.wait().await.unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{status:?}"
    );

    assert_eq!(
        bank.balance().await,
        0,
        "the uncommitted deposit is visible"
    );
    assert!(
        bank.records().await.is_empty(),
        "a record survived the crash"
    );

    // The retry waits for the dead transaction's locks to go, then applies the deposit once.
    let retry = bank.run_pg_effect(&key, &[]).await;
    assert_eq!(retry, ["effect applied", "balance 100"]);
    assert_eq!(bank.balance().await, 100);
    assert_eq!(bank.records().await, ["completed"]);

    // Another retry replays: the body does not run, the balance stays.
    let replay = bank.run_pg_effect(&key, &[]).await;
    assert_eq!(replay, ["balance 100"]);
    assert_eq!(bank.balance().await, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_duplicate_processes_in_transactional_mode_deposit_once() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let key = unique("deposit");
    // The process that wins holds its transaction 500 ms after the effect, so the others
    // arrive while it is open and wait on the row.
    let children: Vec<_> = (0..20)
        .map(|_| {
            bank.pg_effect(&key, &[("PG_EFFECT_HOLD_MS", "500")])
                .spawn()
                .expect("start pg_effect")
        })
        .collect();
    let mut applied = 0;
    for child in children {
        let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("pg_effect did not finish within 60 s")
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(stdout.ends_with("balance 100\n"), "{stdout:?}");
        applied += stdout.matches("effect applied").count();
    }
    assert_eq!(applied, 1, "the deposit ran in exactly one process");
    assert_eq!(bank.balance().await, 100);
    assert_eq!(bank.records().await, ["completed"]);
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Refused {
    Declined,
    Idempotency(String),
}

impl From<Error> for Refused {
    fn from(error: Error) -> Self {
        Refused::Idempotency(error.code().as_str().into())
    }
}

struct Accounts {
    transactional: Transactional,
    account: String,
}

impl Accounts {
    async fn credit(&self, tx: &mut Transaction<'_, Postgres>, cents: i64) -> i64 {
        sqlx::query_scalar(
            "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
        )
        .bind(&self.account)
        .bind(cents)
        .fetch_one(&mut **tx)
        .await
        .unwrap()
    }

    /// Credits, then fails when `decline`: an `Err` undoes the credit and frees the key.
    #[idempotent(key = key, tx = tx, runtime = &self.transactional)]
    async fn deposit(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &str,
        decline: bool,
    ) -> Result<i64, Refused> {
        let balance = self.credit(tx, 100).await;
        if decline {
            return Err(Refused::Declined);
        }
        Ok(balance)
    }

    /// What `claim = claim` binds in transactional mode: the claim of this call, held by the
    /// open transaction, also current for code the body calls.
    #[idempotent(key = key, tx = tx, runtime = &self.transactional, name = "accounts::stamp", claim = claim)]
    async fn stamp(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &str,
    ) -> Result<(u64, String, bool), Refused> {
        let _ = &tx;
        claim.check().await.map_err(|_| Refused::Declined)?;
        let current = ClaimHandle::current().map(|c| c.token()) == Some(claim.token());
        Ok((
            claim.token().get(),
            claim.operation_key().as_str().to_owned(),
            current && !claim.is_lost(),
        ))
    }

    /// Credits, then fails when `decline`; the `Err` is recorded like an `Ok`, with the credit.
    #[idempotent(key = key, tx = tx, runtime = &self.transactional, on_error = "store")]
    async fn fee(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &str,
        decline: bool,
    ) -> Result<i64, Refused> {
        let balance = self.credit(tx, -1).await;
        if decline {
            return Err(Refused::Declined);
        }
        Ok(balance)
    }
}

#[tokio::test]
async fn the_attribute_in_transactional_mode_binds_the_claim() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let store = PostgresStore::builder(bank.pool.clone())
        .table(&bank.table)
        .build()
        .unwrap();
    let accounts = Accounts {
        transactional: idempotent_postgres::Transactional::new(&store).namespace("attribute-claim"),
        account: bank.account.clone(),
    };
    let key = unique("k");
    let call =
        Call::new(Key::new(key.as_str()).unwrap()).scope(Scope::new().operation("accounts::stamp"));
    let storage_key = accounts.transactional.storage_key(&call);
    let mut tx = bank.pool.begin().await.unwrap();
    let (token, operation_key, current) = accounts.stamp(&mut tx, &key).await.unwrap();
    tx.commit().await.unwrap();
    assert!(token > 0);
    // The first claim of the key begins the record's lifetime.
    let expected = storage_key.operation_key(idempotent_core::FencingToken::new(token));
    assert_eq!(operation_key, expected.as_str());
    assert!(current, "the bound claim is the current one and held");
    // The replay returns the recorded values without running the body.
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(
        accounts.stamp(&mut tx, &key).await.unwrap(),
        (token, operation_key, true)
    );
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn the_attribute_in_transactional_mode_records_oks_and_undoes_errs() {
    let Some(bank) = Bank::open().await else {
        return;
    };
    let store = PostgresStore::builder(bank.pool.clone())
        .table(&bank.table)
        .build()
        .unwrap();
    let accounts = Accounts {
        transactional: idempotent_postgres::Transactional::new(&store).namespace("attribute"),
        account: bank.account.clone(),
    };
    let key = unique("k");

    // An `Err` undoes the body's writes and releases the key, even if the caller commits.
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(
        accounts.deposit(&mut tx, &key, true).await,
        Err(Refused::Declined)
    );
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 0);

    // An `Ok` commits with its record; retries replay it without running the body.
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(accounts.deposit(&mut tx, &key, false).await, Ok(100));
    tx.commit().await.unwrap();
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(accounts.deposit(&mut tx, &key, true).await, Ok(100));
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 100);

    // Rolled back, the call never happened.
    let other = unique("k");
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(accounts.deposit(&mut tx, &other, false).await, Ok(200));
    tx.rollback().await.unwrap();
    assert_eq!(bank.balance().await, 100);

    // `on_error = "store"`: the `Err` and the body's writes commit together, and replay.
    let fee = unique("fee");
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(
        accounts.fee(&mut tx, &fee, true).await,
        Err(Refused::Declined)
    );
    tx.commit().await.unwrap();
    let mut tx = bank.pool.begin().await.unwrap();
    assert_eq!(
        accounts.fee(&mut tx, &fee, false).await,
        Err(Refused::Declined)
    );
    tx.commit().await.unwrap();
    assert_eq!(bank.balance().await, 99);
    assert_eq!(
        bank.records()
            .await
            .iter()
            .filter(|s| *s == "completed")
            .count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_gives_clean_503s_then_service_resumes_without_an_app_restart() {
    let Some(database) = PrivatePostgres::start().await else {
        return;
    };
    let url = database.url();
    let server = Server::payments(&[("IDEMPOTENCY_STORE", url.as_str())]).await;
    let client = Client::new(Protocol::Http1);
    let payments = server.url("/payments");

    let before = client
        .post(&payments, Some("before-restart"), Some("alice"), PAYMENT)
        .await;
    assert_eq!(before.status, StatusCode::CREATED);

    database.stop().await;
    for key in ["during-1", "during-2", "before-restart"] {
        let answer = client
            .post(&payments, Some(key), Some("alice"), PAYMENT)
            .await;
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{key}: {:?}",
            answer.body
        );
        assert_eq!(answer.problem_code(), "store_unavailable");
        assert!(answer.headers.contains_key("retry-after"));
    }
    assert_eq!(
        client.count(&server).await,
        1,
        "a request ran without its store"
    );

    database.start_again().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let after = loop {
        let answer = client
            .post(&payments, Some("after-restart"), Some("alice"), PAYMENT)
            .await;
        if answer.status != StatusCode::SERVICE_UNAVAILABLE {
            break answer;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still 503 30 s after the database came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(after.status, StatusCode::CREATED, "{:?}", after.body);
    assert!(!after.replayed());

    // Records committed before the restart survived it.
    let replay = client
        .post(&payments, Some("before-restart"), Some("alice"), PAYMENT)
        .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, before.body);
    assert_eq!(client.count(&server).await, 2);
}
