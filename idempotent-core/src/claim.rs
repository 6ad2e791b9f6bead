//! The running claim as the work sees it: its fencing token, its downstream operation key, and
//! whether it is still held.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use std::time::Duration;

use bytes::Bytes;

use tokio::sync::Notify;
use tokio::task::futures::TaskLocalFuture;
use tokio::time::Instant;

use crate::lease::{Renewal, attempt_limit, bounded};
use crate::steps::{CheckpointError, Checkpoints, check_name, encode_checkpoint};
use crate::store::{DynCheckpoints, DynStore};
use crate::{Error, FencingToken, Key, StorageKey, StoreError};

tokio::task_local! {
    static CURRENT: ClaimSlot;
}

#[doc = include_str!("../docs/claim-handle.md")]
#[derive(Clone)]
pub struct ClaimHandle {
    claim: KeyClaim,
}

/// The claim of a call on any runtime: its token, its lease and whether it is still held,
/// without steps. What a [`ClaimHandle`] dereferences to, and all the work gets on a runtime
/// whose store keeps no checkpoints ([`Idempotency::keys_only`](crate::Idempotency::keys_only),
/// [`Idempotency::with_sessions`](crate::Idempotency::with_sessions)):
/// [`KeyClaim::current`](crate::KeyClaim::current) there, where [`ClaimHandle::current`] is `None`.
#[derive(Clone)]
pub struct KeyClaim {
    state: Arc<ClaimState>,
}

impl std::ops::Deref for ClaimHandle {
    type Target = KeyClaim;
    fn deref(&self) -> &KeyClaim {
        &self.claim
    }
}

struct ClaimState {
    key: StorageKey,
    token: FencingToken,
    /// The token that began the record's lifetime: with the key, it names the operation.
    lifetime: FencingToken,
    lease: Duration,
    /// `None` in the transactional mode: there the claim is a row of the caller's open
    /// transaction, held by the database until the transaction ends.
    store: Option<Arc<dyn DynStore>>,
    /// Where steps save their checkpoints: `None` in the transactional mode (a step saves
    /// nothing there) and on a store that keeps none (its claims have no steps).
    checkpoints: Option<Arc<dyn DynCheckpoints>>,
    /// [`HELD`], [`LOST`], [`RELEASED`] or [`COMPLETED`]; moves only away from `HELD`.
    phase: AtomicU8,
    /// Set once the result starts being written, never cleared: from then on a renewal the
    /// store rejects is answered by the write's own outcome (the record is no longer in flight
    /// because a write landed, or the write is rejected too and reports the loss).
    recording: AtomicBool,
    /// Set by [`KeyClaim::finish_on_shutdown`](crate::KeyClaim::finish_on_shutdown): a graceful shutdown's deadline does not
    /// stop the work.
    finish_on_shutdown: AtomicBool,
    notify: Notify,
    /// The operation's checkpoints as this claim knows them: `None` until the first step
    /// asks (loaded from the store when the claim took an operation over, empty when it began
    /// one). A `std` mutex, never held across a store call: a step costs no lock of tokio's
    /// (whose acquisition spends the task's cooperative budget and can make a caller yield
    /// behind every other task on its thread).
    steps: std::sync::Mutex<Known>,
    /// Woken when a checkpoint write ends, for a step of the same name waiting on it.
    step_written: Notify,
    max_checkpoint_bytes: usize,
}

/// The call holds the claim.
const HELD: u8 = 0;
/// The lease ended before a renewal got through, or the store rejected the token.
const LOST: u8 = 1;
/// The call gave the claim up (its work failed transiently, panicked or was abandoned).
const RELEASED: u8 = 2;
/// The call's record was written: the operation is done.
const COMPLETED: u8 = 3;

impl ClaimHandle {
    /// The claim of the call whose work is running on this task, with its steps: set while a
    /// runtime whose store keeps checkpoints polls the work of
    /// [`Idempotency::run`](crate::Idempotency::run),
    /// [`run_with`](crate::Idempotency::run_with) and
    /// [`execute`](crate::Idempotency::execute) (and so inside `#[idempotent]` functions and
    /// behind the tower layer), and in a transactional mode's work. `None` elsewhere: outside
    /// a claim, in tasks the work spawns, and in the work of a runtime whose store keeps no
    /// checkpoints (its claim is [`KeyClaim::current`](crate::KeyClaim::current)).
    pub fn current() -> Option<ClaimHandle> {
        KeyClaim::current().and_then(KeyClaim::with_steps)
    }

    /// Runs `work` with `self` as [`current`](Self::current): what a transactional mode does
    /// with the work of a claim it made, so that `#[step]`s and [`ClaimHandle::current`] inside
    /// it see the claim.
    pub fn scope<F: Future>(self, work: F) -> impl Future<Output = F::Output> {
        self.claim.scope(work)
    }

    /// A claim held by an open database transaction: it cannot be lost while the transaction
    /// is open, and nothing of it survives if the transaction does not commit. For a
    /// transactional mode (such as `idempotent-postgres`'s) to hand its work the claim it made:
    /// `token` is the claim's fencing token, `lifetime` the token that began the record's
    /// lifetime (`token` itself unless the claim took over an abandoned one), `lease` the lease
    /// written with it. Such a handle keeps no checkpoints through a store: a step's result is
    /// saved by the transactional mode itself (or nowhere).
    pub fn in_transaction(
        key: StorageKey,
        token: FencingToken,
        lifetime: FencingToken,
        lease: Duration,
    ) -> Self {
        ClaimHandle {
            claim: KeyClaim::with_store(
                None,
                None,
                key,
                (token, lifetime),
                lease,
                crate::steps::DEFAULT_MAX_CHECKPOINT_BYTES,
            ),
        }
    }

    /// Runs `work` as the operation's step `name`, once per operation: the first attempt runs
    /// it and saves its result on the in-flight record (a *checkpoint*, see
    /// [`steps`](crate::steps)); every later attempt of the same operation (after a crash, a
    /// lapsed lease, a released claim) returns the saved result without running it.
    ///
    /// - Before running, the claim must still be held: a lost one fails with
    ///   [`Error::ClaimLost`] and runs nothing.
    /// - The checkpoint is written with the claim's fencing token: if another owner took the
    ///   operation over meanwhile, it is refused and the step fails with
    ///   [`Error::ClaimLost`] (its effect happened; the new owner runs the step again, so pass
    ///   [`step_key`](crate::KeyClaim::step_key) downstream).
    /// - A store that fails the write fails the step with [`Error::Store`]; a checkpoint past
    ///   [`Defaults::max_checkpoint_bytes`](crate::Defaults::max_checkpoint_bytes) fails it
    ///   with [`CheckpointError::TooLarge`]. Nothing is saved in either case.
    /// - In the PostgreSQL transactional mode the whole operation is one transaction: the step
    ///   just runs (a crash undoes all of it, and nothing is saved to resume from).
    ///
    /// A step's result is encoded as JSON. For work that can fail, see
    /// [`try_step`](Self::try_step): a failure is not saved.
    ///
    /// ```
    /// use idempotent_core::memory::MemoryStore;
    /// use idempotent_core::{Call, ClaimHandle, Idempotency, Retain};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotent_core::Error> {
    /// let idempotency = Idempotency::new(MemoryStore::new());
    /// let call = Call::new("order-7".parse()?);
    /// let order = idempotency
    ///     .run_with(
    ///         &call,
    ///         async {
    ///             let claim = ClaimHandle::current().expect("inside run");
    ///             let reservation: String =
    ///                 claim.step("reserve", async { "res-1".to_owned() }).await.ok()?;
    ///             // The provider's idempotency key for this step of this operation.
    ///             let charge_key = claim.step_key("charge").ok()?;
    ///             let charge: String = claim
    ///                 .step("charge", async move { format!("ch-{}", &charge_key.as_str()[..8]) })
    ///                 .await
    ///                 .ok()?;
    ///             Some((reservation, charge))
    ///         },
    ///         // A failed step is not the operation's result: release, so a retry resumes.
    ///         |order| if order.is_some() { Retain::Keep } else { Retain::Release },
    ///     )
    ///     .await?
    ///     .into_inner()
    ///     .expect("both steps ran");
    /// assert_eq!(order.0, "res-1");
    /// # Ok(())
    /// # }
    /// ```
    pub async fn step<T, F>(&self, name: &str, work: F) -> Result<T, Error>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: Future<Output = T>,
    {
        let work = async { Ok::<T, std::convert::Infallible>(work.await) };
        self.try_step(name, work).await.map_err(|e| match e {
            StepError::Failed(never) => match never {},
            StepError::Idempotency(error) => error,
        })
    }

    /// Like [`step`](Self::step), for work that can fail: an `Ok` is saved and returned to
    /// every later attempt; an `Err` is not saved (a later attempt runs the step again) and is
    /// returned as [`StepError::Failed`].
    pub async fn try_step<T, E, F>(&self, name: &str, work: F) -> Result<T, StepError<E>>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: Future<Output = Result<T, E>>,
    {
        let store = match self.restore_step(name).await {
            Ok(Restored::Saved(value)) => return Ok(value),
            Ok(Restored::Run(store)) => store,
            Err(error) => return Err(StepError::Idempotency(error)),
        };
        let value = work.await.map_err(StepError::Failed)?;
        let Some(store) = store else {
            return Ok(value);
        };
        let (key, token) = (self.state.key, self.state.token);
        let saved_first = self
            .record_step(name, &value, |entry| async move {
                store.save_step(&key, token, entry).await
            })
            .await
            .map_err(StepError::Idempotency)?;
        match saved_first {
            // The same step ran concurrently and saved first: its result is the operation's.
            Some(saved) => decode_step(name, &saved).map_err(StepError::Idempotency),
            None => Ok(value),
        }
    }

    /// The first half of a step that a store's companion runs itself (an atomic step, whose
    /// checkpoint commits with the step's own writes): the step's saved result if the
    /// operation has one (`Some`: do not run it), or `None` to run it and then
    /// [`record_step`](Self::record_step). Checks the name and that the claim is held. On a
    /// claim that keeps no checkpoints ([`keeps_checkpoints`](Self::keeps_checkpoints) is
    /// false), always `None`.
    pub async fn saved_step<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<T>, Error> {
        match self.restore_step(name).await? {
            Restored::Saved(value) => Ok(Some(value)),
            Restored::Run(_) => Ok(None),
        }
    }

    /// Whether this claim keeps checkpoints through a store: `false` for a claim made
    /// [`in_transaction`](Self::in_transaction).
    pub fn keeps_checkpoints(&self) -> bool {
        self.state.checkpoints.is_some()
    }

    /// Where the claim's store keeps its records ([`Store::location`](crate::Store::location)),
    /// for a companion that must write beside them (an atomic step checks that the claim is on
    /// its own table); `None` for a claim made [`in_transaction`](Self::in_transaction) or on a
    /// store that names no location.
    pub fn store_location(&self) -> Option<String> {
        self.state.store.as_ref().and_then(|store| store.location())
    }

    /// The first half of a step: its saved result if it has one, or leave to run it (with
    /// the store to save its checkpoint in; `None` for a transactional claim, which saves
    /// nothing). Checks the name and that the claim is held.
    pub(crate) async fn restore_step<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Restored<T>, Error> {
        check_name(name)?;
        if !self.is_held() {
            return Err(Error::ClaimLost);
        }
        let Some(store) = self.state.checkpoints.clone() else {
            return Ok(Restored::Run(None));
        };
        match self.saved(name).await? {
            Some(saved) => decode_step(name, &saved).map(Restored::Saved),
            None => Ok(Restored::Run(Some(store))),
        }
    }

    /// The second half of a step that ran: encodes `value`, checks the
    /// [limit](crate::Defaults::max_checkpoint_bytes), and saves the checkpoint with `write`
    /// (given the encoded entry, which a store's [`load_steps`](crate::CheckpointStore::load_steps) must
    /// hand back as part of its log), fenced like every write of this claim. A step of the
    /// same name that saved first wins: nothing is written then, and its saved result's bytes
    /// are returned (decode them as JSON).
    pub async fn record_step<T, W, Fut>(
        &self,
        name: &str,
        value: &T,
        write: W,
    ) -> Result<Option<Bytes>, Error>
    where
        T: serde::Serialize,
        W: FnOnce(Bytes) -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        self.record_entry(name, value, write, true).await
    }

    /// [`record_step`](Self::record_step), within the checkpoint limit or (the runtime's own
    /// entries, which must not be refused) past it.
    async fn record_entry<T, W, Fut>(
        &self,
        name: &str,
        value: &T,
        write: W,
        limited: bool,
    ) -> Result<Option<Bytes>, Error>
    where
        T: serde::Serialize,
        W: FnOnce(Bytes) -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        let json = serde_json::to_vec(value).map_err(|source| {
            Error::Checkpoint(CheckpointError::Value {
                step: name.to_owned(),
                source,
            })
        })?;
        let entry = encode_checkpoint(name, &json);
        let entry_len = entry.len();
        let limit = self.state.max_checkpoint_bytes;
        // Checked, and its bytes reserved against the limit (so steps running side by side
        // cannot pass it together), before the write; the lock is not held across it. A step
        // of the same name being written is waited for: its write decides (an atomic step's
        // effect commits with its checkpoint, so only one may write).
        loop {
            let checked = self
                .with_known(|known, pending, writing| {
                    if let Some(saved) = known.get(name) {
                        return Checked::Saved(saved.clone());
                    }
                    if writing.iter().any(|w| w == name) {
                        // Created before the lock is let go: the write's end cannot be missed.
                        return Checked::Wait(self.state.step_written.notified());
                    }
                    let size = known.steps_len() + *pending + entry_len;
                    if limited && size > limit {
                        return Checked::TooLarge(size);
                    }
                    if limited {
                        *pending += entry_len;
                    }
                    writing.push(name.to_owned());
                    Checked::Write
                })
                .await?;
            match checked {
                Checked::Write => break,
                Checked::Saved(saved) => return Ok(Some(saved)),
                Checked::Wait(written) => written.await,
                Checked::TooLarge(size) => {
                    return Err(Error::Checkpoint(CheckpointError::TooLarge {
                        step: name.to_owned(),
                        size,
                        limit,
                    }));
                }
            }
        }
        // From here the name (and the reserved bytes) are this write's until it ends, also if
        // this future is dropped mid-write.
        let mut writing = Writing {
            claim: self,
            name,
            reserved: if limited { entry_len } else { 0 },
            ended: false,
        };
        let written = self.fenced(write(entry)).await;
        let json = Bytes::from(json);
        let same_name_first = {
            let mut steps = self.lock_steps();
            writing.end(&mut steps);
            match written {
                Ok(()) => {}
                Err(Error::Store(error)) => {
                    // It may have landed: forget what this claim knows, and read the store
                    // again before the next step.
                    steps.forget();
                    return Err(Error::Store(error));
                }
                Err(error) => return Err(error),
            }
            match steps.checkpoints.as_mut() {
                Some(known) => match known.get(name) {
                    None => {
                        known.push(name, json.clone(), entry_len);
                        false
                    }
                    // This write itself, read back by a load that came after it.
                    Some(saved) => *saved != json,
                },
                // Forgotten meanwhile (another write's outcome is unknown), or being loaded:
                // the next step reads the store, and a load that began before this write
                // landed is not taken.
                None => {
                    steps.forget();
                    false
                }
            }
        };
        if !same_name_first {
            return Ok(None);
        }
        // A step of the same name saved too, and this claim cannot tell whose write the store
        // has first (the first entry of a name wins): the store says.
        self.lock_steps().forget();
        let first = self
            .with_known(|known, _, _| known.get(name).cloned())
            .await?;
        Ok(first.filter(|saved| *saved != json))
    }

    /// The claim's knowledge of its checkpoints, locked (only between store calls).
    fn lock_steps(&self) -> std::sync::MutexGuard<'_, Known> {
        self.state
            .steps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the checkpoints this claim knows (and the bytes that steps being written
    /// have reserved), loading them first if it has not (or must again): a claim that began
    /// its operation (its token is the lifetime's) has none to load, unless a write of
    /// uncertain outcome made it forget them. A load that fails leaves that as it was, for
    /// the next step to try again; a load that a write of uncertain outcome overtook is made
    /// again (it may not have seen that write).
    async fn with_known<R>(
        &self,
        f: impl FnOnce(&mut Checkpoints, &mut usize, &mut Vec<String>) -> R,
    ) -> Result<R, Error> {
        loop {
            let (store, generation) = {
                let mut guard = self.lock_steps();
                let steps = &mut *guard;
                let load = match &self.state.checkpoints {
                    Some(store) if steps.checkpoints.is_none() => (steps.reload
                        || self.state.token != self.state.lifetime)
                        .then(|| store.clone()),
                    _ => None,
                };
                match load {
                    Some(store) => (store, steps.generation),
                    None => {
                        let known = steps.checkpoints.get_or_insert_with(Checkpoints::default);
                        return Ok(f(known, &mut steps.pending, &mut steps.writing));
                    }
                }
            };
            let bytes = self
                .fenced(store.load_steps(&self.state.key, self.state.token))
                .await?;
            let loaded = Checkpoints::decode(bytes).map_err(Error::Store)?;
            let mut guard = self.lock_steps();
            let steps = &mut *guard;
            if steps.generation == generation {
                if steps.checkpoints.is_none() {
                    steps.checkpoints = Some(loaded);
                    steps.reload = false;
                }
                let known = steps.checkpoints.get_or_insert_with(Checkpoints::default);
                return Ok(f(known, &mut steps.pending, &mut steps.writing));
            }
        }
    }

    /// Counts one more attempt at this operation on its record (a checkpoint of the
    /// runtime's own, written with the claim's token like a step's) and returns how many were
    /// counted before. A completer counts its runs with it, so the count holds across its
    /// instances and their crashes. `0` in the PostgreSQL transactional mode, which keeps no
    /// checkpoints.
    pub async fn count_attempt(&self) -> Result<u32, Error> {
        if !self.is_held() {
            return Err(Error::ClaimLost);
        }
        let Some(store) = self.state.checkpoints.clone() else {
            return Ok(0);
        };
        let before = self
            .with_known(|known, _, _| {
                known
                    .steps()
                    .filter(|(name, _)| name.starts_with(ATTEMPT))
                    .count()
            })
            .await?;
        let before = u32::try_from(before).unwrap_or(u32::MAX);
        let name = format!("{ATTEMPT}{}", before.saturating_add(1));
        let (key, token) = (self.state.key, self.state.token);
        self.record_entry(
            &name,
            &(),
            |entry| async move { store.save_step(&key, token, entry).await },
            false,
        )
        .await?;
        Ok(before)
    }

    /// The saved result of step `name`, loading the operation's checkpoints on first use: a
    /// claim that began its operation (its token is the lifetime's) has none to load.
    async fn saved(&self, name: &str) -> Result<Option<Bytes>, Error> {
        self.with_known(|known, _, _| known.get(name).cloned())
            .await
    }

    /// Keeps `request` on the operation's in-flight record, so that a completer can run the
    /// operation again from it if its client never retries ([`CheckpointStore::save_request`]). Written
    /// with the claim's token, bounded like a renewal. The HTTP layer calls it when it runs a
    /// completer; other callers rarely need it.
    ///
    /// [`CheckpointStore::save_request`]: crate::CheckpointStore::save_request
    pub async fn save_request(&self, request: Bytes) -> Result<(), Error> {
        if !self.is_held() {
            return Err(Error::ClaimLost);
        }
        let Some(store) = &self.state.checkpoints else {
            return Ok(());
        };
        self.fenced(store.save_request(&self.state.key, self.state.token, request))
            .await
    }
}

impl fmt::Debug for ClaimHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.claim.fmt(f)
    }
}

impl fmt::Debug for KeyClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyClaim")
            .field("storage_key", &self.state.key)
            .field("token", &self.state.token)
            .field("lease", &self.state.lease)
            .field("transactional", &self.state.store.is_none())
            .field("held", &self.is_held())
            .finish()
    }
}

impl KeyClaim {
    pub(crate) fn leased(seed: &Seed) -> Self {
        Self::with_store(
            Some(Arc::clone(&seed.store)),
            seed.checkpoints.clone(),
            seed.key,
            (seed.token, seed.lifetime),
            seed.lease,
            seed.max_checkpoint_bytes,
        )
    }

    fn with_store(
        store: Option<Arc<dyn DynStore>>,
        checkpoints: Option<Arc<dyn DynCheckpoints>>,
        key: StorageKey,
        (token, lifetime): (FencingToken, FencingToken),
        lease: Duration,
        max_checkpoint_bytes: usize,
    ) -> Self {
        KeyClaim {
            state: Arc::new(ClaimState {
                key,
                token,
                lifetime,
                lease,
                store,
                checkpoints,
                phase: AtomicU8::new(HELD),
                recording: AtomicBool::new(false),
                finish_on_shutdown: AtomicBool::new(false),
                notify: Notify::new(),
                steps: std::sync::Mutex::new(Known::default()),
                step_written: Notify::new(),
                max_checkpoint_bytes,
            }),
        }
    }

    /// The claim of the call whose work is running on this task, if any.
    ///
    /// Set while the runtime polls the work of [`Idempotency::run`](crate::Idempotency::run),
    /// [`run_with`](crate::Idempotency::run_with) and
    /// [`execute`](crate::Idempotency::execute) (and so inside `#[idempotent]` functions and
    /// behind the tower layer), on any runtime. `None` elsewhere, including in tasks the work
    /// spawns.
    pub fn current() -> Option<KeyClaim> {
        CURRENT.try_with(ClaimSlot::handle).ok()
    }

    /// This claim with its steps, if its store keeps checkpoints (or it was made
    /// [`in_transaction`](ClaimHandle::in_transaction)); `None` on a runtime whose store
    /// keeps none.
    pub fn with_steps(self) -> Option<ClaimHandle> {
        (self.state.store.is_none() || self.state.checkpoints.is_some())
            .then_some(ClaimHandle { claim: self })
    }

    /// Runs `work` with `self` as [`current`](Self::current).
    pub fn scope<F: Future>(self, work: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(ClaimSlot::of(self), work)
    }

    /// The claim's fencing token: strictly increasing per storage key across owners, takeovers
    /// and expiry (the exact guarantee per store is in the crate's failure model).
    pub fn token(&self) -> FencingToken {
        self.state.token
    }

    /// The storage key the claim is on.
    pub fn storage_key(&self) -> StorageKey {
        self.state.key
    }

    /// The key to pass downstream for this operation: see [`StorageKey::operation_key`].
    /// Identical for every owner and attempt while the record lives (a takeover after a lapsed
    /// lease, and a retry after a release, included); different once the record has expired
    /// and the same client key begins a new operation.
    pub fn operation_key(&self) -> Key {
        self.state.key.operation_key(self.state.lifetime)
    }

    /// The token of the claim that began the record's lifetime (this claim's own
    /// [`token`](Self::token), unless it took over an abandoned claim of the same request).
    pub fn lifetime(&self) -> FencingToken {
        self.state.lifetime
    }

    /// The claim's lease: how long it lives without renewal.
    pub fn lease(&self) -> Duration {
        self.state.lease
    }

    /// True once the claim is known to be gone while the operation was not done: its lease
    /// ended before a renewal got through, the store rejected its token (another owner holds
    /// the key), or the call gave the claim up (its work failed or was abandoned). Never becomes
    /// false again. False after the call's record was written.
    pub fn is_lost(&self) -> bool {
        matches!(self.phase(), LOST | RELEASED)
    }

    fn phase(&self) -> u8 {
        self.state.phase.load(Ordering::Acquire)
    }

    fn is_held(&self) -> bool {
        self.phase() == HELD
    }

    /// Completes when the claim is lost (see [`is_lost`](Self::is_lost); at once if it already
    /// is); never completes while it is held, nor after the call's record was written. Owns a
    /// clone of the handle, so it can be moved into a task or a `select!`.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let handle = self.clone();
        async move {
            loop {
                let notified = handle.state.notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                if handle.is_lost() {
                    return;
                }
                notified.await;
            }
        }
    }

    /// Asks the store whether the claim is still held, extending its lease if it is: one round
    /// trip. Call it right before an irreversible step.
    ///
    /// - `Ok(())`: the store confirmed this claim's token and renewed the lease.
    /// - [`Error::ClaimLost`]: another owner holds the key, or the lease ended. Do not perform
    ///   the step.
    /// - [`Error::Store`]: the store did not answer; whether the claim is held is unknown.
    ///
    /// In the PostgreSQL transactional mode the claim is a row of the caller's open transaction
    /// and cannot be lost before it ends: this returns `Ok(())` without a round trip.
    pub async fn check(&self) -> Result<(), Error> {
        if !self.is_held() {
            return Err(Error::ClaimLost);
        }
        let Some(store) = &self.state.store else {
            return Ok(());
        };
        let lease = self.state.lease;
        match bounded(
            store.renew(&self.state.key, self.state.token, lease),
            attempt_limit(lease),
        )
        .await
        {
            Some(Ok(())) => Ok(()),
            Some(Err(StoreError::TokenRejected)) => {
                self.mark_lost("the store rejected its token");
                Err(Error::ClaimLost)
            }
            Some(Err(error)) => Err(Error::Store(error)),
            None => Err(Error::Store(StoreError::Unavailable(
                format!("the store did not answer within {:?}", attempt_limit(lease)).into(),
            ))),
        }
    }

    /// The key to pass downstream for the operation's step `name`: the
    /// [`operation_key`](Self::operation_key) and the name, joined by a dot. The same for every
    /// owner and attempt of this step of this operation, so a step that ran but whose
    /// checkpoint was not saved (a crash in between) causes one effect downstream.
    pub fn step_key(&self, name: &str) -> Result<Key, Error> {
        check_name(name)?;
        let key = format!("{}.{name}", self.operation_key().as_str());
        Ok(Key::new(key)?)
    }

    /// Awaits one fenced write of this claim, bounded like a renewal: a rejected token marks
    /// the claim lost.
    async fn fenced<T>(
        &self,
        write: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, Error> {
        let limit = attempt_limit(self.state.lease);
        match bounded(write, limit).await {
            Some(Ok(value)) => Ok(value),
            Some(Err(StoreError::TokenRejected)) => {
                self.mark_lost("the store rejected its token");
                Err(Error::ClaimLost)
            }
            Some(Err(error)) => Err(Error::Store(error)),
            None => Err(Error::Store(StoreError::Unavailable(
                format!("the store did not answer within {limit:?}").into(),
            ))),
        }
    }

    /// Asks a graceful shutdown ([`Idempotency::shutdown`](crate::Idempotency::shutdown)) to
    /// let the rest of this work finish instead of stopping it at the shutdown's deadline.
    ///
    /// Call it once the work's effect has happened and only finishing steps remain: stopped
    /// work releases its claim, so a retry would run it, effect included, again. The HTTP and
    /// gRPC layer calls it as soon as the handler has answered, while the response body is
    /// still being read. Work that asked this and is still running at the deadline is
    /// reported in [`Drained::remaining`](crate::Drained::remaining).
    pub fn finish_on_shutdown(&self) {
        self.state.finish_on_shutdown.store(true, Ordering::Release);
    }

    pub(crate) fn finishes_on_shutdown(&self) -> bool {
        self.state.finish_on_shutdown.load(Ordering::Acquire)
    }

    /// The result starts being written; see `ClaimState::recording`.
    pub(crate) fn start_recording(&self) {
        self.state.recording.store(true, Ordering::Release);
    }

    /// The store a renewal writes to; `None` for a transactional claim.
    pub(crate) fn store(&self) -> Option<&Arc<dyn DynStore>> {
        self.state.store.as_ref()
    }

    /// Whether the call's result has started being written.
    pub(crate) fn is_recording(&self) -> bool {
        self.state.recording.load(Ordering::Acquire)
    }

    /// Held → lost, logged and signalled once; no effect in any other phase.
    pub(crate) fn mark_lost(&self, why: &'static str) {
        if self.leave(LOST) {
            if let Some(store) = &self.state.store {
                store.metrics().lost.increment(1);
            }
            tracing::error!(
                storage_key = %self.state.key,
                token = self.state.token.get(),
                why,
                "idempotent call lost its claim while running: another owner may run the same operation; \
                 pass the operation key downstream or fence the resource with the token"
            );
        }
    }

    /// Held → released (the call gave the claim up): the work's other tasks learn it through
    /// [`lost`](Self::lost).
    pub(crate) fn mark_released(&self) {
        self.leave(RELEASED);
    }

    /// Held → completed: the record is written. Waiters on [`lost`](Self::lost) are woken
    /// only to find it not lost (it never completes after this); [`settled`](Self::settled)
    /// completes.
    pub(crate) fn mark_completed(&self) {
        if self
            .state
            .phase
            .compare_exchange(HELD, COMPLETED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.state.notify.notify_waiters();
        }
    }

    /// Whether the call's record was written.
    pub fn is_completed(&self) -> bool {
        self.phase() == COMPLETED
    }

    /// Completes once the claim is no longer held: its record written
    /// ([`is_completed`](Self::is_completed)), or the claim lost or given up
    /// ([`is_lost`](Self::is_lost)), including by a runtime that gave up recording the result.
    /// A consumer acknowledges a message only after this: an ack before the record is written
    /// could lose the effect's only trace.
    pub async fn settled(&self) {
        loop {
            let notified = self.state.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if !self.is_held() {
                return;
            }
            notified.await;
        }
    }

    fn leave(&self, phase: u8) -> bool {
        let left = self
            .state
            .phase
            .compare_exchange(HELD, phase, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if left {
            self.state.notify.notify_waiters();
        }
        left
    }
}

/// Why a [step](ClaimHandle::try_step) failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError<E> {
    /// The step's own work failed; nothing was saved, and a later attempt runs it again.
    #[error("the step failed")]
    Failed(#[source] E),
    /// The step could not run or keep its checkpoint: see [`ClaimHandle::step`].
    #[error(transparent)]
    Idempotency(Error),
}

/// What a claim knows of its operation's checkpoints.
#[derive(Default)]
struct Known {
    /// `None` until a step asks (or after a write of uncertain outcome).
    checkpoints: Option<Checkpoints>,
    /// Set by a checkpoint write that failed in a way that may still have landed (a timeout,
    /// a dropped connection): the next load reads the store even on a claim that began its
    /// operation. Cleared only by a load that succeeded.
    reload: bool,
    /// Moved on by every [`forget`](Known::forget): a load that began before one is not
    /// taken (it may have missed the write whose outcome is unknown).
    generation: u64,
    /// Bytes of steps being written, reserved against the limit.
    pending: usize,
    /// The names of the steps being written (a step of the same name waits for its write).
    writing: Vec<String>,
}

/// What [`ClaimHandle::record_entry`] found before its write.
enum Checked<'a> {
    /// Write the checkpoint.
    Write,
    /// A step of the same name was saved: its result.
    Saved(Bytes),
    /// A step of the same name is being written: wait for it, then look again.
    Wait(tokio::sync::futures::Notified<'a>),
    /// The checkpoint would take the record past the limit: the size it would make.
    TooLarge(usize),
}

/// A step's name held as being written; let go (and the steps waiting on it woken) when the
/// write ends, or when the step is dropped mid-write.
struct Writing<'a> {
    claim: &'a ClaimHandle,
    name: &'a str,
    /// The bytes reserved against the limit.
    reserved: usize,
    ended: bool,
}

impl Writing<'_> {
    /// Lets the name and the reserved bytes go, and wakes the steps waiting on them.
    fn end(&mut self, steps: &mut Known) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        steps.pending = steps.pending.saturating_sub(self.reserved);
        if let Some(at) = steps.writing.iter().position(|w| w == self.name) {
            steps.writing.swap_remove(at);
        }
        self.claim.state.step_written.notify_waiters();
    }
}

impl Drop for Writing<'_> {
    /// The step was dropped mid-write: the write may still land, so the claim reads the store
    /// again before the next step (as after a write that failed), and a step of the same
    /// name waiting on it goes on from there.
    fn drop(&mut self) {
        if !self.ended {
            let claim = self.claim;
            let mut steps = claim.lock_steps();
            steps.forget();
            self.end(&mut steps);
        }
    }
}

impl Known {
    /// Forgets the checkpoints after a write of uncertain outcome: the next step reads the
    /// store again.
    fn forget(&mut self) {
        self.checkpoints = None;
        self.reload = true;
        self.generation = self.generation.wrapping_add(1);
    }
}

/// The names of the attempts [`ClaimHandle::count_attempt`] counts: the runtime's own (a
/// step's name never starts with `~`).
const ATTEMPT: &str = "~attempt-";

/// A step's saved result, decoded.
fn decode_step<T: serde::de::DeserializeOwned>(name: &str, saved: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(saved).map_err(|source| {
        Error::Checkpoint(CheckpointError::Value {
            step: name.to_owned(),
            source,
        })
    })
}

/// What [`ClaimHandle::restore_step`] found.
pub(crate) enum Restored<T> {
    /// The step's saved result.
    Saved(T),
    /// Nothing saved: run the step, then save its checkpoint in this store (`None`: nowhere).
    Run(Option<Arc<dyn DynCheckpoints>>),
}

/// What a store-backed claim is made of.
#[derive(Clone)]
pub(crate) struct Seed {
    pub(crate) store: Arc<dyn DynStore>,
    pub(crate) checkpoints: Option<Arc<dyn DynCheckpoints>>,
    pub(crate) key: StorageKey,
    pub(crate) token: FencingToken,
    pub(crate) lifetime: FencingToken,
    pub(crate) lease: Duration,
    pub(crate) max_checkpoint_bytes: usize,
}

/// The claim of the call whose work is running, as the runtime keeps it while the work runs
/// ([`ClaimHandle::current`] reads it): the [`ClaimHandle`] is built only when something asks
/// for it (the work, a renewal, a failed record write), so a call whose work finishes at once
/// and whose record is written at once never allocates one. Armed, it is also the call's
/// guard: dropped before the work's outcome is classified (the caller went away, or the work
/// panicked), it releases the claim.
pub(crate) struct ClaimSlot {
    seed: Option<Seed>,
    handle: std::cell::OnceCell<KeyClaim>,
    armed: bool,
}

impl ClaimSlot {
    /// The slot of a leased claim: armed, no handle yet.
    pub(crate) fn leased(seed: Seed) -> Self {
        ClaimSlot {
            seed: Some(seed),
            handle: std::cell::OnceCell::new(),
            armed: true,
        }
    }

    /// A slot holding an existing handle, guarding nothing.
    fn of(handle: KeyClaim) -> Self {
        ClaimSlot {
            seed: None,
            handle: std::cell::OnceCell::from(handle),
            armed: false,
        }
    }

    /// Runs `work` with this slot's claim as [`ClaimHandle::current`].
    pub(crate) fn scope<F: Future>(self, work: F) -> TaskLocalFuture<ClaimSlot, F> {
        CURRENT.scope(self, work)
    }

    /// Starts renewing the claim of the slot the calling work runs in.
    pub(crate) fn start_renewal(claimed_at: Instant) -> Option<Renewal> {
        CURRENT
            .try_with(|slot| Renewal::start(&slot.handle(), claimed_at))
            .ok()
            .flatten()
    }

    /// The claim's handle, built on first use.
    pub(crate) fn handle(&self) -> KeyClaim {
        self.handle
            .get_or_init(|| match &self.seed {
                Some(seed) => KeyClaim::leased(seed),
                // Built with its handle (`of`): never reached.
                None => unreachable!("a slot without a seed is created with its handle"),
            })
            .clone()
    }

    /// The handle, if anything asked for one.
    pub(crate) fn existing(&self) -> Option<&KeyClaim> {
        self.handle.get()
    }

    /// The work's outcome is being dealt with: the slot no longer releases the claim when
    /// dropped.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Disarms the slot and gives the claim up (see [`release`]).
    pub(crate) fn release(mut self) -> impl Future<Output = ()> + Send + 'static {
        self.armed = false;
        release(self.seed.clone(), self.handle.get().cloned())
    }
}

impl Drop for ClaimSlot {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(seed) = &self.seed {
            tracing::debug!(storage_key = %seed.key, "idempotent call abandoned; releasing its claim");
        }
        let release = release(self.seed.clone(), self.handle.get().cloned());
        // Without a runtime to release on, the claim ends with its lease.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(release);
            }
            Err(_) => {
                if let Some(handle) = self.handle.get() {
                    handle.mark_released();
                }
            }
        }
    }
}

/// Gives the claim up: the work's other tasks learn it through [`KeyClaim::lost`](crate::KeyClaim::lost), and the
/// store's record is deleted so the next retry runs. The store write is bounded: a store that
/// hangs leaves the claim to end with its lease.
async fn release(seed: Option<Seed>, handle: Option<KeyClaim>) {
    if let Some(handle) = &handle {
        handle.mark_released();
    }
    let Some(Seed {
        store,
        key,
        token,
        lease,
        ..
    }) = seed
    else {
        return;
    };
    match bounded(store.release(&key, token), attempt_limit(lease)).await {
        Some(Ok(())) => tracing::debug!(storage_key = %key, "idempotent call released"),
        Some(Err(StoreError::TokenRejected)) => tracing::debug!(
            storage_key = %key,
            "idempotent call's claim was already gone when it released it"
        ),
        Some(Err(error)) => tracing::warn!(
            storage_key = %key,
            error = &error as &dyn std::error::Error,
            "idempotent call could not release its claim; it ends with its lease"
        ),
        None => tracing::warn!(
            storage_key = %key,
            "the store did not answer the release; the claim ends with its lease"
        ),
    }
}
