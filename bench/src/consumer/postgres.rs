//! The PostgreSQL side of the `-pg` rows: the accounts table the postings add up in, its
//! `INSERT`, and the store of the runtime's records in a table of the benchmark's own.

use idempotent_postgres::PostgresStore;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::postings::Posting;

const ACCOUNTS_TABLE: &str = "consumer_bench_accounts";
const RECORDS_TABLE: &str = "consumer_bench_idempotency";

/// The effect of one posting: its amount added to its account's balance.
pub(crate) const INSERT: &str = "INSERT INTO consumer_bench_accounts (account, balance) VALUES ($1, $2) \
     ON CONFLICT (account) DO UPDATE SET balance = consumer_bench_accounts.balance + EXCLUDED.balance \
     RETURNING balance";

/// The pool, and the store over the benchmark's own table.
#[derive(Clone)]
pub(crate) struct Postgres {
    pub(crate) pool: PgPool,
    pub(crate) store: PostgresStore,
}

impl Postgres {
    /// Connects with room for `concurrency` handlers, and creates both tables if need be.
    pub(crate) async fn connect(url: &str, concurrency: usize) -> Postgres {
        let pool = PgPoolOptions::new()
            .max_connections(concurrency as u32 + 4)
            .connect(url)
            .await
            .expect("connect to PostgreSQL");
        let store = PostgresStore::builder(pool.clone())
            .table(RECORDS_TABLE)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {ACCOUNTS_TABLE} (account text PRIMARY KEY, balance bigint NOT NULL)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        Postgres { pool, store }
    }

    /// Empties both tables, before a row.
    pub(crate) async fn clear(&self) {
        sqlx::query(&format!("TRUNCATE {ACCOUNTS_TABLE}, {RECORDS_TABLE}"))
            .execute(&self.pool)
            .await
            .unwrap();
    }

    /// The accounts, and what their balances add up to.
    pub(crate) async fn balances(&self) -> (i64, i64) {
        sqlx::query_as(&format!(
            "SELECT count(*), coalesce(sum(balance), 0)::bigint FROM {ACCOUNTS_TABLE}"
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

/// `BEGIN; INSERT …; COMMIT`: the effect without the runtime (the `bare-pg` rows).
pub(crate) async fn apply(pool: &PgPool, posting: &Posting) {
    let mut tx = pool.begin().await.unwrap();
    let _: i64 = sqlx::query_scalar(INSERT)
        .bind(&posting.account)
        .bind(posting.amount)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}
