//! `Consumer::run_transactional` against a real PostgreSQL server (its URL in
//! `IDEMPOTENT_TEST_POSTGRES_URL`), over an in-process source, with a handler that inserts
//! into a table of its own in the transaction that claims the message's key: duplicates insert
//! nothing, a handler's error rolls back its insert and the claim, `sql_failure` sorts a CHECK
//! violation as rejected (dead-lettered on the `max_deliveries`-th delivery) and a lock
//! timeout as transient (retried past it), concurrent duplicates leave one row per key, and
//! the claim is `ClaimHandle::current()` inside the handler.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_cache::{CACHE_LOOKUPS, CacheTier};
use idempotent_consumer::{
    Consumer, Decode, Failure, Message, Outcome, Report, TxHandler, sql_failure,
};
use idempotent_core::ClaimHandle;
use idempotent_core::metrics::{REQUESTS, Recorded, STORE_OPERATION_DURATION};
use idempotent_postgres::{PostgresStore, Transactional};
use idempotent_test_kit::names::unique;
use idempotent_test_kit::postgres::shared_pool;
use sqlx::PgConnection;
use sqlx::postgres::PgPool;
use support::source::{Answer, PATIENCE, TestSource, answers_of, wait_until};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The lock timeout every handler transaction sets in `begin`.
const LOCK_TIMEOUT: &str = "100ms";

// ---------------------------------------------------------------------------------------------
// The database and the handler
// ---------------------------------------------------------------------------------------------

/// A fresh records table, an `entries` table the handler inserts into (no unique constraint
/// on the message id: only the claim keeps a duplicate from inserting twice; `amount` must not
/// be negative), and a `locks` table with one row, `held`.
struct Db {
    pool: PgPool,
    store: PostgresStore,
    entries: String,
    locks: String,
}

impl Db {
    async fn open() -> Option<Db> {
        let pool = shared_pool(24).await?;
        let suffix = unique("t");
        let store = PostgresStore::builder(pool.clone())
            .table(format!("records_{suffix}"))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let entries = format!("entries_{suffix}");
        let locks = format!("locks_{suffix}");
        for statement in [
            format!(
                "CREATE TABLE \"{entries}\" (seq bigserial PRIMARY KEY, message_id text NOT NULL, \
                 amount bigint NOT NULL CHECK (amount >= 0), operation_key text NOT NULL)"
            ),
            format!("CREATE TABLE \"{locks}\" (id text PRIMARY KEY, n bigint NOT NULL)"),
            format!("INSERT INTO \"{locks}\" VALUES ('held', 0)"),
        ] {
            sqlx::query(&statement).execute(&pool).await.unwrap();
        }
        Some(Db {
            pool,
            store,
            entries,
            locks,
        })
    }

    /// The committed entries: message id → how many rows.
    async fn rows(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(&format!(
            "SELECT message_id, count(*) FROM \"{}\" GROUP BY message_id",
            self.entries
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    /// Committed rows of the records table.
    async fn records(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\"", self.store.table()))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    fn ledger(&self) -> Ledger {
        Ledger {
            entries: self.entries.clone(),
            locks: self.locks.clone(),
            attempts: Arc::default(),
            begins: Arc::default(),
        }
    }
}

/// `AMOUNT [fail N] [lock]`: insert an entry of AMOUNT; with `fail N`, fail transiently after
/// the insert on deliveries before the N-th; with `lock`, first update the `held` row of
/// `locks`.
#[derive(Debug)]
struct Entry {
    id: String,
    deliveries: u64,
    amount: i64,
    fail_until: u64,
    lock: bool,
}

/// One call of the handler.
#[derive(Debug, Clone)]
struct Attempt {
    id: String,
    deliveries: u64,
    /// `ClaimHandle::current()` was there, naming the claim's operation.
    claim_current: bool,
}

#[derive(Clone)]
struct Ledger {
    entries: String,
    locks: String,
    attempts: Arc<Mutex<Vec<Attempt>>>,
    /// Transactions begun.
    begins: Arc<AtomicUsize>,
}

impl Ledger {
    fn attempts(&self) -> Vec<Attempt> {
        self.attempts.lock().unwrap().clone()
    }

    fn attempts_of(&self, id: &str) -> Vec<u64> {
        self.attempts()
            .into_iter()
            .filter(|a| a.id == id)
            .map(|a| a.deliveries)
            .collect()
    }
}

impl Decode for Ledger {
    type Input = Entry;

    fn decode(&self, message: &Message) -> Result<Entry, Failure> {
        let malformed = || Failure::Malformed(format!("cannot decode {:?}", message.body()));
        let body = std::str::from_utf8(message.body()).map_err(|_| malformed())?;
        let mut words = body.split(' ');
        let amount = words
            .next()
            .and_then(|w| w.parse().ok())
            .ok_or_else(malformed)?;
        let mut entry = Entry {
            id: message.id().ok_or_else(malformed)?.to_owned(),
            deliveries: message.deliveries(),
            amount,
            fail_until: 0,
            lock: false,
        };
        while let Some(word) = words.next() {
            match word {
                "fail" => {
                    entry.fail_until = words
                        .next()
                        .and_then(|w| w.parse().ok())
                        .ok_or_else(malformed)?;
                }
                "lock" => entry.lock = true,
                _ => return Err(malformed()),
            }
        }
        Ok(entry)
    }
}

impl TxHandler for Ledger {
    type Output = i64;

    async fn begin(&self, tx: &mut PgConnection) -> Result<(), Failure> {
        self.begins.fetch_add(1, Ordering::SeqCst);
        sqlx::query(&format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            .execute(tx)
            .await
            .map_err(|e| sql_failure("lock_timeout", &e))?;
        Ok(())
    }

    async fn handle(
        &self,
        tx: &mut PgConnection,
        entry: &Entry,
        claim: &ClaimHandle,
    ) -> Result<i64, Failure> {
        let current = ClaimHandle::current();
        self.attempts.lock().unwrap().push(Attempt {
            id: entry.id.clone(),
            deliveries: entry.deliveries,
            claim_current: current.is_some_and(|c| c.operation_key() == claim.operation_key()),
        });
        if entry.lock {
            sqlx::query(&format!(
                "UPDATE \"{}\" SET n = n + 1 WHERE id = 'held'",
                self.locks
            ))
            .execute(&mut *tx)
            .await
            .map_err(|e| sql_failure("lock", &e))?;
        }
        let seq = sqlx::query_scalar(&format!(
            "INSERT INTO \"{}\" (message_id, amount, operation_key) VALUES ($1, $2, $3) RETURNING seq",
            self.entries
        ))
        .bind(&entry.id)
        .bind(entry.amount)
        .bind(claim.operation_key().as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| sql_failure("insert", &e))?;
        if entry.deliveries < entry.fail_until {
            return Err(Failure::Transient(
                "failing after the insert on purpose".into(),
            ));
        }
        Ok(seq)
    }
}

// ---------------------------------------------------------------------------------------------
// Running a consumer
// ---------------------------------------------------------------------------------------------

type Observations = Arc<Mutex<HashMap<(String, u64), Observed>>>;

#[derive(Debug, Clone, PartialEq)]
enum Observed {
    Applied,
    Duplicate,
    Retried(Failure),
    DeadLettered(Failure),
}

/// A consumer of `source` whose observer records into `observed`.
fn consumer(source: &TestSource, observed: &Observations) -> Consumer<TestSource> {
    let observed = Arc::clone(observed);
    Consumer::new(source.clone()).on_outcome(move |message, outcome| {
        let outcome = match outcome {
            Outcome::Applied => Observed::Applied,
            Outcome::Duplicate => Observed::Duplicate,
            Outcome::Retried { failure, .. } => Observed::Retried(failure.clone()),
            Outcome::DeadLettered { failure } => Observed::DeadLettered(failure.clone()),
            other => panic!("an outcome the test does not know: {other:?}"),
        };
        let previous = observed.lock().unwrap().insert(
            (message.position().to_owned(), message.deliveries()),
            outcome,
        );
        assert!(previous.is_none(), "one outcome per delivery");
    })
}

struct Started {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Report>,
}

fn start(
    consumer: Consumer<TestSource>,
    db: &Db,
    transactional: Transactional,
    ledger: &Ledger,
) -> Started {
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    let task = tokio::spawn(consumer.run_transactional(
        db.pool.clone(),
        transactional,
        ledger.clone(),
        shutdown,
    ));
    Started { stop, task }
}

impl Started {
    async fn stop(self) -> Report {
        let _ = self.stop.send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the consumer drains and returns")
            .expect("the consumer does not panic")
    }
}

async fn run_until_settled(consumer: Consumer<TestSource>, db: &Db, ledger: &Ledger) -> Report {
    let source = consumer.source().clone();
    let started = start(
        consumer,
        db,
        idempotent_postgres::Transactional::new(&db.store),
        ledger,
    );
    wait_until("the source to settle", || source.is_settled()).await;
    started.stop().await
}

/// Every delivery was answered exactly once, as the observer saw it.
fn assert_every_delivery_answered_once(source: &TestSource, observed: &Observations) {
    let deliveries = source.deliveries();
    let observed = observed.lock().unwrap();
    assert_eq!(observed.len(), deliveries.len());
    for delivery in deliveries {
        let message = &delivery.message;
        assert_eq!(
            delivery.answers.len(),
            1,
            "{message:?}: {:?}",
            delivery.answers
        );
        let outcome = &observed[&(message.position().to_owned(), message.deliveries())];
        match (&delivery.answers[0].answer, outcome) {
            (Answer::Ack, Observed::Applied | Observed::Duplicate)
            | (Answer::Retry(_), Observed::Retried(_)) => {}
            (Answer::DeadLetter(reason), Observed::DeadLettered(failure)) => {
                assert_eq!(reason, failure.reason());
            }
            (answer, outcome) => panic!("{message:?} answered {answer:?}, observed {outcome:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_inserts_nothing_and_the_claim_is_current_in_the_handler() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    let mut positions = HashMap::new();
    for copy in 0..3 {
        for i in 0..10 {
            let position = source.publish(&format!("e-{i}"), &format!("{i}"));
            positions.insert((i, copy), position);
        }
    }
    let report = run_until_settled(consumer(&source, &observed).concurrency(4), &db, &ledger).await;
    assert_every_delivery_answered_once(&source, &observed);
    assert_eq!((report.applied, report.duplicates), (10, 20), "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    let rows = db.rows().await;
    assert_eq!(rows.len(), 10);
    assert!(rows.values().all(|&n| n == 1), "{rows:?}");
    assert_eq!(db.records().await, 10);
    for i in 0..10 {
        assert_eq!(
            ledger.attempts_of(&format!("e-{i}")),
            [1],
            "the handler ran once for e-{i}"
        );
        for copy in 0..3 {
            let answers = answers_of(&source, &positions[&(i, copy)]);
            assert_eq!(answers.last().unwrap().1, Answer::Ack, "e-{i} copy {copy}");
        }
    }
    assert!(ledger.attempts().iter().all(|a| a.claim_current));
    // The row holds the operation key the claim handed the handler: one per message id.
    let keys: i64 = sqlx::query_scalar(&format!(
        "SELECT count(DISTINCT operation_key) FROM \"{}\"",
        db.entries
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(keys, 10);
}

/// With a cache tier in front of the store, a duplicate of a committed message is acknowledged
/// from the tier: no transaction begins, no claim reaches PostgreSQL. A message reusing an id
/// with other content is dead-lettered as malformed from the tier too, as the store would have
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_cache_tier_a_duplicate_is_acknowledged_without_a_transaction() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    let (transactional, recorded) = Recorded::capture(|| {
        idempotent_postgres::Transactional::new(&db.store).tier(CacheTier::memory(100))
    });
    let started = start(consumer(&source, &observed), &db, transactional, &ledger);
    for i in 0..5 {
        source.publish(&format!("c-{i}"), &format!("{i}"));
    }
    wait_until("the first copies to settle", || source.is_settled()).await;
    let begins = ledger.begins.load(Ordering::SeqCst);
    let claims = || {
        recorded
            .histogram(STORE_OPERATION_DURATION, &[("operation", "claim")])
            .0
    };
    let claimed = claims();
    assert_eq!((begins, claimed), (5, 5));
    for i in 0..5 {
        for _ in 0..3 {
            source.publish(&format!("c-{i}"), &format!("{i}"));
        }
    }
    source.publish("c-0", "99");
    wait_until("the duplicates to settle", || source.is_settled()).await;
    let report = started.stop().await;
    assert_every_delivery_answered_once(&source, &observed);
    assert_eq!(
        (report.applied, report.duplicates, report.dead_lettered),
        (5, 15, 1),
        "{report:?}"
    );
    assert_eq!(
        ledger.begins.load(Ordering::SeqCst),
        begins,
        "no transaction began for a duplicate"
    );
    assert_eq!(claims(), claimed, "no claim reached PostgreSQL");
    assert_eq!(
        recorded.counter(CACHE_LOOKUPS, &[("outcome", "hit")]),
        16,
        "the duplicates and the reuse were answered by the tier"
    );
    let rows = db.rows().await;
    assert_eq!(rows.len(), 5);
    assert!(rows.values().all(|&n| n == 1), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_error_rolls_back_its_insert_and_the_claim_then_applies_once() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    // Inserts, then fails, on its first two deliveries.
    let failing = source.publish("f", "7 fail 3");
    let fine = source.publish("g", "8");
    let consumer = consumer(&source, &observed)
        .max_deliveries(2)
        .backoff(Duration::from_millis(5), Duration::from_millis(10));
    let report = run_until_settled(consumer, &db, &ledger).await;
    assert_every_delivery_answered_once(&source, &observed);
    assert_eq!(
        answers_of(&source, &failing),
        [
            (1, Answer::Retry(Duration::from_millis(5))),
            (2, Answer::Retry(Duration::from_millis(10))),
            (3, Answer::Ack),
        ]
    );
    assert_eq!(answers_of(&source, &fine), [(1, Answer::Ack)]);
    // Each delivery ran the handler: the claim was rolled back with the insert.
    assert_eq!(ledger.attempts_of("f"), [1, 2, 3]);
    assert_eq!(
        db.rows().await,
        HashMap::from([("f".to_owned(), 1), ("g".to_owned(), 1)])
    );
    assert_eq!(db.records().await, 2);
    assert_eq!((report.applied, report.retried), (2, 2), "{report:?}");
    let amount: i64 = sqlx::query_scalar(&format!(
        "SELECT amount FROM \"{}\" WHERE message_id = 'f'",
        db.entries
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(amount, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_constraint_violation_is_rejected_and_dead_lettered_on_the_max_deliveries_th_delivery() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    let negative = source.publish("neg", "-5");
    let fine = source.publish("pos", "5");
    let consumer = consumer(&source, &observed)
        .max_deliveries(3)
        .backoff(Duration::from_millis(5), Duration::from_millis(50));
    let report = run_until_settled(consumer, &db, &ledger).await;
    assert_every_delivery_answered_once(&source, &observed);
    let answers = answers_of(&source, &negative);
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers[0], (1, Answer::Retry(Duration::from_millis(5))));
    assert_eq!(answers[1], (2, Answer::Retry(Duration::from_millis(10))));
    let (3, Answer::DeadLetter(reason)) = &answers[2] else {
        panic!("{answers:?}");
    };
    assert!(reason.contains("SQLSTATE 23514"), "{reason}");
    let observed = observed.lock().unwrap().clone();
    for n in 1..=3 {
        match &observed[&(negative.clone(), n)] {
            Observed::Retried(Failure::Rejected(r))
            | Observed::DeadLettered(Failure::Rejected(r)) => {
                assert!(r.starts_with("insert: "), "{r}");
            }
            other => panic!("delivery {n}: {other:?}"),
        }
    }
    assert_eq!(answers_of(&source, &fine), [(1, Answer::Ack)]);
    assert_eq!(ledger.attempts_of("neg"), [1, 2, 3]);
    assert_eq!(db.rows().await, HashMap::from([("pos".to_owned(), 1)]));
    assert_eq!(
        db.records().await,
        1,
        "the rejected message's claim was rolled back"
    );
    assert_eq!(
        (report.applied, report.retried, report.dead_lettered),
        (1, 2, 1),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_timeout_is_transient_and_retried_past_max_deliveries_until_the_lock_is_free() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    // Another transaction holds the row the handler updates.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\" SET n = n WHERE id = 'held'",
        db.locks
    ))
    .execute(&mut *holder)
    .await
    .unwrap();
    let locked = source.publish("l", "3 lock");
    let consumer = consumer(&source, &observed)
        .max_deliveries(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    let started = start(
        consumer,
        &db,
        idempotent_postgres::Transactional::new(&db.store),
        &ledger,
    );
    wait_until("four deliveries to time out", || {
        answers_of(&source, &locked)
            .iter()
            .filter(|(_, a)| matches!(a, Answer::Retry(_)))
            .count()
            >= 4
    })
    .await;
    assert!(db.rows().await.is_empty());
    holder.rollback().await.unwrap();
    wait_until("the source to settle", || source.is_settled()).await;
    let report = started.stop().await;
    assert_every_delivery_answered_once(&source, &observed);

    let answers = answers_of(&source, &locked);
    let (last, retries) = answers.split_last().unwrap();
    assert_eq!(last.1, Answer::Ack, "{answers:?}");
    assert!(retries.len() >= 4, "{answers:?}");
    assert!(
        retries.iter().all(|(_, a)| matches!(a, Answer::Retry(_))),
        "{answers:?}"
    );
    let observed = observed.lock().unwrap().clone();
    for (n, _) in retries {
        match &observed[&(locked.clone(), *n)] {
            Observed::Retried(Failure::Transient(reason)) => {
                assert!(reason.contains("SQLSTATE 55P03"), "{reason}");
            }
            other => panic!("delivery {n}: {other:?}"),
        }
    }
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(db.rows().await, HashMap::from([("l".to_owned(), 1)]));
    let n: i64 = sqlx::query_scalar(&format!("SELECT n FROM \"{}\" WHERE id = 'held'", db.locks))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "only the committed attempt's update stands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_messages_over_twenty_ids_leave_twenty_rows() {
    let Some(db) = Db::open().await else {
        return;
    };
    let source = TestSource::new();
    let observed = Observations::default();
    let ledger = db.ledger();
    // Ten copies of each of twenty ids, published in turns: copies of one id meet in flight.
    for _ in 0..10 {
        for i in 0..20 {
            source.publish(&format!("c-{i}"), &format!("{i}"));
        }
    }
    let (transactional, recorded) =
        Recorded::capture(|| idempotent_postgres::Transactional::new(&db.store));
    let consumer = consumer(&source, &observed)
        .concurrency(16)
        .backoff(Duration::from_millis(5), Duration::from_millis(20));
    let started = start(consumer, &db, transactional, &ledger);
    wait_until("the source to settle", || source.is_settled()).await;
    let report = started.stop().await;
    assert_every_delivery_answered_once(&source, &observed);
    assert_eq!(
        (report.applied, report.duplicates, report.dead_lettered),
        (20, 180, 0),
        "{report:?}"
    );
    let rows = db.rows().await;
    assert_eq!(rows.len(), 20, "{rows:?}");
    assert!(rows.values().all(|&n| n == 1), "{rows:?}");
    assert_eq!(db.records().await, 20);
    let attempts = ledger.attempts();
    assert_eq!(attempts.len(), 20, "the handler ran once per id");
    assert!(attempts.iter().all(|a| a.claim_current));
    // Each delivery's claim is counted once: twenty ran, the rest replayed (or, having waited
    // past the lock timeout on a duplicate's row, were refused and retried).
    let requests =
        |outcome| recorded.counter(REQUESTS, &[("protocol", "message"), ("outcome", outcome)]);
    assert_eq!(requests("fresh"), 20);
    assert_eq!(requests("replayed"), 180);
    assert_eq!(
        recorded.counter(REQUESTS, &[("protocol", "message")]),
        200 + report.retried
    );
}
