//! The `#[idempotent]` attribute macro of [`idempotent-core`](https://docs.rs/idempotent-core).
//!
//! Depend on `idempotent-core` (its default `macros` feature re-exports this attribute as
//! `idempotent_core::idempotent`, documented there) rather than on this crate: the expansion
//! calls `idempotent_core`, and the two crates are released in lockstep.
//!
//! Public API: two items, the [`macro@idempotent`] and [`macro@step`] attributes.
//!
//! The pipeline: `args` parses the arguments, `item` the function, `expand` validates both and
//! emits the expansion; on any error, `fallback` emits it with the function unchanged.

mod args;
mod expand;
mod fallback;
mod item;
mod step;

use proc_macro::TokenStream;

/// Defined in the `idempotent-macros` crate; use it as `idempotent_core::idempotent` (feature
/// `macros`, on by default).
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let expanded = expand::idempotent(args.into(), item.clone().into());
    expanded.map_or_else(|error| fallback::fallback(error, item), Into::into)
}

/// Defined in the `idempotent-macros` crate; use it as `idempotent_core::step` (feature
/// `macros`, on by default).
#[proc_macro_attribute]
pub fn step(args: TokenStream, item: TokenStream) -> TokenStream {
    let expanded = step::step(args.into(), item.clone().into());
    expanded.map_or_else(|error| fallback::fallback(error, item), Into::into)
}
