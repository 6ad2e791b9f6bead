//! The accepted range of every duration setting, and the checks that enforce it.
//!
//! | setting | accepted | set with |
//! |---|---|---|
//! | TTL: how long a completed result is replayed | [`MIN_TTL`] (1 ms) to [`MAX_TTL`] (365 days) | [`Defaults::ttl`](crate::Defaults::ttl), [`CallOptions::ttl`](crate::CallOptions::ttl) (also the tower layer's `call_options`), `#[idempotent(ttl = "..")]` |
//! | lease: how long a claim lives without renewal | [`MIN_LEASE`] (100 ms) to [`MAX_LEASE`] (365 days) | [`Defaults::lease`](crate::Defaults::lease), [`CallOptions::lease`](crate::CallOptions::lease) (also the tower layer's `call_options`), `#[idempotent(lease = "..")]` |
//! | record retry: how long an unrecorded result is retried | zero to [`MAX_RECORD_RETRY`] (365 days) | [`IdempotencyBuilder::record_retry`](crate::IdempotencyBuilder::record_retry) |
//! | in-flight wait: [`InFlightPolicy::Wait`](crate::InFlightPolicy::Wait)'s `max` | any, zero to [`Duration::MAX`] | [`Defaults::in_flight`](crate::Defaults::in_flight), [`CallOptions::in_flight`](crate::CallOptions::in_flight); `#[idempotent(wait = "..")]` |
//!
//! Why these bounds:
//!
//! - **Lease at least 100 ms.** While the work runs the lease is renewed every third of it, and
//!   each renewal is abandoned after a sixth of it (16 ms at the floor), which is about the
//!   least one round trip to a shared store can be given. A shorter lease lapses while its
//!   owner still runs, and a duplicate then runs too: a zero lease would let every duplicate
//!   run at once.
//! - **TTL at least 1 ms**: the resolution of the stores' expiries (Redis counts whole
//!   milliseconds). A zero TTL would record a result that is forgotten before anyone can
//!   replay it.
//! - **At most 365 days** for TTLs, leases and the record retry: far beyond any useful
//!   setting, and well inside what every backend and clock accepts (Redis `PEXPIRE` fails past
//!   `i64` milliseconds from now, PostgreSQL timestamps end in the year 294276, and adding a
//!   `Duration` to an `Instant` can overflow).
//! - **A wait of any length.** [`InFlightPolicy::Wait { max: Duration::MAX }`] waits until the
//!   running call finishes or its lease ends, however long that is; a `max` too far away for
//!   the clock to represent waits with no deadline. `max` zero answers at once, like
//!   [`InFlightPolicy::Reject`].
//!
//! # Program settings panic, outside values are checked
//!
//! A duration written in the program (the setters of [`IdempotencyBuilder`], [`Call`] and the
//! tower layer) is a programming error when it is out of range, so those setters panic with
//! the message of a [`DurationError`], as tokio's runtime builder does for a zero thread count;
//! each documents it under `# Panics`. The `#[idempotent]` attribute checks its literals
//! against the same ranges at compile time. A duration that comes from outside the program (an
//! environment variable, a configuration file, a request) should go through [`check_ttl`],
//! [`check_lease`] or [`check_record_retry`] first, which return the error instead:
//!
//! ```
//! use std::time::Duration;
//! use idempotent_core::limits;
//!
//! let lease = limits::check_lease(Duration::from_millis(50)).unwrap_err();
//! assert_eq!(lease.to_string(), "lease must be between 100ms and 365d, got 50ms");
//! assert_eq!(limits::check_ttl(Duration::from_secs(3600)), Ok(Duration::from_secs(3600)));
//! ```
//!
//! # Stores
//!
//! Stores are also called directly (by tests, by custom runtimes) with any duration, so each
//! built-in store treats a TTL above [`MAX_TTL`] as [`MAX_TTL`] and a lease above
//! [`MAX_LEASE`] as [`MAX_LEASE`] ([`clamp_ttl`], [`clamp_lease`]), before it writes anything:
//! a record always gets an expiry, and never one past the ceiling. Below the floors they honour
//! what they are given, down to their resolution (Redis: 1 ms). Custom stores can do the same
//! with [`clamp_ttl`] and [`clamp_lease`].
//!
//! [`IdempotencyBuilder`]: crate::IdempotencyBuilder
//! [`Call`]: crate::Call
//! [`InFlightPolicy::Wait { max: Duration::MAX }`]: crate::InFlightPolicy::Wait
//! [`InFlightPolicy::Reject`]: crate::InFlightPolicy::Reject

use std::fmt;
use std::ops::RangeInclusive;
use std::time::Duration;

const DAY: u64 = 24 * 60 * 60;

/// The shortest TTL: 1 millisecond.
pub const MIN_TTL: Duration = Duration::from_millis(1);
/// The longest TTL: 365 days.
pub const MAX_TTL: Duration = Duration::from_secs(365 * DAY);
/// The shortest lease: 100 milliseconds.
pub const MIN_LEASE: Duration = Duration::from_millis(100);
/// The longest lease: 365 days.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * DAY);
/// The longest record retry bound: 365 days. The shortest is zero (one more attempt, then
/// give up).
pub const MAX_RECORD_RETRY: Duration = Duration::from_secs(365 * DAY);

/// A duration setting with an accepted range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Setting {
    /// How long a completed result is replayed: [`MIN_TTL`] to [`MAX_TTL`].
    Ttl,
    /// How long a claim lives without renewal: [`MIN_LEASE`] to [`MAX_LEASE`].
    Lease,
    /// How long a result that could not be recorded is retried: zero to
    /// [`MAX_RECORD_RETRY`].
    RecordRetry,
}

impl Setting {
    /// The durations this setting accepts, both ends included.
    pub fn range(self) -> RangeInclusive<Duration> {
        match self {
            Setting::Ttl => MIN_TTL..=MAX_TTL,
            Setting::Lease => MIN_LEASE..=MAX_LEASE,
            Setting::RecordRetry => Duration::ZERO..=MAX_RECORD_RETRY,
        }
    }

    /// `value` if this setting accepts it.
    fn check(self, value: Duration) -> Result<Duration, DurationError> {
        if self.range().contains(&value) {
            Ok(value)
        } else {
            Err(DurationError {
                setting: self,
                value,
            })
        }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Setting::Ttl => "ttl",
            Setting::Lease => "lease",
            Setting::RecordRetry => "record_retry",
        })
    }
}

/// A duration outside the range its setting accepts. The message names the setting, the
/// range and the value: `lease must be between 100ms and 365d, got 50ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{setting} must be between {} and {}, got {}",
    Human(*.setting.range().start()),
    Human(*.setting.range().end()),
    Human(*.value)
)]
pub struct DurationError {
    setting: Setting,
    value: Duration,
}

impl DurationError {
    /// The setting the value was given for.
    pub fn setting(&self) -> Setting {
        self.setting
    }

    /// The value that was refused.
    pub fn value(&self) -> Duration {
        self.value
    }
}

/// `ttl`, if it is between [`MIN_TTL`] and [`MAX_TTL`].
pub fn check_ttl(ttl: Duration) -> Result<Duration, DurationError> {
    Setting::Ttl.check(ttl)
}

/// `lease`, if it is between [`MIN_LEASE`] and [`MAX_LEASE`].
pub fn check_lease(lease: Duration) -> Result<Duration, DurationError> {
    Setting::Lease.check(lease)
}

/// `bound`, if it is at most [`MAX_RECORD_RETRY`].
pub fn check_record_retry(bound: Duration) -> Result<Duration, DurationError> {
    Setting::RecordRetry.check(bound)
}

/// `ttl`, or [`MAX_TTL`] if it is longer: what a store records.
pub fn clamp_ttl(ttl: Duration) -> Duration {
    ttl.min(MAX_TTL)
}

/// `lease`, or [`MAX_LEASE`] if it is longer: what a store records.
pub fn clamp_lease(lease: Duration) -> Duration {
    lease.min(MAX_LEASE)
}

/// `value` for `setting`, or a panic with the [`DurationError`]'s message at the caller.
#[track_caller]
pub(crate) fn require(setting: Setting, value: Duration) -> Duration {
    match setting.check(value) {
        Ok(value) => value,
        Err(error) => panic!("{error}"),
    }
}

/// A duration as people write it: the largest unit that divides it exactly (`365d`, `90s`,
/// `100ms`), or `Duration`'s own notation (`1.5ms`, `500µs`).
struct Human(Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            return f.write_str("0s");
        }
        if d.subsec_nanos() % 1_000_000 != 0 {
            return write!(f, "{d:?}");
        }
        let secs = d.as_secs();
        if d.subsec_nanos() != 0 {
            return write!(f, "{}ms", d.as_millis());
        }
        for (unit, per) in [("d", DAY), ("h", 3600), ("m", 60)] {
            if secs % per == 0 {
                return write!(f, "{}{unit}", secs / per);
            }
        }
        write!(f, "{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_written() {
        for (d, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(15 * 60), "15m"),
            (Duration::from_secs(24 * 3600), "1d"),
            (Duration::from_secs(36 * 3600), "36h"),
            (MAX_TTL, "365d"),
            (Duration::from_micros(500), "500µs"),
            (Duration::from_nanos(1_500_000), "1.5ms"),
            (Duration::MAX, "18446744073709551615.999999999s"),
        ] {
            assert_eq!(Human(d).to_string(), text, "{d:?}");
        }
    }
}
