//! The retry policy ([`RetryPolicy`]) and the loop every client integration shares
//! ([`deliver`]): attempts, deadline, backoff with full jitter and the retry budget.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotent_core::BoxError;
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

use super::error::{ClientError, GiveUp};
use super::metrics::ClientMetrics;
use super::verdict::{Ended, RetryReason, Verdict};

/// Default [`RetryPolicy::max_attempts`]: 6.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 6;
/// Default [`RetryPolicy::deadline`]: 30 seconds for a logical call, retries included.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// Default [`RetryPolicy::attempt_timeout`]: 10 seconds for one attempt.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`RetryPolicy::max_request_body`]: 1 MiB, the server layer's default limit.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1 << 20;

/// The longest a call, an attempt or a wait lasts: about 30 years, tokio's own "never". A
/// deadline or an attempt timeout beyond it (`Duration::MAX`, say) means none; a wait beyond
/// it ends after any deadline, so it is never begun. Every instant the client computes is
/// `now` plus at most this, which the clock and the timer can represent.
const NEVER: Duration = Duration::from_secs(60 * 60 * 24 * 365 * 30);

/// How a client retries one logical call: at most [`max_attempts`](Self::max_attempts)
/// attempts within the [`deadline`](Self::deadline), each bounded by the
/// [`attempt_timeout`](Self::attempt_timeout), separated by exponential backoff with full
/// jitter (or the server's `Retry-After` / `grpc-retry-pushback-ms`), and only while the
/// retry [`budget`](Self::budget) allows.
///
/// The budget is shared by every clone of the policy (and of the layers and services built
/// with it): it is what keeps a fleet of clients from multiplying an outage. By default it
/// allows retries of 20 % of the calls of the last 10 seconds, plus 10 per second.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) deadline: Duration,
    pub(crate) attempt_timeout: Duration,
    pub(crate) first_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) budget: Arc<TpsBudget>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            deadline: DEFAULT_DEADLINE,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            budget: Arc::new(TpsBudget::default()),
        }
    }
}

impl RetryPolicy {
    /// The defaults: [`DEFAULT_MAX_ATTEMPTS`], [`DEFAULT_DEADLINE`],
    /// [`DEFAULT_ATTEMPT_TIMEOUT`], backoff from 100 ms up to 5 s, [`DEFAULT_MAX_REQUEST_BODY`]
    /// and a budget of 20 % retries plus 10 per second.
    pub fn new() -> Self {
        Self::default()
    }

    /// Attempts per logical call, the first included (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// How long a logical call may take, every attempt and wait included. No retry starts
    /// after it, and no wait is begun that would end after it (a server's `Retry-After` that
    /// does is not waited: the call ends at once, with that answer). `Duration::MAX` (any
    /// deadline over about 30 years) means no deadline.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How long one attempt may wait for its answer's head before it is abandoned and
    /// retried (the abandoned request may still have reached the server: the retry carries
    /// the same key, so it cannot run twice). `Duration::MAX` means no timeout of its own: an
    /// attempt is still bounded by the [`deadline`](Self::deadline).
    #[must_use]
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Exponential backoff with full jitter: before retry `n`, a random wait between zero and
    /// `min(max, first × 2ⁿ⁻¹)`. A server's `Retry-After` or `grpc-retry-pushback-ms` is
    /// waited instead.
    #[must_use]
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The largest request body kept for resending (default [`DEFAULT_MAX_REQUEST_BODY`]); a
    /// larger one fails with [`ClientError::BodyTooLarge`] before anything is sent.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// The retry budget (tower's [`TpsBudget`]): each logical call deposits, each retry
    /// withdraws; `retry_percent` of the calls of the last `ttl` may be retried, plus
    /// `min_per_sec` retries per second. A call whose retry the budget refuses ends with
    /// its last answer. `ttl` is clamped to 1–60 s and `retry_percent` to 0–1000 (%/100).
    #[must_use]
    pub fn budget(mut self, ttl: Duration, min_per_sec: u32, retry_percent: f32) -> Self {
        let ttl = ttl.clamp(Duration::from_secs(1), Duration::from_secs(60));
        let percent = if retry_percent.is_finite() {
            retry_percent.clamp(0.0, 1000.0)
        } else {
            0.0
        };
        let min_per_sec = min_per_sec.min(i32::MAX as u32 - 1);
        self.budget = Arc::new(TpsBudget::new(ttl, min_per_sec, percent));
        self
    }

    /// The wait before retry number `retry` (1 for the first retry): full jitter.
    fn backoff_for(&self, retry: u32) -> Duration {
        let exponent = retry.saturating_sub(1).min(20);
        let ceiling = self
            .first_backoff
            .saturating_mul(1 << exponent)
            .min(self.max_backoff);
        jitter(ceiling, fastrand::u32(..))
    }
}

/// `ceiling × fraction / 2³²`, in integers: no rounding can carry it past `ceiling`, and no
/// ceiling (up to `Duration::MAX`) overflows.
fn jitter(ceiling: Duration, fraction: u32) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    // Under 2⁹⁵ nanoseconds times under 2³²: fits in a u128.
    let nanos = (ceiling.as_nanos() * u128::from(fraction)) >> 32;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    let subsec = u32::try_from(nanos % NANOS_PER_SEC).unwrap_or(0);
    Duration::new(secs, subsec)
}

/// How one logical call went: its answer, how many attempts it took, and why it ended.
pub(crate) struct Delivered<R> {
    pub(crate) answer: R,
    pub(crate) attempts: u32,
    pub(crate) ended: Ended,
}

/// The last attempt of a call being retried: an answer with a retryable status, or none.
enum Last<R> {
    Answer(R),
    Failed(BoxError),
}

/// Why an attempt produced no answer.
#[derive(Debug)]
struct AttemptTimedOut(Duration);

impl fmt::Display for AttemptTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no answer within the attempt timeout of {:?}", self.0)
    }
}

impl std::error::Error for AttemptTimedOut {}

/// `now + duration`, with any duration over [`NEVER`] taken as [`NEVER`]: never an overflow.
fn after(now: Instant, duration: Duration) -> Instant {
    now.checked_add(duration.min(NEVER))
        // A clock that cannot hold 30 years from now: a day, then now.
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

impl RetryPolicy {
    /// When a call that starts `now` ends at the latest (its [`deadline`](Self::deadline)).
    pub(crate) fn deadline_from(&self, now: Instant) -> Instant {
        after(now, self.deadline)
    }
}

/// Sends one logical call by `deadline`: `send` makes one attempt (the same request, the same
/// key or session number `seq`), and `verdict` judges each answer. Ends with the first answer
/// that is not to be retried (a session's refusal included), or, when the attempts, the
/// deadline or the budget run out, with the last answer (a retryable status is still an
/// answer) or [`ClientError::GaveUp`] if the last attempt got none.
pub(crate) async fn deliver<R, F, Fut>(
    policy: &RetryPolicy,
    metrics: &ClientMetrics,
    key: &str,
    seq: Option<u64>,
    deadline: Instant,
    mut send: F,
    verdict: impl Fn(&R) -> Verdict,
) -> Result<Delivered<R>, ClientError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<R, BoxError>>,
{
    policy.budget.deposit();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        metrics.attempt();
        let now = Instant::now();
        let timeout = policy
            .attempt_timeout
            .min(deadline.saturating_duration_since(now));
        tracing::debug!(key, seq, attempt = attempts, "sending idempotent request");
        let (server_delay, why, failure) = match tokio::time::timeout(timeout, send()).await {
            Ok(Ok(answer)) => match verdict(&answer) {
                Verdict::Done => {
                    return Ok(Delivered {
                        answer,
                        attempts,
                        ended: Ended::Answered,
                    });
                }
                Verdict::KeyReused => {
                    tracing::error!(
                        key,
                        attempts,
                        "the idempotency key was already used for a different request: the server refused this one; a key must name one operation"
                    );
                    return Ok(Delivered {
                        answer,
                        attempts,
                        ended: Ended::KeyReused,
                    });
                }
                Verdict::Refused(refusal) => {
                    tracing::warn!(
                        key,
                        seq,
                        attempts,
                        ?refusal,
                        "the server refused the session's call; not retried"
                    );
                    return Ok(Delivered {
                        answer,
                        attempts,
                        ended: Ended::Refused(refusal),
                    });
                }
                Verdict::Retry(after, why) => (after, why, Last::Answer(answer)),
            },
            Ok(Err(error)) => (None, RetryReason::Error, Last::Failed(error)),
            Err(_) => (
                None,
                RetryReason::Timeout,
                Last::Failed(Box::new(AttemptTimedOut(timeout))),
            ),
        };
        let give_up = |reason: GiveUp, failure: Last<R>| match failure {
            Last::Answer(answer) => {
                tracing::warn!(key, seq, attempts, %reason, "idempotent request not retried again; returning its last answer");
                Ok(Delivered {
                    answer,
                    attempts,
                    ended: Ended::GaveUp(reason),
                })
            }
            Last::Failed(last) => {
                tracing::warn!(key, seq, attempts, %reason, error = %last, "idempotent request failed; gave up");
                Err(ClientError::GaveUp {
                    key: key.to_owned(),
                    seq,
                    attempts,
                    reason,
                    last,
                })
            }
        };
        if attempts >= policy.max_attempts {
            return give_up(GiveUp::Attempts, failure);
        }
        let wait = server_delay.unwrap_or_else(|| policy.backoff_for(attempts));
        // However long the server asked for: a wait that would end at or after the deadline
        // is not begun. Compared with what is left, never added to an instant.
        if wait >= deadline.saturating_duration_since(Instant::now()) {
            return give_up(GiveUp::Deadline, failure);
        }
        if !policy.budget.withdraw() {
            return give_up(GiveUp::Budget, failure);
        }
        metrics.retry(why);
        match &failure {
            Last::Failed(error) => {
                tracing::info!(key, seq, attempt = attempts, ?wait, error = %error, "idempotent request failed; retrying with the same key")
            }
            Last::Answer(_) => {
                tracing::info!(
                    key,
                    seq,
                    attempt = attempts,
                    ?wait,
                    "idempotent request answered with a retryable status; retrying with the same key"
                )
            }
        }
        drop(failure);
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // `Instant + Duration` panicked on a huge wait or setting, and the jitter relied on float
    // rounding to stay under `Duration::MAX`: every step now saturates or compares.
    #[test]
    fn huge_delays_and_settings_saturate() {
        for ceiling in [Duration::ZERO, Duration::from_millis(1), Duration::MAX] {
            for fraction in [0, 1, u32::MAX / 2, u32::MAX] {
                assert!(
                    jitter(ceiling, fraction) <= ceiling,
                    "{ceiling:?} {fraction}"
                );
            }
        }
        assert!(jitter(Duration::MAX, u32::MAX) > Duration::MAX / 2);
        let policy = RetryPolicy::new().backoff(Duration::MAX, Duration::MAX);
        for retry in [0, 1, 2, 30, u32::MAX] {
            let _ = policy.backoff_for(retry);
        }
        let now = Instant::now();
        assert_eq!(after(now, Duration::MAX), now + NEVER);
        assert_eq!(
            after(now, Duration::from_secs(3)),
            now + Duration::from_secs(3)
        );
    }

    #[test]
    fn backoff_is_full_jitter_under_a_growing_ceiling() {
        let policy =
            RetryPolicy::new().backoff(Duration::from_millis(100), Duration::from_millis(800));
        for retry in 1..=8u32 {
            let ceiling = Duration::from_millis(100 * (1 << (retry - 1).min(3)));
            let waits: Vec<_> = (0..200).map(|_| policy.backoff_for(retry)).collect();
            assert!(waits.iter().all(|w| *w <= ceiling), "retry {retry}");
            // Spread over the whole range, not a fixed delay.
            assert!(waits.iter().any(|w| *w < ceiling / 4), "retry {retry}");
            assert!(waits.iter().any(|w| *w > ceiling * 3 / 4), "retry {retry}");
        }
    }
}
