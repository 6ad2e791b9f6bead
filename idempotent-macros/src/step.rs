//! `#[step]`: an `async fn` whose result is a checkpoint of the operation it runs in.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::{ItemFn, LitStr, ReturnType, Token, parse_quote};

/// The longest step name, as `idempotent_core::steps::MAX_STEP_NAME_LEN`.
const MAX_STEP_NAME_LEN: usize = 64;

/// `name = "..."`, or nothing (the function's name).
struct Args {
    name: Option<LitStr>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.is_empty() {
            return Ok(Args { name: None });
        }
        let key: syn::Ident = input.parse()?;
        if key != "name" {
            return Err(syn::Error::new(
                key.span(),
                "unknown argument: `#[step]` takes only `name = \"...\"`",
            ));
        }
        input.parse::<Token![=]>()?;
        let name: LitStr = input.parse()?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after `name = \"...\"`"));
        }
        Ok(Args { name: Some(name) })
    }
}

fn check_name(name: &str, span: Span) -> syn::Result<()> {
    let valid = !name.is_empty()
        && name.len() <= MAX_STEP_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(syn::Error::new(
            span,
            format!(
                "invalid step name {name:?}: 1 to {MAX_STEP_NAME_LEN} bytes of [A-Za-z0-9_.-] are allowed"
            ),
        ))
    }
}

pub(crate) fn step(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let args: Args = syn::parse2(args)?;
    let mut function: ItemFn = syn::parse2(item)?;
    let sig = &function.sig;
    if let Some(constness) = &sig.constness {
        return Err(syn::Error::new_spanned(
            constness,
            "`#[step]` cannot be applied to a `const fn`: expected an `async fn`",
        ));
    }
    if sig.asyncness.is_none() {
        return Err(syn::Error::new(
            sig.fn_token.span,
            "`#[step]` requires an `async fn`: expected `async` before `fn`",
        ));
    }
    let name = match &args.name {
        Some(name) => {
            check_name(&name.value(), name.span())?;
            name.value()
        }
        None => {
            let ident = sig.ident.to_string();
            let ident = ident.trim_start_matches("r#").to_owned();
            check_name(&ident, sig.ident.span())?;
            ident
        }
    };
    let (output, span) = match &sig.output {
        ReturnType::Default => (quote!(()), sig.paren_token.span.close()),
        ReturnType::Type(_, ty) => (quote!(#ty), syn::spanned::Spanned::span(&**ty)),
    };
    // Spanned at the return type: a type the checkpoint cannot hold is reported there.
    let call = quote_spanned!(span=> ::idempotent_core::__private::step::<#output, _>);
    function.sig.output =
        parse_quote!(-> ::core::result::Result<#output, ::idempotent_core::Error>);
    let body = &function.block;
    let block: syn::Block = parse_quote!({
        #call(#name, async move #body).await
    });
    *function.block = block;
    Ok(quote!(#function))
}
