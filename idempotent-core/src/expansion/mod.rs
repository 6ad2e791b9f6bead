//! What `#[idempotent]` expands into. Not a public API: no semver guarantees; only the
//! `idempotent-macros` release pinned by this crate calls it.
//!
//! An expanded function's body is
//!
//! ```text
//! let invocation = __private::Invocation::new(runtime, name, __private::key(&key))
//!     .scope(..).fingerprint(..)
//!     .options(__private::CallOptions::new().ttl(TTL).lease(LEASE).in_flight(..));
//! let returns = __private::returns::<R>(
//!     __private::value::<<R as __private::IdempotentResult>::Value>(),
//!     __private::refused::<<R as __private::IdempotentResult>::Error>(),
//! ); // and `.storing_errors(__private::stored_errors::<..>())` with `on_error = "store"`
//! __private::run(invocation, returns, async move { original body }).await
//! ```
//!
//! where `R` is the declared return type, so every behaviour lives here, in plain Rust, and is
//! tested without the macro. `TTL` is a block that evaluates the literal in a constant,
//! `{ const __IDEMPOTENT_TTL: __private::Duration = __private::ttl(secs, nanos); __IDEMPOTENT_TTL }`,
//! so that a literal outside [`limits`](crate::limits) is a compile error; `LEASE` is the same
//! with [`lease`]. With
//! `tx = <parameter>` (transactional mode, feature `postgres`), the body is three steps instead,
//! see [`postgres`].

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use serde::de::{DeserializeOwned, IgnoredAny};

pub use crate::{CallOptions, InFlightPolicy};
pub use core::{concat, module_path};
pub use std::time::Duration;

use crate::metrics::{ProtocolLabel, RequestOutcome};
use crate::{
    Call, CanonicalError, Error, Execution, Fingerprint, Idempotency, Key, KeyError, Retain, Scope,
    ToKey,
};

/// A `#[step]` function's body as step `name` of the operation running on this task; outside
/// any idempotent call, the body just runs.
pub async fn step<T, F>(name: &'static str, work: F) -> Result<T, crate::Error>
where
    T: Serialize + DeserializeOwned,
    F: Future<Output = T>,
{
    match crate::ClaimHandle::current() {
        Some(claim) => claim.step(name, work).await,
        None => Ok(work.await),
    }
}

/// The running claim, for `claim = name`: the expansion calls this at the top of the work,
/// which the runtime (or, with `tx = ...`, `idempotent_postgres::__private::with_claim`) polls with the claim
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
    options: CallOptions,
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
            options: CallOptions::new(),
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

    /// `ttl = ...`, `lease = ...`, `wait = ...` and `in_flight = ...`.
    pub fn options(mut self, options: CallOptions) -> Self {
        self.options = options;
        self
    }

    /// The runtime, and the call or the error that stops the call before it claims.
    pub fn into_call(self) -> (R, Result<Call, Error>) {
        let call = (|| {
            let mut call = Call::new(self.key?)
                .scope(self.scope.operation(self.name))
                .options(self.options);
            if let Some(fingerprint) = self.fingerprint {
                call = call.fingerprint(fingerprint?);
            }
            Ok(call)
        })();
        (self.runtime, call)
    }
}

/// `ttl = "..."`: the literal's duration, `Duration::new(secs, nanos)`. The expansion calls it in
/// a constant, spanned at the literal, so a TTL outside [`limits`](crate::limits) is a compile
/// error there that names the bound it crosses.
#[track_caller]
pub const fn ttl(secs: u64, nanos: u32) -> Duration {
    crate::limits::require_const(crate::limits::Setting::Ttl, Duration::new(secs, nanos))
}

/// `lease = "..."`: like [`ttl`], for the lease's range.
#[track_caller]
pub const fn lease(secs: u64, nanos: u32) -> Duration {
    crate::limits::require_const(crate::limits::Setting::Lease, Duration::new(secs, nanos))
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

/// The return type of an `#[idempotent]` function: `Result<T, E>`, checked by [`returns`]. What
/// `T` and `E` must implement is checked separately, each where the signature names the type.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` functions must return `Result<T, E>`, not `{Self}`",
    label = "expected `Result<T, E>`",
    note = "`T: Serialize + DeserializeOwned` is the value retries replay; \
            `E: From<idempotent_core::Error>` receives the idempotency failures"
)]
pub trait IdempotentResult: Sized {
    /// The value retries replay.
    type Value;
    /// The function's error.
    type Error;
    /// As a `Result`.
    fn into_result(self) -> Result<Self::Value, Self::Error>;
    /// From a `Result`.
    fn from_result(result: Result<Self::Value, Self::Error>) -> Self;
}

impl<T, E> IdempotentResult for Result<T, E> {
    type Value = T;
    type Error = E;
    fn into_result(self) -> Self {
        self
    }
    fn from_result(result: Self) -> Self {
        result
    }
}

/// The `Ok` type of an `#[idempotent]` function, checked by [`value`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be replayed: the `Ok` type of an `#[idempotent]` function must \
               implement `Serialize` and `DeserializeOwned`",
    label = "not `Serialize + DeserializeOwned`",
    note = "retries get the `Ok` value back from its JSON record: derive or implement \
            `serde::Serialize` and `serde::Deserialize` for it"
)]
pub trait Replayable: Serialize + DeserializeOwned {}

// `do_not_recommend`: a type that lacks both serde traits is one error, "not `Replayable`",
// rather than one per missing trait.
#[diagnostic::do_not_recommend]
impl<T: Serialize + DeserializeOwned> Replayable for T {}

/// The error type of an `#[idempotent]` function, checked by [`refused`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idempotency failures: the error type of an `#[idempotent]` \
               function must implement `From<idempotent_core::Error>`",
    label = "no `From<idempotent_core::Error>`",
    note = "a call the runtime refuses (a key in flight, a fingerprint mismatch, a store \
            failure) returns `Err(E::from(error))`: use `idempotent_core::Error` or \
            `Box<dyn std::error::Error + Send + Sync>`, or implement \
            `From<idempotent_core::Error>` for it"
)]
pub trait FromIdempotencyError: From<Error> {}

#[diagnostic::do_not_recommend]
impl<E: From<Error>> FromIdempotencyError for E {}

/// The error type of an `#[idempotent]` function with `on_error = "store"`, checked by
/// [`stored_errors`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored: with `on_error = \"store\"`, the error type of an \
               `#[idempotent]` function must implement `Serialize` and `DeserializeOwned`",
    label = "not `Serialize + DeserializeOwned`",
    note = "retries get a stored `Err` back from its JSON record: derive or implement \
            `serde::Serialize` and `serde::Deserialize` for it, or keep \
            `on_error = \"release\"`, which stores no error"
)]
pub trait StorableError: Serialize + DeserializeOwned {}

#[diagnostic::do_not_recommend]
impl<E: Serialize + DeserializeOwned> StorableError for E {}

/// How the runtime records, replays and refuses the return value `O` (`Result<T, E>`) of a
/// function.
///
/// The expansion builds it with [`returns`], [`value`], [`refused`] and, with
/// `on_error = "store"`, [`stored_errors`], each called with the type it checks, where the
/// signature spells that type: a type that lacks a bound is reported there, once. What the
/// bounds provide is kept here as function pointers, so the runners ([`run`],
/// `idempotent_postgres::__private::{claim, finish}`) have no bound left to report a second time.
pub struct Returns<O, T, E> {
    value: Value<T>,
    refused: fn(Error) -> E,
    stored_errors: Option<StoredErrors<E>>,
    into_result: fn(O) -> Result<T, E>,
    from_result: fn(Result<T, E>) -> O,
}

/// The `Ok` half of a record, from [`value`].
pub struct Value<T> {
    encode: fn(&T) -> Option<Bytes>,
    decode: fn(&[u8]) -> serde_json::Result<Result<T, IgnoredAny>>,
}

/// The `Err` half of a record under `on_error = "store"`, from [`stored_errors`].
pub struct StoredErrors<E> {
    encode: fn(&E) -> Option<Bytes>,
    decode: fn(&[u8]) -> serde_json::Result<E>,
}

/// Checks the `Ok` type: the value retries replay.
pub fn value<T: Replayable>() -> Value<T> {
    Value {
        encode: |value| encode(&Ok::<_, ()>(value)),
        decode: |bytes| serde_json::from_slice(bytes),
    }
}

/// Checks the error type: it receives the runtime's refusals.
pub fn refused<E: FromIdempotencyError>() -> fn(Error) -> E {
    <E as From<Error>>::from
}

/// Checks the error type under `on_error = "store"`: stored errors are replayed.
pub fn stored_errors<E: StorableError>() -> StoredErrors<E> {
    /// The `Err` variant of a record, `{"Err": error}`; only read once the record is known to
    /// be an `Err`.
    #[derive(serde::Deserialize)]
    struct ErrRecord<E> {
        #[serde(rename = "Err")]
        error: E,
    }
    StoredErrors {
        encode: |error| encode(&Err::<(), _>(error)),
        decode: |bytes| serde_json::from_slice::<ErrRecord<E>>(bytes).map(|record| record.error),
    }
}

/// Checks the return type, and makes the [`Returns`] of `on_error = "release"` (the default):
/// an `Ok` is recorded and replayed; an `Err` releases the key, so the next call runs the body
/// again.
pub fn returns<O: IdempotentResult>(
    value: Value<O::Value>,
    refused: fn(Error) -> O::Error,
) -> Returns<O, O::Value, O::Error> {
    Returns {
        value,
        refused,
        stored_errors: None,
        into_result: O::into_result,
        from_result: O::from_result,
    }
}

impl<O, T, E> Returns<O, T, E> {
    /// The function's refusal: an [`Error`] converted into its error type.
    pub fn refuse(&self, error: Error) -> E {
        (self.refused)(error)
    }

    /// The function's return value from a result.
    pub fn from_result(&self, result: Result<T, E>) -> O {
        (self.from_result)(result)
    }

    /// The function's return value as a result.
    pub fn into_result(&self, output: O) -> Result<T, E> {
        (self.into_result)(output)
    }

    /// `on_error = "store"`: `Ok` and `Err` are both recorded and replayed.
    pub fn storing_errors(self, errors: StoredErrors<E>) -> Self {
        Returns {
            stored_errors: Some(errors),
            ..self
        }
    }

    /// Whether a fresh result is kept: an `Ok` always, an `Err` under `on_error = "store"`.
    pub fn retain(&self, result: &Result<T, E>) -> Retain {
        match (result, &self.stored_errors) {
            (Ok(_), _) | (Err(_), Some(_)) => Retain::Keep,
            (Err(_), None) => Retain::Release,
        }
    }

    /// The record of a kept result; `None` if it cannot be encoded.
    pub fn encode(&self, result: &Result<T, E>) -> Option<Bytes> {
        match (result, &self.stored_errors) {
            (Ok(value), _) => (self.value.encode)(value),
            (Err(error), Some(stored)) => (stored.encode)(error),
            (Err(_), None) => None,
        }
    }

    /// Decodes a recorded result.
    pub fn replay(&self, bytes: &[u8]) -> Result<Result<T, E>, Error> {
        let payload = |error: serde_json::Error| Error::Payload(error.into());
        match (self.value.decode)(bytes).map_err(payload)? {
            Ok(value) => Ok(Ok(value)),
            Err(IgnoredAny) => match &self.stored_errors {
                Some(stored) => (stored.decode)(bytes).map(Err).map_err(payload),
                None => Err(Error::Payload(
                    "the recorded result is an error, which `on_error = \"release\"` does not \
                     replay"
                        .into(),
                )),
            },
        }
    }
}

/// Runs an expanded function's body once per key: a fresh result is recorded as `returns` says,
/// a recorded one replayed, a refusal converted into the function's error.
pub async fn run<O, T, E, F>(invocation: Invocation, returns: Returns<O, T, E>, work: F) -> O
where
    F: Future<Output = O>,
{
    (returns.from_result)(execute(invocation, &returns, work).await)
}

async fn execute<O, T, E, F>(
    invocation: Invocation,
    returns: &Returns<O, T, E>,
    work: F,
) -> Result<T, E>
where
    F: Future<Output = O>,
{
    let refused = returns.refused;
    let into_result = returns.into_result;
    let (runtime, call) = invocation.into_call();
    let call = call.map_err(|error| {
        runtime.count(ProtocolLabel::Call, RequestOutcome::of_error(&error));
        refused(error)
    })?;
    let work = async move { into_result(work.await) };
    let execution = runtime
        .execute(
            &call,
            work,
            |result| returns.retain(result),
            |result| returns.encode(result),
        )
        .await;
    runtime.inner.metrics().call(&execution);
    let execution = execution.map_err(refused)?;
    match execution {
        Execution::Fresh(result) => result,
        Execution::Replayed(bytes) => returns.replay(&bytes).map_err(refused)?,
    }
}

/// Records are serde's JSON encoding of a `Result` (`{"Ok": value}` or `{"Err": error}`), so a
/// function can switch `on_error` without orphaning its records.
fn encode<T: Serialize, E: Serialize>(result: &Result<T, E>) -> Option<Bytes> {
    match serde_json::to_vec(result) {
        Ok(bytes) => Some(Bytes::from(bytes)),
        Err(error) => {
            // The body ran and its effect happened: a retry must not run it again, so record
            // the call without its result; retries get `Error::ResultNotRetained`.
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "idempotent result cannot be encoded for replay; retries will get result_not_retained"
            );
            None
        }
    }
}

// `tx = <parameter>` expands into `idempotent_postgres::__private` instead, whose steps use
// [`Invocation::into_call`] and the [`Returns`] methods above: the claim, the body and the
// record in the caller's PostgreSQL transaction. An expanded function's body is
//
// ```text
// let invocation = __private::Invocation::new(runtime, name, __private::key(&key))...;
// let returns = __private::returns::<R>(..); // as without `tx`
// let pending = match postgres::claim(invocation, returns, postgres::connection(&mut *tx)).await {
//     ControlFlow::Continue(pending) => pending,
//     ControlFlow::Break(replayed_or_refused) => return replayed_or_refused,
// };
// let output = { let tx = &mut *tx; async move { original body } }.await;
// postgres::finish(pending, postgres::connection(&mut *tx), output).await
// ```
//
// Three steps rather than one call, because the body borrows the transaction between the
// claim and the record: a closure that receives it cannot capture borrowed arguments and
// still be `Send` for every lifetime of the borrow.

#[cfg(all(test, feature = "memory"))]
mod tests;
