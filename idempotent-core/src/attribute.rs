//! The `#[idempotent]` attribute and its documentation.

/// Makes the effect of an `async fn` happen once per key.
///
/// The first call with a key claims it and runs the body. A retry with the same key (after a
/// client timeout, a broker redelivery, a crash) gets the recorded result instead of a second
/// effect; a duplicate that arrives while the first call is still running is refused, or waits
/// for its result. The function keeps its signature: callers see the same `async fn`.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// use idempotent_core::{Error, idempotent};
/// use serde::{Deserialize, Serialize};
///
/// static CHARGES: AtomicU64 = AtomicU64::new(0);
///
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// struct Receipt {
///     charge_id: u64,
///     cents: u64,
/// }
///
/// #[idempotent(key = order_id, ttl = "24h")]
/// async fn charge(order_id: u64, cents: u64) -> Result<Receipt, Error> {
///     // The effect to protect: in a real service, a call to the payment provider.
///     let charge_id = CHARGES.fetch_add(1, Ordering::SeqCst) + 1;
///     Ok(Receipt { charge_id, cents })
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let first = charge(8472, 1999).await?;
/// let retry = charge(8472, 1999).await?; // replayed: the body does not run again
/// assert_eq!(first, retry);
/// assert_eq!(CHARGES.load(Ordering::SeqCst), 1);
/// # Ok(())
/// # }
/// ```
///
/// # What a call does
///
/// 1. Evaluates `key` (and `scope`, `fingerprint`), borrowing what they name, before the body.
/// 2. Claims the key in the runtime's store (see [`Idempotency`](crate::Idempotency) for the exact semantics):
///    a completed record is replayed without running the body; a record in flight is answered
///    by the in-flight policy.
/// 3. Runs the body, renewing the claim's lease while it runs.
/// 4. Records an `Ok` value for the TTL, so retries replay it. An `Err` releases the key, so
///    the next call runs the body again (unless `on_error = "store"`).
/// 5. If the call's future is dropped or the body panics, the claim is released.
///
/// When the runtime refuses a call (the key is in flight, the key was used with another
/// fingerprint, the key is invalid, the store is down), the body does not run and the function
/// returns `Err(E::from(error))` with the [`Error`](crate::Error); match on it, or use
/// [`Error::code`](crate::Error::code) and [`Error::retry_after`](crate::Error::retry_after).
///
/// # What it accepts
///
/// An `async fn` with a body: a free function, a method with any receiver (`&self`,
/// `&mut self`, `self`, `self: Arc<Self>`, ...), a generic function, a function with borrowed
/// arguments, or an `async fn` in a trait implementation. It must return `Result<T, E>` (or an
/// alias of it) where
///
/// - `T: Serialize + DeserializeOwned` is the value retries replay, and
/// - `E: From<idempotent_core::Error>` receives the runtime's refusals: [`Error`](crate::Error)
///   itself, `Box<dyn std::error::Error + Send + Sync>`, `anyhow::Error`, or your own error
///   type with a `From` impl, and
/// - with `on_error = "store"`, `E: Serialize + DeserializeOwned` too, since errors are then
///   replayed like values.
///
/// The call needs a tokio runtime with the time driver enabled.
///
/// # Arguments
///
/// | argument | value | default |
/// |---|---|---|
/// | `key` | an expression whose type implements [`ToKey`](crate::ToKey) | required |
/// | `ttl` | a duration: how long a result is replayed | the runtime's TTL, 24 h unless configured |
/// | `lease` | a duration: how long a claim lives without renewal | the runtime's lease, 30 s unless configured |
/// | `scope` | an expression of type [`Scope`](crate::Scope) (or a reference to one) | the empty scope |
/// | `fingerprint` | an expression whose type implements `Serialize` | none: every call with the key is the same request |
/// | `name` | a string literal: the function's key space | `"{module_path!()}::{function name}"` |
/// | `on_error` | `"release"` or `"store"` | `"release"` |
/// | `in_flight` | `"reject"` | the runtime's policy, *reject* unless configured |
/// | `wait` | a duration: wait this long for a call in flight | (see `in_flight`) |
/// | `runtime` | an expression: `&Idempotency`, `Idempotency` or `Arc<Idempotency>` | [`default_runtime()`](crate::default_runtime) |
/// | `tx` | the name of the transaction parameter (feature `postgres`) | none: the runtime's store |
/// | `crate` | a path to this crate | `::idempotent_core` |
///
/// A duration is a string in the syntax of [`limits::parse_duration`](crate::limits::parse_duration)
/// — `"500ms"`, `"90s"`, `"15m"`, `"24h"`, `"7d"`, `"1h 30m"`, `"1.5s"` — or an integer number
/// of seconds (`ttl = 3600`). A malformed duration, a missing unit and a zero `wait` are
/// compile errors on the literal, and so are a `ttl` or `lease` outside the ranges of
/// [`limits`](crate::limits) (a TTL from 1 ms to 365 days, a lease from 100 ms to 365 days):
/// the expansion evaluates each in a constant that checks it against those ranges, and the
/// error names the bound it crosses: "ttl must be at most 365d
/// (`idempotent_core::limits::MAX_TTL`): write a duration from 1ms to 365d". An unknown or
/// repeated argument is a compile error on that argument.
///
/// ## `key = <expr>`
///
/// What identifies a call: any expression over the arguments, `self` included. It is borrowed,
/// never moved, so the body can still use what it names. Its type implements [`ToKey`](crate::ToKey):
/// strings, integers, `uuid::Uuid` (feature `uuid`), [`Key`](crate::Key), and your own types. A value that
/// is not a valid key (an empty string, say) fails the call with
/// [`Error::InvalidKey`](crate::Error::InvalidKey) before the body runs.
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// struct Delivery {
///     message_id: String,
///     body: Vec<u8>,
/// }
///
/// struct Consumer {
///     queue: String,
/// }
///
/// impl Consumer {
///     #[idempotent(key = format!("{}/{}", self.queue, delivery.message_id))]
///     async fn apply(&self, delivery: &Delivery) -> Result<usize, Error> {
///         Ok(delivery.body.len())
///     }
/// }
/// ```
///
/// ## `ttl = "24h"`, `lease = "30s"`
///
/// `ttl` is how long a completed result is replayed; after it, the key is forgotten and a call
/// runs the body again. `lease` is how long a claim survives without renewal: the lease is
/// renewed while the body runs, so only a crashed process's claim lapses, after `lease`.
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// #[idempotent(key = report_date, ttl = "7d", lease = "2m")]
/// async fn send_daily_report(report_date: &str) -> Result<(), Error> {
///     Ok(())
/// }
/// ```
///
/// ## `scope = <expr>`
///
/// Whose key it is. Calls in different scopes never share a record, so one tenant can neither
/// replay nor detect another tenant's keys. The expression may use arguments and fields. The
/// scope's operation part is always set to the function's `name`.
///
/// ```
/// # use idempotent_core::{Error, Scope, idempotent};
/// struct Payments {
///     tenant: String,
/// }
///
/// impl Payments {
///     #[idempotent(key = key, scope = Scope::new().tenant(&self.tenant).principal(user))]
///     async fn charge(&self, user: &str, key: &str) -> Result<u64, Error> {
///         Ok(1999)
///     }
/// }
/// ```
///
/// ## `fingerprint = <expr>`
///
/// What the call means. A call that reuses a key with a different fingerprint is refused with
/// [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch), converted into your error
/// type, instead of being answered with another request's result. The value is hashed
/// canonically ([`Fingerprint::of`](crate::Fingerprint::of)).
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// # use serde::Serialize;
/// #[derive(Serialize)]
/// struct Transfer {
///     to: String,
///     cents: u64,
/// }
///
/// #[idempotent(key = key, fingerprint = transfer)]
/// async fn transfer(key: &str, transfer: &Transfer) -> Result<u64, Error> {
///     Ok(transfer.cents)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// transfer("t-1", &Transfer { to: "bob".into(), cents: 100 }).await?;
/// let reused = transfer("t-1", &Transfer { to: "eve".into(), cents: 100 }).await;
/// assert!(matches!(reused, Err(Error::FingerprintMismatch)));
/// # Ok(())
/// # }
/// ```
///
/// ## `name = "..."`
///
/// The function's key space: two functions share records only if they have the same name.
/// The default is the module path and the function's name (`"my_app::billing::charge"`), so
/// renaming or moving the function, or the crate, forgets its keys. Give a name that stays
/// put when records must outlive such a refactoring, or to let a new function take over an
/// old one's keys.
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// #[idempotent(key = order_id, name = "billing.charge.v1")]
/// async fn charge_with_new_provider(order_id: u64) -> Result<(), Error> {
///     Ok(())
/// }
/// ```
///
/// ## `on_error = "release" | "store"`
///
/// What an `Err` does. `"release"` (the default) forgets the call, so the next call with the
/// key runs the body again: right for transient failures (a timeout, an unavailable
/// dependency). `"store"` records the `Err` like an `Ok` and replays it for the TTL: right for
/// deterministic failures (a declined card), and it requires `E: Serialize + DeserializeOwned`.
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// # use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize)]
/// enum ChargeError {
///     Declined { reason: String },
///     Refused { code: String },
/// }
///
/// impl From<Error> for ChargeError {
///     fn from(error: Error) -> Self {
///         ChargeError::Refused { code: error.code().as_str().into() }
///     }
/// }
///
/// #[idempotent(key = order_id, on_error = "store")]
/// async fn charge(order_id: u64, cents: u64) -> Result<u64, ChargeError> {
///     if cents > 10_000 {
///         return Err(ChargeError::Declined { reason: "over the limit".into() });
///     }
///     Ok(cents)
/// }
/// ```
///
/// ## `in_flight = "reject"`, `wait = "5s"`
///
/// What a call does when another call with its key is still running. `in_flight = "reject"`
/// fails at once with [`Error::InFlight`](crate::Error::InFlight), which carries a retry hint.
/// `wait = "5s"` waits up to five seconds for the running call and replays its result; if that
/// call released the key (it failed), the waiting call runs the body itself; if the time runs
/// out, it fails with `Error::InFlight`. Without either, the runtime's policy applies (*reject*
/// unless configured with [`Defaults::in_flight`](crate::Defaults::in_flight)).
/// The two arguments exclude each other.
///
/// ```
/// # use idempotent_core::{Error, idempotent};
/// #[idempotent(key = message_id, wait = "5s")]
/// async fn handle(message_id: &str) -> Result<(), Error> {
///     Ok(())
/// }
///
/// #[idempotent(key = request_id, in_flight = "reject")]
/// async fn create_order(request_id: &str) -> Result<u64, Error> {
///     Ok(1)
/// }
/// ```
///
/// ## `runtime = <expr>`
///
/// The runtime (store and defaults) to use, typically a field of the service, evaluated on
/// each call. Without it, the function uses the [default runtime](#the-default-runtime).
///
/// ```
/// # use idempotent_core::{Error, Idempotency, idempotent};
/// struct Jobs {
///     idempotency: Idempotency,
/// }
///
/// impl Jobs {
///     #[idempotent(key = job_id, runtime = &self.idempotency)]
///     async fn run(&self, job_id: u64) -> Result<(), Error> {
///         Ok(())
///     }
/// }
/// ```
///
/// ## `tx = <parameter>`
///
/// With the `postgres` feature: the claim and the completed record are written in the
/// caller's PostgreSQL transaction, the one the function's parameter holds (a
/// `&mut sqlx::Transaction<'_, Postgres>` or a `&mut PgConnection` inside a transaction), so the
/// body's own writes in that transaction and the record commit together or not at all. The
/// caller commits: after a commit, retries replay the result; after a rollback or a crash,
/// neither the writes nor the record exist, and a retry runs the body again. A concurrent call
/// with the same key waits on the row until the first transaction ends, then replays its
/// result. An `Err` undoes the body's writes (back to a savepoint taken after the claim) and
/// releases the key in the transaction, which stays usable; with `on_error = "store"` the
/// `Err` is recorded, with the writes. See `idempotent_postgres::Transactional` for the
/// details and requirements; the PostgreSQL crate must be a dependency of the crate that
/// uses `tx = ...`.
///
/// `runtime = ...` then names an `idempotent_postgres::Transactional` (from
/// `Transactional::of(&runtime, &store)`), for its table,
/// namespace and defaults; without it, `Transactional::default()` (table
/// `idempotent_records`, the empty namespace). No lease renewal runs: nobody else can see an
/// uncommitted claim.
///
/// ```
/// # #[cfg(feature = "postgres")] {
/// use idempotent_postgres::Transactional;
/// use idempotent_core::{Error, idempotent};
/// use sqlx::{Postgres, Transaction};
///
/// struct Ledger {
///     transactional: Transactional,
/// }
///
/// impl Ledger {
///     #[idempotent(key = transfer_id, tx = tx, runtime = &self.transactional)]
///     async fn transfer(
///         &self,
///         tx: &mut Transaction<'_, Postgres>,
///         transfer_id: &str,
///         cents: i64,
///     ) -> Result<(), Error> {
///         sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = 'alice'")
///             .bind(cents)
///             .execute(&mut **tx)
///             .await
///             .map_err(|e| Error::Payload(e.into()))?;
///         Ok(())
///     }
/// }
///
/// # type BoxError = Box<dyn std::error::Error>;
/// # async fn example(ledger: Ledger, pool: sqlx::PgPool) -> Result<(), BoxError> {
/// let mut tx = pool.begin().await?;
/// ledger.transfer(&mut tx, "t-1", 100).await?;
/// tx.commit().await?; // the debit and its record, together
/// # Ok(())
/// # }
/// # }
/// ```
///
/// ## `crate = path`
///
/// Where the expansion finds this crate when it is not `::idempotent_core`: a renamed
/// dependency, or a framework that re-exports it.
///
/// ```
/// extern crate idempotent_core as idem;
///
/// #[idem::idempotent(key = id, crate = idem)]
/// async fn charge(id: u64) -> Result<(), idem::Error> {
///     Ok(())
/// }
/// ```
///
/// # The default runtime
///
/// Functions without `runtime = ...` use [`default_runtime()`](crate::default_runtime): the runtime the application
/// installed with [`set_default_runtime`](crate::set_default_runtime) at startup, before the first call, or, if it
/// installed none, a runtime with the default settings over a [`MemoryStore`](crate::memory::MemoryStore)
/// created on first use. The in-memory store protects one process; a service with several
/// instances installs a runtime over a shared store.
///
/// ```
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::{Defaults, Idempotency, set_default_runtime};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // In `main`, before serving:
/// let store = MemoryStore::new(); // or a shared store
/// let runtime = Idempotency::builder(store)
///     .namespace("billing")
///     .defaults(Defaults::new().ttl(Duration::from_secs(48 * 3600)))
///     .build();
/// set_default_runtime(runtime).expect("the default runtime is installed once");
/// # }
/// ```
///
/// # Mistakes are compile errors
///
/// Each at the offending token: a function that is not `async`, a missing `key`, an unknown or
/// repeated argument, a zero, out-of-range or malformed duration, a key, scope or fingerprint
/// of the wrong type, a return type that is not a `Result`, a `tx` that names no
/// parameter, a parameter that is not a `&mut` transaction, or a `runtime` that is not a
/// `Transactional`.
///
/// A `T` or an `E` that lacks what [the return type requires](#what-it-accepts) is one error,
/// which names the requirement, on that type as the signature spells it: on `Session` in
/// `Result<Session, Error>`, on `Vec<Session>` in `Result<Vec<Session>>` (an alias that fixes
/// `E`); on the whole return type when an alias hides the type (`-> Charged` with
/// `type Charged = Result<u64, Declined>`).
///
/// ```compile_fail,E0080
/// use idempotent_core::{Error, idempotent};
///
/// // error: ttl must be at least 1ms (`idempotent_core::limits::MIN_TTL`)
/// #[idempotent(key = id, ttl = "0s")]
/// async fn charge(id: u64) -> Result<u64, Error> {
///     Ok(id)
/// }
/// ```
///
/// ```compile_fail,E0277
/// use idempotent_core::{Error, idempotent};
///
/// struct Session {
///     token: String,
/// }
///
/// // error: `Session` cannot be replayed: the `Ok` type of an `#[idempotent]` function must
/// // implement `Serialize` and `DeserializeOwned`
/// #[idempotent(key = user)]
/// async fn open_session(user: &str) -> Result<Session, Error> {
///     Ok(Session { token: user.to_owned() })
/// }
/// ```
///
/// ```compile_fail,E0277
/// use idempotent_core::{Error, idempotent};
///
/// struct OrderId(u64);
///
/// // error: `OrderId` cannot be used as an idempotency key
/// #[idempotent(key = order)]
/// async fn charge(order: OrderId) -> Result<u64, Error> {
///     Ok(order.0)
/// }
/// ```
///
/// # Limitations
///
/// - **Functions only, `async` only, with a body.** On a trait, put the attribute on the
///   implementation's method, not on the declaration; `const fn` and non-`async` functions
///   are rejected.
/// - **The return type must be named.** `Result<impl Trait, E>` is rejected: a replayed value
///   is deserialized into the declared type.
/// - **Methods' default names do not include the type.** An attribute cannot see its `impl`
///   block, so two methods of the same name on two types in one module share a key space
///   unless one has a `name`.
/// - **Generic functions share one key space** across instantiations: a record written by
///   `f::<A>` is replayed to `f::<B>`, and fails with [`Error::Payload`](crate::Error::Payload)
///   if it does not decode as `B`. Put the type in the key when instantiations must not meet.
/// - **Values replay through JSON.** `Some(None)` replays as `None`, and non-finite floats
///   encode as `null` and fail to replay with `Error::Payload`. A value JSON cannot encode at all
///   (a map with non-string keys) is returned to the first caller, and retries get
///   [`Error::ResultNotRetained`](crate::Error::ResultNotRetained) rather than a second run.
/// - **Arguments, expressions and cancellation.** The key, scope and fingerprint expressions run
///   on every call, replays included. The body runs in an inner future, so the arguments it uses
///   are dropped when the body finishes rather than when the function returns. Dropping the
///   call's future releases the key even if the body's effect had already happened: spawn the
///   call (`tokio::spawn`) when it must run to completion regardless of the caller.
/// - **Exactly-once needs an idempotent or transactional effect.** If the process dies between
///   the body's effect and the record, the lease lapses and a retry runs the body again; see the
///   [crate docs](crate#what-it-cannot-do). For database work, `tx = ...` closes that gap.
#[cfg(feature = "macros")]
pub use idempotent_macros::idempotent;

/// Makes an `async fn` a [step](crate::steps) of whatever idempotent operation calls it: its
/// result becomes a checkpoint of that operation, so a later attempt of the same operation
/// gets the saved result instead of running the body again.
///
/// `#[step]` names the step after the function; `#[step(name = "charge")]` names it
/// explicitly (1 to 64 bytes of `[A-Za-z0-9_.-]`, checked at compile time). The function must
/// be `async`, and its return type `T` must be `Serialize + DeserializeOwned`; the attribute
/// changes it to `Result<T, idempotent_core::Error>`, which is
/// [`ClaimHandle::step`](crate::ClaimHandle::step)'s: a lost claim, a refused or failed
/// checkpoint write, or a checkpoint past the limit. Called outside any idempotent call (no
/// [`ClaimHandle::current`](crate::ClaimHandle::current)), the body just runs.
///
/// Whatever the body returns is saved, an `Err` of a `Result` included (a later attempt gets
/// that `Err` back): for work whose failure should run again, use
/// [`ClaimHandle::try_step`](crate::ClaimHandle::try_step). A name is one checkpoint: a
/// second call of the same `#[step]` function in one operation, whatever its arguments,
/// returns the first call's result.
///
/// ```
/// use idempotent_core::{Call, Idempotency, memory::MemoryStore, step};
///
/// struct Shop;
///
/// impl Shop {
///     #[step]
///     async fn reserve(&self, sku: &str) -> String {
///         format!("reservation of {sku}")
///     }
///
///     #[step(name = "charge")]
///     async fn charge_card(&self, cents: u64) -> u64 {
///         cents // the provider's charge id, say
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_core::Error> {
/// let idempotency = Idempotency::new(MemoryStore::new());
/// let shop = Shop;
/// let call = Call::new("order-1".parse()?);
/// let (reservation, charge) = idempotency
///     .run(&call, async {
///         // A step's error (a lost claim, a failed checkpoint) is not a result to keep.
///         let reservation = shop.reserve("tea").await.expect("checkpointed");
///         let charge = shop.charge_card(1999).await.expect("checkpointed");
///         (reservation, charge)
///     })
///     .await?
///     .into_inner();
/// assert_eq!((reservation.as_str(), charge), ("reservation of tea", 1999));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "macros")]
pub use idempotent_macros::step;
