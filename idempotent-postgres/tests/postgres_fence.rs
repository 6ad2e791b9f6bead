//! `postgres::Fence` against a real PostgreSQL server (started by `scripts/test.sh`): stale
//! owners of one key refused by the resource, in every order, concurrently, after a rollback,
//! and under a stampede of writers.
//!
//! Longer than most test files: every test runs on the same fence-and-resource fixture, and
//! the orders of stale writers are one subject.
// Built only with the features it needs (like a `required-features` entry in Cargo.toml).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use idempotent_core::conformance::fresh_key;
use idempotent_core::{
    Call, CallOptions, Claim, ClaimHandle, FencingToken, Fingerprint, Idempotency, ProblemCode,
    StorageKey, Store, StoreError,
};
use idempotent_postgres::{DEFAULT_FENCE_TABLE, Fence, FenceError, PostgresStore};
use idempotent_test_kit::backend::postgres_url;
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::pool_bounding_locks as pool;
use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};
use tokio::time::{Instant, timeout};

/// The bound on every wait in these tests; a test that reaches it has failed.
const BOUND: Duration = Duration::from_secs(30);

/// A migrated fence on a fresh table, and a fresh table for the resource it guards: one row
/// per resource, with the value and the token of the last write.
struct Fixture {
    pool: PgPool,
    fence: Fence,
    data: String,
}

async fn fixture(url: &str, connections: u32) -> Fixture {
    let pool = pool(url, connections).await;
    let fence = Fence::with_table(unique("fence")).unwrap();
    fence.migrate(&pool).await.unwrap();
    let data = unique("data");
    sqlx::query(&format!(
        "CREATE TABLE \"{data}\" (id text PRIMARY KEY, value text NOT NULL, \
         writes bigint NOT NULL, last_token bigint NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    Fixture { pool, fence, data }
}

impl Fixture {
    async fn begin(&self) -> Transaction<'static, Postgres> {
        timeout(BOUND, self.pool.begin()).await.unwrap().unwrap()
    }

    /// The protected write: upserts the resource's row, in `tx`.
    async fn write(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        resource: &str,
        value: &str,
        token: FencingToken,
    ) {
        sqlx::query(&format!(
            "INSERT INTO \"{}\" (id, value, writes, last_token) VALUES ($1, $2, 1, $3) \
             ON CONFLICT (id) DO UPDATE SET value = excluded.value, \
             writes = \"{0}\".writes + 1, last_token = excluded.last_token",
            self.data
        ))
        .bind(resource)
        .bind(value)
        .bind(i64::try_from(token.get()).unwrap())
        .execute(&mut **tx)
        .await
        .unwrap();
    }

    /// One owner's whole fenced write in its own transaction, guard first: committed if the
    /// fence accepts the token, rolled back otherwise.
    async fn fenced_write(
        &self,
        resource: &str,
        value: &str,
        token: FencingToken,
    ) -> Result<(), FenceError> {
        let mut tx = self.begin().await;
        self.fence.advance(&mut tx, resource, token).await?;
        self.write(&mut tx, resource, value, token).await;
        tx.commit().await.unwrap();
        Ok(())
    }

    /// The resource's committed value and write count.
    async fn value(&self, resource: &str) -> Option<(String, i64)> {
        sqlx::query_as(&format!(
            "SELECT value, writes FROM \"{}\" WHERE id = $1",
            self.data
        ))
        .bind(resource)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    /// The committed highest token the fence holds for `resource`.
    async fn highest(&self, resource: &str) -> Option<u64> {
        let token: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT token FROM \"{}\" WHERE resource = $1",
            self.fence.table()
        ))
        .bind(resource)
        .fetch_optional(&self.pool)
        .await
        .unwrap();
        token.map(|t| u64::try_from(t).unwrap())
    }
}

fn assert_stale(result: Result<(), FenceError>, token: FencingToken, highest: FencingToken) {
    match result {
        Err(FenceError::Stale {
            token: refused,
            highest: seen,
        }) => assert_eq!((refused, seen), (token, highest)),
        other => panic!("expected Stale {{ {token:?}, {highest:?} }}, got {other:?}"),
    }
}

async fn store_on_fresh_table(pool: &PgPool) -> PostgresStore {
    let store = PostgresStore::builder(pool.clone())
        .table(unique("records"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store
}

/// A short lease, so that the first owner's claim lapses (as when its process or the store
/// stalls past the lease).
const SHORT_LEASE: Duration = Duration::from_millis(200);

/// Waits, by the store's own clock (the `retry_after` it answers), until `key` can be claimed
/// again, and claims it.
async fn claim_after_lapse(store: &PostgresStore, key: &StorageKey) -> FencingToken {
    let deadline = Instant::now() + BOUND;
    let f = Fingerprint::from_bytes(b"fenced");
    loop {
        assert!(
            Instant::now() < deadline,
            "the first owner's lease never lapsed"
        );
        match store
            .claim(key, &f, Duration::from_secs(30), Duration::from_secs(30))
            .await
            .unwrap()
        {
            Claim::Claimed(token) => return token,
            Claim::InFlight { retry_after, .. } => {
                tokio::time::sleep(retry_after.max(Duration::from_millis(5))).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Two real owners of one key: A claims with a short lease that lapses, then B takes the key
/// over. Returns their tokens, B's greater.
async fn two_owners(store: &PostgresStore) -> (FencingToken, FencingToken) {
    let key = fresh_key();
    let f = Fingerprint::from_bytes(b"fenced");
    let Claim::Claimed(a) = store
        .claim(&key, &f, SHORT_LEASE, SHORT_LEASE)
        .await
        .unwrap()
    else {
        panic!("A could not claim a fresh key");
    };
    let b = claim_after_lapse(store, &key).await;
    assert!(b > a, "the new owner's token {b:?} is not above {a:?}");
    (a, b)
}

/// The backend pid of `tx`'s connection.
async fn backend_pid(tx: &mut Transaction<'static, Postgres>) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

/// Waits until backend `pid` is blocked on a lock (its statement is waiting for another
/// transaction), as the server reports it.
async fn wait_until_blocked(pool: &PgPool, pid: i32) {
    let deadline = Instant::now() + BOUND;
    loop {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(pool)
                .await
                .unwrap();
        if waiting.as_deref() == Some("Lock") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never blocked on the fence row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts `advance` for `token` in its own transaction on another task; it returns the
/// transaction (to commit or roll back) with the result. Also returns the backend's pid.
async fn spawn_advance(
    f: &Arc<Fixture>,
    resource: &'static str,
    token: FencingToken,
) -> (
    i32,
    tokio::task::JoinHandle<(Transaction<'static, Postgres>, Result<(), FenceError>)>,
) {
    let mut tx = f.begin().await;
    let pid = backend_pid(&mut tx).await;
    let f = Arc::clone(f);
    let handle = tokio::spawn(async move {
        let result = f.fence.advance(&mut tx, resource, token).await;
        (tx, result)
    });
    (pid, handle)
}

#[tokio::test]
async fn stale_owner_after_a_takeover_is_refused_and_its_write_does_not_happen() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = fixture(&url, 4).await;
    let store = store_on_fresh_table(&f.pool).await;
    let call = Call::new("publish-report-1".parse().unwrap())
        .options(CallOptions::new().lease(Duration::from_secs(30)));

    // A claims the call's key with a short lease and stalls past it (no renewal).
    let idempotency = Idempotency::new(store.clone());
    let key = idempotency.storage_key(&call);
    let Claim::Claimed(a) = store
        .claim(&key, &Fingerprint::empty(), SHORT_LEASE, SHORT_LEASE)
        .await
        .unwrap()
    else {
        panic!("A could not claim");
    };
    // B: a retry of the call through the runtime, once the store says the lease lapsed. Its
    // work reads its token from the claim handle and writes through the fence.
    let deadline = Instant::now() + BOUND;
    let b = loop {
        let outcome = idempotency
            .run(&call, async {
                let b = ClaimHandle::current().expect("inside run").token();
                f.fenced_write("report:1", "written by B", b)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<u64, String>(b.get())
            })
            .await;
        match outcome {
            Ok(outcome) => break FencingToken::new(outcome.into_inner().unwrap()),
            Err(error) => {
                assert_eq!(error.code(), ProblemCode::InFlight, "{error}");
                assert!(Instant::now() < deadline, "A's lease never lapsed");
                let wait = error.retry_after().unwrap_or(Duration::from_millis(20));
                tokio::time::sleep(wait.max(Duration::from_millis(5))).await;
            }
        }
    };
    assert!(b > a, "B's token {b:?} is not above A's {a:?}");
    assert_eq!(f.highest("report:1").await, Some(b.get()));

    // A resumes and writes, in its own transaction: refused, and nothing of it is written.
    assert_stale(f.fenced_write("report:1", "written by A", a).await, a, b);
    assert_eq!(
        f.value("report:1").await,
        Some(("written by B".to_owned(), 1))
    );
    assert_eq!(f.highest("report:1").await, Some(b.get()));
    // Nor can A complete the record.
    assert!(matches!(
        store
            .complete(&key, a, bytes::Bytes::from_static(b"A"), BOUND)
            .await,
        Err(StoreError::TokenRejected)
    ));
}

#[tokio::test]
async fn stale_owner_writing_first_is_accepted_then_refused_after_the_newer_owner() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = fixture(&url, 4).await;
    let store = store_on_fresh_table(&f.pool).await;
    let (a, b) = two_owners(&store).await;

    // A has not seen B yet: accepted (fencing orders writes, it cannot undo an earlier one).
    f.fenced_write("report:2", "A1", a).await.unwrap();
    assert_eq!(f.highest("report:2").await, Some(a.get()));
    // B writes: accepted, the highest token is now B's.
    f.fenced_write("report:2", "B1", b).await.unwrap();
    assert_eq!(f.highest("report:2").await, Some(b.get()));
    // A again, this time with the guard *after* its write: refused, and the rollback undoes
    // the write it made before the guard.
    let mut tx = f.begin().await;
    f.write(&mut tx, "report:2", "A2", a).await;
    assert_stale(f.fence.advance(&mut tx, "report:2", a).await, a, b);
    tx.rollback().await.unwrap();
    assert_eq!(f.value("report:2").await, Some(("B1".to_owned(), 2)));
    assert_eq!(f.highest("report:2").await, Some(b.get()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_owner_waits_for_the_older_transaction_then_wins() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = Arc::new(fixture(&url, 4).await);
    let store = store_on_fresh_table(&f.pool).await;
    let (a, b) = two_owners(&store).await;

    // A advances (inserting the fence row) and holds its transaction open.
    let mut tx_a = f.begin().await;
    f.fence.advance(&mut tx_a, "report:3", a).await.unwrap();
    // B's advance blocks on A's row, as the server reports.
    let (pid_b, handle_b) = spawn_advance(&f, "report:3", b).await;
    wait_until_blocked(&f.pool, pid_b).await;
    assert!(!handle_b.is_finished());
    // A writes and commits; B's statement then goes on and is accepted, B > A.
    f.write(&mut tx_a, "report:3", "A", a).await;
    tx_a.commit().await.unwrap();
    let (mut tx_b, result) = timeout(BOUND, handle_b).await.unwrap().unwrap();
    result.unwrap();
    f.write(&mut tx_b, "report:3", "B", b).await;
    tx_b.commit().await.unwrap();
    assert_eq!(f.value("report:3").await, Some(("B".to_owned(), 2)));
    assert_eq!(f.highest("report:3").await, Some(b.get()));
    // A again: refused.
    assert_stale(f.fenced_write("report:3", "A again", a).await, a, b);
    assert_eq!(f.value("report:3").await, Some(("B".to_owned(), 2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_waiting_on_the_newer_transaction_is_refused_when_it_commits() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = Arc::new(fixture(&url, 4).await);
    let store = store_on_fresh_table(&f.pool).await;
    let (a, b) = two_owners(&store).await;

    for existing in [false, true] {
        // Once on a resource with no fence row yet (B's row is an uncommitted insert), once on
        // one A wrote earlier (B's row is an uncommitted update).
        let resource = if existing { "report:4b" } else { "report:4a" };
        if existing {
            f.fenced_write(resource, "A0", a).await.unwrap();
        }
        let mut tx_b = f.begin().await;
        f.fence.advance(&mut tx_b, resource, b).await.unwrap();
        f.write(&mut tx_b, resource, "B", b).await;
        // A's advance blocks on B's row; B commits; A's statement then sees B's token.
        let (pid_a, handle_a) = spawn_advance(&f, resource, a).await;
        wait_until_blocked(&f.pool, pid_a).await;
        assert!(!handle_a.is_finished());
        tx_b.commit().await.unwrap();
        let (tx_a, result) = timeout(BOUND, handle_a).await.unwrap().unwrap();
        assert_stale(result, a, b);
        tx_a.rollback().await.unwrap();
        let writes = if existing { 2 } else { 1 };
        assert_eq!(f.value(resource).await, Some(("B".to_owned(), writes)));
        assert_eq!(f.highest(resource).await, Some(b.get()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_of_the_newer_owner_leaves_the_older_token_highest() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = Arc::new(fixture(&url, 4).await);
    let store = store_on_fresh_table(&f.pool).await;
    let (a, b) = two_owners(&store).await;

    for existing in [false, true] {
        let resource = if existing { "report:5b" } else { "report:5a" };
        if existing {
            f.fenced_write(resource, "A0", a).await.unwrap();
        }
        // B advances and writes, A waits on B's row, then B rolls back.
        let mut tx_b = f.begin().await;
        f.fence.advance(&mut tx_b, resource, b).await.unwrap();
        f.write(&mut tx_b, resource, "B", b).await;
        let (pid_a, handle_a) = spawn_advance(&f, resource, a).await;
        wait_until_blocked(&f.pool, pid_a).await;
        tx_b.rollback().await.unwrap();
        // Nothing of B remains, so A is not stale: accepted, and its token is the highest.
        let (mut tx_a, result) = timeout(BOUND, handle_a).await.unwrap().unwrap();
        result.unwrap();
        f.write(&mut tx_a, resource, "A1", a).await;
        tx_a.commit().await.unwrap();
        assert_eq!(f.highest(resource).await, Some(a.get()));
        let writes = if existing { 2 } else { 1 };
        assert_eq!(f.value(resource).await, Some(("A1".to_owned(), writes)));
        // And A may go on writing.
        f.fenced_write(resource, "A2", a).await.unwrap();
        assert_eq!(f.value(resource).await, Some(("A2".to_owned(), writes + 1)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_owner_gets_a_serialization_failure_after_a_concurrent_commit() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = Arc::new(fixture(&url, 4).await);
    let t = FencingToken::new;
    // (token of the REPEATABLE READ owner, token of the owner committing after its snapshot):
    // a stale one, and a newer one, which is not accepted either.
    for (resource, mine, theirs) in [("rr:stale", t(1), t(2)), ("rr:newer", t(4), t(3))] {
        let mut other = f.begin().await;
        f.fence.advance(&mut other, resource, theirs).await.unwrap();
        // The repeatable-read transaction takes its snapshot before the other one commits.
        let mut tx = f.begin().await;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        let pid = backend_pid(&mut tx).await;
        let fixture = Arc::clone(&f);
        let handle = tokio::spawn(async move {
            let result = fixture.fence.advance(&mut tx, resource, mine).await;
            (tx, result)
        });
        wait_until_blocked(&f.pool, pid).await;
        other.commit().await.unwrap();
        let (tx, result) = timeout(BOUND, handle).await.unwrap().unwrap();
        match result {
            Err(FenceError::Database(error)) => {
                let code = error.as_database_error().and_then(|e| e.code());
                assert_eq!(code.as_deref(), Some("40001"), "{error}");
            }
            other => panic!("expected a serialization failure, got {other:?}"),
        }
        tx.rollback().await.unwrap();
        // Retried, the transaction compares with the committed token.
        let retried = f.fenced_write(resource, "retried", mine).await;
        if mine < theirs {
            assert_stale(retried, mine, theirs);
        } else {
            retried.unwrap();
        }
    }
}

#[tokio::test]
async fn equal_tokens_are_accepted_and_resources_are_independent() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = fixture(&url, 2).await;
    let t = FencingToken::new;

    // The same claim writes one resource twice in one transaction, and again in another.
    let mut tx = f.begin().await;
    f.fence.advance(&mut tx, "r1", t(5)).await.unwrap();
    f.fence.advance(&mut tx, "r1", t(5)).await.unwrap();
    tx.commit().await.unwrap();
    f.fenced_write("r1", "five", t(5)).await.unwrap();
    assert_eq!(f.highest("r1").await, Some(5));
    // Below is refused, above is accepted.
    assert_stale(f.fenced_write("r1", "four", t(4)).await, t(4), t(5));
    f.fenced_write("r1", "six", t(6)).await.unwrap();
    assert_stale(f.fenced_write("r1", "five", t(5)).await, t(5), t(6));

    // Another resource has its own highest token.
    f.fenced_write("r2", "three", t(3)).await.unwrap();
    assert_eq!(f.highest("r2").await, Some(3));
    assert_eq!(f.highest("r1").await, Some(6));
    assert_eq!(f.value("r1").await, Some(("six".to_owned(), 2)));
    assert_eq!(f.value("r2").await, Some(("three".to_owned(), 1)));

    // A refusal leaves the transaction usable: the caller decides what to roll back.
    let mut tx = f.begin().await;
    assert_stale(f.fence.advance(&mut tx, "r1", t(1)).await, t(1), t(6));
    f.fence.advance(&mut tx, "r2", t(3)).await.unwrap();
    tx.commit().await.unwrap();

    // The largest token a bigint holds is accepted; above it, the token is refused as such.
    let max = t(u64::try_from(i64::MAX).unwrap());
    f.fenced_write("r3", "max", max).await.unwrap();
    assert_eq!(f.highest("r3").await, Some(max.get()));
    let mut tx = f.begin().await;
    let above = t(max.get() + 1);
    assert!(matches!(
        f.fence.advance(&mut tx, "r3", above).await,
        Err(FenceError::TokenOutOfRange { token }) if token == above
    ));
}

#[tokio::test]
async fn advance_outside_a_transaction_or_before_migrate_fails() {
    let Some(url) = postgres_url() else {
        return;
    };
    let f = fixture(&url, 2).await;
    // Autocommit: the row lock would end before the write, so nothing is done.
    let mut connection = f.pool.acquire().await.unwrap();
    let result = f
        .fence
        .advance(&mut connection, "r", FencingToken::new(1))
        .await;
    assert!(
        matches!(result, Err(FenceError::NotInTransaction)),
        "{result:?}"
    );
    assert_eq!(f.highest("r").await, None);

    let unmigrated = Fence::with_table(unique("never_migrated")).unwrap();
    let mut tx = f.begin().await;
    let result = unmigrated.advance(&mut tx, "r", FencingToken::new(1)).await;
    assert!(matches!(result, Err(FenceError::Database(_))), "{result:?}");
}

#[tokio::test]
async fn table_name_is_validated_configurable_and_schema_qualified() {
    assert_eq!(Fence::new().table(), DEFAULT_FENCE_TABLE);
    assert_eq!(Fence::default().table(), "idempotent_fences");
    for bad in [
        "x; DROP TABLE users",
        "Robert'); --",
        "\"x\"",
        "",
        "a.b.c",
        "Upper",
        "fences'",
        &"f".repeat(49),
    ] {
        let error = Fence::with_table(bad).unwrap_err();
        assert!(error.to_string().contains("invalid table name"), "{error}");
    }
    let Some(url) = postgres_url() else {
        return;
    };
    let pool = pool(&url, 2).await;
    let schema = unique("s");
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&pool)
        .await
        .unwrap();
    // A reserved word works as a name: identifiers are always quoted.
    let fence = Fence::with_table(format!("{schema}.select")).unwrap();
    assert_eq!(fence.table(), format!("{schema}.select"));
    fence.migrate(&pool).await.unwrap();
    fence.migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    fence
        .advance(&mut tx, "r", FencingToken::new(2))
        .await
        .unwrap();
    assert_stale(
        fence.advance(&mut tx, "r", FencingToken::new(1)).await,
        FencingToken::new(1),
        FencingToken::new(2),
    );
    tx.commit().await.unwrap();
    let token: i64 = sqlx::query_scalar(&format!(
        "SELECT token FROM \"{schema}\".\"select\" WHERE resource = 'r'"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(token, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_of_one_table_all_succeed() {
    let Some(url) = postgres_url() else {
        return;
    };
    const MIGRATIONS: usize = 8;
    let pool = pool(&url, u32::try_from(MIGRATIONS).unwrap()).await;
    // Several rounds: without the advisory lock, concurrent `CREATE TABLE IF NOT EXISTS` fails
    // (a duplicate key in `pg_type`) in some of them, not in every one.
    for _ in 0..5 {
        let fence = Fence::with_table(unique("fence")).unwrap();
        let barrier = Arc::new(tokio::sync::Barrier::new(MIGRATIONS));
        let migrations: Vec<_> = (0..MIGRATIONS)
            .map(|_| {
                let (fence, pool, barrier) = (fence.clone(), pool.clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    fence.migrate(&pool).await
                })
            })
            .collect();
        for migration in migrations {
            timeout(BOUND, migration)
                .await
                .unwrap()
                .unwrap()
                .expect("concurrent migrate");
        }
        let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\"", fence.table()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_leave_the_highest_token_and_refuse_only_stale_ones() {
    let Some(url) = postgres_url() else {
        return;
    };
    const WRITERS: u64 = 50;
    let f = Arc::new(fixture(&url, u32::try_from(WRITERS).unwrap() + 2).await);
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (id, value, writes, last_token) VALUES ('counter', '', 0, 0)",
        f.data
    ))
    .execute(&f.pool)
    .await
    .unwrap();
    // Every writer opens its transaction, then all race their fenced increment at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(usize::try_from(WRITERS).unwrap()));
    let writers: Vec<_> = (0..WRITERS)
        // Distinct tokens 1..=50, started out of order.
        .map(|i| FencingToken::new(i * 37 % WRITERS + 1))
        .map(|token| {
            let (f, barrier) = (Arc::clone(&f), Arc::clone(&barrier));
            tokio::spawn(async move {
                let mut tx = f.begin().await;
                barrier.wait().await;
                if let Err(error) = f.fence.advance(&mut tx, "counter", token).await {
                    tx.rollback().await.unwrap();
                    return (token, Err(error));
                }
                // Under the fence row's lock: the last committed increment's token.
                let previous: i64 = sqlx::query_scalar(&format!(
                    "UPDATE \"{}\" AS d SET writes = d.writes + 1, last_token = $1 \
                     FROM (SELECT last_token FROM \"{0}\" WHERE id = 'counter') AS p \
                     WHERE d.id = 'counter' RETURNING p.last_token",
                    f.data
                ))
                .bind(i64::try_from(token.get()).unwrap())
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                (token, Ok(u64::try_from(previous).unwrap()))
            })
        })
        .collect();
    let mut committed = BTreeSet::new();
    let mut refused = Vec::new();
    for writer in writers {
        let (token, result) = timeout(BOUND, writer).await.unwrap().unwrap();
        match result {
            Ok(previous) => {
                // Committed increments follow each other in increasing token order.
                assert!(
                    previous < token.get(),
                    "{token:?} was applied after {previous}"
                );
                committed.insert(token.get());
            }
            Err(FenceError::Stale { token: t, highest }) => {
                assert_eq!(t, token);
                assert!(highest > token, "{token:?} refused by {highest:?}");
                refused.push((token, highest));
            }
            Err(other) => panic!("{token:?}: {other}"),
        }
    }
    assert_eq!(committed.len() + refused.len(), 50);
    // Every refusal was caused by a token whose write committed.
    for (token, highest) in &refused {
        assert!(
            committed.contains(&highest.get()),
            "{token:?} refused by {highest:?}, which never committed"
        );
    }
    // The highest token always gets through, and it is what the fence and the resource hold.
    assert!(committed.contains(&WRITERS));
    assert_eq!(f.highest("counter").await, Some(WRITERS));
    let (last_token, writes): (i64, i64) = sqlx::query_as(&format!(
        "SELECT last_token, writes FROM \"{}\" WHERE id = 'counter'",
        f.data
    ))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(last_token, 50);
    assert_eq!(writes, i64::try_from(committed.len()).unwrap());
}
