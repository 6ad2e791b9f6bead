//! The `ledger` example's notification relay on its own: delivers the notifications the
//! consumers enqueued in the transactional outbox to `NOTIFY_URL`, at least once, each with its
//! key as `Idempotency-Key`.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres NOTIFY_URL=http://127.0.0.1:4000/notify \
//!     cargo run --release --example relay
//! ```
//!
//! Any number of relays (these, and those inside the consumers) share the outbox: each takes
//! its batches under row locks (`FOR UPDATE SKIP LOCKED`), so two never deliver one message at
//! the same time, and a relay that dies leaves its messages to the others (5 s after it took
//! them). Each attempt is counted before the notification is sent, so one whose delivery kills
//! its relay (SIGKILL, out of memory) every time is dead-lettered after `RELAY_MAX_ATTEMPTS`
//! such deaths, with a last error starting `relay_crashed`, instead of taking every relay down
//! forever. The notifications of a batch whose relay died are each taken again alone (a batch
//! of one), so only the one that kills its relay is charged for the deaths and dead-lettered:
//! the others are delivered (those the dead relay had sent already are sent again, with the
//! same key). On SIGTERM it finishes the batch in hand and exits 0.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | the ledger's database |
//! | `NOTIFY_URL` | required | where notifications are POSTed |
//! | `RELAY_MAX_ATTEMPTS`, `RELAY_BACKOFF`, `RELAY_POLL` | `10`, `1s`, `1s` | attempts before dead-lettering, the first backoff, the poll interval |
//! | `RELAY_DELIVERY_TIMEOUT` | `30s` | how long one delivery may take; a relay frozen mid-batch holds its messages for twice this plus 5 s, then PostgreSQL ends its transaction and other relays deliver them |
//!
//! A bad value makes it exit with status 2 and a message naming the variable.

mod common;

use std::process::ExitCode;

use idempotent_postgres::outbox::Outbox;
use sqlx::postgres::PgPoolOptions;

#[tokio::main]
async fn main() -> ExitCode {
    let settings = match common::relay::relay_settings() {
        Ok(Some(settings)) => settings,
        Ok(None) => {
            eprintln!("relay: NOTIFY_URL is not set");
            return ExitCode::from(2);
        }
        Err(message) => {
            eprintln!("relay: {message}");
            return ExitCode::from(2);
        }
    };
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let pool = match PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url)
        .await
    {
        Ok(pool) => pool,
        Err(error) => {
            eprintln!("relay: cannot connect to PostgreSQL at {database_url}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outbox = Outbox::new();
    if let Err(error) = outbox.migrate(&pool).await {
        eprintln!("relay: cannot create the outbox table: {error:?}");
        return ExitCode::FAILURE;
    }
    let mut sigterm = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        Ok(sigterm) => sigterm,
        Err(error) => {
            eprintln!("relay: cannot listen for SIGTERM: {error}");
            return ExitCode::FAILURE;
        }
    };
    let relay = common::relay::relay(pool, outbox, &settings);
    println!(
        "relaying to {} as {}",
        settings.notify_url,
        std::process::id()
    );
    relay
        .run(async move {
            sigterm.recv().await;
        })
        .await;
    eprintln!("relay: stopped on SIGTERM");
    ExitCode::SUCCESS
}
