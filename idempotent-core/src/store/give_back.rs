//! Giving back a claim whose answer came too late: a shared store (Redis, PostgreSQL) may
//! make a claim after its caller gave up; [`Unanswered`] ends its lease as soon as the store
//! answers again, on a bounded number of background tasks.

use std::time::Duration;

use super::measured::BoxFuture;
use crate::StoreError;

/// A claim sent to a shared store whose answer did not come back: the store may have
/// received it, and will then make it when it next runs (a store frozen, then thawed). Its
/// caller has already been told the store is unavailable and will retry; a claim landing
/// after that must not hold the key for a whole lease. Each such claim carries a random
/// *claimant* number, written into the record it makes; dropped before [`answered`], this
/// guard gives back, in the background, the in-flight record that carries that number.
///
/// [`answered`]: Unanswered::answered
pub struct Unanswered {
    give_back: Option<GiveBack>,
}

/// One attempt to give back a claim: `Ok(true)` if the store held it and has given it up,
/// `Ok(false)` if it holds no such claim.
pub type GiveBack =
    Box<dyn FnMut() -> BoxFuture<'static, Result<bool, StoreError>> + Send + 'static>;

/// How long a claim that may still land is given back for once the store answers again and
/// does not hold it: the claim may be queued behind the give-back on another connection.
const GIVE_BACK_SETTLE: Duration = Duration::from_secs(5);
/// How long a claim that may land is tried to be given back at most. A store frozen longer
/// than this makes the claim at its thaw, and it holds the key until its lease ends.
pub const GIVE_BACK_MAX: Duration = Duration::from_secs(600);
/// Each give-back attempt is abandoned after this long.
const GIVE_BACK_ATTEMPT: Duration = Duration::from_secs(2);

impl Unanswered {
    /// Armed with what gives the claim back.
    pub fn new(give_back: GiveBack) -> Self {
        Unanswered {
            give_back: Some(give_back),
        }
    }

    /// The store answered: the caller knows what the claim did.
    pub fn answered(&mut self) {
        self.give_back = None;
    }
}

/// At most this many claims are being given back at once; past it (a long outage under heavy
/// load), a claim the store may still make ends with its lease.
const GIVE_BACK_TASKS: usize = 10_000;

static GIVING_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Unanswered {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        let Some(give_back) = self.give_back.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if GIVING_BACK.fetch_add(1, Ordering::AcqRel) >= GIVE_BACK_TASKS {
            GIVING_BACK.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        runtime.spawn(async move {
            give_back_until_settled(give_back).await;
            GIVING_BACK.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// Tries to give an unanswered claim back, with backoff, until the store gives it up, or has
/// answered for [`GIVE_BACK_SETTLE`] without holding it, or [`GIVE_BACK_MAX`] has passed.
async fn give_back_until_settled(mut give_back: GiveBack) {
    let started = tokio::time::Instant::now();
    let mut first_answer = None;
    let mut delay = Duration::from_millis(200);
    loop {
        let now = tokio::time::Instant::now();
        match tokio::time::timeout(GIVE_BACK_ATTEMPT, give_back()).await {
            Ok(Ok(true)) => {
                tracing::info!(
                    "a claim the store made after its caller stopped waiting was given back"
                );
                return;
            }
            Ok(Ok(false)) => {
                let answered = *first_answer.get_or_insert(now);
                if now.duration_since(answered) >= GIVE_BACK_SETTLE {
                    return;
                }
            }
            Ok(Err(_)) | Err(_) => {
                if now.duration_since(started) >= GIVE_BACK_MAX {
                    tracing::warn!(
                        "the store stayed unreachable; a claim it may still make ends with its lease"
                    );
                    return;
                }
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// A random number naming one claim attempt (see [`Unanswered`]): never zero.
pub fn claimant() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    // Non-negative as an i64 (PostgreSQL's bigint) and never zero.
    (hasher.finish() >> 1).max(1)
}
