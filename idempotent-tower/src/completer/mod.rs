//! The completer: finishes, in the background, operations whose clients went away (see
//! [`Completer`]).

use std::fmt;
use std::future::Future;
use std::future::poll_fn;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Empty;
use idempotent_core::capability::{KeepsCheckpoints, KeysAndCheckpoints};
use idempotent_core::steps::Abandoned;
use idempotent_core::{
    Call, ClaimHandle, Error, Execution, Idempotency, InFlightPolicy, Retain, StoreError,
};
use tokio::sync::watch;
use tower_service::Service;

use crate::server::body::RequestBody;
use crate::server::capture::{Captured, capture};
use crate::server::config::Config;
use crate::server::layer::IdempotencyLayer;
use crate::server::protocol::Http;

use crate::server::kept::{CodeVersion, KeptRequest, owner};

mod record;

pub use record::{RecordedResponse, RecordedResponseError, operation_failed_record};

/// The request extension of a handler the [`Completer`] runs: which attempt this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completing {
    attempt: u32,
}

impl Completing {
    /// The completer's attempt, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

impl CompleterPass {
    fn count(&mut self, done: Result<Finished, tokio::task::JoinError>) {
        match done {
            Ok(Finished::Completed) => self.completed += 1,
            Ok(Finished::Failed) => self.failed += 1,
            Ok(Finished::GaveUp) => self.given_up += 1,
            Ok(Finished::Skipped) => self.skipped += 1,
            Err(error) => {
                tracing::error!(%error, "a completer run panicked or was cancelled");
                self.failed += 1;
            }
        }
    }
}

/// What one [`pass`](Completer::pass) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterPass {
    /// Abandoned operations listed.
    pub found: usize,
    /// Operations finished: their answer is recorded.
    pub completed: usize,
    /// Runs whose answer was not kept: the operation waits for the next pass.
    pub failed: usize,
    /// Operations recorded as failed after their last attempt.
    pub given_up: usize,
    /// Operations someone else finished or took over first, and requests not this
    /// completer's to run (another runtime's, another version's, or unreadable): nothing ran.
    pub skipped: usize,
}

/// Finishes, in the background, operations whose clients went away.
///
/// A client that times out and never retries leaves its operation half-done: its claim lapses
/// (or was released when the request failed), with some [steps](idempotent_core::steps) saved
/// and others not. With [`IdempotencyLayer::keep_requests`] the layer keeps every protected
/// request (method, URI, headers but credentials, body up to the request limit) on its
/// in-flight record; a [`Completer`] lists the records abandoned for longer than
/// [`after`](Completer::after), takes each over like a retry would
/// ([`Call::resume`](idempotent_core::Call::resume), [`CheckpointStore::resume`](idempotent_core::CheckpointStore::resume):
/// only the same operation, still abandoned; never a new one), and runs the kept request
/// through the service under the layer. The handler
/// resumes from its checkpoints, and its answer is recorded by the layer's rules, so the
/// client's eventual retry replays it.
///
/// - **Attempts.** Each run is one attempt, counted on the record before it runs
///   ([`ClaimHandle::count_attempt`]), so a run that crashes its process counts, and every
///   instance's completer counts into the same number. A run whose answer the layer does not
///   keep (a `5xx`, an error, a lost claim) releases the operation; a later pass tries again.
///   The last of [`max_attempts`](Completer::max_attempts) keeps whatever the handler
///   answered, so the operation ends failed with its last answer; if even that run gave
///   nothing to keep (it crashed, panicked or lost its claim), the next pass records
///   `500 operation_failed`. A client's own retry in between resumes the operation as usual.
/// - **Bounds.** A pass lists at most [`batch`](Completer::batch) operations and runs them in
///   at most [`concurrency`](Completer::concurrency) slots, shared by every pass. A run that
///   never ends keeps its slot (and its claim, renewed); the passes go on with the others.
/// - **Whose requests.** Only its own runtime's, of the code [versions](Completer::versions)
///   it runs: a request kept by a runtime with another namespace (a store shared by several
///   services), by a version it is not told it can run, or one it cannot read, is skipped,
///   never run or recorded (it stays for its own version's completer, a client's retry, or
///   its TTL). One completer per runtime, with a service that routes every kept request: two
///   layers with kept requests on one runtime share it. The store lists only the kept
///   requests of this runtime and of each version it runs (their
///   [`RequestOwner`](idempotent_core::RequestOwner), the first bytes of the kept format,
///   names the namespace and the version), longest abandoned first: requests of another
///   runtime, or of a version this completer does not run, left unfinished on a shared store
///   never take this one's [`batch`](Completer::batch).
/// - **Versions, and a deploy.** During a rolling deploy, instances of the old release and
///   of the new one share the store. Each completer runs by default only the version its
///   layer keeps ([`IdempotencyLayer::keep_requests`]): an operation the old release kept
///   and abandoned is finished by an old instance's completer, or by its client's retry
///   (which resumes it through the layer whatever its version), never by code that may read
///   its body or its steps differently. Once the old release is gone, its abandoned
///   operations wait for a retry or their TTL; a release that knows it can run an older
///   version's requests (the same handlers, the same steps) says so with
///   [`versions`](Completer::versions). Requests kept before versions were recorded (by an
///   earlier release of this crate) are run only when told, with
///   [`unversioned`](Completer::unversioned): which code kept them cannot be told, and a
///   completer that runs what it cannot vouch for is what versions are there to prevent.
/// - **What the handler sees.** The kept request, with the [`ClaimHandle`] and a
///   [`Completing`] extension. Extensions that middleware outside the layer adds (an
///   authenticated principal, say) are not there, nor are the `Authorization`,
///   `Proxy-Authorization` and `Cookie` headers, which are never kept.
/// - **What it does not finish.** Requests in a [client session](idempotent_core::session),
///   and gRPC requests: their records keep no request.
///
/// Metrics: `idempotency.completer.attempts` (runs), `idempotency.completer.completed`
/// (operations whose answer was recorded), `idempotency.completer.given_up` (operations
/// recorded as failed), all counters.
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use idempotent_core::{Idempotency, memory::MemoryStore};
/// use idempotent_tower::{Completer, IdempotencyLayer};
///
/// # async fn orders() -> &'static str { "ok" }
/// # async fn example() {
/// let version = env!("CARGO_PKG_VERSION").parse().expect("a code version");
/// let layer = IdempotencyLayer::http(Idempotency::new(MemoryStore::new())).keep_requests(version);
/// let routes = Router::new().route("/orders", post(orders));
/// let completer = Completer::new(&layer, routes.clone())
///     .after(Duration::from_secs(30))
///     .spawn();
/// let app = routes.layer(layer);
/// // serve `app`; at shutdown:
/// completer.stop().await;
/// # }
/// ```
pub struct Completer<S> {
    config: Arc<Config<Http>>,
    /// The layer's runtime, with its checkpoints.
    idempotency: Idempotency<KeysAndCheckpoints>,
    inner: S,
    after: Duration,
    scan_every: Duration,
    concurrency: usize,
    batch: usize,
    max_attempts: u32,
    metrics: Arc<CompleterMetrics>,
    /// The runs under way, at most `concurrency`, across passes.
    running: Arc<tokio::sync::Semaphore>,
    /// The versions whose kept requests this completer runs.
    versions: Arc<[CodeVersion]>,
    /// Whether it runs requests kept before versions were recorded.
    unversioned: bool,
    /// Whose kept requests it runs, as the store lists them: its runtime's, of each of its
    /// versions (and, if `unversioned`, of none).
    owners: Arc<[idempotent_core::RequestOwner]>,
    /// Which of `owners` a pass lists first: each pass starts at the next, so that one
    /// version's backlog does not take every pass's `batch`.
    first_owner: Arc<std::sync::atomic::AtomicUsize>,
}

impl<S: Clone> Clone for Completer<S> {
    fn clone(&self) -> Self {
        Completer {
            config: Arc::clone(&self.config),
            idempotency: self.idempotency.clone(),
            inner: self.inner.clone(),
            after: self.after,
            scan_every: self.scan_every,
            concurrency: self.concurrency,
            batch: self.batch,
            max_attempts: self.max_attempts,
            metrics: Arc::clone(&self.metrics),
            running: Arc::clone(&self.running),
            versions: Arc::clone(&self.versions),
            unversioned: self.unversioned,
            owners: Arc::clone(&self.owners),
            first_owner: Arc::clone(&self.first_owner),
        }
    }
}

impl<S> fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("after", &self.after)
            .field("scan_every", &self.scan_every)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("max_attempts", &self.max_attempts)
            .field("versions", &self.versions)
            .field("unversioned", &self.unversioned)
            .finish_non_exhaustive()
    }
}

/// Default [`Completer::after`]: 60 seconds.
pub const DEFAULT_COMPLETER_AFTER: Duration = Duration::from_secs(60);
/// Default [`Completer::max_attempts`]: 5.
pub const DEFAULT_COMPLETER_ATTEMPTS: u32 = 5;

impl<S, ResBody> Completer<S>
where
    S: Service<Request<RequestBody<Empty<Bytes>>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Send,
{
    /// A completer for the operations of `layer` (its runtime, its limits and outcome policy),
    /// running them through `inner`: the service the layer wraps, without the layer. Build
    /// the layer with [`keep_requests`](IdempotencyLayer::keep_requests): without kept
    /// requests there is nothing to finish.
    ///
    /// Defaults: [`after`](Self::after) [`DEFAULT_COMPLETER_AFTER`], a pass every quarter of
    /// it, 4 at once, 64 a pass, [`DEFAULT_COMPLETER_ATTEMPTS`] attempts, the requests of the
    /// [version](Self::versions) the layer keeps (none if it keeps none), not those kept
    /// before versions ([`unversioned`](Self::unversioned)).
    ///
    /// The layer's runtime must keep checkpoints (its type says so): a completer over a store
    /// of keys only does not compile.
    pub fn new<C: KeepsCheckpoints>(layer: &IdempotencyLayer<Http, C>, inner: S) -> Self {
        let versions: Vec<CodeVersion> = layer
            .config
            .keep_requests
            .iter()
            .map(|keeper| keeper.version.clone())
            .collect();
        Completer {
            config: Arc::clone(&layer.config),
            idempotency: layer.runtime.keys_and_checkpoints(),
            inner,
            after: DEFAULT_COMPLETER_AFTER,
            scan_every: DEFAULT_COMPLETER_AFTER / 4,
            concurrency: 4,
            batch: 64,
            max_attempts: DEFAULT_COMPLETER_ATTEMPTS,
            metrics: Arc::new(CompleterMetrics::register()),
            running: Arc::new(tokio::sync::Semaphore::new(4)),
            versions: Arc::from(versions),
            unversioned: false,
            owners: Arc::from(Vec::new()),
            first_owner: Arc::default(),
        }
        .with_owners()
    }

    /// The code versions whose kept requests it runs (default: the one its layer keeps with
    /// [`keep_requests`](IdempotencyLayer::keep_requests)), in place of those set before.
    /// List a version only if this code can run its requests: the same routes, reading the
    /// same bodies, and the same [steps](idempotent_core::steps) under the same names
    /// returning what the older code saved. The requests of other versions are left to
    /// their own completers (see "Versions, and a deploy" above). Each version is listed
    /// from the store by itself, so a version's many requests cost this completer nothing.
    ///
    /// ```
    /// use idempotent_core::Idempotency;
    /// use idempotent_core::memory::MemoryStore;
    /// use idempotent_tower::{CodeVersion, Completer, IdempotencyLayer};
    /// # async fn orders() -> &'static str { "ok" }
    ///
    /// # fn main() -> Result<(), idempotent_tower::InvalidCodeVersion> {
    /// let layer = IdempotencyLayer::http(Idempotency::new(MemoryStore::new()))
    ///     .keep_requests(CodeVersion::new("1.4.2")?);
    /// let routes = axum::Router::new().route("/orders", axum::routing::post(orders));
    /// // 1.4.2 changed nothing the handlers of 1.4.1 saved: it finishes 1.4.1's operations too.
    /// let completer = Completer::new(&layer, routes)
    ///     .versions([CodeVersion::new("1.4.2")?, CodeVersion::new("1.4.1")?]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn versions(mut self, versions: impl IntoIterator<Item = CodeVersion>) -> Self {
        let mut listed: Vec<CodeVersion> = Vec::new();
        for version in versions {
            if !listed.contains(&version) {
                listed.push(version);
            }
        }
        self.versions = Arc::from(listed);
        self.with_owners()
    }

    /// Whether it also runs the requests kept before versions were recorded (default
    /// `false`): those an earlier release of this crate kept, in the kept format without a
    /// version. Which code kept them cannot be told; say `true` only for a release whose
    /// handlers and steps can run the requests of the release it replaces (for the one
    /// deploy that brings versions in), and a client's retry resumes them either way.
    pub fn unversioned(mut self, run: bool) -> Self {
        self.unversioned = run;
        self.with_owners()
    }

    /// `owners` from `versions` and `unversioned`.
    fn with_owners(mut self) -> Self {
        let keys = &self.config.keys;
        let versioned = self
            .versions
            .iter()
            .map(|version| owner(keys, Some(version)));
        let unversioned = self.unversioned.then(|| owner(keys, None));
        self.owners = versioned.chain(unversioned).collect();
        self
    }

    /// How long an operation stays abandoned (its lease ended, or it was released, and no
    /// retry took it over) before the completer finishes it; also sets the pass interval to a
    /// quarter of it (at least 10 ms). Give clients time to retry first: their retry resumes
    /// the operation just as well, and answers them.
    pub fn after(mut self, idle: Duration) -> Self {
        self.after = idle;
        self.scan_every = (idle / 4).max(Duration::from_millis(10));
        self
    }

    /// How often a pass runs (default: a quarter of [`after`](Self::after)).
    pub fn scan_every(mut self, every: Duration) -> Self {
        self.scan_every = every.max(Duration::from_millis(1));
        self
    }

    /// How many operations run at once (default 4, at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self.running = Arc::new(tokio::sync::Semaphore::new(self.concurrency));
        self
    }

    /// How many abandoned operations one pass lists (default 64, at least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How many runs an operation gets before it is recorded as failed (default
    /// [`DEFAULT_COMPLETER_ATTEMPTS`], at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// One pass: lists the operations abandoned for [`after`](Self::after) and finishes what
    /// it can, [`concurrency`](Self::concurrency) at once.
    ///
    /// The future owns what it needs (it does not borrow the completer), so it can be spawned.
    pub fn pass(&self) -> impl Future<Output = Result<CompleterPass, Error>> + Send + 'static {
        let this = self.clone();
        async move { this.pass_owned().await }
    }

    async fn pass_owned(self) -> Result<CompleterPass, Error> {
        let mut runs = tokio::task::JoinSet::new();
        let mut pass = CompleterPass::default();
        pass.found = self.clone().dispatch(&mut runs, &mut pass).await?;
        while let Some(done) = runs.join_next().await {
            pass.count(done);
        }
        Ok(pass)
    }

    /// Lists the operations abandoned for [`after`](Self::after) and starts a run of each in
    /// `runs` as a slot frees up (the slots are the completer's, shared by every pass; runs
    /// that end meanwhile are counted in `pass`). How many were listed.
    async fn dispatch(
        self,
        runs: &mut tokio::task::JoinSet<Finished>,
        pass: &mut CompleterPass,
    ) -> Result<usize, Error> {
        let idempotency = self.idempotency.clone();
        // One listing per owner (a version of this runtime), the batch shared: each pass
        // starts with the next owner, so that none waits behind another's backlog for long.
        let owners = self.owners.len();
        let first = self
            .first_owner
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut found = Vec::new();
        for i in 0..owners {
            let room = self.batch - found.len();
            if room == 0 {
                break;
            }
            let owner = &self.owners[(first + i) % owners];
            found.extend(idempotency.abandoned(self.after, room, Some(owner)).await?);
        }
        let listed = found.len();
        for abandoned in found {
            let slot = loop {
                if let Ok(slot) = Arc::clone(&self.running).try_acquire_owned() {
                    break slot;
                }
                // Every slot is taken: by a run of these (wait for one to end), or by runs
                // this set does not hold (wait for a slot).
                if runs.is_empty() {
                    match Arc::clone(&self.running).acquire_owned().await {
                        Ok(slot) => break slot,
                        Err(_) => return Ok(listed),
                    }
                }
                tokio::select! {
                    done = runs.join_next() => {
                        if let Some(done) = done {
                            pass.count(done);
                        }
                    }
                    slot = Arc::clone(&self.running).acquire_owned() => match slot {
                        Ok(slot) => break slot,
                        Err(_) => return Ok(listed),
                    },
                }
            };
            runs.spawn(self.clone().finish(abandoned, slot));
        }
        Ok(listed)
    }

    /// Runs a pass every [`scan_every`](Self::scan_every) on a task of its own until the
    /// handle is stopped or dropped. Needs a tokio runtime.
    ///
    /// A pass starts its runs and does not wait for them: the next one lists what is
    /// abandoned then (the operations still running are leased, so not listed again), and a
    /// run that never ends only holds its slot.
    pub fn spawn(self) -> CompleterHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut runs = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    () = tokio::time::sleep(self.scan_every) => {}
                }
                let mut pass = CompleterPass::default();
                while let Some(done) = runs.try_join_next() {
                    pass.count(done);
                }
                let dispatched = tokio::select! {
                    _ = stopped.changed() => break,
                    listed = self.clone().dispatch(&mut runs, &mut pass) => listed,
                };
                match dispatched {
                    Ok(found) => {
                        pass.found = found;
                        if pass != CompleterPass::default() {
                            tracing::info!(?pass, "completer pass");
                        }
                    }
                    Err(error) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "completer pass failed; trying again at the next one"
                    ),
                }
            }
            // Stopped: the runs under way are dropped, which releases their claims.
            runs.abort_all();
            while runs.join_next().await.is_some() {}
        });
        CompleterHandle {
            stop,
            task: Some(task),
        }
    }

    /// Finishes one abandoned operation, as far as one attempt goes, holding one of the
    /// completer's slots.
    async fn finish(
        self,
        abandoned: Abandoned,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Finished {
        let _slot = slot;
        let config = &self.config;
        let saved = match KeptRequest::decode_bytes(abandoned.request.clone()) {
            Ok(saved) if self.owners.contains(&saved.owner()) => saved,
            Ok(saved) => {
                tracing::debug!(storage_key = %abandoned.key, version = ?saved.version(), "kept request of another runtime (namespace) or of a version this completer does not run; skipped");
                return Finished::Skipped;
            }
            // Not one this completer can tell is its own: left alone, never recorded.
            Err(error) => {
                tracing::warn!(storage_key = %abandoned.key, %error, "kept request unreadable; skipped");
                return Finished::Skipped;
            }
        };
        let max_attempts = self.max_attempts;
        let options = config.call_options.in_flight(InFlightPolicy::Reject);
        let call = Call::resume(&abandoned).options(options);
        let max_response = self.idempotency.max_result_bytes(&call);
        let call = call.options(options.max_result_bytes(usize::MAX));
        let mut inner = self.inner.clone();
        let metrics = Arc::clone(&self.metrics);
        let work = async move {
            let claim = ClaimHandle::current().ok_or(Ran::NotRun)?;
            // Counted on the record before it runs: a run that crashes the process counts
            // too, and every instance's completer counts into the same number.
            let before = match claim.count_attempt().await {
                Ok(before) => before,
                // Checkpoints that cannot be read or written make every attempt fail alike:
                // the operation is given up rather than taken over forever.
                Err(error @ (Error::Checkpoint(_) | Error::Store(StoreError::Corrupt(_)))) => {
                    return Err(Ran::GaveUp(format!(
                        "its checkpoints cannot be used ({error})"
                    )));
                }
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "the completer could not count its attempt; leaving the operation"
                    );
                    return Err(Ran::NotRun);
                }
            };
            if before >= max_attempts {
                return Err(Ran::GaveUp(format!(
                    "finishing it in the background failed {before} times"
                )));
            }
            let attempt = before + 1;
            metrics.attempts.increment(1);
            let (method, uri, headers, body) = saved.into_parts();
            let mut request = Request::new(RequestBody::buffered(body));
            *request.method_mut() = method;
            *request.uri_mut() = uri;
            *request.headers_mut() = headers;
            request.extensions_mut().insert(claim.clone());
            request.extensions_mut().insert(Completing { attempt });
            if let Err(error) = poll_fn(|cx| inner.poll_ready(cx)).await {
                return Ok((attempt, Err(error)));
            }
            match inner.call(request).await {
                Ok(response) => {
                    claim.finish_on_shutdown();
                    Ok((attempt, Ok(capture(response, max_response).await)))
                }
                Err(error) => Ok((attempt, Err(error))),
            }
        };
        let retain = |output: &Output<ResBody, S::Error>| match output {
            Ok((_, Ok(captured))) if config.retains(captured) => Retain::Keep,
            // The last attempt is the operation's answer, whatever it is.
            Ok((attempt, Ok(Captured::Complete { .. }))) if *attempt >= max_attempts => {
                Retain::Keep
            }
            Err(Ran::GaveUp(_)) => Retain::Keep,
            _ => Retain::Release,
        };
        let encode = |output: &Output<ResBody, S::Error>| match output {
            Ok((_, Ok(captured))) => {
                crate::server::service::record_of_captured(config, captured, abandoned.key)
            }
            Err(Ran::GaveUp(why)) => Some(record::operation_failed(&format!(
                "the client went away before this request finished, and {why}"
            ))),
            Ok((_, Err(_))) | Err(Ran::NotRun) => None,
        };
        match self.idempotency.execute(&call, work, retain, encode).await {
            Ok(Execution::Fresh(Ok((attempt, Ok(captured))))) => {
                let status = captured.status().as_u16();
                if config.retains(&captured) {
                    tracing::info!(storage_key = %abandoned.key, attempt, status, "completer finished an abandoned operation");
                    self.metrics.completed.increment(1);
                    Finished::Completed
                } else if attempt >= max_attempts && matches!(captured, Captured::Complete { .. }) {
                    tracing::warn!(storage_key = %abandoned.key, attempt, status, "completer gave up an abandoned operation; its last answer is recorded");
                    self.metrics.given_up.increment(1);
                    Finished::GaveUp
                } else {
                    tracing::info!(storage_key = %abandoned.key, attempt, status, "completer run not kept; trying again later");
                    Finished::Failed
                }
            }
            Ok(Execution::Fresh(Ok((attempt, Err(error))))) => {
                tracing::warn!(storage_key = %abandoned.key, attempt, %error, "completer run failed; trying again later");
                Finished::Failed
            }
            Ok(Execution::Fresh(Err(Ran::GaveUp(why)))) => {
                tracing::warn!(storage_key = %abandoned.key, why, "completer gave up an abandoned operation; operation_failed is recorded");
                self.metrics.given_up.increment(1);
                Finished::GaveUp
            }
            Ok(Execution::Fresh(Err(Ran::NotRun))) => Finished::Failed,
            Ok(Execution::Replayed(_))
            | Err(Error::NothingToResume | Error::InFlight { .. } | Error::FingerprintMismatch) => {
                Finished::Skipped
            }
            Err(error) => {
                tracing::warn!(storage_key = %abandoned.key, error = &error as &dyn std::error::Error, "completer could not resume an operation");
                Finished::Failed
            }
        }
    }
}

/// What a completer's run made: the attempt and the inner service's answer, or why it did not
/// call the inner service.
type Output<B, E> = Result<(u32, Result<Captured<B>, E>), Ran>;

/// Why a completer's run did not call the inner service.
enum Ran {
    /// No claim, or the attempt could not be counted: the operation is left for later.
    NotRun,
    /// Its attempts are spent, or its checkpoints unusable (why): `500 operation_failed` is
    /// recorded.
    GaveUp(String),
}

enum Finished {
    Completed,
    Failed,
    GaveUp,
    Skipped,
}

/// A running [`Completer`]: [`stop`](Self::stop) it at shutdown. Dropping it stops it too,
/// without waiting.
#[derive(Debug)]
pub struct CompleterHandle {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl CompleterHandle {
    /// Stops the completer: a pass under way is stopped, and so are the runs it started (at
    /// their next await point: each operation's claim is released, to be finished later);
    /// this returns once they are dropped.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for CompleterHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

struct CompleterMetrics {
    attempts: ::metrics::Counter,
    completed: ::metrics::Counter,
    given_up: ::metrics::Counter,
}

impl CompleterMetrics {
    fn register() -> Self {
        ::metrics::describe_counter!(
            "idempotency.completer.attempts",
            ::metrics::Unit::Count,
            "Runs of abandoned operations by the completer."
        );
        ::metrics::describe_counter!(
            "idempotency.completer.completed",
            ::metrics::Unit::Count,
            "Abandoned operations the completer finished (their answer recorded)."
        );
        ::metrics::describe_counter!(
            "idempotency.completer.given_up",
            ::metrics::Unit::Count,
            "Abandoned operations the completer recorded as failed after their last attempt."
        );
        CompleterMetrics {
            attempts: ::metrics::counter!("idempotency.completer.attempts"),
            completed: ::metrics::counter!("idempotency.completer.completed"),
            given_up: ::metrics::counter!("idempotency.completer.given_up"),
        }
    }
}
