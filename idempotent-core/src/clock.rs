//! Time sources for stores that keep their own time: the memory store reads a [`Clock`]
//! ([`SystemClock`] unless told otherwise), and tests move a `ManualClock` (feature
//! `test-util`) instead of sleeping.

use std::fmt;
#[cfg(feature = "test-util")]
use std::sync::Arc;
#[cfg(feature = "test-util")]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonic time source: the time elapsed since some fixed origin.
///
/// Stores with a server clock (Redis, PostgreSQL) use the server's; [`MemoryStore`] uses this,
/// so tests can move time with a `ManualClock` (feature `test-util`) instead of sleeping.
///
/// [`MemoryStore`]: crate::memory::MemoryStore
pub trait Clock: Send + Sync + 'static {
    /// Time since this clock's origin. Never decreases.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock, read through [`tokio::time::Instant`] so that it follows
/// tokio's paused test clock when a test pauses time.
#[derive(Clone, Copy)]
pub struct SystemClock {
    origin: tokio::time::Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        SystemClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

impl fmt::Debug for SystemClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SystemClock")
    }
}

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use idempotent_core::clock::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new();
/// let shared = clock.clone();
/// clock.advance(Duration::from_secs(90));
/// assert_eq!(shared.now(), Duration::from_secs(90));
/// ```
#[derive(Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

#[cfg(feature = "test-util")]
impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`. The clock stops at its end, `u64::MAX` nanoseconds
    /// (about 584 years): [`Duration::MAX`] moves it there, past every expiry.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by))
            });
    }
}

#[cfg(feature = "test-util")]
impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(feature = "test-util")]
impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}
