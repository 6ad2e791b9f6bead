//! The `#[idempotent]` attribute and its documentation.

#[doc = include_str!("../docs/attribute.md")]
#[cfg(feature = "macros")]
pub use idempotent_macros::idempotent;

#[doc = include_str!("../docs/step.md")]
#[cfg(feature = "macros")]
pub use idempotent_macros::step;
