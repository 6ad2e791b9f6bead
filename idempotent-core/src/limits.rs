#![doc = include_str!("../docs/limits.md")]

use std::fmt;
use std::ops::RangeInclusive;
use std::time::Duration;

mod parse;

pub use parse::{ParseDurationError, parse_duration};

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
        let (min, max) = self.bounds();
        min..=max
    }

    /// The ends of [`range`](Self::range).
    const fn bounds(self) -> (Duration, Duration) {
        match self {
            Setting::Ttl => (MIN_TTL, MAX_TTL),
            Setting::Lease => (MIN_LEASE, MAX_LEASE),
            Setting::RecordRetry => (Duration::ZERO, MAX_RECORD_RETRY),
        }
    }

    /// The names of [`bounds`](Self::bounds), for messages.
    const fn bound_names(self) -> (&'static str, &'static str) {
        match self {
            Setting::Ttl => ("MIN_TTL", "MAX_TTL"),
            Setting::Lease => ("MIN_LEASE", "MAX_LEASE"),
            Setting::RecordRetry => ("Duration::ZERO", "MAX_RECORD_RETRY"),
        }
    }

    const fn name(self) -> &'static str {
        match self {
            Setting::Ttl => "ttl",
            Setting::Lease => "lease",
            Setting::RecordRetry => "record_retry",
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
        f.write_str(self.name())
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

/// A [client session](crate::session)'s window outside 1 to
/// [`MAX_SESSION_WINDOW`](crate::session::MAX_SESSION_WINDOW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "session window {0} is out of range; it must be 1 to {max}",
    max = crate::session::MAX_SESSION_WINDOW
)]
pub struct WindowError(pub u64);

/// `window`, if it is between 1 and [`MAX_SESSION_WINDOW`](crate::session::MAX_SESSION_WINDOW).
pub fn check_session_window(window: u64) -> Result<u64, WindowError> {
    if (1..=crate::session::MAX_SESSION_WINDOW).contains(&window) {
        Ok(window)
    } else {
        Err(WindowError(window))
    }
}

/// `ttl`, or [`MAX_TTL`] if it is longer: what a store records.
pub fn clamp_ttl(ttl: Duration) -> Duration {
    ttl.min(MAX_TTL)
}

/// `lease`, or [`MAX_LEASE`] if it is longer: what a store records.
pub fn clamp_lease(lease: Duration) -> Duration {
    lease.min(MAX_LEASE)
}

/// `value` for `setting`, clamped into its range; a value outside it is logged as a warning
/// with the [`DurationError`]'s message and what it became.
pub(crate) fn clamped(setting: Setting, value: Duration) -> Duration {
    match setting.check(value) {
        Ok(value) => value,
        Err(error) => {
            let (min, max) = setting.bounds();
            let clamped = value.clamp(min, max);
            tracing::warn!(%error, ?clamped, "a duration setting out of its range was clamped into it");
            clamped
        }
    }
}

/// `value` for `setting`, or a panic that names the bound it crosses: evaluated in a constant,
/// the panic is a compile error at the caller. The `#[idempotent]` attribute checks its `ttl`
/// and `lease` literals with it, so the ranges are written once, above.
#[track_caller]
pub(crate) const fn require_const(setting: Setting, value: Duration) -> Duration {
    let (min, max) = setting.bounds();
    if value.as_nanos() < min.as_nanos() {
        panic!("{}", out_of_range(setting, false).as_str());
    }
    if value.as_nanos() > max.as_nanos() {
        panic!("{}", out_of_range(setting, true).as_str());
    }
    value
}

/// What [`require_const`] says about a value below (or, with `above`, over) the range:
/// `ttl must be at most 365d (`idempotent_core::limits::MAX_TTL`): write a duration from 1ms to
/// 365d`.
const fn out_of_range(setting: Setting, above: bool) -> ConstText {
    let (min, max) = setting.bounds();
    let (min_name, max_name) = setting.bound_names();
    let (side, bound, name) = match above {
        false => (" must be at least ", min, min_name),
        true => (" must be at most ", max, max_name),
    };
    ConstText::new()
        .push(setting.name())
        .push(side)
        .duration(bound)
        .push(" (`idempotent_core::limits::")
        .push(name)
        .push("`): write a duration from ")
        .duration(min)
        .push(" to ")
        .duration(max)
}

/// Text built in a `const fn`, where `format!` is not available.
struct ConstText {
    bytes: [u8; 160],
    len: usize,
}

impl ConstText {
    const fn new() -> Self {
        ConstText {
            bytes: [0; 160],
            len: 0,
        }
    }

    const fn push(mut self, text: &str) -> Self {
        let text = text.as_bytes();
        let mut i = 0;
        while i < text.len() {
            self.bytes[self.len] = text[i];
            self.len += 1;
            i += 1;
        }
        self
    }

    const fn number(mut self, n: u128) -> Self {
        let mut digits = [0u8; 39];
        let (mut n, mut count) = (n, 0);
        loop {
            digits[count] = b'0' + (n % 10) as u8;
            count += 1;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        while count > 0 {
            count -= 1;
            self.bytes[self.len] = digits[count];
            self.len += 1;
        }
        self
    }

    /// `d` as [`Human`] writes it; below millisecond resolution, in nanoseconds.
    const fn duration(self, d: Duration) -> Self {
        match in_largest_unit(d) {
            Some((count, unit)) => self.number(count).push(unit),
            None => self.number(d.as_nanos()).push("ns"),
        }
    }

    const fn as_str(&self) -> &str {
        match std::str::from_utf8(self.bytes.split_at(self.len).0) {
            Ok(text) => text,
            // Only whole `&str`s and ASCII digits are pushed.
            Err(_) => panic!("ConstText holds UTF-8"),
        }
    }
}

/// `d` as a count of the largest unit that divides it exactly (`(365, "d")`, `(90, "s")`,
/// `(1500, "ms")`; zero is `(0, "s")`), or `None` below millisecond resolution.
const fn in_largest_unit(d: Duration) -> Option<(u128, &'static str)> {
    if d.is_zero() {
        return Some((0, "s"));
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return None;
    }
    if d.subsec_nanos() != 0 {
        return Some((d.as_millis(), "ms"));
    }
    let secs = d.as_secs();
    let (count, unit) = if secs.is_multiple_of(DAY) {
        (secs / DAY, "d")
    } else if secs.is_multiple_of(3600) {
        (secs / 3600, "h")
    } else if secs.is_multiple_of(60) {
        (secs / 60, "m")
    } else {
        (secs, "s")
    };
    Some((count as u128, unit))
}

/// A duration as people write it: the largest unit that divides it exactly (`365d`, `90s`,
/// `100ms`), or `Duration`'s own notation (`1.5ms`, `500µs`).
struct Human(Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match in_largest_unit(self.0) {
            Some((count, unit)) => write!(f, "{count}{unit}"),
            None => write!(f, "{:?}", self.0),
        }
    }
}

#[cfg(test)]
mod tests;
