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
//! so every behaviour lives here, in plain Rust, and is tested without the macro. With
//! `tx = <parameter>` (transactional mode, feature `postgres`), the body is three steps instead,
//! see [`postgres`].

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

/// The running claim, for `claim = name`: the expansion calls this at the top of the work,
/// which the runtime (or, with `tx = ...`, [`postgres::with_claim`]) polls with the claim
/// set, so it is always there.
pub fn current_claim() -> crate::ClaimHandle {
    crate::ClaimHandle::current()
        .expect("the work of an #[idempotent] function runs with its claim set")
}

/// One call of an expanded function: where it runs and what identifies it. `R` is the runtime:
/// an [`Idempotency`], or a transactional runtime with `tx = ...`.
#[must_use]
pub struct Invocation<R = Idempotency> {
    runtime: R,
    name: &'static str,
    key: Result<Key, KeyError>,
    scope: Scope,
    fingerprint: Option<Result<Fingerprint, CanonicalError>>,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    in_flight: Option<InFlightPolicy>,
}

impl<R> Invocation<R> {
    /// A call of the function `name` with `key`, through `runtime`.
    pub fn new(runtime: R, name: &'static str, key: Result<Key, KeyError>) -> Self {
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
}

impl Invocation<Idempotency> {
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
    O::from_result(execute(invocation, work, retain_released, replay_released::<O>).await)
}

/// Classifies a result under `on_error = "release"`: an `Ok` is recorded, an `Err` released.
fn retain_released<T: Serialize, E>(result: &Result<T, E>) -> Retain {
    match result {
        Ok(value) => encode(&Ok::<_, ()>(value)),
        Err(_) => Retain::Release,
    }
}

/// Decodes a recorded result under `on_error = "release"`, which records only `Ok`s.
fn replay_released<O: IdempotentResult>(bytes: &[u8]) -> Result<Result<O::Value, O::Error>, Error> {
    match serde_json::from_slice::<Result<O::Value, IgnoredAny>>(bytes) {
        Ok(Ok(value)) => Ok(Ok(value)),
        Ok(Err(_)) => Err(Error::Payload(
            "the recorded result is an error, which `on_error = \"release\"` does not replay"
                .into(),
        )),
        Err(e) => Err(Error::Payload(e.into())),
    }
}

/// Decodes a recorded result under `on_error = "store"`.
fn replay_stored<O>(bytes: &[u8]) -> Result<Result<O::Value, O::Error>, Error>
where
    O: IdempotentResult,
    O::Error: DeserializeOwned,
{
    serde_json::from_slice::<Result<O::Value, O::Error>>(bytes)
        .map_err(|e| Error::Payload(e.into()))
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
            replay_stored::<O>,
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

/// `tx = <parameter>`: the claim, the body and the record in the caller's PostgreSQL
/// transaction ([`Transactional`](crate::Transactional)). An expanded function's body is
///
/// ```text
/// let invocation = __private::Invocation::new(runtime, name, __private::key(&key))...;
/// let pending = match postgres::claim(invocation, postgres::connection(&mut *tx)).await {
///     ControlFlow::Continue(pending) => pending,
///     ControlFlow::Break(replayed_or_refused) => return replayed_or_refused,
/// };
/// let output = { let tx = &mut *tx; async move { original body } }.await;
/// postgres::finish(pending, postgres::connection(&mut *tx), output).await
/// ```
///
/// Three steps rather than one call, because the body borrows the transaction between the
/// claim and the record: a closure that receives it cannot capture borrowed arguments and
/// still be `Send` for every lifetime of the borrow.
#[cfg(feature = "postgres")]
pub mod postgres {
    use std::marker::PhantomData;
    use std::sync::{Arc, OnceLock};

    use serde::Serialize;
    use serde::de::DeserializeOwned;
    use sqlx::pool::PoolConnection;
    use sqlx::postgres::{PgConnection, Postgres};

    pub use core::ops::ControlFlow;

    use super::{
        IdempotentResult, Invocation, encode, replay_released, replay_stored, retain_released,
    };
    use crate::store::postgres::{PendingRecord, RawClaim};
    use crate::{Error, Retain, Transactional};

    /// `runtime = expr` with `tx = ...`.
    pub fn runtime<R: AsTransactional + ?Sized>(runtime: &R) -> Transactional {
        runtime.as_transactional().clone()
    }

    /// No `runtime = ...` with `tx = ...`: [`Transactional::default`].
    pub fn default_runtime() -> Transactional {
        static DEFAULT: OnceLock<Transactional> = OnceLock::new();
        DEFAULT.get_or_init(Transactional::default).clone()
    }

    /// The type of a `runtime = ...` expression with `tx = ...`.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a transactional idempotency runtime",
        label = "expected `&idempotent_core::Transactional`",
        note = "with `tx = ...`, the runtime is a `Transactional`: \
                `PostgresStore::transactional()` makes one"
    )]
    pub trait AsTransactional {
        /// The runtime.
        fn as_transactional(&self) -> &Transactional;
    }

    impl AsTransactional for Transactional {
        fn as_transactional(&self) -> &Transactional {
            self
        }
    }

    impl<T: AsTransactional + ?Sized> AsTransactional for &T {
        fn as_transactional(&self) -> &Transactional {
            (**self).as_transactional()
        }
    }

    impl<T: AsTransactional + ?Sized> AsTransactional for Arc<T> {
        fn as_transactional(&self) -> &Transactional {
            (**self).as_transactional()
        }
    }

    /// What the parameter named by `tx = ...` refers to.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a PostgreSQL transaction",
        label = "expected `&mut sqlx::Transaction<'_, Postgres>` or `&mut PgConnection`"
    )]
    pub trait TransactionArg {
        /// The connection the transaction runs on.
        fn connection(&mut self) -> &mut PgConnection;
    }

    impl TransactionArg for PgConnection {
        fn connection(&mut self) -> &mut PgConnection {
            self
        }
    }

    impl TransactionArg for sqlx::Transaction<'_, Postgres> {
        fn connection(&mut self) -> &mut PgConnection {
            self
        }
    }

    impl TransactionArg for PoolConnection<Postgres> {
        fn connection(&mut self) -> &mut PgConnection {
            self
        }
    }

    /// `&mut *tx`, as the connection the claim and the record are written on.
    pub fn connection<C: TransactionArg + ?Sized>(transaction: &mut C) -> &mut PgConnection {
        transaction.connection()
    }

    /// Decodes a recorded result into the function's `Result`.
    type Replay<O> = fn(
        &[u8],
    ) -> Result<
        Result<<O as IdempotentResult>::Value, <O as IdempotentResult>::Error>,
        Error,
    >;

    /// A claim held in the caller's transaction, waiting for the body's output.
    #[must_use]
    pub struct Pending<O> {
        record: PendingRecord,
        output: PhantomData<fn() -> O>,
    }

    /// Runs the body with the pending record's claim as the current claim.
    pub fn with_claim<O, F: Future>(
        pending: &Pending<O>,
        work: F,
    ) -> impl Future<Output = F::Output> + use<O, F> {
        pending.record.claim().scope(work)
    }

    /// Claims (`on_error = "release"`): `Continue` to run the body, or `Break` with the
    /// function's return value (a replay, or a refusal converted into `E`).
    pub async fn claim<O: IdempotentResult>(
        invocation: Invocation<Transactional>,
        connection: &mut PgConnection,
    ) -> ControlFlow<O, Pending<O>> {
        claim_with(invocation, connection, replay_released::<O>).await
    }

    /// Claims (`on_error = "store"`).
    pub async fn claim_storing_errors<O>(
        invocation: Invocation<Transactional>,
        connection: &mut PgConnection,
    ) -> ControlFlow<O, Pending<O>>
    where
        O: IdempotentResult,
        O::Error: Serialize + DeserializeOwned,
    {
        claim_with(invocation, connection, replay_stored::<O>).await
    }

    /// Records an `Ok` in the transaction, or undoes an `Err`'s writes and releases the key
    /// (`on_error = "release"`).
    pub async fn finish<O: IdempotentResult>(
        pending: Pending<O>,
        connection: &mut PgConnection,
        output: O,
    ) -> O {
        let result = output.into_result();
        let retain = retain_released(&result);
        finish_with(pending, connection, result, retain).await
    }

    /// Records an `Ok` or an `Err` in the transaction (`on_error = "store"`).
    pub async fn finish_storing_errors<O>(
        pending: Pending<O>,
        connection: &mut PgConnection,
        output: O,
    ) -> O
    where
        O: IdempotentResult,
        O::Error: Serialize + DeserializeOwned,
    {
        let result = output.into_result();
        let retain = encode(&result.as_ref());
        finish_with(pending, connection, result, retain).await
    }

    async fn claim_with<O: IdempotentResult>(
        invocation: Invocation<Transactional>,
        connection: &mut PgConnection,
        replay: Replay<O>,
    ) -> ControlFlow<O, Pending<O>> {
        let refused = |error: Error| ControlFlow::Break(O::from_result(Err(error.into())));
        let Invocation {
            runtime,
            name,
            key,
            scope,
            fingerprint,
            ttl,
            lease,
            in_flight,
        } = invocation;
        let key = match key {
            Ok(key) => key,
            Err(error) => return refused(error.into()),
        };
        let mut call = runtime.call(key).scope(scope.operation(name));
        match fingerprint.transpose() {
            Ok(Some(fingerprint)) => call = call.fingerprint(fingerprint),
            Ok(None) => {}
            Err(error) => return refused(error.into()),
        }
        if let Some(ttl) = ttl {
            call = call.ttl(ttl);
        }
        if let Some(lease) = lease {
            call = call.lease(lease);
        }
        if let Some(policy) = in_flight {
            call = call.in_flight(policy);
        }
        match call.claim_raw(connection).await {
            Ok(RawClaim::Run(record)) => ControlFlow::Continue(Pending {
                record,
                output: PhantomData,
            }),
            Ok(RawClaim::Replay(bytes)) => match replay(&bytes) {
                Ok(result) => ControlFlow::Break(O::from_result(result)),
                Err(error) => refused(error),
            },
            Err(error) => refused(error),
        }
    }

    async fn finish_with<O: IdempotentResult>(
        pending: Pending<O>,
        connection: &mut PgConnection,
        result: Result<O::Value, O::Error>,
        retain: Retain,
    ) -> O {
        let released = retain == Retain::Release;
        match pending.record.finish(connection, retain).await {
            Ok(()) => O::from_result(result),
            // The function's own `Err` says more than the failed release; the caller rolls
            // back either way.
            Err(_) if released => O::from_result(result),
            Err(error) => O::from_result(Err(error.into())),
        }
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
