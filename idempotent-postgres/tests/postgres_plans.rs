//! How PostgreSQL's planner reaches the rows of `PostgresStore`'s table: the statements of one
//! key through the primary key, whatever the statistics say of the states. Against a real
//! PostgreSQL server (started by `scripts/test.sh`).

use idempotent_postgres::PostgresStore;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::shared_pool;
use sqlx::PgPool;

/// A migrated table of 5,000 completed records, analyzed: its statistics say that no record
/// is in flight, as they mostly do in production (a claim is in flight briefly).
async fn analyzed_table() -> Option<(PgPool, String)> {
    let pool = shared_pool(2).await?;
    let table = unique("plans");
    let store = PostgresStore::builder(pool.clone())
        .table(table.clone())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO \"{table}\" (storage_key, state, fingerprint, token, payload, expires_at, \
         kept_until, since) \
         SELECT sha256(g::text::bytea), 'completed', '\\x00', g, '\\x00', \
         clock_timestamp() + interval '1 day', clock_timestamp() + interval '1 day', \
         clock_timestamp() FROM generate_series(1, 5000) g"
    ))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(&format!("ANALYZE \"{table}\""))
        .execute(&pool)
        .await
        .unwrap();
    Some((pool, table))
}

/// The indexes the plan of `statement` reads.
async fn indexes_read(pool: &PgPool, statement: &str) -> Vec<String> {
    let plan: serde_json::Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {statement}"))
        .fetch_one(pool)
        .await
        .unwrap();
    fn walk(node: &serde_json::Value, found: &mut Vec<String>) {
        if let Some(name) = node.get("Index Name").and_then(|name| name.as_str()) {
            found.push(name.to_owned());
        }
        for child in node
            .get("Plans")
            .and_then(|plans| plans.as_array())
            .into_iter()
            .flatten()
        {
            walk(child, found);
        }
    }
    let mut found = Vec::new();
    walk(&plan[0]["Plan"], &mut found);
    found
}

#[tokio::test]
async fn a_keys_statements_reach_its_row_through_the_primary_key_when_in_flight_looks_rare() {
    let Some((pool, table)) = analyzed_table().await else {
        return;
    };
    let key = "sha256('42'::bytea)";
    // The shapes of the statements of one key: the completion, release and renewal of a claim
    // (`in_flight`), a completion that may find its own (`IN`), a session's row.
    for state in [
        "state = 'in_flight'",
        "state IN ('in_flight', 'completed')",
        "state = 'session'",
    ] {
        let statement = format!(
            "UPDATE \"{table}\" SET payload = '\\x01' \
             WHERE storage_key = {key} AND token = 42 AND {state}"
        );
        let read = indexes_read(&pool, &statement).await;
        assert_eq!(
            read,
            [format!("{table}_pkey")],
            "{state}: a key's statement is planned over another index than the primary key"
        );
    }
}

#[tokio::test]
async fn migrate_keys_the_listing_index_apart_and_drops_the_earlier_one() {
    let Some((pool, table)) = analyzed_table().await else {
        return;
    };
    let definition = |index: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT indexdef FROM pg_indexes WHERE indexname = $1")
                .bind(index)
                .fetch_optional(&pool)
                .await
                .unwrap()
        }
    };
    let listing = definition(format!("{table}_listing_idx")).await.unwrap();
    assert!(listing.contains("COLLATE \"C\""), "{listing}");
    // The listings read it.
    let statement = format!(
        "SELECT storage_key FROM \"{table}\" WHERE state COLLATE \"C\" = 'completed' \
         AND since IS NOT NULL ORDER BY since, storage_key LIMIT 10"
    );
    let read = indexes_read(&pool, &statement).await;
    assert_eq!(read, [format!("{table}_listing_idx")]);

    // A table migrated by an earlier 0.4 build has an index on `state` as it is: dropped.
    sqlx::query(&format!(
        "CREATE INDEX \"{table}_state_since_idx\" ON \"{table}\" (state, since, storage_key)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    PostgresStore::builder(pool.clone())
        .table(table.clone())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    assert_eq!(definition(format!("{table}_state_since_idx")).await, None);
    assert!(definition(format!("{table}_listing_idx")).await.is_some());
}
