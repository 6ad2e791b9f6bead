//! One call and its settings: [`Call`] (what identifies it), [`CallOptions`] (its overrides)
//! and [`Defaults`] (what a runtime uses where a call sets nothing).

use std::marker::PhantomData;
use std::time::Duration;

use crate::capability::{NeedsCheckpoints, NeedsKeys, NeedsSessions};
use crate::limits::{Setting, clamped};
use crate::session::{DEFAULT_SESSION_IDLE, DEFAULT_SESSION_WINDOW, InSession};
use crate::{Fingerprint, Key, Scope};

/// Default time a completed record is kept: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default lease of an in-flight claim: 30 seconds, renewed every third of it while the work runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default largest result retained for replay: 1 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1 << 20;

/// What a call does when it finds its key claimed by a call still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InFlightPolicy {
    /// Fail at once with [`Error::InFlight`](crate::Error::InFlight) (HTTP 409 with
    /// `Retry-After`). The default.
    #[default]
    Reject,
    /// Wait up to `max` for the running call to finish, then replay its result. If it released
    /// its claim (it failed transiently), this call claims the key and runs the work itself. If
    /// `max` passes first, fail with [`Error::InFlight`](crate::Error::InFlight).
    ///
    /// Every `max` is accepted (see [`limits`](crate::limits)): zero answers at once, like
    /// [`Reject`](Self::Reject), and [`Duration::MAX`] (or any `max` too far away for the clock)
    /// waits with no deadline, until the running call finishes, releases its claim or lets its
    /// lease end.
    Wait {
        /// The longest this call waits.
        max: Duration,
    },
}

/// One idempotent call: its key, who the key belongs to, what the request means, and its
/// [`CallOptions`]. The standalone runtime ([`Idempotency`](crate::Idempotency)) and the
/// PostgreSQL transactional mode take the same `Call`.
///
/// ```
/// use idempotent_core::{Call, CallOptions, Fingerprint, InFlightPolicy, Scope};
/// use std::time::Duration;
///
/// let call = Call::new("order-42".parse()?)
///     .scope(Scope::new().tenant("acme").operation("charge"))
///     .fingerprint(Fingerprint::of(&("EUR", 1999u64))?)
///     .options(
///         CallOptions::new()
///             .ttl(Duration::from_secs(3600))
///             .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(5) }),
///     );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A call's type says what it needs of its runtime's store (see
/// [`capability`](crate::capability)): [`Call::new`] makes a `Call` (= `Call<NeedsKeys>`), which
/// every runtime runs; [`Call::in_session`] a `Call<NeedsSessions>`, which only a runtime whose
/// store serves sessions runs; [`Call::resume`] a `Call<NeedsCheckpoints>`.
#[derive(Clone, Debug)]
#[must_use]
pub struct Call<N = NeedsKeys> {
    key: Key,
    scope: Scope,
    fingerprint: Fingerprint,
    options: CallOptions,
    session: Option<InSession>,
    resume_only: bool,
    /// Set by [`Call::resume`]: the record the call is on, named directly.
    at: Option<crate::StorageKey>,
    need: PhantomData<fn() -> N>,
}

impl Call {
    /// A call with `key`, the empty scope, the empty fingerprint and no overrides.
    pub fn new(key: Key) -> Self {
        Call {
            key,
            scope: Scope::new(),
            fingerprint: Fingerprint::empty(),
            options: CallOptions::new(),
            session: None,
            resume_only: false,
            at: None,
            need: PhantomData,
        }
    }
}

impl Call<NeedsSessions> {
    /// A call numbered `place` in the [client session](crate::session) named `id` (a
    /// session id follows the rules of a [`Key`]), with the empty scope, the empty fingerprint
    /// and no overrides. The session is scoped like a key: the same id in two scopes names
    /// two sessions. Its records live as long as the session
    /// ([`Defaults::session_idle`]): the call's TTL is not used.
    ///
    /// ```
    /// use idempotent_core::session::InSession;
    /// use idempotent_core::{Call, Idempotency};
    /// use idempotent_core::memory::MemoryStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let idempotency = Idempotency::new(MemoryStore::new());
    /// let first = Call::in_session("device-7".parse()?, InSession::new(1, 0)?);
    /// assert_eq!(idempotency.run(&first, async { 10u32 }).await?.into_inner(), 10);
    /// // Lost answer: the same number again is a replay, whatever its ack.
    /// assert!(idempotency.run(&first, async { 11u32 }).await?.is_replayed());
    /// // The client holds answer 1 and says so: request 1 is gone for good.
    /// let next = Call::in_session("device-7".parse()?, InSession::new(2, 1)?);
    /// idempotency.run(&next, async { 20u32 }).await?;
    /// let late = idempotency.run(&first, async { 12u32 }).await;
    /// assert!(matches!(late, Err(idempotent_core::Error::SequenceAcknowledged { .. })));
    /// # Ok(())
    /// # }
    /// ```
    pub fn in_session(id: Key, place: InSession) -> Self {
        Call {
            session: Some(place),
            ..Call::new(id).needing()
        }
    }
}

impl Call<NeedsCheckpoints> {
    /// A completer's call on an [abandoned](crate::steps::Abandoned) operation: on its record
    /// (named by its storage key, so no key or scope is needed), with the fingerprint it was
    /// claimed with, [`resume_only`](Call::resume_only), and no overrides. Its work runs only
    /// if it takes the operation over, and resumes from the operation's checkpoints.
    pub fn resume(abandoned: &crate::steps::Abandoned) -> Self {
        Call {
            at: Some(abandoned.key),
            fingerprint: abandoned.fingerprint,
            resume_only: true,
            ..Call::new(Key::new("resume").expect("a valid key")).needing()
        }
    }
}

impl<N> Call<N> {
    /// This call, needing `M`.
    fn needing<M>(self) -> Call<M> {
        Call {
            key: self.key,
            scope: self.scope,
            fingerprint: self.fingerprint,
            options: self.options,
            session: self.session,
            resume_only: self.resume_only,
            at: self.at,
            need: PhantomData,
        }
    }

    /// Who the key belongs to.
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// What the request means; a retry with the same key and another fingerprint fails with
    /// [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch). Default:
    /// [`Fingerprint::empty`].
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// This call's overrides of the runtime's [`Defaults`] (default: none).
    pub fn options(mut self, options: CallOptions) -> Self {
        self.options = options;
        self
    }

    /// Makes this a completer's call: it runs only if it takes over an abandoned claim of the
    /// same request (the operation goes on, with its [checkpoints](crate::steps)), through
    /// [`CheckpointStore::resume`](crate::CheckpointStore::resume). Where there is no such operation (it finished,
    /// expired, or the key now holds another request's) it changes nothing and fails with
    /// [`Error::NothingToResume`](crate::Error::NothingToResume) without running anything.
    pub fn resume_only(mut self) -> Call<NeedsCheckpoints> {
        self.resume_only = true;
        self.needing()
    }

    /// Whether the call only resumes an operation ([`resume_only`](Self::resume_only)).
    pub fn is_resume_only(&self) -> bool {
        self.resume_only
    }

    /// The record a [`resume`](Call::resume) call is on.
    pub(crate) fn at(&self) -> Option<crate::StorageKey> {
        self.at
    }

    /// The key; for a call in a session, the session id.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The call's place in its session, if it is in one ([`Call::in_session`]).
    pub fn session(&self) -> Option<InSession> {
        self.session
    }

    /// The call's scope.
    pub fn scope_ref(&self) -> &Scope {
        &self.scope
    }

    /// The call's fingerprint.
    pub fn fingerprint_ref(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The settings this call runs with under `defaults` (a runtime's
    /// [`defaults`](crate::Idempotency::defaults)): its options where it has them, the
    /// defaults elsewhere.
    pub fn settings(&self, defaults: &Defaults) -> Settings {
        let options = &self.options;
        Settings {
            ttl: options.ttl.unwrap_or(defaults.ttl),
            lease: options.lease.unwrap_or(defaults.lease),
            in_flight: options.in_flight.unwrap_or(defaults.in_flight),
            max_result_bytes: options
                .max_result_bytes
                .unwrap_or(defaults.max_result_bytes),
            session_window: defaults.session_window,
            session_idle: defaults.session_idle,
            max_checkpoint_bytes: defaults.max_checkpoint_bytes,
        }
    }
}

/// Per-call overrides of a runtime's [`Defaults`]: each setting left unset takes the
/// runtime's. The one type for call settings: [`Call::options`], the `#[idempotent]`
/// attribute's `ttl`, `lease`, `wait` and `in_flight` arguments, and the HTTP and gRPC layer's
/// `call_options` all build one.
///
/// ```
/// use idempotent_core::{CallOptions, InFlightPolicy};
/// use std::time::Duration;
///
/// let options = CallOptions::new()
///     .ttl(Duration::from_secs(3600))
///     .lease(Duration::from_secs(10))
///     .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(5) });
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[must_use]
pub struct CallOptions {
    ttl: Option<Duration>,
    lease: Option<Duration>,
    in_flight: Option<InFlightPolicy>,
    max_result_bytes: Option<usize>,
}

impl CallOptions {
    /// No overrides: every setting is the runtime's.
    pub const fn new() -> Self {
        CallOptions {
            ttl: None,
            lease: None,
            in_flight: None,
            max_result_bytes: None,
        }
    }

    /// How long a completed result is replayed.
    ///
    /// Clamped, with a warning, into [`limits::MIN_TTL`](crate::limits::MIN_TTL) to
    /// [`limits::MAX_TTL`](crate::limits::MAX_TTL) (1 ms to 365 days): `Duration::MAX` is the
    /// longest. Refuse a value read from outside the program with
    /// [`limits::check_ttl`](crate::limits::check_ttl) instead.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(clamped(Setting::Ttl, ttl));
        self
    }

    /// How long a claim lives without renewal; after a crash, the key stays locked this long.
    ///
    /// Clamped, with a warning, into [`limits::MIN_LEASE`](crate::limits::MIN_LEASE) to
    /// [`limits::MAX_LEASE`](crate::limits::MAX_LEASE) (100 ms to 365 days): a shorter lease
    /// would lapse while its owner still runs, so a zero one is the shortest. Refuse a value
    /// read from outside the program with [`limits::check_lease`](crate::limits::check_lease)
    /// instead.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(clamped(Setting::Lease, lease));
        self
    }

    /// What to do when the key is in flight. Every [`InFlightPolicy::Wait`] `max` is
    /// accepted, [`Duration::MAX`] included.
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.in_flight = Some(policy);
        self
    }

    /// The largest result retained for replay, in encoded bytes; a larger one is recorded as
    /// "not retained" and retries get [`Error::ResultNotRetained`](crate::Error::ResultNotRetained).
    /// A caller that bounds its results itself, as the HTTP layer bounds response bodies, sets
    /// it so that one limit decides.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = Some(max);
        self
    }
}

/// What a runtime uses for every setting a call leaves unset. One type shared by the
/// standalone runtime ([`IdempotencyBuilder::defaults`](crate::IdempotencyBuilder::defaults))
/// and the PostgreSQL transactional mode, which takes its runtime's
/// (`idempotent_postgres::Transactional::of`).
///
/// ```
/// use idempotent_core::{Defaults, Idempotency, InFlightPolicy};
/// use idempotent_core::memory::MemoryStore;
/// use std::time::Duration;
///
/// let idempotency = Idempotency::builder(MemoryStore::new())
///     .defaults(
///         Defaults::new()
///             .ttl(Duration::from_secs(6 * 3600))
///             .in_flight(InFlightPolicy::Wait { max: Duration::from_secs(2) }),
///     )
///     .build();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Defaults {
    ttl: Duration,
    lease: Duration,
    in_flight: InFlightPolicy,
    max_result_bytes: usize,
    session_window: u64,
    session_idle: Duration,
    max_checkpoint_bytes: usize,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults::new()
    }
}

impl Defaults {
    /// [`DEFAULT_TTL`], [`DEFAULT_LEASE`], [`InFlightPolicy::Reject`] and
    /// [`DEFAULT_MAX_RESULT_BYTES`].
    pub const fn new() -> Self {
        Defaults {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            in_flight: InFlightPolicy::Reject,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            session_window: DEFAULT_SESSION_WINDOW,
            session_idle: DEFAULT_SESSION_IDLE,
            max_checkpoint_bytes: crate::steps::DEFAULT_MAX_CHECKPOINT_BYTES,
        }
    }

    /// How long completed results are replayed (default [`DEFAULT_TTL`]).
    ///
    /// Clamped as [`CallOptions::ttl`]: into 1 ms to 365 days.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = clamped(Setting::Ttl, ttl);
        self
    }

    /// How long a claim lives without renewal (default [`DEFAULT_LEASE`]).
    ///
    /// Clamped as [`CallOptions::lease`]: into 100 ms to 365 days.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = clamped(Setting::Lease, lease);
        self
    }

    /// What a call does when its key is in flight (default [`InFlightPolicy::Reject`]).
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.in_flight = policy;
        self
    }

    /// The largest result retained for replay (default [`DEFAULT_MAX_RESULT_BYTES`]).
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = max;
        self
    }

    /// How far past its acknowledged mark a [client session](crate::session) may number a
    /// request (default [`DEFAULT_SESSION_WINDOW`]): a session keeps at most this many
    /// answers, plus the one being made.
    ///
    /// Clamped, with a warning, into 1 to
    /// [`MAX_SESSION_WINDOW`](crate::session::MAX_SESSION_WINDOW). Refuse a value read from
    /// outside the program with
    /// [`limits::check_session_window`](crate::limits::check_session_window) instead.
    pub fn session_window(mut self, window: u64) -> Self {
        if let Err(error) = crate::limits::check_session_window(window) {
            let clamped = window.clamp(1, crate::session::MAX_SESSION_WINDOW);
            tracing::warn!(%error, clamped, "a session window out of its range was clamped into it");
            self.session_window = clamped;
            return self;
        }
        self.session_window = window;
        self
    }

    /// How long a [client session](crate::session) nobody sends to lives, with the answers
    /// it holds (default [`DEFAULT_SESSION_IDLE`]); every request of the session starts it
    /// again.
    ///
    /// Clamped as [`CallOptions::ttl`]: into 1 ms to 365 days.
    pub fn session_idle(mut self, idle: Duration) -> Self {
        self.session_idle = clamped(Setting::Ttl, idle);
        self
    }
}

impl Defaults {
    /// How many bytes of [checkpoints](crate::steps) one operation's record may carry
    /// (default [`DEFAULT_MAX_CHECKPOINT_BYTES`](crate::steps::DEFAULT_MAX_CHECKPOINT_BYTES)),
    /// counted as the store keeps them: each step's JSON plus its name and 5 bytes. A step
    /// whose checkpoint would pass it fails with
    /// [`CheckpointError::TooLarge`](crate::steps::CheckpointError::TooLarge).
    pub fn max_checkpoint_bytes(mut self, max: usize) -> Self {
        self.max_checkpoint_bytes = max;
        self
    }
}

/// A call's settings once its options are applied over a runtime's defaults
/// ([`Call::settings`]): what a claim loop outside the runtime (a transactional mode) claims
/// and records with.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Settings {
    /// How long the finished record is kept.
    pub ttl: Duration,
    /// The lease of a claim.
    pub lease: Duration,
    /// What a call that meets a live in-flight record does.
    pub in_flight: InFlightPolicy,
    /// The largest result kept for replay.
    pub max_result_bytes: usize,
    /// How many requests of a client session are kept.
    pub session_window: u64,
    /// How long an idle client session is kept.
    pub session_idle: Duration,
    /// The most bytes of checkpoints an operation keeps.
    pub max_checkpoint_bytes: usize,
}
