#![doc = include_str!("../docs/conformance.md")]

mod faults;
mod inspect;
mod sessions;
mod steps;

pub use faults::{Fault, Faults, FaultyStore, KeysOnlyStore, Op};
pub use inspect::*;
pub use sessions::*;
pub use steps::*;

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::{
    CheckpointStore, Claim, FencingToken, Fingerprint, SessionStore, StorageKey, Store, StoreError,
};

/// A store under test, and control over its time.
pub trait Harness: Send + Sync + Sized + 'static {
    /// The store under test. Cloning must share the records (the concurrent checks hand a
    /// clone to every task).
    type Store: Store + Clone;

    /// Creates a harness with a ready store (connected, migrated).
    fn setup() -> impl Future<Output = Self> + Send;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// Lets `by` pass for the store: advance a manual clock, or sleep.
    fn advance(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// The granularity of time the checks use: leases and TTLs are small multiples of it, and
    /// the checks advance time by fractions of it. Must be well above the store's clock
    /// resolution and the latency of one operation.
    fn time_unit(&self) -> Duration;

    /// The environment variable holding the URL of the server this store needs, if any. When
    /// it is unset, each check reports so loudly and returns without running, or fails where
    /// backends are required (see [`backend_url`]).
    fn backend_env() -> Option<&'static str> {
        None
    }
}

/// Runs one check on a fresh multi-threaded runtime. Used by
/// [`store_conformance_tests!`](crate::store_conformance_tests).
pub fn run<H: Harness, F, Fut>(check: F)
where
    F: FnOnce(Arc<H>) -> Fut,
    Fut: Future<Output = ()>,
{
    if let Some(var) = H::backend_env()
        && backend_url(var).is_none()
    {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("cannot build a tokio runtime for the conformance check");
    runtime.block_on(async {
        let harness = Arc::new(H::setup().await);
        check(harness).await;
    });
}

/// Expands to one `#[test]` per conformance check for the [`Harness`] type given: the key
/// cycle's checks for every store, the session checks where its store implements
/// [`SessionStore`], the step checks where it implements [`CheckpointStore`]. The checks of a
/// capability the store does not implement are still listed, each saying so on stderr and
/// passing at once: there is nothing of that capability to check.
#[macro_export]
macro_rules! store_conformance_tests {
    ($harness:ty) => {
        $crate::store_conformance_tests!(@tests $harness; keys;
            claim_on_absent_key_wins,
            exactly_one_of_1000_concurrent_claims_wins,
            in_flight_record_reports_fingerprint_and_lease,
            completed_record_replays_fingerprint_and_payload,
            payload_round_trips_empty_and_one_mebibyte,
            stale_token_is_rejected_everywhere,
            completed_record_cannot_be_released_or_renewed_and_a_repeated_completion_changes_nothing,
            release_frees_the_key_for_a_higher_token,
            takeover_of_the_same_request_continues_the_lifetime,
            another_request_on_an_abandoned_record_is_refused,
            expired_record_begins_a_new_lifetime,
            abandoned_claim_is_kept_for_its_ttl_only,
            lease_expiry_allows_takeover_and_fences_the_old_owner,
            renew_extends_the_lease,
            ttl_expiry_frees_the_key,
            completed_record_tells_the_time_left,
            tokens_increase_across_expiry_and_release,
            keys_are_isolated,
            completed_in_process_agrees_with_claim,
        );
        $crate::store_conformance_tests!(@tests $harness; sessions;
            session_starts_only_without_an_ack,
            session_requests_are_records_of_their_own,
            session_ack_drops_answers_and_refuses_below_the_mark,
            session_window_bounds_the_numbers,
            session_expires_after_its_idle_time,
            session_requests_keep_its_answers_alive,
            session_gate_is_atomic,
            sessions_are_isolated,
            session_mark_reads_what_the_gate_left,
            claim_in_session_is_the_gate_then_the_claim,
            claim_in_session_never_claims_an_acknowledged_request,
        );
        $crate::store_conformance_tests!(@tests $harness; checkpoints;
            checkpoints_round_trip_in_order,
            checkpoints_are_fenced_by_the_token,
            checkpoints_last_as_long_as_the_operation,
            completion_drops_checkpoints_and_request,
            abandoned_lists_idle_records_with_a_request,
            concurrent_checkpoints_all_land,
            resume_takes_over_only_an_abandoned_operation_of_its_request,
            a_stale_resume_leaves_another_operations_checkpoints,
            abandoned_lists_one_owners_requests,
        );
        $crate::store_conformance_tests!(@tests $harness; inspection;
            inspect_reports_each_state_with_its_label,
            a_lapsed_lease_is_abandoned,
            list_finds_records_by_state_and_age_in_pages,
            repairs_are_fenced_by_the_token_and_the_lease,
            session_state_reads_what_the_gate_left,
        );
    };
    (@tests $harness:ty; keys; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run::<$harness, _, _>(|h| async move {
                    $crate::conformance::$check(&*h).await
                });
            }
        )*
    };
    (@tests $harness:ty; $capability:ident; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                #[allow(unused_imports)]
                use $crate::conformance::{
                    CheckpointChecks as _, InspectChecks as _, NoCheckpointChecks as _,
                    NoInspectChecks as _, NoSessionChecks as _, SessionChecks as _,
                };
                (&$crate::conformance::Probe::<$harness>::new())
                    .$capability(::core::stringify!($check));
            }
        )*
    };
}

/// Picks, for a harness, the checks its store's traits call for: what
/// [`store_conformance_tests!`](crate::store_conformance_tests) expands to calls it. A store
/// that implements [`SessionStore`] gets [`SessionChecks`], any other [`NoSessionChecks`],
/// which says so and checks nothing; [`CheckpointStore`] likewise.
#[derive(Debug)]
pub struct Probe<H>(std::marker::PhantomData<fn() -> H>);

impl<H> Probe<H> {
    /// The probe of `H`.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        Probe(std::marker::PhantomData)
    }
}

/// The session checks, for a store that keeps sessions; see [`Probe`].
pub trait SessionChecks {
    /// Runs the session check named `check`.
    fn sessions(&self, check: &str);
}

/// The session checks, for a store that keeps none; see [`Probe`].
pub trait NoSessionChecks {
    /// Says that the store keeps no sessions.
    fn sessions(&self, check: &str);
}

/// The step checks, for a store that keeps checkpoints; see [`Probe`].
pub trait CheckpointChecks {
    /// Runs the step check named `check`.
    fn checkpoints(&self, check: &str);
}

/// The step checks, for a store that keeps none; see [`Probe`].
pub trait NoCheckpointChecks {
    /// Says that the store keeps no checkpoints.
    fn checkpoints(&self, check: &str);
}

impl<H: Harness<Store: SessionStore>> SessionChecks for Probe<H> {
    fn sessions(&self, check: &str) {
        run_sessions::<H>(check);
    }
}

impl<H: Harness> NoSessionChecks for &Probe<H> {
    fn sessions(&self, check: &str) {
        does_not_apply::<H>(check, "SessionStore");
    }
}

impl<H: Harness<Store: CheckpointStore>> CheckpointChecks for Probe<H> {
    fn checkpoints(&self, check: &str) {
        run_checkpoints::<H>(check);
    }
}

impl<H: Harness> NoCheckpointChecks for &Probe<H> {
    fn checkpoints(&self, check: &str) {
        does_not_apply::<H>(check, "CheckpointStore");
    }
}

/// The inspection checks, for a store that implements [`InspectStore`](crate::inspect::InspectStore)
/// (with checkpoints and sessions, which they use); see [`Probe`].
pub trait InspectChecks {
    /// Runs the inspection check named `check`.
    fn inspection(&self, check: &str);
}

/// The inspection checks, for a store that cannot be inspected; see [`Probe`].
pub trait NoInspectChecks {
    /// Says that the store cannot be inspected.
    fn inspection(&self, check: &str);
}

impl<H: Harness<Store: Inspectable>> InspectChecks for Probe<H> {
    fn inspection(&self, check: &str) {
        run_inspection::<H>(check);
    }
}

impl<H: Harness> NoInspectChecks for &Probe<H> {
    fn inspection(&self, check: &str) {
        does_not_apply::<H>(check, "InspectStore");
    }
}

/// Runs the inspection check named `check`.
fn run_inspection<H: Harness<Store: Inspectable>>(check: &str) {
    macro_rules! dispatch {
        ($($name:ident),*) => {
            match check {
                $(stringify!($name) => run::<H, _, _>(|h| async move { $name(&*h).await }),)*
                other => panic!("no inspection check named {other}"),
            }
        };
    }
    dispatch!(
        inspect_reports_each_state_with_its_label,
        a_lapsed_lease_is_abandoned,
        list_finds_records_by_state_and_age_in_pages,
        repairs_are_fenced_by_the_token_and_the_lease,
        session_state_reads_what_the_gate_left
    )
}

fn does_not_apply<H: Harness>(check: &str, capability: &str) {
    eprintln!(
        "{check}: {} does not implement {capability}; this check does not apply to it",
        std::any::type_name::<H::Store>()
    );
}

/// Runs the session check named `check`.
fn run_sessions<H: Harness<Store: SessionStore>>(check: &str) {
    macro_rules! dispatch {
        ($($name:ident),*) => {
            match check {
                $(stringify!($name) => run::<H, _, _>(|h| async move { $name(&*h).await }),)*
                other => panic!("no session check named {other}"),
            }
        };
    }
    dispatch!(
        session_starts_only_without_an_ack,
        session_requests_are_records_of_their_own,
        session_ack_drops_answers_and_refuses_below_the_mark,
        session_window_bounds_the_numbers,
        session_expires_after_its_idle_time,
        session_requests_keep_its_answers_alive,
        session_gate_is_atomic,
        sessions_are_isolated,
        session_mark_reads_what_the_gate_left,
        claim_in_session_is_the_gate_then_the_claim,
        claim_in_session_never_claims_an_acknowledged_request
    )
}

/// Runs the step check named `check`.
fn run_checkpoints<H: Harness<Store: CheckpointStore>>(check: &str) {
    macro_rules! dispatch {
        ($($name:ident),*) => {
            match check {
                $(stringify!($name) => run::<H, _, _>(|h| async move { $name(&*h).await }),)*
                other => panic!("no step check named {other}"),
            }
        };
    }
    dispatch!(
        checkpoints_round_trip_in_order,
        checkpoints_are_fenced_by_the_token,
        checkpoints_last_as_long_as_the_operation,
        completion_drops_checkpoints_and_request,
        abandoned_lists_idle_records_with_a_request,
        concurrent_checkpoints_all_land,
        resume_takes_over_only_an_abandoned_operation_of_its_request,
        a_stale_resume_leaves_another_operations_checkpoints,
        abandoned_lists_one_owners_requests
    )
}

/// The URL of a real backend server for tests, from the environment variable `var`
/// (`scripts/test.sh` starts the servers and sets `IDEMPOTENT_TEST_REDIS_URL` and
/// `IDEMPOTENT_TEST_POSTGRES_URL`).
///
/// When the variable is unset, a test must not pass silently: under `scripts/test.sh` or CI
/// (`IDEMPOTENT_REQUIRE_BACKENDS=1` or `CI` set) this panics; otherwise it prints a loud notice
/// on stderr and returns `None`, and the caller returns early.
pub fn backend_url(var: &str) -> Option<String> {
    if let Ok(url) = std::env::var(var)
        && !url.is_empty()
    {
        return Some(url);
    }
    let required = std::env::var_os("IDEMPOTENT_REQUIRE_BACKENDS").is_some_and(|v| v != "0")
        || std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false");
    let how = "run `bash scripts/test.sh`, which starts real Redis and PostgreSQL servers, or \
               set it to a server's URL";
    if required {
        panic!("{var} is not set but backend tests are required here; {how}");
    }
    // Written to the stderr handle rather than with `eprintln!`, which the test harness
    // captures and hides for passing tests: a test that did not run must not look green.
    let _ = writeln!(
        std::io::stderr(),
        "\n*** NOT RUN: {var} is not set, so this test did not talk to a real server. {how}. ***\n"
    );
    None
}

static KEY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A storage key no other check (in this process or another) uses.
pub fn fresh_key() -> StorageKey {
    let n = KEY_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut hasher = blake3::Hasher::new_derive_key("idempotent conformance key");
    hasher.update(&std::process::id().to_le_bytes());
    hasher.update(&n.to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    hasher.update(&nanos.to_le_bytes());
    StorageKey::from_bytes(*hasher.finalize().as_bytes())
}

fn fp(label: &str) -> Fingerprint {
    Fingerprint::from_bytes(label.as_bytes())
}

/// Claims `key` (with a TTL equal to the lease) and returns the token, whether the claim
/// began a lifetime or continued one.
async fn claimed<S: Store>(
    store: &S,
    key: &StorageKey,
    f: &Fingerprint,
    lease: Duration,
) -> FencingToken {
    match store.claim(key, f, lease, lease).await {
        Ok(Claim::Claimed(token) | Claim::TakenOver { token, .. }) => token,
        other => panic!("expected Claimed or TakenOver, got {other:?}"),
    }
}

/// Claims `key` for `lease` and `ttl`: the token and the token that began the record's
/// lifetime.
async fn owned<S: Store>(
    store: &S,
    key: &StorageKey,
    f: &Fingerprint,
    (lease, ttl): (Duration, Duration),
) -> (FencingToken, FencingToken) {
    match store.claim(key, f, lease, ttl).await {
        Ok(Claim::Claimed(token)) => (token, token),
        Ok(Claim::TakenOver { token, lifetime }) => {
            assert!(
                lifetime < token,
                "a lifetime {lifetime:?} taken over begins before the new token {token:?}"
            );
            (token, lifetime)
        }
        other => panic!("expected Claimed or TakenOver, got {other:?}"),
    }
}

fn assert_rejected(result: Result<(), StoreError>, what: &str) {
    match result {
        Err(StoreError::TokenRejected) => {}
        other => panic!("{what}: expected TokenRejected, got {other:?}"),
    }
}

async fn assert_in_flight<S: Store>(
    store: &S,
    key: &StorageKey,
    expected: &Fingerprint,
    lease: Duration,
) {
    match store.claim(key, &fp("probe"), lease, lease).await {
        Ok(Claim::InFlight {
            fingerprint,
            retry_after,
        }) => {
            assert_eq!(
                fingerprint, *expected,
                "in-flight record reports the owner's fingerprint"
            );
            assert!(
                retry_after <= lease,
                "retry_after {retry_after:?} exceeds lease {lease:?}"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
}

async fn assert_completed<S: Store>(
    store: &S,
    key: &StorageKey,
    expected_fp: &Fingerprint,
    expected: &[u8],
) {
    match store
        .claim(
            key,
            &fp("probe"),
            Duration::from_secs(60),
            Duration::from_secs(60),
        )
        .await
    {
        Ok(Claim::Completed {
            fingerprint,
            payload,
            ..
        }) => {
            assert_eq!(
                fingerprint, *expected_fp,
                "completed record keeps the claim's fingerprint"
            );
            assert_eq!(payload.len(), expected.len(), "payload length");
            assert!(payload == expected, "payload bytes differ");
        }
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A claim on a key nobody has used succeeds.
pub async fn claim_on_absent_key_wins<H: Harness>(h: &H) {
    let key = fresh_key();
    claimed(h.store(), &key, &fp("a"), 2 * h.time_unit()).await;
}

/// Of 1,000 concurrent claims on one key, exactly one wins; all others see it in flight.
pub async fn exactly_one_of_1000_concurrent_claims_wins<H: Harness>(h: &H) {
    exactly_one_winner(h.store().clone(), 1000, 60 * h.time_unit()).await;
}

async fn exactly_one_winner<S: Store + Clone>(store: S, n: usize, lease: Duration) {
    let key = fresh_key();
    let start = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (store, start) = (store.clone(), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                let f = fp(&format!("claimer {i}"));
                (f, store.claim(&key, &f, lease, lease).await)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut in_flight = Vec::new();
    for task in tasks {
        match task.await.expect("claim task panicked") {
            (f, Ok(Claim::Claimed(token))) => winners.push((f, token)),
            (_, Ok(Claim::InFlight { fingerprint, .. })) => in_flight.push(fingerprint),
            (_, other) => panic!("unexpected concurrent claim result: {other:?}"),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one of {n} concurrent claims wins"
    );
    assert_eq!(in_flight.len(), n - 1);
    let winner = winners[0].0;
    assert!(
        in_flight.iter().all(|f| *f == winner),
        "every loser sees the winner's fingerprint"
    );
}

/// An in-flight record reports its fingerprint and the time left on its lease, and a second
/// claim changes nothing.
pub async fn in_flight_record_reports_fingerprint_and_lease<H: Harness>(h: &H) {
    let (store, key, lease) = (h.store(), fresh_key(), 4 * h.time_unit());
    let owner = fp("owner");
    claimed(store, &key, &owner, lease).await;
    match store.claim(&key, &fp("other"), lease, lease).await {
        Ok(Claim::InFlight {
            fingerprint,
            retry_after,
        }) => {
            assert_eq!(fingerprint, owner);
            assert!(retry_after <= lease, "retry_after {retry_after:?} > lease");
            assert!(
                retry_after > lease / 2,
                "retry_after {retry_after:?} too small"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_in_flight(store, &key, &owner, lease).await;
}

/// A completed record replays its fingerprint and its payload byte for byte.
pub async fn completed_record_replays_fingerprint_and_payload<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let token = claimed(store, &key, &f, 2 * unit).await;
    let payload = Bytes::from_static(b"{\"id\":1,\"status\":201}");
    store
        .complete(&key, token, payload.clone(), 10 * unit)
        .await
        .expect("complete with the current token");
    assert_completed(store, &key, &f, &payload).await;
    assert_completed(store, &key, &f, &payload).await;
}

/// Empty and 1 MiB payloads (every byte value) come back unchanged.
pub async fn payload_round_trips_empty_and_one_mebibyte<H: Harness>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let big: Vec<u8> = (0..(1usize << 20))
        .map(|i| (i % 256) as u8 ^ (i >> 12) as u8)
        .collect();
    for payload in [Vec::new(), big, vec![0u8; 3], vec![0xff; 17]] {
        let key = fresh_key();
        let f = fp("round trip");
        let token = claimed(store, &key, &f, 2 * unit).await;
        store
            .complete(&key, token, Bytes::from(payload.clone()), 10 * unit)
            .await
            .expect("complete");
        assert_completed(store, &key, &f, &payload).await;
    }
}

/// `complete`, `release` and `renew` with a token that is not the current one are rejected and
/// change nothing.
pub async fn stale_token_is_rejected_everywhere<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let owner = fp("owner");
    let token = claimed(store, &key, &owner, 4 * unit).await;
    for wrong in [
        FencingToken::new(token.get().wrapping_add(1)),
        FencingToken::new(token.get().wrapping_sub(1)),
        FencingToken::new(0),
        FencingToken::new(u64::MAX),
    ] {
        assert_rejected(
            store
                .complete(&key, wrong, Bytes::from_static(b"x"), 10 * unit)
                .await,
            "complete with a wrong token",
        );
        assert_rejected(
            store.release(&key, wrong).await,
            "release with a wrong token",
        );
        assert_rejected(
            store.renew(&key, wrong, 4 * unit).await,
            "renew with a wrong token",
        );
    }
    assert_in_flight(store, &key, &owner, 4 * unit).await;
    // Tokens are per key: a token of another key is not valid here.
    let other = fresh_key();
    let other_token = claimed(store, &other, &owner, 4 * unit).await;
    if other_token != token {
        assert_rejected(
            store
                .complete(&key, other_token, Bytes::from_static(b"x"), 10 * unit)
                .await,
            "complete with another key's token",
        );
    }
    // Operations on keys that hold nothing are rejected too.
    let absent = fresh_key();
    assert_rejected(
        store
            .complete(&absent, token, Bytes::from_static(b"x"), 10 * unit)
            .await,
        "complete on an absent key",
    );
    assert_rejected(
        store.release(&absent, token).await,
        "release on an absent key",
    );
    assert_rejected(
        store.renew(&absent, token, unit).await,
        "renew on an absent key",
    );
    store
        .complete(&key, token, Bytes::from_static(b"done"), 10 * unit)
        .await
        .expect("the current token still completes");
    assert_completed(store, &key, &owner, b"done").await;
}

/// Once completed, a record is not released or renewed, even with the token that completed
/// it; a completion repeated with that token (its first answer was lost, or it carries
/// another payload) succeeds and changes nothing.
pub async fn completed_record_cannot_be_released_or_renewed_and_a_repeated_completion_changes_nothing<
    H: Harness,
>(
    h: &H,
) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let token = claimed(store, &key, &f, 2 * unit).await;
    store
        .complete(&key, token, Bytes::from_static(b"first"), 10 * unit)
        .await
        .expect("complete");
    assert_rejected(
        store.release(&key, token).await,
        "release of a completed record",
    );
    assert_rejected(
        store.renew(&key, token, unit).await,
        "renew of a completed record",
    );
    store
        .complete(&key, token, Bytes::from_static(b"second"), 10 * unit)
        .await
        .expect("the owner's repeated completion finds its own record and succeeds");
    assert_rejected(
        store
            .complete(
                &key,
                FencingToken::new(token.get().wrapping_add(1)),
                Bytes::from_static(b"third"),
                10 * unit,
            )
            .await,
        "completion of a completed record with another token",
    );
    assert_completed(store, &key, &f, b"first").await;
}

/// Releasing a claim frees the key: the next claim wins with a higher token, and the released
/// token is dead.
pub async fn release_frees_the_key_for_a_higher_token<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let first = claimed(store, &key, &fp("a"), 4 * unit).await;
    store.release(&key, first).await.expect("release");
    assert_rejected(store.release(&key, first).await, "second release");
    let second = claimed(store, &key, &fp("a"), 4 * unit).await;
    assert!(
        second > first,
        "token {second:?} not above released {first:?}"
    );
    assert_rejected(
        store
            .complete(&key, first, Bytes::from_static(b"x"), 4 * unit)
            .await,
        "complete with the released token",
    );
    assert_in_flight(store, &key, &fp("a"), 4 * unit).await;
}

/// When a lease ends, the next claim takes over with a higher token, and the old owner can no
/// longer complete, release or renew.
pub async fn lease_expiry_allows_takeover_and_fences_the_old_owner<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let old = claimed(store, &key, &fp("request"), 2 * unit).await;
    h.advance(3 * unit).await;
    let new = claimed(store, &key, &fp("request"), 4 * unit).await;
    assert!(new > old, "takeover token {new:?} not above {old:?}");
    assert_rejected(
        store
            .complete(&key, old, Bytes::from_static(b"stale"), 10 * unit)
            .await,
        "old owner's complete",
    );
    assert_rejected(store.renew(&key, old, 10 * unit).await, "old owner's renew");
    assert_rejected(store.release(&key, old).await, "old owner's release");
    assert_in_flight(store, &key, &fp("request"), 4 * unit).await;
    store
        .complete(&key, new, Bytes::from_static(b"fresh"), 10 * unit)
        .await
        .expect("new owner completes");
    assert_completed(store, &key, &fp("request"), b"fresh").await;
}

/// An owner whose lease ended, or who released its claim, leaves the record for the next
/// claim of the same request to take over: a new, higher token in the same lifetime (the
/// operation keeps its downstream key).
pub async fn takeover_of_the_same_request_continues_the_lifetime<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let terms = (2 * unit, 20 * unit);
    let (first, lifetime) = owned(store, &key, &f, terms).await;
    assert_eq!(
        lifetime, first,
        "a claim on an absent key begins a lifetime"
    );
    // The lease lapses: the successor continues the lifetime.
    h.advance(3 * unit).await;
    let (second, continued) = owned(store, &key, &f, terms).await;
    assert!(second > first);
    assert_eq!(continued, lifetime, "a takeover after a lapsed lease");
    assert_rejected(
        store
            .complete(&key, first, Bytes::from_static(b"stale"), 10 * unit)
            .await,
        "the lapsed owner's complete",
    );
    // Released: the retry continues it too.
    store.release(&key, second).await.expect("release");
    let (third, continued) = owned(store, &key, &f, terms).await;
    assert!(third > second);
    assert_eq!(continued, lifetime, "a retry after a release");
    assert_rejected(
        store.renew(&key, second, 2 * unit).await,
        "the released owner's renew",
    );
    // Released again: the same request takes it over once more, and completes it.
    store.release(&key, third).await.expect("release");
    let (fourth, continued) = owned(store, &key, &f, terms).await;
    assert!(fourth > third);
    assert_eq!(continued, lifetime, "a retry after a second release");
    store
        .complete(&key, fourth, Bytes::from_static(b"done"), 10 * unit)
        .await
        .expect("the last owner completes");
    assert_completed(store, &key, &f, b"done").await;
}

/// The key belongs to its first request for its record's whole life: a claim of *another*
/// request on a record whose lease lapsed (the first attempt may have taken effect) or which
/// was released is answered [`Claim::InFlight`] with the record's fingerprint (a mismatch for
/// the runtime) and changes nothing; the first request still takes it over, with its
/// lifetime and checkpoints. Only the record's expiry frees the key for another request.
pub async fn another_request_on_an_abandoned_record_is_refused<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let (f, other) = (fp("request"), fp("another request"));
    let terms = (2 * unit, 10 * unit);
    let (first, lifetime) = owned(store, &key, &f, terms).await;
    let refused = |what: &'static str| async move {
        match store.claim(&key, &other, terms.0, terms.1).await {
            Ok(Claim::InFlight { fingerprint, .. }) => assert_eq!(
                fingerprint, f,
                "{what}: the record's own fingerprint is reported"
            ),
            other => panic!("{what}: expected the record reported (InFlight), got {other:?}"),
        }
    };
    // The lease lapses: the first attempt may have taken effect.
    h.advance(3 * unit).await;
    refused("another request on a lapsed record").await;
    refused("asked again").await;
    let (second, continued) = owned(store, &key, &f, terms).await;
    assert!(second > first);
    assert_eq!(continued, lifetime, "the first request still takes it over");
    // Released: still the first request's.
    store.release(&key, second).await.expect("release");
    refused("another request on a released record").await;
    let (third, continued) = owned(store, &key, &f, terms).await;
    assert_eq!(continued, lifetime, "and continues it after the release");
    store.release(&key, third).await.expect("release");
    // Past the TTL it was claimed with, the record is gone: the key is free.
    h.advance(12 * unit).await;
    let (fourth, began) = owned(store, &key, &other, terms).await;
    assert!(fourth > third);
    assert_eq!(
        began, fourth,
        "after its record expired, another request begins anew"
    );
}

/// A claim after the record's TTL ended begins a new lifetime: the reused key is a new
/// operation.
pub async fn expired_record_begins_a_new_lifetime<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let (token, lifetime) = owned(store, &key, &f, (2 * unit, 2 * unit)).await;
    store
        .complete(&key, token, Bytes::from_static(b"result"), 2 * unit)
        .await
        .expect("complete");
    h.advance(3 * unit).await;
    let (next, next_lifetime) = owned(store, &key, &f, (2 * unit, 2 * unit)).await;
    assert!(next > token);
    assert_eq!(
        next_lifetime, next,
        "the expired record's successor begins a lifetime"
    );
    assert_ne!(next_lifetime, lifetime);
}

/// An abandoned claim is kept no longer than the TTL it was claimed with: then the same
/// request begins a new lifetime.
pub async fn abandoned_claim_is_kept_for_its_ttl_only<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let (token, _) = owned(store, &key, &f, (unit, 3 * unit)).await;
    h.advance(4 * unit).await;
    let (next, lifetime) = owned(store, &key, &f, (unit, 3 * unit)).await;
    assert!(next > token);
    assert_eq!(lifetime, next, "past its TTL the abandoned claim is gone");
}

/// Renewing extends the lease from now; an expired lease cannot be renewed.
pub async fn renew_extends_the_lease<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("long job");
    let token = claimed(store, &key, &f, 2 * unit).await;
    for _ in 0..3 {
        h.advance(unit).await;
        store
            .renew(&key, token, 2 * unit)
            .await
            .expect("renew before the lease ends");
    }
    // 3 units after the claim, past the original 2-unit lease, the claim is still held.
    assert_in_flight(store, &key, &f, 2 * unit).await;
    h.advance(3 * unit).await;
    assert_rejected(
        store.renew(&key, token, 2 * unit).await,
        "renew after the lease ended",
    );
    let next = claimed(store, &key, &fp("next"), 2 * unit).await;
    assert!(next > token);
}

/// A completed record is replayed until its TTL ends, then the key is free again.
pub async fn ttl_expiry_frees_the_key<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let token = claimed(store, &key, &f, 2 * unit).await;
    store
        .complete(&key, token, Bytes::from_static(b"result"), 3 * unit)
        .await
        .expect("complete");
    // The TTL counts from completion and outlives the lease.
    h.advance(2 * unit).await;
    assert_completed(store, &key, &f, b"result").await;
    h.advance(2 * unit).await;
    let next = claimed(store, &key, &fp("after ttl"), 2 * unit).await;
    assert!(next > token);
}

/// What a store tells of a record in this process without a claim
/// ([`Store::completed_in_process`]) is what a claim reports of it (the first completion's,
/// whatever a repeated one brought), and only while it is completed and live: nothing of an
/// absent key, a claim in flight, a lapsed lease, a released claim or a record past its TTL.
/// The runtime replays what it tells without claiming, so a store that told more would replay
/// a record a claim would not. A store that tells nothing (`None` throughout, the default)
/// passes.
pub async fn completed_in_process_agrees_with_claim<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    assert_eq!(store.completed_in_process(&key), None, "an absent key");
    let token = claimed(store, &key, &f, 2 * unit).await;
    assert_eq!(store.completed_in_process(&key), None, "a claim in flight");
    let payload = Bytes::from_static(b"{\"id\":1,\"status\":201}");
    store
        .complete(&key, token, payload.clone(), 3 * unit)
        .await
        .expect("complete with the current token");
    if let Some(told) = store.completed_in_process(&key) {
        assert_eq!(told, (f, payload.clone()), "the record as it was completed");
    }
    // A repeated completion changes nothing, here either.
    let _ = store
        .complete(&key, token, Bytes::from_static(b"other"), 3 * unit)
        .await;
    if let Some(told) = store.completed_in_process(&key) {
        assert_eq!(told, (f, payload.clone()), "the record as first completed");
    }
    assert_completed(store, &key, &f, &payload).await;
    let lapsed = fresh_key();
    claimed(store, &lapsed, &f, unit).await;
    h.advance(4 * unit).await;
    assert_eq!(
        store.completed_in_process(&lapsed),
        None,
        "a claim whose lease lapsed"
    );
    assert_eq!(
        store.completed_in_process(&key),
        None,
        "a record past its TTL"
    );
    let released = fresh_key();
    let token = claimed(store, &released, &f, 2 * unit).await;
    store
        .release(&released, token)
        .await
        .expect("release with the current token");
    assert_eq!(
        store.completed_in_process(&released),
        None,
        "a released claim"
    );
}

/// A completed record tells how long it has left (what a cache tier keeps a copy for): more
/// than nothing, no more than its TTL, and less as time passes. A store that tells more than
/// is left would let a cached answer outlive its record.
pub async fn completed_record_tells_the_time_left<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("request");
    let token = claimed(store, &key, &f, 2 * unit).await;
    let ttl = 6 * unit;
    store
        .complete(&key, token, Bytes::from_static(b"result"), ttl)
        .await
        .expect("complete");
    let left = |claim: Result<Claim, StoreError>| match claim {
        Ok(Claim::Completed { expires_in, .. }) => expires_in,
        other => panic!("expected Completed, got {other:?}"),
    };
    let first = left(store.claim(&key, &f, 2 * unit, ttl).await);
    assert!(
        first > Duration::ZERO && first <= ttl,
        "time left {first:?} right after completing with a TTL of {ttl:?}"
    );
    h.advance(3 * unit).await;
    let later = left(store.claim(&key, &f, 2 * unit, ttl).await);
    assert!(
        later <= ttl - 3 * unit,
        "time left {later:?} after {:?} of a {ttl:?} TTL",
        3 * unit
    );
}

/// Tokens keep increasing per key after the record expired or was released, so an owner from
/// long ago can never match a new claim's token.
pub async fn tokens_increase_across_expiry_and_release<H: Harness>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let mut last = claimed(store, &key, &fp("0"), unit).await;
    store
        .complete(&key, last, Bytes::from_static(b"r"), unit)
        .await
        .expect("complete");
    h.advance(2 * unit).await;
    for round in 0..3 {
        let token = claimed(store, &key, &fp("n"), unit).await;
        assert!(token > last, "round {round}: {token:?} not above {last:?}");
        if round % 2 == 0 {
            store.release(&key, token).await.expect("release");
        } else {
            h.advance(2 * unit).await;
        }
        last = token;
    }
}

/// Operations on one key never affect another.
pub async fn keys_are_isolated<H: Harness>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let (a, b, c) = (fresh_key(), fresh_key(), fresh_key());
    let ta = claimed(store, &a, &fp("a"), 4 * unit).await;
    let tb = claimed(store, &b, &fp("b"), 4 * unit).await;
    store
        .complete(&a, ta, Bytes::from_static(b"A"), 10 * unit)
        .await
        .expect("complete a");
    assert_in_flight(store, &b, &fp("b"), 4 * unit).await;
    store.release(&b, tb).await.expect("release b");
    assert_completed(store, &a, &fp("a"), b"A").await;
    claimed(store, &c, &fp("c"), 4 * unit).await;
    claimed(store, &b, &fp("b"), 4 * unit).await;
}
