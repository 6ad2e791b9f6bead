//! Unit tests of the expansion target (`super`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::memory::MemoryStore;

fn invocation(runtime: &Idempotency, key: &str) -> Invocation {
    Invocation::new(runtime.clone(), "tests::op", self::key(key))
}

/// What the expansion builds under `on_error = "release"`.
fn releasing<T: Replayable, E: FromIdempotencyError>() -> Returns<Result<T, E>, T, E> {
    returns(value(), refused())
}

/// What the expansion builds under `on_error = "store"`.
fn storing<T, E>() -> Returns<Result<T, E>, T, E>
where
    T: Replayable,
    E: FromIdempotencyError + StorableError,
{
    releasing().storing_errors(stored_errors())
}

#[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
enum Declined {
    Card(u32),
    Refused(String),
}

impl From<Error> for Declined {
    fn from(error: Error) -> Self {
        Declined::Refused(error.code().as_str().into())
    }
}

#[tokio::test]
async fn an_ok_is_replayed_and_an_err_released() {
    let runtime = Idempotency::new(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let body = |fail: bool| {
        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if fail {
                Err(Error::ResultNotRetained)
            } else {
                Ok(run)
            }
        }
    };
    let call = |fail| run(invocation(&runtime, "k"), releasing(), body(fail));
    assert!(call(true).await.is_err());
    assert_eq!(call(false).await.unwrap(), 2);
    assert_eq!(call(false).await.unwrap(), 2);
}

#[tokio::test]
async fn a_stored_err_is_replayed() {
    let runtime = Idempotency::new(MemoryStore::new());
    let first = run(invocation(&runtime, "k"), storing(), async {
        Err::<u8, _>(Declined::Card(1))
    });
    assert_eq!(first.await, Err(Declined::Card(1)));
    let retry = run(invocation(&runtime, "k"), storing(), async {
        Err::<u8, _>(Declined::Card(2))
    });
    assert_eq!(retry.await, Err(Declined::Card(1)));
    let ok = run(invocation(&runtime, "ok"), storing(), async {
        Ok::<u8, Declined>(7)
    });
    assert_eq!(ok.await, Ok(7));
    let retry = run(invocation(&runtime, "ok"), storing(), async {
        Ok::<u8, Declined>(8)
    });
    assert_eq!(retry.await, Ok(7));
}

#[tokio::test]
async fn a_stored_err_is_serdes_encoding_and_only_stores_replay_it() {
    let runtime = Idempotency::new(MemoryStore::new());
    let stored = run(invocation(&runtime, "k"), storing(), async {
        Err::<u8, _>(Declined::Card(3))
    });
    assert_eq!(stored.await, Err(Declined::Card(3)));

    let call = Call::new(Key::new("k").unwrap()).scope(Scope::new().operation("tests::op"));
    let replayed = runtime
        .run(&call, async { Ok::<u8, Declined>(0) })
        .await
        .unwrap();
    assert!(replayed.is_replayed());
    assert_eq!(replayed.into_inner(), Err(Declined::Card(3)));

    // A function switched to `on_error = "release"` refuses the stored error, and runs
    // nothing.
    let never = async { unreachable!("the work must not run") };
    let released = run(
        invocation(&runtime, "k"),
        releasing::<u8, Declined>(),
        never,
    );
    assert_eq!(
        released.await,
        Err(Declined::Refused("payload_error".into()))
    );
}

#[tokio::test]
async fn a_stored_err_of_another_type_is_a_payload_error() {
    #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
    enum Other {
        Code(u8),
        Refused(String),
    }
    impl From<Error> for Other {
        fn from(error: Error) -> Self {
            Other::Refused(error.code().as_str().into())
        }
    }
    let runtime = Idempotency::new(MemoryStore::new());
    let stored = run(invocation(&runtime, "k"), storing(), async {
        Err::<u8, _>(Declined::Card(4))
    });
    assert_eq!(stored.await, Err(Declined::Card(4)));
    let never = async { unreachable!("the work must not run") };
    let replayed = run(invocation(&runtime, "k"), storing::<u8, Other>(), never);
    assert_eq!(replayed.await, Err(Other::Refused("payload_error".into())));
}

#[tokio::test]
async fn records_are_serdes_encoding_of_a_result_under_the_operation_name() {
    let runtime = Idempotency::new(MemoryStore::new());
    let scope = Scope::new().tenant("acme");
    let fresh = run(
        invocation(&runtime, "k").scope(scope.clone()),
        releasing(),
        async { Ok::<_, Error>(vec![1u8, 2]) },
    );
    assert_eq!(fresh.await.unwrap(), vec![1, 2]);

    let call = Call::new(Key::new("k").unwrap()).scope(scope.operation("tests::op"));
    let replayed = runtime
        .run(&call, async { Ok::<Vec<u8>, ()>(vec![]) })
        .await
        .unwrap();
    assert!(replayed.is_replayed());
    assert_eq!(replayed.into_inner(), Ok(vec![1, 2]));
}

#[tokio::test]
async fn refusals_reach_the_callers_error_before_the_work_runs() {
    let runtime = Idempotency::new(MemoryStore::new());
    let never = async { unreachable!("the work must not run") };
    let invalid = Invocation::new(runtime.clone(), "tests::op", key(""));
    assert!(matches!(
        run(invalid, releasing::<u8, Error>(), never).await,
        Err(Error::InvalidKey(_))
    ));

    let unfingerprintable = invocation(&runtime, "k").fingerprint(fingerprint(&f64::NAN));
    let never = async { unreachable!("the work must not run") };
    assert!(matches!(
        run(unfingerprintable, releasing::<u8, Error>(), never).await,
        Err(Error::Fingerprint(_))
    ));
}

#[tokio::test]
async fn an_unencodable_value_is_returned_once_and_never_rerun() {
    let runtime = Idempotency::new(MemoryStore::new());
    let value = HashMap::from([((1u8, 2u8), 3u8)]);
    let fresh = run(invocation(&runtime, "k"), releasing(), async {
        Ok::<_, Error>(value.clone())
    });
    assert_eq!(fresh.await.unwrap(), value);
    let retry = run(invocation(&runtime, "k"), releasing(), async {
        Ok::<_, Error>(HashMap::<(u8, u8), u8>::new())
    });
    assert!(matches!(retry.await, Err(Error::ResultNotRetained)));
}

#[test]
fn keys_convert_from_strings_integers_and_references() {
    assert_eq!(key("order-1").unwrap().as_str(), "order-1");
    assert_eq!(key(&String::from("a b")).unwrap().as_str(), "a b");
    assert_eq!(key(&-42i64).unwrap().as_str(), "-42");
    assert_eq!(key(&&7u8).unwrap().as_str(), "7");
    assert_eq!(key(&Arc::<str>::from("x")).unwrap().as_str(), "x");
    assert!(key("").is_err());
}
