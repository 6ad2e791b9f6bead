//! What `#[idempotent]` functions do when they run: replay, concurrency, independence of keys,
//! error handling, fingerprints, TTL, cancellation, and the key space a `name` defines.
//!
//! Longer than most test files: one short test per behaviour of the expansion, over a few
//! shared example services.

use std::collections::{BTreeMap, HashMap};
use std::future::pending;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::clock::ManualClock;
use idempotent_core::memory::MemoryStore;
use idempotent_core::{
    Call, ClaimHandle, Error, FencingToken, Idempotency, Key, Scope, default_runtime, idempotent,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// An application error that carries the runtime's errors, as the macro requires.
#[derive(Debug)]
enum AppError {
    Idempotency(Error),
    Declined(String),
}

impl From<Error> for AppError {
    fn from(error: Error) -> Self {
        AppError::Idempotency(error)
    }
}

/// An error that can be stored and replayed (`on_error = "store"`).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum ChargeError {
    Declined { reason: String },
    Idempotency { code: String },
}

impl From<Error> for ChargeError {
    fn from(error: Error) -> Self {
        ChargeError::Idempotency {
            code: error.code().as_str().to_owned(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: usize,
    cents: u64,
    note: Option<String>,
}

/// A result whose `Serialize` panics.
#[derive(Debug, Deserialize)]
struct PanicsWhenEncoded;

impl Serialize for PanicsWhenEncoded {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("this result cannot be encoded");
    }
}

#[derive(Serialize)]
struct Order {
    id: u64,
    cents: u64,
}

/// A service with its own runtime (over a store on a manual clock) and a count of how often a
/// body ran, so every test is independent of the others and of the default runtime.
struct Ledger {
    idempotency: Idempotency,
    clock: ManualClock,
    runs: AtomicUsize,
    gate: Semaphore,
    started: Semaphore,
    block_first: AtomicBool,
    fail_first: AtomicBool,
}

impl Ledger {
    fn new() -> Arc<Self> {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        Arc::new(Ledger {
            idempotency: Idempotency::new(store),
            clock,
            runs: AtomicUsize::new(0),
            gate: Semaphore::new(0),
            started: Semaphore::new(0),
            block_first: AtomicBool::new(false),
            fail_first: AtomicBool::new(false),
        })
    }

    fn ran(&self) -> usize {
        self.runs.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn panics_when_encoded(&self, key: &str) -> Result<PanicsWhenEncoded, AppError> {
        self.ran();
        Ok(PanicsWhenEncoded)
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn zero(&self, key: &str) -> Result<u64, AppError> {
        self.ran();
        Ok(0)
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn empty_string(&self, key: &str) -> Result<String, AppError> {
        self.ran();
        Ok(String::new())
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn empty_vec(&self, key: &str) -> Result<Vec<Receipt>, AppError> {
        self.ran();
        Ok(Vec::new())
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn none(&self, key: &str) -> Result<Option<u64>, AppError> {
        self.ran();
        Ok(None)
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn unit(&self, key: &str) -> Result<(), AppError> {
        self.ran();
        Ok(())
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn receipt(&self, key: &str, cents: u64) -> Result<Receipt, AppError> {
        Ok(Receipt {
            charge_id: self.ran(),
            cents,
            note: Some(String::new()),
        })
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn map(&self, key: &str) -> Result<BTreeMap<String, Vec<Option<i64>>>, AppError> {
        self.ran();
        Ok(BTreeMap::from([
            ("a".to_owned(), vec![Some(-1), None]),
            ("b".to_owned(), vec![]),
        ]))
    }

    /// Waits for the test to open the gate; concurrent duplicates are rejected.
    #[idempotent(key = key, runtime = &self.idempotency, in_flight = "reject")]
    async fn gated(&self, key: String) -> Result<usize, AppError> {
        let run = self.ran();
        self.started.add_permits(1);
        self.gate.acquire().await.expect("gate open").forget();
        Ok(run)
    }

    /// Concurrent duplicates wait for the first call's result.
    #[idempotent(key = key, runtime = &self.idempotency, wait = "10s")]
    async fn slow(&self, key: String) -> Result<usize, AppError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(self.ran())
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn labelled(&self, key: u32) -> Result<String, AppError> {
        self.ran();
        Ok(format!("charged {key}"))
    }

    /// Fails on its first run if `fail_first` is set.
    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn flaky(&self, key: &str) -> Result<usize, AppError> {
        let run = self.ran();
        if self.fail_first.swap(false, Ordering::SeqCst) {
            return Err(AppError::Declined("card network timeout".into()));
        }
        Ok(run)
    }

    #[idempotent(key = key, runtime = &self.idempotency, on_error = "store")]
    async fn decline(&self, key: &str, cents: u64) -> Result<usize, ChargeError> {
        let run = self.ran();
        if cents > 100 {
            return Err(ChargeError::Declined {
                reason: format!("limit exceeded on run {run}"),
            });
        }
        Ok(run)
    }

    #[idempotent(key = order.id, fingerprint = order, runtime = &self.idempotency)]
    async fn charge(&self, order: &Order) -> Result<Receipt, AppError> {
        Ok(Receipt {
            charge_id: self.ran(),
            cents: order.cents,
            note: None,
        })
    }

    #[idempotent(key = key, ttl = "1h", runtime = &self.idempotency)]
    async fn hourly(&self, key: &str) -> Result<usize, AppError> {
        Ok(self.ran())
    }

    /// The first run never finishes if `block_first` is set.
    #[idempotent(key = key, lease = "60s", wait = "5s", runtime = &self.idempotency)]
    async fn abandoned(&self, key: &str) -> Result<usize, AppError> {
        let run = self.ran();
        self.started.add_permits(1);
        if self.block_first.swap(false, Ordering::SeqCst) {
            pending::<()>().await;
        }
        Ok(run)
    }

    #[idempotent(key = key, scope = Scope::new().tenant(tenant), runtime = &self.idempotency)]
    async fn for_tenant(&self, tenant: &str, key: &str) -> Result<usize, AppError> {
        Ok(self.ran())
    }

    #[idempotent(key = key, name = "payments::charge", runtime = &self.idempotency)]
    async fn charge_v1(&self, key: &str) -> Result<String, AppError> {
        self.ran();
        Ok("charged by v1".into())
    }

    #[idempotent(key = key, name = "payments::charge", runtime = &self.idempotency)]
    async fn charge_v2(&self, key: &str) -> Result<String, AppError> {
        self.ran();
        Ok("charged by v2".into())
    }

    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn refund(&self, key: &str) -> Result<String, AppError> {
        self.ran();
        Ok("refunded".into())
    }

    /// JSON cannot encode maps with non-string keys.
    #[idempotent(key = key, runtime = &self.idempotency)]
    async fn unencodable(&self, key: &str) -> Result<HashMap<(u8, u8), u8>, AppError> {
        self.ran();
        Ok(HashMap::from([((1, 2), 3)]))
    }
}

fn is_in_flight(result: &Result<usize, AppError>) -> bool {
    matches!(result, Err(AppError::Idempotency(Error::InFlight { .. })))
}

#[tokio::test]
async fn a_retry_returns_the_identical_value() {
    let ledger = Ledger::new();

    assert_eq!(ledger.zero("k").await.unwrap(), 0);
    assert_eq!(ledger.zero("k").await.unwrap(), 0);
    assert_eq!(ledger.runs(), 1);

    assert_eq!(ledger.empty_string("k").await.unwrap(), "");
    assert_eq!(ledger.empty_string("k").await.unwrap(), "");
    assert_eq!(ledger.runs(), 2);

    assert_eq!(ledger.empty_vec("k").await.unwrap(), Vec::new());
    assert_eq!(ledger.empty_vec("k").await.unwrap(), Vec::new());
    assert_eq!(ledger.runs(), 3);

    assert_eq!(ledger.none("k").await.unwrap(), None);
    assert_eq!(ledger.none("k").await.unwrap(), None);
    assert_eq!(ledger.runs(), 4);

    ledger.unit("k").await.unwrap();
    ledger.unit("k").await.unwrap();
    assert_eq!(ledger.runs(), 5);

    let first = ledger.receipt("k", 1999).await.unwrap();
    let retry = ledger.receipt("k", 1999).await.unwrap();
    assert_eq!(
        first,
        Receipt {
            charge_id: 6,
            cents: 1999,
            note: Some(String::new())
        }
    );
    assert_eq!(retry, first);
    assert_eq!(ledger.runs(), 6);

    let first = ledger.map("k").await.unwrap();
    assert_eq!(ledger.map("k").await.unwrap(), first);
    assert_eq!(ledger.runs(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_body_runs_once_for_100_concurrent_calls_that_wait() {
    let ledger = Ledger::new();
    let mut calls = JoinSet::new();
    for _ in 0..100 {
        let ledger = Arc::clone(&ledger);
        calls.spawn(async move { ledger.slow("k".into()).await });
    }
    let results: Vec<usize> = calls
        .join_all()
        .await
        .into_iter()
        .map(|result| result.unwrap())
        .collect();
    assert_eq!(results, vec![1; 100]);
    assert_eq!(ledger.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_body_runs_once_for_100_concurrent_calls_that_reject() {
    let ledger = Ledger::new();
    let mut calls = JoinSet::new();
    for _ in 0..100 {
        let ledger = Arc::clone(&ledger);
        calls.spawn(async move { ledger.gated("k".into()).await });
    }
    // The owner is held at the gate until every duplicate has been answered.
    for _ in 0..99 {
        let rejected = calls.join_next().await.unwrap().unwrap();
        assert!(is_in_flight(&rejected), "{rejected:?}");
    }
    ledger.gate.add_permits(1);
    let owner = calls.join_next().await.unwrap().unwrap();
    assert_eq!(owner.unwrap(), 1);
    assert_eq!(ledger.runs(), 1);

    assert_eq!(ledger.gated("k".into()).await.unwrap(), 1, "replayed");
    assert_eq!(ledger.runs(), 1);
}

#[tokio::test]
async fn different_keys_run_independently() {
    let ledger = Ledger::new();
    for key in 0..10 {
        assert_eq!(
            ledger.labelled(key).await.unwrap(),
            format!("charged {key}")
        );
    }
    for key in 0..10 {
        assert_eq!(
            ledger.labelled(key).await.unwrap(),
            format!("charged {key}")
        );
    }
    assert_eq!(ledger.runs(), 10);

    // Two keys in flight at once: each is claimed by its own call.
    let mut calls = JoinSet::new();
    for key in ["a", "b"] {
        let ledger = Arc::clone(&ledger);
        calls.spawn(async move { ledger.gated(key.into()).await });
    }
    ledger.started.acquire_many(2).await.unwrap().forget();
    assert!(is_in_flight(&ledger.gated("a".into()).await));
    assert!(is_in_flight(&ledger.gated("b".into()).await));
    ledger.gate.add_permits(2);
    let mut runs: Vec<usize> = calls
        .join_all()
        .await
        .into_iter()
        .map(|result| result.unwrap())
        .collect();
    runs.sort_unstable();
    assert_eq!(runs, [11, 12]);
    assert_eq!(ledger.runs(), 12);
}

#[tokio::test]
async fn an_err_releases_the_key_by_default() {
    let ledger = Ledger::new();
    ledger.fail_first.store(true, Ordering::SeqCst);

    let failed = ledger.flaky("k").await;
    assert!(
        matches!(&failed, Err(AppError::Declined(reason)) if reason == "card network timeout"),
        "{failed:?}"
    );
    assert_eq!(
        ledger.flaky("k").await.unwrap(),
        2,
        "the retry ran the body"
    );
    assert_eq!(
        ledger.flaky("k").await.unwrap(),
        2,
        "the success is replayed"
    );
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn an_err_is_replayed_with_on_error_store() {
    let ledger = Ledger::new();
    let declined = ChargeError::Declined {
        reason: "limit exceeded on run 1".into(),
    };
    assert_eq!(ledger.decline("big", 500).await, Err(declined));
    assert_eq!(
        ledger.decline("big", 500).await,
        Err(ChargeError::Declined {
            reason: "limit exceeded on run 1".into()
        })
    );
    assert_eq!(ledger.runs(), 1);

    assert_eq!(ledger.decline("small", 50).await, Ok(2));
    assert_eq!(ledger.decline("small", 50).await, Ok(2));
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn a_fingerprint_mismatch_surfaces_as_the_users_error() {
    let ledger = Ledger::new();
    let order = Order { id: 7, cents: 100 };
    let receipt = ledger.charge(&order).await.unwrap();

    let changed = Order { id: 7, cents: 200 };
    let mismatch = ledger.charge(&changed).await;
    assert!(
        matches!(
            mismatch,
            Err(AppError::Idempotency(Error::FingerprintMismatch))
        ),
        "{mismatch:?}"
    );
    assert_eq!(ledger.charge(&order).await.unwrap(), receipt);
    assert_eq!(ledger.runs(), 1);
}

#[tokio::test]
async fn ttl_expiry_runs_the_body_again() {
    let ledger = Ledger::new();
    assert_eq!(ledger.hourly("k").await.unwrap(), 1);

    ledger.clock.advance(Duration::from_secs(59 * 60));
    assert_eq!(
        ledger.hourly("k").await.unwrap(),
        1,
        "replayed within the TTL"
    );

    ledger.clock.advance(Duration::from_secs(2 * 60));
    assert_eq!(
        ledger.hourly("k").await.unwrap(),
        2,
        "ran again after the TTL"
    );
    assert_eq!(ledger.hourly("k").await.unwrap(), 2);
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn dropping_the_future_mid_flight_releases_the_key() {
    let ledger = Ledger::new();
    ledger.block_first.store(true, Ordering::SeqCst);

    let first = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.abandoned("k").await }
    });
    ledger.started.acquire().await.unwrap().forget();
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    // The lease is 60 s on a clock that does not move, and this call waits at most 5 s: it can
    // only run if dropping the first call released the key.
    assert_eq!(ledger.abandoned("k").await.unwrap(), 2);
    assert_eq!(ledger.abandoned("k").await.unwrap(), 2);
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn an_invalid_key_fails_before_the_body_runs() {
    let ledger = Ledger::new();
    let result = ledger.zero("").await;
    assert!(
        matches!(result, Err(AppError::Idempotency(Error::InvalidKey(_)))),
        "{result:?}"
    );
    assert_eq!(ledger.runs(), 0);
}

#[tokio::test]
async fn a_scope_separates_tenants() {
    let ledger = Ledger::new();
    assert_eq!(ledger.for_tenant("acme", "k").await.unwrap(), 1);
    assert_eq!(ledger.for_tenant("globex", "k").await.unwrap(), 2);
    assert_eq!(ledger.for_tenant("acme", "k").await.unwrap(), 1);
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn functions_with_one_name_share_keys_and_others_do_not() {
    let ledger = Ledger::new();
    assert_eq!(ledger.charge_v1("k").await.unwrap(), "charged by v1");
    // A renamed or rewritten function keeps its keys when it keeps its `name`.
    assert_eq!(ledger.charge_v2("k").await.unwrap(), "charged by v1");
    assert_eq!(ledger.runs(), 1);
    // Another function's key space is its own.
    assert_eq!(ledger.refund("k").await.unwrap(), "refunded");
    assert_eq!(ledger.runs(), 2);
}

#[tokio::test]
async fn the_default_name_is_the_module_path_and_function_name() {
    let ledger = Ledger::new();
    assert_eq!(ledger.hourly("k").await.unwrap(), 1);

    let call = Call::new("k".parse().unwrap())
        .scope(Scope::new().operation(concat!(module_path!(), "::hourly")));
    let replayed = ledger
        .idempotency
        .run(&call, async { Ok::<usize, ()>(0) })
        .await
        .unwrap();
    assert!(replayed.is_replayed());
    assert_eq!(replayed.into_inner(), Ok(1));
}

#[tokio::test]
async fn a_result_that_cannot_be_encoded_is_returned_once_and_never_rerun() {
    let ledger = Ledger::new();
    assert_eq!(
        ledger.unencodable("k").await.unwrap(),
        HashMap::from([((1, 2), 3)])
    );
    let retry = ledger.unencodable("k").await;
    assert!(
        matches!(retry, Err(AppError::Idempotency(Error::ResultNotRetained))),
        "{retry:?}"
    );
    assert_eq!(ledger.runs(), 1);
}

/// Free functions on the default runtime (here the lazily created in-memory one).
mod on_the_default_runtime {
    use super::*;

    static RUNS: AtomicUsize = AtomicUsize::new(0);

    #[idempotent(key = delivery_id, ttl = "15m")]
    async fn apply(delivery_id: uuid::Uuid, cents: u64) -> Result<(usize, u64), AppError> {
        Ok((RUNS.fetch_add(1, Ordering::SeqCst) + 1, cents))
    }

    #[tokio::test]
    async fn a_free_function_replays_through_the_default_runtime() {
        let id = uuid::Uuid::from_u128(0x8e03978e_40d5_43e8_bc93_6894a57f9324);
        assert_eq!(apply(id, 250).await.unwrap(), (1, 250));
        assert_eq!(apply(id, 250).await.unwrap(), (1, 250));
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);

        let call = Call::new("8e03978e-40d5-43e8-bc93-6894a57f9324".parse().unwrap())
            .scope(Scope::new().operation(concat!(module_path!(), "::apply")));
        let replayed = default_runtime()
            .run(&call, async { Ok::<(usize, u64), ()>((0, 0)) })
            .await
            .unwrap();
        assert_eq!(
            replayed.into_inner(),
            Ok((1, 250)),
            "uuids are hyphenated keys"
        );
    }
}

/// The other shapes behave the same once expanded.
mod shapes {
    use super::*;

    trait Consumer {
        async fn consume(&self, delivery: &str) -> Result<usize, AppError>;
    }

    impl Consumer for Ledger {
        #[idempotent(key = delivery, runtime = &self.idempotency)]
        async fn consume(&self, delivery: &str) -> Result<usize, AppError> {
            Ok(self.ran())
        }
    }

    #[idempotent(key = key, runtime = ledger.idempotency)]
    async fn generic<T>(ledger: &Ledger, key: &str, value: T) -> Result<(usize, T), AppError>
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        Ok((ledger.ran(), value))
    }

    #[tokio::test]
    async fn a_trait_impl_method_replays() {
        let ledger = Ledger::new();
        assert_eq!(ledger.consume("d-1").await.unwrap(), 1);
        assert_eq!(ledger.consume("d-1").await.unwrap(), 1);
        assert_eq!(ledger.consume("d-2").await.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_generic_function_replays() {
        let ledger = Ledger::new();
        assert_eq!(
            generic(&ledger, "k", "first".to_owned()).await.unwrap(),
            (1, "first".to_owned())
        );
        assert_eq!(
            generic(&ledger, "k", "second".to_owned()).await.unwrap(),
            (1, "first".to_owned())
        );
        assert_eq!(ledger.runs(), 1);
    }
}

/// `claim = claim` binds the call's running claim: held, current, and with the operation key
/// of this call's storage key.
#[idempotent(key = key, name = "claims::observe", runtime = idempotency, claim = claim)]
async fn observe_claim(
    idempotency: &Idempotency,
    key: &str,
    runs: &AtomicUsize,
) -> Result<(u64, String, bool), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    claim.check().await?;
    let current = ClaimHandle::current().map(|c| c.token()) == Some(claim.token());
    Ok((
        claim.token().get(),
        claim.operation_key().as_str().to_owned(),
        current && !claim.is_lost(),
    ))
}

#[tokio::test]
async fn claim_binding_gives_the_body_its_claim() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let storage_key = idempotency.storage_key(
        &Call::new(Key::new("order-9").unwrap()).scope(Scope::new().operation("claims::observe")),
    );
    let (token, operation_key, current) =
        observe_claim(&idempotency, "order-9", &runs).await.unwrap();
    assert!(token > 0);
    // The first claim of the key begins the record's lifetime.
    let expected = storage_key.operation_key(FencingToken::new(token));
    assert_eq!(operation_key, expected.as_str());
    assert!(current);
    let replayed = observe_claim(&idempotency, "order-9", &runs).await.unwrap();
    assert_eq!(replayed, (token, operation_key, true));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// A panic in the result's `Serialize` unwound through the armed claim and released the key:
// a retry of the attribute's function ran its body again.
#[tokio::test]
async fn a_result_whose_encoding_panics_is_recorded_not_released() {
    let ledger = Ledger::new();
    let first = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.panics_when_encoded("k").await.map(|_| ()) }
    })
    .await;
    assert!(first.expect_err("the panic reaches the caller").is_panic());
    let retry = ledger.panics_when_encoded("k").await;
    assert!(
        matches!(retry, Err(AppError::Idempotency(Error::ResultNotRetained))),
        "{retry:?}"
    );
    assert_eq!(ledger.runs(), 1, "the body ran once");
}
