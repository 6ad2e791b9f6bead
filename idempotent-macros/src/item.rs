//! Which functions `#[idempotent]` accepts.

use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};
use syn::parse::{Parse, ParseStream};
use syn::{
    Attribute, FnArg, GenericArgument, Ident, Pat, PatIdent, PatType, PathArguments, ReturnType,
    Signature, Token, Type, TypeGroup, TypeParen, TypePath, Visibility, braced, token,
};

/// An `async fn` with a body and a return type, its body kept as raw tokens so that a body
/// that does not parse is still compiled, and rustc reports the user's own error.
pub(crate) struct Function {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) sig: Signature,
    /// `#![...]` attributes at the start of the body; they stay on the function.
    pub(crate) inner_attrs: Vec<TokenStream>,
    pub(crate) body: TokenStream,
    pub(crate) brace: Span,
}

impl Function {
    /// Parses and validates the item the attribute is on.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let function: Function = syn::parse2(tokens)?;
        let sig = &function.sig;
        if let Some(constness) = &sig.constness {
            return Err(syn::Error::new_spanned(
                constness,
                "`#[idempotent]` cannot be applied to a `const fn`: expected an `async fn`",
            ));
        }
        if sig.asyncness.is_none() {
            return Err(syn::Error::new(
                sig.fn_token.span,
                "`#[idempotent]` requires an `async fn`: expected `async` before `fn`",
            ));
        }
        match &sig.output {
            ReturnType::Default => {
                return Err(syn::Error::new(
                    sig.paren_token.span.close(),
                    "expected a return type `-> Result<T, E>`: the value `T` is what retries \
                     replay",
                ));
            }
            ReturnType::Type(_, ty) => reject_impl_trait(ty)?,
        }
        Ok(function)
    }

    /// Checks that `claim = name` introduces a new variable rather than hiding a parameter.
    pub(crate) fn check_claim_binding(&self, name: &Ident) -> syn::Result<()> {
        let hides_parameter = self.sig.inputs.iter().any(|input| match input {
            FnArg::Typed(PatType { pat, .. }) => {
                matches!(&**pat, Pat::Ident(PatIdent { ident, .. }) if ident == name)
            }
            FnArg::Receiver(_) => name == "self",
        });
        if hides_parameter || name == "self" {
            return Err(syn::Error::new_spanned(
                name,
                format!(
                    "`claim = {name}` would hide the parameter `{name}`: expected a new \
                     variable name, e.g. `claim = claim`"
                ),
            ));
        }
        Ok(())
    }

    /// The type of the parameter `tx = name` names, checked to be a mutable reference: the
    /// expansion reborrows it for the claim, the body and the record in turn.
    pub(crate) fn transaction_parameter(&self, name: &Ident) -> syn::Result<&Type> {
        let parameter = self.sig.inputs.iter().find_map(|input| match input {
            FnArg::Typed(PatType { pat, ty, .. }) => match &**pat {
                Pat::Ident(PatIdent { ident, .. }) if ident == name => Some(&**ty),
                _ => None,
            },
            FnArg::Receiver(_) => None,
        });
        let Some(ty) = parameter else {
            return Err(syn::Error::new_spanned(
                name,
                format!(
                    "this function has no parameter `{name}`: expected the name of the \
                     parameter that holds the transaction, e.g. \
                     `{name}: &mut Transaction<'_, Postgres>`"
                ),
            ));
        };
        let mut inner = ty;
        while let Type::Group(group) = inner {
            inner = &group.elem;
        }
        match inner {
            Type::Reference(reference) if reference.mutability.is_some() => Ok(ty),
            _ => Err(syn::Error::new_spanned(
                ty,
                format!(
                    "expected `{name}` to be a mutable reference to the transaction: \
                     `&mut Transaction<'_, Postgres>` or `&mut PgConnection`"
                ),
            )),
        }
    }

    /// The declared return type.
    pub(crate) fn return_type(&self) -> &Type {
        match &self.sig.output {
            ReturnType::Type(_, ty) => ty,
            ReturnType::Default => unreachable!("checked by Function::parse"),
        }
    }

    /// The `Ok` and error types as the signature spells them: the first and second type
    /// arguments of a return type written `Result<..>` (an alias such as `io::Result<T>`
    /// spells only the first). `None` for a type the signature does not spell out; the
    /// expansion then reports that type's errors on the whole return type.
    pub(crate) fn result_arguments(&self) -> (Option<&Type>, Option<&Type>) {
        let mut ty = self.return_type();
        while let Type::Group(TypeGroup { elem, .. }) | Type::Paren(TypeParen { elem, .. }) = ty {
            ty = elem;
        }
        let arguments = match ty {
            Type::Path(TypePath { path, .. }) => {
                path.segments.last().and_then(|last| match &last.arguments {
                    PathArguments::AngleBracketed(arguments) if last.ident == "Result" => {
                        Some(arguments)
                    }
                    _ => None,
                })
            }
            _ => None,
        };
        let mut types = arguments
            .into_iter()
            .flat_map(|arguments| &arguments.args)
            .filter_map(|argument| match argument {
                GenericArgument::Type(ty) => Some(ty),
                _ => None,
            });
        (types.next(), types.next())
    }
}

impl Parse for Function {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let starts_fn = input.peek(Token![fn])
            || input.peek(Token![async])
            || input.peek(Token![const])
            || input.peek(Token![unsafe])
            || input.peek(Token![extern]);
        if !starts_fn {
            return Err(input.error("`#[idempotent]` applies to functions: expected an `async fn`"));
        }
        let sig: Signature = input.parse()?;
        if input.peek(Token![;]) {
            let semi: Token![;] = input.parse()?;
            return Err(syn::Error::new_spanned(
                semi,
                "expected a function body: put `#[idempotent]` on the implementation, not on \
                 the trait's declaration",
            ));
        }
        let content;
        let brace: token::Brace = braced!(content in input);
        let mut inner_attrs = Vec::new();
        while content.peek(Token![#]) && content.peek2(Token![!]) {
            let pound: TokenTree = content.parse()?;
            let bang: TokenTree = content.parse()?;
            let group: TokenTree = content.parse()?;
            if !matches!(&group, TokenTree::Group(g) if g.delimiter() == Delimiter::Bracket) {
                return Err(syn::Error::new(group.span(), "expected `[`"));
            }
            inner_attrs.push([pound, bang, group].into_iter().collect());
        }
        let body: TokenStream = content.parse()?;
        Ok(Function {
            attrs,
            vis,
            sig,
            inner_attrs,
            body,
            brace: brace.span.join(),
        })
    }
}

/// A replayed value is deserialized into the declared type, so that type must be nameable.
fn reject_impl_trait(ty: &Type) -> syn::Result<()> {
    let error = |span: &dyn quote::ToTokens| {
        Err(syn::Error::new_spanned(
            span,
            "`impl Trait` cannot be replayed: expected a named type in `-> Result<T, E>`",
        ))
    };
    match ty {
        Type::ImplTrait(t) => error(t),
        Type::Paren(t) => reject_impl_trait(&t.elem),
        Type::Group(t) => reject_impl_trait(&t.elem),
        Type::Reference(t) => reject_impl_trait(&t.elem),
        Type::Slice(t) => reject_impl_trait(&t.elem),
        Type::Array(t) => reject_impl_trait(&t.elem),
        Type::Tuple(t) => t.elems.iter().try_for_each(reject_impl_trait),
        Type::Path(t) => {
            for segment in &t.path.segments {
                if let syn::PathArguments::AngleBracketed(args) = &segment.arguments {
                    for arg in &args.args {
                        if let syn::GenericArgument::Type(ty) = arg {
                            reject_impl_trait(ty)?;
                        }
                    }
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
