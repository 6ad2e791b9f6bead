//! What `#[idempotent]` emits: the signature unchanged, and a body that is one call into
//! `idempotent_core::__private` with the original body as the work; with `tx = ...`, three
//! (claim, body, record), because the body borrows the transaction in between.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::Expr;
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;

use crate::args::{Args, OnError};
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
                    let ty = function.transaction_parameter(name)?.to_token_stream();
                    let mut tokens = ty.into_iter().map(|token| token.span());
                    let first = tokens.next().unwrap_or_else(|| name.span());
                    Some(Transaction {
                        name: name.clone(),
                        ty_spans: (first, tokens.last().unwrap_or(first)),
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
    /// Its type's first and last tokens, so that a type that is not a transaction is reported
    /// on the whole type.
    ty_spans: (Span, Span),
}

fn expand(args: Args, function: Function, transaction: Option<Transaction>) -> TokenStream {
    let krate = match &args.krate {
        Some((_, path)) => path.to_token_stream(),
        None => quote!(::idempotent_core),
    };
    let private = quote!(#krate::__private);
    // The transactional mode's runtime and steps live in their own module.
    let runtimes = match &transaction {
        Some(_) => quote!(#private::postgres),
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
    let duration = |millis: u64| quote!(#private::Duration::from_millis(#millis));
    if let Some((_, ttl)) = &args.ttl {
        let ttl = duration(ttl.0);
        invocation.extend(quote!(.ttl(#ttl)));
    }
    if let Some((_, lease)) = &args.lease {
        let lease = duration(lease.0);
        invocation.extend(quote!(.lease(#lease)));
    }
    if let Some((_, wait)) = &args.wait {
        let wait = duration(wait.0);
        invocation.extend(quote!(.wait(#wait)));
    }
    if args.in_flight.is_some() {
        invocation.extend(quote!(.reject()));
    }

    let storing_errors = args.on_error.map(|(_, on_error)| on_error) == Some(OnError::Store);
    // Spanned at the return type, so that an unreplayable `T` or an unconvertible `E` is
    // reported there, once.
    let ret_span = function.return_type().span();

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
            let run = if storing_errors {
                quote!(run_storing_errors)
            } else {
                quote!(run)
            };
            let run = respan(quote!(#private::#run), ret_span);
            quote_spanned!(ret_span=> #run(#invocation_var, #work).await)
        }
        Some(Transaction { name, ty_spans }) => {
            let (claim, finish) = if storing_errors {
                (quote!(claim_storing_errors), quote!(finish_storing_errors))
            } else {
                (quote!(claim), quote!(finish))
            };
            let claim = respan(quote!(#private::postgres::#claim), ret_span);
            let finish = respan(quote!(#private::postgres::#finish), ret_span);
            let (first, last) = ty_spans;
            let connection = respan(quote!(#private::postgres::connection), first);
            let argument = Ident::new(&name.to_string(), last);
            let connection = quote_spanned!(first=> #connection(&mut *#argument));
            let pending = Ident::new("__idempotent_pending", Span::mixed_site());
            let output = Ident::new("__idempotent_output", Span::mixed_site());
            let flow = quote!(#private::postgres::ControlFlow);
            // The body gets a reborrow of the transaction, so that the record can be written
            // with it once the body's future is done.
            quote! {
                let #pending = match #claim(#invocation_var, #connection).await {
                    #flow::Continue(#pending) => #pending,
                    #flow::Break(#output) => return #output,
                };
                let #output = {
                    #[allow(unused_variables)]
                    let #name = &mut *#name;
                    #private::postgres::with_claim(&#pending, #work)
                }
                .await;
                #finish(#pending, #connection, #output).await
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

/// `path` (no groups) with every token at `span`.
fn respan(path: TokenStream, span: Span) -> TokenStream {
    path.into_iter()
        .map(|mut token| {
            token.set_span(span);
            token
        })
        .collect()
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
