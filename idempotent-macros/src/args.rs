//! What the user wrote inside `#[idempotent(...)]`.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned as _;
use syn::{Expr, Ident, Lit, LitStr, Path, Token};

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(scope);
    syn::custom_keyword!(fingerprint);
    syn::custom_keyword!(name);
    syn::custom_keyword!(on_error);
    syn::custom_keyword!(in_flight);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(runtime);
    syn::custom_keyword!(tx);
    syn::custom_keyword!(claim);
}

const EXPECTED: &str = "`key`, `ttl`, `lease`, `scope`, `fingerprint`, `name`, `on_error`, \
                        `in_flight`, `wait`, `runtime`, `tx`, `claim` or `crate`";

/// The arguments, each with the keyword it was given under (for spans).
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<(kw::key, Expr)>,
    pub(crate) ttl: Option<(kw::ttl, DurationLit)>,
    pub(crate) lease: Option<(kw::lease, DurationLit)>,
    pub(crate) scope: Option<(kw::scope, Expr)>,
    pub(crate) fingerprint: Option<(kw::fingerprint, Expr)>,
    pub(crate) name: Option<(kw::name, Name)>,
    pub(crate) on_error: Option<(kw::on_error, OnError)>,
    pub(crate) in_flight: Option<(kw::in_flight, Reject)>,
    pub(crate) wait: Option<(kw::wait, DurationLit)>,
    pub(crate) runtime: Option<(kw::runtime, Expr)>,
    pub(crate) tx: Option<(kw::tx, Ident)>,
    pub(crate) claim: Option<(kw::claim, Ident)>,
    pub(crate) krate: Option<(Token![crate], Path)>,
}

impl Args {
    /// Parses the attribute's arguments and checks the ones that depend on each other.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let args: Args = syn::parse2(tokens)?;
        if args.key.is_none() {
            return Err(syn::Error::new(
                Span::call_site(),
                "missing argument `key`: expected the expression that identifies a call, \
                 e.g. `#[idempotent(key = order.id)]`",
            ));
        }
        if let (Some((wait, _)), Some(_)) = (&args.wait, &args.in_flight) {
            return Err(syn::Error::new_spanned(
                wait,
                "`wait` contradicts `in_flight = \"reject\"`: expected one of them",
            ));
        }
        Ok(args)
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::key) {
                assign(input, &mut args.key, Expr::parse)?;
            } else if lookahead.peek(kw::ttl) {
                assign(input, &mut args.ttl, DurationLit::parse)?;
            } else if lookahead.peek(kw::lease) {
                assign(input, &mut args.lease, DurationLit::parse)?;
            } else if lookahead.peek(kw::scope) {
                assign(input, &mut args.scope, Expr::parse)?;
            } else if lookahead.peek(kw::fingerprint) {
                assign(input, &mut args.fingerprint, Expr::parse)?;
            } else if lookahead.peek(kw::name) {
                assign(input, &mut args.name, Name::parse)?;
            } else if lookahead.peek(kw::on_error) {
                assign(input, &mut args.on_error, OnError::parse)?;
            } else if lookahead.peek(kw::in_flight) {
                assign(input, &mut args.in_flight, Reject::parse)?;
            } else if lookahead.peek(kw::wait) {
                assign(input, &mut args.wait, DurationLit::parse_above_zero)?;
            } else if lookahead.peek(kw::runtime) {
                assign(input, &mut args.runtime, Expr::parse)?;
            } else if lookahead.peek(kw::tx) {
                assign(input, &mut args.tx, parameter_name)?;
            } else if lookahead.peek(kw::claim) {
                assign(input, &mut args.claim, binding_name)?;
            } else if lookahead.peek(Token![crate]) {
                assign(input, &mut args.krate, Path::parse_mod_style)?;
            } else if input.peek(syn::Ident::peek_any) {
                let unknown = syn::Ident::parse_any(input)?;
                return Err(syn::Error::new_spanned(
                    &unknown,
                    format!("unknown argument `{unknown}`; expected {EXPECTED}"),
                ));
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

/// Parses `keyword = value` into `slot`; a keyword given twice is an error at the second one.
fn assign<K, V>(
    input: ParseStream<'_>,
    slot: &mut Option<(K, V)>,
    value: impl FnOnce(ParseStream<'_>) -> syn::Result<V>,
) -> syn::Result<()>
where
    K: Parse + ToTokens,
{
    let keyword: K = input.parse()?;
    if !input.peek(Token![=]) {
        let name = keyword.to_token_stream().to_string();
        return Err(syn::Error::new_spanned(
            keyword,
            format!("expected `{name} = <value>`"),
        ));
    }
    input.parse::<Token![=]>()?;
    let value = value(input)?;
    if slot.is_some() {
        let name = keyword.to_token_stream().to_string();
        return Err(syn::Error::new_spanned(
            keyword,
            format!("duplicate argument `{name}`; expected each argument at most once"),
        ));
    }
    *slot = Some((keyword, value));
    Ok(())
}

/// A duration literal, read at compile time. A `ttl` or `lease` is checked against the ranges
/// of `idempotent_core::limits` by the expansion, in a constant that calls the core crate (this
/// crate cannot depend on it, since the core crate depends on this one).
pub(crate) struct DurationLit {
    pub(crate) value: Duration,
    /// The literal's span, where a duration out of its range is reported.
    pub(crate) span: Span,
}

/// What a duration argument takes, after "expected".
const DURATION_FORMS: &str = "a string such as \"500ms\", \"90s\", \"15m\", \"24h\", \"7d\" or \
                              \"1h 30m\", or an integer number of seconds";

/// Why a number in a duration cannot be a `Duration`.
const TOO_LARGE: &str = "longer than `Duration::MAX`, or finer than 1ns";

impl DurationLit {
    /// A string in the syntax of `idempotent_core::limits::parse_duration`, or an integer
    /// number of seconds.
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let expr: Expr = input.parse()?;
        let value = match &expr {
            Expr::Lit(syn::ExprLit {
                lit: Lit::Str(s), ..
            }) => parse_duration(&s.value()).map_err(|error| match error {
                humantime::DurationError::NumberOverflow => TOO_LARGE.to_owned(),
                other => other.to_string(),
            }),
            Expr::Lit(syn::ExprLit {
                lit: Lit::Int(i), ..
            }) if i.suffix().is_empty() => i
                .base10_parse()
                .map(Duration::from_secs)
                .map_err(|_| TOO_LARGE.to_owned()),
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    format!("expected a duration: {DURATION_FORMS}"),
                ));
            }
        };
        match value {
            Ok(value) => Ok(DurationLit {
                value,
                span: expr.span(),
            }),
            Err(reason) => Err(syn::Error::new_spanned(
                expr,
                format!("invalid duration ({reason}): expected {DURATION_FORMS}"),
            )),
        }
    }

    /// A duration above zero (a `wait`, which has no range in the core crate).
    fn parse_above_zero(input: ParseStream<'_>) -> syn::Result<Self> {
        let duration = Self::parse(input)?;
        if duration.value.is_zero() {
            return Err(syn::Error::new(
                duration.span,
                "duration is zero: expected a duration greater than zero",
            ));
        }
        Ok(duration)
    }
}

/// `idempotent_core::limits::parse_duration`, which this crate cannot call: humantime, and a
/// count of milliseconds up to `u64::MAX` (humantime counts them in nanoseconds).
fn parse_duration(text: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(text).or_else(|error| match text.strip_suffix("ms") {
        Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            digits.parse().map(Duration::from_millis).map_err(|_| error)
        }
        _ => Err(error),
    })
}

/// The `name` of the function's key space: a non-empty string literal.
pub(crate) struct Name(pub(crate) LitStr);

impl Name {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let expr: Expr = input.parse()?;
        match expr {
            Expr::Lit(syn::ExprLit {
                lit: Lit::Str(s), ..
            }) if !s.value().is_empty() => Ok(Name(s)),
            other => Err(syn::Error::new_spanned(
                other,
                "expected a non-empty string literal naming the function's key space, \
                 e.g. `name = \"payments::charge\"`",
            )),
        }
    }
}

/// What happens to an `Err` returned by the function.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnError {
    /// Release the claim: the next call with the key runs the body again.
    Release,
    /// Store the error: later calls with the key replay it.
    Store,
}

impl OnError {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let expr: Expr = input.parse()?;
        match string_literal(&expr).as_deref() {
            Some("release") => Ok(OnError::Release),
            Some("store") => Ok(OnError::Store),
            _ => Err(syn::Error::new_spanned(
                expr,
                "expected `\"release\"` (an `Err` lets the next call run again) or `\"store\"` \
                 (an `Err` is replayed)",
            )),
        }
    }
}

/// `in_flight = "reject"`: refuse a call whose key is in flight, whatever the runtime's policy.
pub(crate) struct Reject;

impl Reject {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let expr: Expr = input.parse()?;
        match string_literal(&expr).as_deref() {
            Some("reject") => Ok(Reject),
            _ => Err(syn::Error::new_spanned(
                expr,
                "expected `\"reject\"`; to wait for the running call instead, \
                 use `wait = \"5s\"` (the longest to wait)",
            )),
        }
    }
}

/// `tx = <name>`: the name of one of the function's parameters.
fn parameter_name(input: ParseStream<'_>) -> syn::Result<Ident> {
    plain_name(
        input,
        "expected the name of the parameter that holds the transaction, e.g. `tx = tx`",
    )
}

/// `claim = <name>`: a new variable the body sees the claim under.
fn binding_name(input: ParseStream<'_>) -> syn::Result<Ident> {
    plain_name(
        input,
        "expected a variable name to bind the running claim to, e.g. `claim = claim`",
    )
}

/// A bare identifier, or `expected` at whatever expression stands there instead.
fn plain_name(input: ParseStream<'_>, expected: &str) -> syn::Result<Ident> {
    let expr: Expr = input.parse()?;
    match &expr {
        Expr::Path(path) if path.qself.is_none() && path.attrs.is_empty() => {
            path.path.get_ident().cloned()
        }
        _ => None,
    }
    .ok_or_else(|| syn::Error::new_spanned(expr, expected))
}

fn string_literal(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s.value()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duration(value: &str) -> syn::Result<Duration> {
        syn::parse::Parser::parse_str(DurationLit::parse, value).map(|d| d.value)
    }

    fn wait(value: &str) -> syn::Result<Duration> {
        syn::parse::Parser::parse_str(DurationLit::parse_above_zero, value).map(|d| d.value)
    }

    #[test]
    fn durations_in_every_unit() {
        for (text, expected) in [
            (r#""500ms""#, Duration::from_millis(500)),
            (r#""90s""#, Duration::from_secs(90)),
            (r#""15m""#, Duration::from_secs(900)),
            (r#""24h""#, Duration::from_secs(86_400)),
            (r#""7d""#, Duration::from_secs(604_800)),
            ("45", Duration::from_secs(45)),
            (r#""1h 30m""#, Duration::from_secs(5_400)),
            (r#""1.5h""#, Duration::from_secs(5_400)),
            (r#""250us""#, Duration::from_micros(250)),
            (r#""0s""#, Duration::ZERO),
            (
                r#""18446744073709551615ms""#,
                Duration::from_millis(u64::MAX),
            ),
            ("18446744073709551615", Duration::from_secs(u64::MAX)),
        ] {
            assert_eq!(duration(text).unwrap(), expected, "{text}");
        }
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        for bad in [
            r#""""#,
            r#""s""#,
            r#""1""#,
            r#""-1s""#,
            r#""+1ms""#,
            r#""one day""#,
            "1u64",
            "1.5",
            "DAY",
            "18446744073709551616",
            r#""18446744073709551616ms""#,
            r#""99999999999999999999d""#,
        ] {
            let error = duration(bad).expect_err(bad).to_string();
            assert!(error.ends_with(DURATION_FORMS), "{bad}: {error}");
        }
    }

    #[test]
    fn a_wait_is_above_zero() {
        assert_eq!(
            wait(r#""400d""#).unwrap(),
            Duration::from_secs(400 * 86_400)
        );
        assert_eq!(wait(r#""1ns""#).unwrap(), Duration::from_nanos(1));
        for zero in [r#""0s""#, r#""0""#, "0"] {
            let error = wait(zero).expect_err(zero).to_string();
            assert_eq!(
                error,
                "duration is zero: expected a duration greater than zero"
            );
        }
    }
}
