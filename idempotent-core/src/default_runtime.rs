//! The runtime `#[idempotent]` functions use when they name none.

use std::sync::OnceLock;

use crate::Idempotency;

static DEFAULT_RUNTIME: OnceLock<Idempotency> = OnceLock::new();

/// Installs the runtime that [`#[idempotent]`](macro@crate::idempotent) functions without a
/// `runtime = ...` argument use. Call it once, at startup, before the first such call.
///
/// Fails, handing `runtime` back, if a default runtime is already in place: installed by an
/// earlier call, or created by [`default_runtime`] because an `#[idempotent]` function ran
/// first.
///
/// ```
/// use idempotent_core::memory::MemoryStore;
/// use idempotent_core::{Defaults, Idempotency, set_default_runtime};
/// use std::time::Duration;
///
/// let runtime = Idempotency::builder(MemoryStore::new())
///     .namespace("billing")
///     .defaults(Defaults::new().ttl(Duration::from_secs(7 * 24 * 3600)))
///     .build();
/// set_default_runtime(runtime).expect("installed once, at startup");
/// ```
pub fn set_default_runtime(runtime: Idempotency) -> Result<(), Idempotency> {
    DEFAULT_RUNTIME.set(runtime)
}

/// The runtime [`#[idempotent]`](macro@crate::idempotent) functions use when they name none:
/// the one installed with [`set_default_runtime`], or else, created on first use, a runtime
/// with the default settings over a [`MemoryStore`](crate::memory::MemoryStore) (which protects one
/// process only).
///
/// # Panics
///
/// Without the `memory` feature there is no store to fall back on: panics if no runtime was
/// installed.
pub fn default_runtime() -> &'static Idempotency {
    DEFAULT_RUNTIME.get_or_init(fallback_runtime)
}

#[cfg(feature = "memory")]
fn fallback_runtime() -> Idempotency {
    Idempotency::new(crate::memory::MemoryStore::new())
}

#[cfg(not(feature = "memory"))]
fn fallback_runtime() -> Idempotency {
    panic!(
        "no default idempotency runtime: call `idempotent_core::set_default_runtime` at startup, \
         pass `runtime = ...` to #[idempotent], or enable the `memory` feature"
    )
}
