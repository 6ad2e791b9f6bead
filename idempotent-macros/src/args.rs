//! What the user wrote inside `#[idempotent(...)]`.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
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
    pub(crate) ttl: Option<(kw::ttl, Millis)>,
    pub(crate) lease: Option<(kw::lease, Millis)>,
    pub(crate) scope: Option<(kw::scope, Expr)>,
    pub(crate) fingerprint: Option<(kw::fingerprint, Expr)>,
    pub(crate) name: Option<(kw::name, Name)>,
    pub(crate) on_error: Option<(kw::on_error, OnError)>,
    pub(crate) in_flight: Option<(kw::in_flight, Reject)>,
    pub(crate) wait: Option<(kw::wait, Millis)>,
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
                assign(input, &mut args.ttl, |input| {
                    Millis::parse(input, Some(TTL))
                })?;
            } else if lookahead.peek(kw::lease) {
                assign(input, &mut args.lease, |input| {
                    Millis::parse(input, Some(LEASE))
                })?;
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
                assign(input, &mut args.wait, |input| Millis::parse(input, None))?;
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

/// A duration checked at compile time, in milliseconds.
pub(crate) struct Millis(pub(crate) u64);

const DURATION_EXPECTED: &str = "expected a duration: a string such as \"500ms\", \"90s\", \
                                 \"15m\", \"24h\" or \"7d\", or an integer number of seconds";

/// The range a duration argument accepts, in milliseconds, both ends included.
#[derive(Clone, Copy)]
struct Bounds {
    argument: &'static str,
    min: u64,
    max: u64,
}

// The ranges of `idempotent_core::limits`, which this crate cannot depend on (the core crate
// depends on it). `tests/tests/duration_limits.rs` reads these four lines and checks that they
// agree with `limits`: keep each a plain literal.
/// `limits::MIN_TTL`: 1 ms.
const MIN_TTL_MS: u64 = 1;
/// `limits::MAX_TTL`: 365 days.
const MAX_TTL_MS: u64 = 31_536_000_000;
/// `limits::MIN_LEASE`: 100 ms.
const MIN_LEASE_MS: u64 = 100;
/// `limits::MAX_LEASE`: 365 days.
const MAX_LEASE_MS: u64 = 31_536_000_000;

const DAY_MS: u64 = 24 * 60 * 60 * 1000;

const TTL: Bounds = Bounds {
    argument: "ttl",
    min: MIN_TTL_MS,
    max: MAX_TTL_MS,
};
const LEASE: Bounds = Bounds {
    argument: "lease",
    min: MIN_LEASE_MS,
    max: MAX_LEASE_MS,
};

impl Bounds {
    fn error(self, lit: &TokenStream) -> syn::Error {
        syn::Error::new_spanned(
            lit,
            format!(
                "{} must be between {} and {}",
                self.argument,
                human(self.min),
                human(self.max)
            ),
        )
    }
}

/// `ms` in the largest unit that divides it exactly: `100ms`, `90s`, `365d`.
fn human(ms: u64) -> String {
    for (unit, per) in [("d", DAY_MS), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms != 0 && ms % per == 0 {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

impl Millis {
    /// A duration literal; with `bounds`, one inside them (a TTL, a lease), otherwise any
    /// duration above zero (a wait).
    fn parse(input: ParseStream<'_>, bounds: Option<Bounds>) -> syn::Result<Self> {
        let expr: Expr = input.parse()?;
        let (digits, unit, lit) = match &expr {
            Expr::Lit(syn::ExprLit {
                lit: Lit::Str(s), ..
            }) => {
                let text = s.value();
                let split = text
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(text.len());
                let (digits, unit) = text.split_at(split);
                (digits.to_owned(), unit.to_owned(), s.to_token_stream())
            }
            Expr::Lit(syn::ExprLit {
                lit: Lit::Int(i), ..
            }) if i.suffix().is_empty() => (
                i.base10_digits().to_owned(),
                "s".to_owned(),
                i.to_token_stream(),
            ),
            other => return Err(syn::Error::new_spanned(other, DURATION_EXPECTED)),
        };
        let per_unit: u64 = match unit.as_str() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(syn::Error::new_spanned(lit, DURATION_EXPECTED)),
        };
        if digits.is_empty() {
            return Err(syn::Error::new_spanned(lit, DURATION_EXPECTED));
        }
        let millis = digits
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(per_unit));
        match (millis, bounds) {
            (Some(millis), Some(bounds)) if (bounds.min..=bounds.max).contains(&millis) => {
                Ok(Millis(millis))
            }
            (_, Some(bounds)) => Err(bounds.error(&lit)),
            (Some(0), None) => Err(syn::Error::new_spanned(
                lit,
                "duration is zero: expected a duration greater than zero",
            )),
            (Some(millis), None) => Ok(Millis(millis)),
            (None, None) => Err(syn::Error::new_spanned(
                lit,
                "duration too large: expected at most 584 million years",
            )),
        }
    }
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

    fn millis(value: &str) -> syn::Result<u64> {
        syn::parse::Parser::parse_str(|input: ParseStream<'_>| Millis::parse(input, None), value)
            .map(|m| m.0)
    }

    fn within(bounds: Bounds, value: &str) -> syn::Result<u64> {
        syn::parse::Parser::parse_str(
            |input: ParseStream<'_>| Millis::parse(input, Some(bounds)),
            value,
        )
        .map(|m| m.0)
    }

    #[test]
    fn durations_in_every_unit() {
        assert_eq!(millis(r#""500ms""#).unwrap(), 500);
        assert_eq!(millis(r#""90s""#).unwrap(), 90_000);
        assert_eq!(millis(r#""15m""#).unwrap(), 900_000);
        assert_eq!(millis(r#""24h""#).unwrap(), 86_400_000);
        assert_eq!(millis(r#""7d""#).unwrap(), 604_800_000);
        assert_eq!(millis("45").unwrap(), 45_000);
    }

    #[test]
    fn rejects_zero_garbage_and_overflow() {
        for bad in [
            r#""0s""#,
            "0",
            r#""""#,
            r#""s""#,
            r#""1""#,
            r#""1 h""#,
            r#""1h30m""#,
            r#""-1s""#,
            r#""1.5h""#,
            "1u64",
            "1.5",
            "DAY",
            r#""18446744073709551615d""#,
        ] {
            assert!(millis(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn ttl_and_lease_are_checked_against_their_ranges() {
        assert_eq!(within(LEASE, r#""100ms""#).unwrap(), 100);
        assert_eq!(within(LEASE, r#""365d""#).unwrap(), 365 * DAY_MS);
        assert_eq!(within(TTL, r#""1ms""#).unwrap(), 1);
        assert_eq!(within(TTL, r#""8760h""#).unwrap(), 365 * DAY_MS);
        for (bounds, bad, message) in [
            (LEASE, r#""99ms""#, "lease must be between 100ms and 365d"),
            (LEASE, r#""0s""#, "lease must be between 100ms and 365d"),
            (LEASE, r#""366d""#, "lease must be between 100ms and 365d"),
            (
                LEASE,
                r#""18446744073709551615d""#,
                "lease must be between 100ms and 365d",
            ),
            (TTL, r#""0ms""#, "ttl must be between 1ms and 365d"),
            (TTL, "31536001", "ttl must be between 1ms and 365d"),
        ] {
            let error = within(bounds, bad).expect_err(bad);
            assert_eq!(error.to_string(), message, "{bad}");
        }
    }

    #[test]
    fn waits_take_any_duration_above_zero() {
        assert_eq!(millis(r#""400d""#).unwrap(), 400 * DAY_MS);
        assert_eq!(millis(r#""1ms""#).unwrap(), 1);
    }

    #[test]
    fn ranges_read_as_written() {
        assert_eq!(human(1), "1ms");
        assert_eq!(human(100), "100ms");
        assert_eq!(human(1_500), "1500ms");
        assert_eq!(human(90_000), "90s");
        assert_eq!(human(900_000), "15m");
        assert_eq!(human(36 * 3_600_000), "36h");
        assert_eq!(human(365 * DAY_MS), "365d");
    }
}
