//! What `#[idempotent]` emits: the signature unchanged, and a body that is one call into
//! `idempotent_core::__private` with the original body as the work; with `tx = ...`, three
//! (claim, body, record), because the body borrows the transaction in between.
//!
//! What the `Ok` and error types must implement is checked once each, by a call whose tokens
//! cover the type as the signature spells it, so that a missing bound is one error on that
//! type; the calls into the runtime put no bound on either type.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::Expr;
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;

use crate::args::{Args, DurationLit, OnError};
use crate::item::Function;

/// Parses, validates and expands; every user error comes back as one `syn::Error`.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    match (Args::parse(args), Function::parse(item)) {
        (Ok(args), Ok(function)) => {
            if let Some((_, name)) = &args.claim {
                function.check_claim_binding(name)?;
            }
            let transaction = match &args.tx {
                Some((_, name)) => {
                    let ty = function.transaction_parameter(name)?;
                    Some(Transaction {
                        name: name.clone(),
                        ty: Range::of(ty),
                    })
                }
                None => None,
            };
            Ok(expand(args, function, transaction))
        }
        (Err(mut args), Err(function)) => {
            args.combine(function);
            Err(args)
        }
        (Err(error), Ok(_)) | (Ok(_), Err(error)) => Err(error),
    }
}

/// The parameter named by `tx = ...`.
struct Transaction {
    name: Ident,
    /// Its type, so that a type that is not a transaction is reported on the whole type.
    ty: Range,
}

/// The source range of some tokens: rustc spans an expression or a type from its first token
/// to its last, so generated tokens that start at `first` and end at `last` are reported on
/// the whole range.
#[derive(Clone, Copy)]
struct Range {
    first: Span,
    last: Span,
}

impl Range {
    fn of(tokens: &impl ToTokens) -> Self {
        let mut spans = tokens
            .to_token_stream()
            .into_iter()
            .map(|token| token.span());
        let first = spans.next().unwrap_or_else(Span::call_site);
        Range {
            first,
            last: spans.last().unwrap_or(first),
        }
    }

    /// `tokens` (no groups) over the range: the first token at its start, the others at its
    /// end.
    fn cover(self, tokens: TokenStream) -> TokenStream {
        let mut tokens = respan(tokens, self.last).into_iter();
        let first = tokens.next().map(|mut token| {
            token.set_span(self.first);
            token
        });
        first.into_iter().chain(tokens).collect()
    }
}

fn expand(args: Args, function: Function, transaction: Option<Transaction>) -> TokenStream {
    let krate = match &args.krate {
        Some((_, path)) => path.to_token_stream(),
        None => quote!(::idempotent_core),
    };
    let private = quote!(#krate::__private);
    // The transactional mode's runtime and steps live in the PostgreSQL crate, which a user of
    // `tx = ...` depends on; without `tx`, the expansion names no backend.
    let runtimes = match &transaction {
        Some(_) => quote!(::idempotent_postgres::__private),
        None => private.clone(),
    };

    let runtime = match &args.runtime {
        Some((_, expr)) => by_reference(&runtimes, "runtime", expr),
        None => quote!(#runtimes::default_runtime()),
    };
    let name = match &args.name {
        Some((_, name)) => name.0.to_token_stream(),
        None => {
            let function = function.sig.ident.unraw().to_string();
            quote!(#private::concat!(#private::module_path!(), "::", #function))
        }
    };
    let key = match &args.key {
        Some((_, expr)) => by_reference(&private, "key", expr),
        None => unreachable!("checked by Args::parse"),
    };

    let mut invocation = quote!(#private::Invocation::new(#runtime, #name, #key));
    if let Some((_, expr)) = &args.scope {
        let scope = by_reference(&private, "scope", expr);
        invocation.extend(quote!(.scope(#scope)));
    }
    if let Some((_, expr)) = &args.fingerprint {
        let fingerprint = by_reference(&private, "fingerprint", expr);
        invocation.extend(quote!(.fingerprint(#fingerprint)));
    }
    let mut options = TokenStream::new();
    if let Some((_, ttl)) = &args.ttl {
        let ttl = checked_duration(&private, "ttl", ttl);
        options.extend(quote!(.ttl(#ttl)));
    }
    if let Some((_, lease)) = &args.lease {
        let lease = checked_duration(&private, "lease", lease);
        options.extend(quote!(.lease(#lease)));
    }
    if let Some((_, wait)) = &args.wait {
        let (secs, nanos) = (wait.value.as_secs(), wait.value.subsec_nanos());
        let wait = quote!(#private::Duration::new(#secs, #nanos));
        options.extend(quote!(.in_flight(#private::InFlightPolicy::Wait { max: #wait })));
    }
    if args.in_flight.is_some() {
        options.extend(quote!(.in_flight(#private::InFlightPolicy::Reject)));
    }
    if !options.is_empty() {
        invocation.extend(quote!(.options(#private::CallOptions::new() #options)));
    }

    let storing_errors = args.on_error.map(|(_, on_error)| on_error) == Some(OnError::Store);
    // Each check covers the type it is about: `T` and `E` as the signature spells them, or
    // else the whole return type, where a return type that is not a `Result` is reported too.
    let ret = function.return_type().to_token_stream();
    let ret_range = Range::of(&ret);
    let (ok, err) = function.result_arguments();
    let ok_range = ok.map_or(ret_range, Range::of);
    let err_range = err.map_or(ret_range, Range::of);
    let value = check(&private, "value", &ret, "Value", ok_range);
    let refused = check(&private, "refused", &ret, "Error", err_range);
    let mut returns = turbofish(quote!(#private::returns), &ret, quote!(), ret_range);
    returns.extend(respan(quote!((#value, #refused)), ret_range.last));
    if storing_errors {
        let stored = check(&private, "stored_errors", &ret, "Error", err_range);
        returns.extend(respan(quote!(.storing_errors), ret_range.last));
        returns.extend(respan(quote!((#stored)), ret_range.last));
    }

    let Function {
        attrs,
        vis,
        sig,
        inner_attrs,
        body,
        brace,
    } = function;
    let mut body = Group::new(Delimiter::Brace, body);
    body.set_span(brace);
    let invocation_var = Ident::new("__idempotent_invocation", Span::mixed_site());
    // `claim = name` binds the running claim at the top of the body.
    let work = match &args.claim {
        Some((_, name)) => {
            let current = respan(quote!(#private::current_claim), name.span());
            quote!(async move {
                let #name = #current();
                #body
            })
        }
        None => quote!(async move #body),
    };
    let statements = match transaction {
        None => {
            let run = ret_range.cover(quote!(#private::run));
            let last = ret_range.last;
            quote_spanned!(last=> #run(#invocation_var, #returns, #work).await)
        }
        Some(Transaction { name, ty }) => {
            let last = ret_range.last;
            let claim = ret_range.cover(quote!(#runtimes::claim));
            let finish = ret_range.cover(quote!(#runtimes::finish));
            let connection = respan(quote!(#runtimes::connection), ty.first);
            let argument = Ident::new(&name.to_string(), ty.last);
            let first = ty.first;
            let connection = quote_spanned!(first=> #connection(&mut *#argument));
            let pending = Ident::new("__idempotent_pending", Span::mixed_site());
            let output = Ident::new("__idempotent_output", Span::mixed_site());
            // Each call covers the return type, like `run` without `tx`.
            let claim = quote_spanned!(last=> #claim(#invocation_var, #returns, #connection).await);
            let finish = quote_spanned!(last=> #finish(#pending, #connection, #output).await);
            let flow = quote!(#runtimes::ControlFlow);
            // The body gets a reborrow of the transaction, so that the record can be written
            // with it once the body's future is done.
            quote! {
                let #pending = match #claim {
                    #flow::Continue(#pending) => #pending,
                    #flow::Break(#output) => return #output,
                };
                let #output = {
                    #[allow(unused_variables)]
                    let #name = &mut *#name;
                    #runtimes::with_claim(&#pending, #work)
                }
                .await;
                #finish
            }
        }
    };
    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            let #invocation_var = #invocation;
            #statements
        }
    }
}

/// `{ const __IDEMPOTENT_TTL: Duration = private::ttl(secs, nanos); __IDEMPOTENT_TTL }` for
/// `setting` `"ttl"` (or `"lease"`): the duration, checked against the core crate's range for
/// the setting while the constant is evaluated, at compile time. The call is spanned at the
/// literal, so a duration out of range is reported there, with the core crate's message.
fn checked_duration(private: &TokenStream, setting: &str, duration: &DurationLit) -> TokenStream {
    let span = duration.span;
    let function = Ident::new(setting, span);
    let name = Ident::new(&format!("__IDEMPOTENT_{}", setting.to_uppercase()), span);
    let (secs, nanos) = (duration.value.as_secs(), duration.value.subsec_nanos());
    let mut arguments = Group::new(Delimiter::Parenthesis, quote!(#secs, #nanos));
    arguments.set_span(span);
    let call = respan(quote!(#private::#function), span);
    quote!({
        const #name: #private::Duration = #call #arguments;
        #name
    })
}

/// `path` (no groups) with every token at `span`.
fn respan(path: TokenStream, span: Span) -> TokenStream {
    path.into_iter()
        .map(|mut token| {
            token.set_span(span);
            token
        })
        .collect()
}

/// `path::<ty rest>` over `range`, with `ty` as written: a bound the function puts on `ty` is
/// reported on it.
fn turbofish(path: TokenStream, ty: &TokenStream, rest: TokenStream, range: Range) -> TokenStream {
    let path = range.cover(quote!(#path::<));
    let rest = respan(quote!(#rest>), range.last);
    quote!(#path #ty #rest)
}

/// `private::function::<<ret as IdempotentResult>::assoc>()` over `range`: the call that
/// checks, once, what `function` requires of the return type's `assoc` type, reported on
/// `range`. The associated type, rather than the tokens at `range`, is what is checked, so a
/// return type that is an alias is checked for what it stands for.
fn check(
    private: &TokenStream,
    function: &str,
    ret: &TokenStream,
    assoc: &str,
    range: Range,
) -> TokenStream {
    let function = Ident::new(function, Span::call_site());
    let assoc = Ident::new(assoc, Span::call_site());
    let ty = range.cover(quote!(<));
    let ty = quote!(#ty #ret);
    let function = turbofish(
        quote!(#private::#function),
        &ty,
        quote!(as #private::IdempotentResult>::#assoc),
        range,
    );
    let call = respan(quote!(()), range.last);
    quote!(#function #call)
}

/// `path::function(&expr)`, spanned at `expr` so a type error is reported on the user's
/// expression. The expression is borrowed, never moved, so the body can still use what it
/// names.
fn by_reference(private: &TokenStream, function: &str, expr: &Expr) -> TokenStream {
    let function = Ident::new(function, Span::call_site());
    let span = expr.span();
    let expr = if binds_tighter_than_reference(expr) {
        expr.to_token_stream()
    } else {
        let mut group = Group::new(Delimiter::Parenthesis, expr.to_token_stream());
        group.set_span(span);
        group.into_token_stream()
    };
    let function = respan(quote!(#private::#function), span);
    quote_spanned!(span=> #function(&#expr))
}

/// Whether `&expr` borrows the whole of `expr` without parentheses.
fn binds_tighter_than_reference(expr: &Expr) -> bool {
    matches!(
        expr,
        Expr::Array(_)
            | Expr::Call(_)
            | Expr::Field(_)
            | Expr::Index(_)
            | Expr::Lit(_)
            | Expr::Macro(_)
            | Expr::MethodCall(_)
            | Expr::Paren(_)
            | Expr::Path(_)
            | Expr::Reference(_)
            | Expr::Struct(_)
            | Expr::Try(_)
            | Expr::Tuple(_)
            | Expr::Unary(_)
    )
}
