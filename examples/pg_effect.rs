//! One deposit, exactly once, in PostgreSQL's transactional mode: the `UPDATE` and the
//! idempotency record commit together, or neither does.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@localhost/postgres cargo run --example pg_effect -- deposit-1
//! DATABASE_URL=postgres://postgres@localhost/postgres cargo run --example pg_effect -- deposit-1
//! ```
//!
//! The first run adds 100 to the account and prints `effect applied` and the new balance; the
//! second finds the committed record and prints the same balance without touching the account.
//! Kill a run between the two lines (`PG_EFFECT_PAUSE=1` makes it wait there) and nothing is
//! committed: the next run applies the deposit, once.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `DATABASE_URL` | required | the PostgreSQL database |
//! | `ACCOUNT` | `alice` | the account to credit (created at balance 0 if missing) |
//! | `IDEMPOTENCY_TABLE` | `idempotent_records` | the records table (created if missing) |
//! | `PG_EFFECT_PAUSE` | unset | when set, stop after the `UPDATE`, before the commit, forever |
//! | `PG_EFFECT_HOLD_MS` | `0` | hold the transaction this long after the `UPDATE` |

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use idempotent_core::{Error, idempotent};
use idempotent_postgres::{DEFAULT_TABLE, PostgresStore, Transactional};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Postgres, Transaction};

struct Ledger {
    transactional: Transactional,
    pause: bool,
    hold: Duration,
}

/// Credits `account` with 100 once per `deposit_id`; returns the balance after the deposit.
#[idempotent(
    key = deposit_id,
    tx = tx,
    runtime = &ledger.transactional,
    name = "pg_effect.deposit"
)]
async fn deposit(
    ledger: &Ledger,
    tx: &mut Transaction<'_, Postgres>,
    deposit_id: &str,
    account: &str,
) -> Result<i64, Error> {
    let balance: i64 = sqlx::query_scalar(
        "UPDATE accounts SET balance = balance + 100 WHERE id = $1 RETURNING balance",
    )
    .bind(account)
    .fetch_one(&mut **tx)
    .await
    .map_err(|e| Error::Payload(e.into()))?;
    println!("effect applied");
    let _ = std::io::stdout().flush();
    if ledger.pause {
        // Crash here and the deposit above was never committed.
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(ledger.hold).await;
    Ok(balance)
}

async fn run() -> Result<i64, Box<dyn std::error::Error>> {
    let deposit_id = std::env::args()
        .nth(1)
        .ok_or("usage: pg_effect DEPOSIT_ID")?;
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let account = std::env::var("ACCOUNT").unwrap_or_else(|_| "alice".into());
    let table = std::env::var("IDEMPOTENCY_TABLE").unwrap_or_else(|_| DEFAULT_TABLE.into());
    let hold = match std::env::var("PG_EFFECT_HOLD_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::ZERO,
    };

    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await?;
    let store = PostgresStore::builder(pool.clone()).table(table).build()?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("INSERT INTO accounts VALUES ($1, 0) ON CONFLICT (id) DO NOTHING")
        .bind(&account)
        .execute(&pool)
        .await?;
    let ledger = Ledger {
        transactional: idempotent_postgres::Transactional::new(&store).namespace("pg_effect"),
        pause: std::env::var_os("PG_EFFECT_PAUSE").is_some(),
        hold,
    };

    let mut tx = pool.begin().await?;
    // An error drops `tx`: rolled back, deposit and record alike.
    let balance = deposit(&ledger, &mut tx, &deposit_id, &account).await?;
    tx.commit().await?;
    Ok(balance)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(balance) => {
            println!("balance {balance}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("pg_effect: {error}");
            ExitCode::FAILURE
        }
    }
}
