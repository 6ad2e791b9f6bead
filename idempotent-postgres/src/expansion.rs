//! The expansion target of `#[idempotent(tx = ...)]`: the claim, the body and the record in
//! the caller's PostgreSQL transaction.

use std::sync::{Arc, OnceLock};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, Postgres};

pub use core::ops::ControlFlow;

use crate::Transactional;
use crate::{PendingRecord, RawClaim};
use idempotent_core::__private::{Invocation, Returns};
use idempotent_core::{Error, Retain};

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
    label = "expected `&idempotent_postgres::Transactional`",
    note = "with `tx = ...`, the runtime is a `Transactional`: \
            `Transactional::of(&runtime, &store)` makes one"
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

/// A claim held in the caller's transaction, waiting for the body's output.
#[must_use]
pub struct Pending<O, T, E> {
    record: PendingRecord,
    returns: Returns<O, T, E>,
}

/// Runs the body with the pending record's claim as the current claim.
pub fn with_claim<O, T, E, F: Future>(
    pending: &Pending<O, T, E>,
    work: F,
) -> impl Future<Output = F::Output> + use<O, T, E, F> {
    pending.record.claim().scope(work)
}

/// Claims: `Continue` to run the body, or `Break` with the function's return value (a
/// replay, or a refusal converted into `E`).
pub async fn claim<O, T, E>(
    invocation: Invocation<Transactional>,
    returns: Returns<O, T, E>,
    connection: &mut PgConnection,
) -> ControlFlow<O, Pending<O, T, E>> {
    let refused = |returns: &Returns<O, T, E>, error: Error| {
        ControlFlow::Break(returns.from_result(Err(returns.refuse(error))))
    };
    let (runtime, call) = invocation.into_call();
    let call = match call {
        Ok(call) => call,
        Err(error) => {
            runtime.count_refused(&error);
            return refused(&returns, error);
        }
    };
    match runtime.claim_raw(&call, connection).await {
        Ok(RawClaim::Run(record)) => ControlFlow::Continue(Pending { record, returns }),
        Ok(RawClaim::Replay(bytes)) => match returns.replay(&bytes) {
            Ok(result) => ControlFlow::Break(returns.from_result(result)),
            Err(error) => refused(&returns, error),
        },
        Err(error) => refused(&returns, error),
    }
}

/// Records the body's output in the transaction: an `Ok`, or an `Err` under
/// `on_error = "store"`; under `on_error = "release"`, an `Err` undoes the body's writes
/// and releases the key.
pub async fn finish<O, T, E>(
    pending: Pending<O, T, E>,
    connection: &mut PgConnection,
    output: O,
) -> O {
    let Pending { record, returns } = pending;
    let result = returns.into_result(output);
    let retain = returns.retain(&result);
    let released = retain == Retain::Release;
    // Encoded before the write, so that the future holds bytes rather than a borrow of
    // the result: it stays `Send` for results that are `Send` but not `Sync`.
    let encoded = match retain {
        Retain::Keep => returns.encode(&result),
        Retain::Release => None,
    };
    let finished = record.finish(connection, retain, encoded).await;
    let result = match finished {
        Ok(()) => result,
        // The function's own `Err` says more than the failed release; the caller rolls
        // back either way.
        Err(_) if released => result,
        Err(error) => Err(returns.refuse(error)),
    };
    returns.from_result(result)
}
