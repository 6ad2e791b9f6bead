//! What `#[idempotent]` emits when the user made a mistake: the error, and the function exactly
//! as written, so the mistake is the only error reported and callers still compile.

use proc_macro::TokenStream;

/// `compile_error!` at the offending token, followed by the original item unchanged.
pub(crate) fn fallback(error: syn::Error, item: TokenStream) -> TokenStream {
    let mut tokens = TokenStream::from(error.into_compile_error());
    tokens.extend(item);
    tokens
}
