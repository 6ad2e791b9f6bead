//! What `#[idempotent]` expands into. Not a public API: no semver guarantees; only the
//! `idempotent-macros` release pinned by this crate calls it.
//!
//! An expanded function's body is
//!
//! ```text
//! let invocation = __private::Invocation::new(runtime, name, __private::key(&key))
//!     .scope(..).fingerprint(..).ttl(..).lease(..).wait(..);
//! __private::run(invocation, async move { original body }).await
//! ```
//!
//! so every behaviour lives here, in plain Rust, and is tested without the macro.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use serde::de::{DeserializeOwned, IgnoredAny};

pub use core::{concat, module_path};
pub use std::time::Duration;

use crate::{
    Call, CanonicalError, Error, Execution, Fingerprint, Idempotency, InFlightPolicy, Key,
    KeyError, Retain, Scope, ToKey,
};

/// One call of an expanded function: where it runs and what identifies it.
#[must_use]
pub struct Invocation {
    runtime: Idempotency,
    name: &'static str,
    key: Result<Key, KeyError>,
    scope: Scope,
    fingerprint: Option<Result<Fingerprint, CanonicalError>>,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    in_flight: Option<InFlightPolicy>,
}

impl Invocation {
    /// A call of the function `name` with `key`, through `runtime`.
    pub fn new(runtime: Idempotency, name: &'static str, key: Result<Key, KeyError>) -> Self {
        Invocation {
            runtime,
            name,
            key,
            scope: Scope::new(),
            fingerprint: None,
            ttl: None,
            lease: None,
            in_flight: None,
        }
    }

    /// `scope = ...`. Its operation part is replaced by the function's name.
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// `fingerprint = ...`.
    pub fn fingerprint(mut self, fingerprint: Result<Fingerprint, CanonicalError>) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// `ttl = ...`.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// `lease = ...`.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// `wait = ...`.
    pub fn wait(mut self, max: Duration) -> Self {
        self.in_flight = Some(InFlightPolicy::Wait { max });
        self
    }

    /// `in_flight = "reject"`.
    pub fn reject(mut self) -> Self {
        self.in_flight = Some(InFlightPolicy::Reject);
        self
    }

    fn into_call(self) -> Result<(Idempotency, Call), Error> {
        let mut call = Call::new(self.key?).scope(self.scope.operation(self.name));
        if let Some(fingerprint) = self.fingerprint {
            call = call.fingerprint(fingerprint?);
        }
        if let Some(ttl) = self.ttl {
            call = call.ttl(ttl);
        }
        if let Some(lease) = self.lease {
            call = call.lease(lease);
        }
        if let Some(policy) = self.in_flight {
            call = call.in_flight(policy);
        }
        Ok((self.runtime, call))
    }
}

/// `key = expr`.
pub fn key<K: ToKey + ?Sized>(key: &K) -> Result<Key, KeyError> {
    key.to_key()
}

/// `fingerprint = expr`.
pub fn fingerprint<T: Serialize + ?Sized>(value: &T) -> Result<Fingerprint, CanonicalError> {
    Fingerprint::of(value)
}

/// `scope = expr`.
pub fn scope<S: IntoScope + ?Sized>(scope: &S) -> Scope {
    scope.to_scope()
}

/// `runtime = expr`.
pub fn runtime<R: AsRuntime + ?Sized>(runtime: &R) -> Idempotency {
    runtime.as_runtime().clone()
}

/// No `runtime = ...`: the process-wide default.
pub fn default_runtime() -> Idempotency {
    crate::default_runtime().clone()
}

/// The type of a `scope = ...` expression.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency scope",
    label = "expected an `idempotent_core::Scope`",
    note = "build one with `Scope::new().tenant(..).principal(..)`"
)]
pub trait IntoScope {
    /// The scope.
    fn to_scope(&self) -> Scope;
}

impl IntoScope for Scope {
    fn to_scope(&self) -> Scope {
        self.clone()
    }
}

impl<T: IntoScope + ?Sized> IntoScope for &T {
    fn to_scope(&self) -> Scope {
        (**self).to_scope()
    }
}

/// The type of a `runtime = ...` expression.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency runtime",
    label = "expected `&idempotent_core::Idempotency`"
)]
pub trait AsRuntime {
    /// The runtime.
    fn as_runtime(&self) -> &Idempotency;
}

impl AsRuntime for Idempotency {
    fn as_runtime(&self) -> &Idempotency {
        self
    }
}

impl<T: AsRuntime + ?Sized> AsRuntime for &T {
    fn as_runtime(&self) -> &Idempotency {
        (**self).as_runtime()
    }
}

impl<T: AsRuntime + ?Sized> AsRuntime for Arc<T> {
    fn as_runtime(&self) -> &Idempotency {
        (**self).as_runtime()
    }
}

/// The return type of an `#[idempotent]` function: `Result<T, E>` where `T` can be replayed and
/// `E` can carry the runtime's errors.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` functions must return `Result<T, E>`, not `{Self}`",
    label = "expected `Result<T, E>`",
    note = "`T: Serialize + DeserializeOwned` is the value retries replay; \
            `E: From<idempotent_core::Error>` receives the idempotency failures"
)]
pub trait IdempotentResult: Sized {
    /// The value retries replay.
    type Value: Serialize + DeserializeOwned;
    /// The function's error.
    type Error: From<Error>;
    /// As a `Result`.
    fn into_result(self) -> Result<Self::Value, Self::Error>;
    /// From a `Result`.
    fn from_result(result: Result<Self::Value, Self::Error>) -> Self;
}

impl<T, E> IdempotentResult for Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
{
    type Value = T;
    type Error = E;
    fn into_result(self) -> Self {
        self
    }
    fn from_result(result: Self) -> Self {
        result
    }
}

/// `on_error = "release"` (the default): an `Ok` is recorded and replayed; an `Err` releases the
/// key, so the next call runs the body again.
pub async fn run<O, F>(invocation: Invocation, work: F) -> O
where
    O: IdempotentResult,
    F: Future<Output = O>,
{
    O::from_result(
        execute(
            invocation,
            work,
            |result| match result {
                Ok(value) => encode(&Ok::<_, ()>(value)),
                Err(_) => Retain::Release,
            },
            |bytes| match serde_json::from_slice::<Result<O::Value, IgnoredAny>>(bytes) {
                Ok(Ok(value)) => Ok(Ok(value)),
                Ok(Err(_)) => Err(Error::Payload(
                    "the recorded result is an error, which `on_error = \"release\"` does not \
                     replay"
                        .into(),
                )),
                Err(e) => Err(Error::Payload(e.into())),
            },
        )
        .await,
    )
}

/// `on_error = "store"`: `Ok` and `Err` are both recorded and replayed.
pub async fn run_storing_errors<O, F>(invocation: Invocation, work: F) -> O
where
    O: IdempotentResult,
    O::Error: Serialize + DeserializeOwned,
    F: Future<Output = O>,
{
    O::from_result(
        execute(
            invocation,
            work,
            |result| encode(&result.as_ref()),
            |bytes| {
                serde_json::from_slice::<Result<O::Value, O::Error>>(bytes)
                    .map_err(|e| Error::Payload(e.into()))
            },
        )
        .await,
    )
}

/// Records are serde's JSON encoding of a `Result` (`{"Ok": value}` or `{"Err": error}`), so a
/// function can switch `on_error` without orphaning its records.
fn encode<T: Serialize, E: Serialize>(result: &Result<T, E>) -> Retain {
    match serde_json::to_vec(result) {
        Ok(bytes) => Retain::Store(Bytes::from(bytes)),
        Err(error) => {
            // The body ran and its effect happened: a retry must not run it again, so record
            // the call without its result; retries get `Error::ResultNotRetained`.
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "idempotent result cannot be encoded for replay; retries will get result_not_retained"
            );
            Retain::CompleteWithoutResult
        }
    }
}

async fn execute<O, F>(
    invocation: Invocation,
    work: F,
    classify: impl FnOnce(&Result<O::Value, O::Error>) -> Retain,
    replay: impl FnOnce(&[u8]) -> Result<Result<O::Value, O::Error>, Error>,
) -> Result<O::Value, O::Error>
where
    O: IdempotentResult,
    F: Future<Output = O>,
{
    let (runtime, call) = invocation.into_call()?;
    let work = async move { work.await.into_result() };
    match runtime.execute(&call, work, classify).await? {
        Execution::Fresh(result) => result,
        Execution::Replayed(bytes) => replay(&bytes)?,
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::MemoryStore;

    fn invocation(runtime: &Idempotency, key: &str) -> Invocation {
        Invocation::new(runtime.clone(), "tests::op", self::key(key))
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
        assert!(run(invocation(&runtime, "k"), body(true)).await.is_err());
        assert_eq!(
            run(invocation(&runtime, "k"), body(false)).await.unwrap(),
            2
        );
        assert_eq!(
            run(invocation(&runtime, "k"), body(false)).await.unwrap(),
            2
        );
    }

    #[tokio::test]
    async fn a_stored_err_is_replayed() {
        #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
        enum Declined {
            Card(u32),
            Refused(String),
        }
        impl From<Error> for Declined {
            fn from(error: Error) -> Self {
                Declined::Refused(error.code().into())
            }
        }
        let runtime = Idempotency::new(MemoryStore::new());
        let first = run_storing_errors(invocation(&runtime, "k"), async {
            Err::<u8, _>(Declined::Card(1))
        });
        assert_eq!(first.await, Err(Declined::Card(1)));
        let retry = run_storing_errors(invocation(&runtime, "k"), async {
            Err::<u8, _>(Declined::Card(2))
        });
        assert_eq!(retry.await, Err(Declined::Card(1)));
    }

    #[tokio::test]
    async fn records_are_serdes_encoding_of_a_result_under_the_operation_name() {
        let runtime = Idempotency::new(MemoryStore::new());
        let scope = Scope::new().tenant("acme");
        let fresh = run(invocation(&runtime, "k").scope(scope.clone()), async {
            Ok::<_, Error>(vec![1u8, 2])
        });
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
            run::<Result<u8, Error>, _>(invalid, never).await,
            Err(Error::InvalidKey(_))
        ));

        let unfingerprintable = invocation(&runtime, "k").fingerprint(fingerprint(&f64::NAN));
        let never = async { unreachable!("the work must not run") };
        assert!(matches!(
            run::<Result<u8, Error>, _>(unfingerprintable, never).await,
            Err(Error::Fingerprint(_))
        ));
    }

    #[tokio::test]
    async fn an_unencodable_value_is_returned_once_and_never_rerun() {
        let runtime = Idempotency::new(MemoryStore::new());
        let value = HashMap::from([((1u8, 2u8), 3u8)]);
        let fresh = run(invocation(&runtime, "k"), async {
            Ok::<_, Error>(value.clone())
        });
        assert_eq!(fresh.await.unwrap(), value);
        let retry = run(invocation(&runtime, "k"), async {
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
}
