//! What a call's outcome becomes: kept for replay or released ([`Retain`]), and what the
//! caller gets back ([`Outcome`], [`Execution`]).

use bytes::Bytes;

/// Whether a fresh outcome is kept for replay or its key released. The one type for this
/// decision: [`Idempotency::run_with`](crate::Idempotency::run_with) and
/// [`execute`](crate::Idempotency::execute) take a function returning it, and so do the HTTP
/// and gRPC layers' `retain` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retain {
    /// Keep the outcome: retries replay it until the TTL ends.
    Keep,
    /// Release the key: the next retry runs the work again (a transient failure).
    Release,
}

/// The result of [`Idempotency::execute`](crate::Idempotency::execute).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution<V> {
    /// The work ran in this call and returned this value.
    Fresh(V),
    /// An earlier call with the same key completed; these are the bytes it retained.
    Replayed(Bytes),
}

/// The result of [`Idempotency::run`](crate::Idempotency::run): the value, and whether it was computed now or replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The work ran in this call.
    Fresh(T),
    /// An earlier call with the same key ran the work; this is its result.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// True if the value was replayed from an earlier call.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }

    /// The value, fresh or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }

    /// A reference to the value.
    pub fn get(&self) -> &T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }
}
