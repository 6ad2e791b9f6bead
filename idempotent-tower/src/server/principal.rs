//! Who a key belongs to: the authenticated [`Principal`] and the scope functions the layer
//! can use ([`scope_by_principal`], the default, and [`scope_by_authorization`]).

use http::header;
use http::request::Parts;
use idempotent_core::Scope;

/// The authenticated principal of a request, as the application's authentication middleware
/// establishes it: the default scope of every protected request.
///
/// Put the middleware outside (before) [`IdempotencyLayer`](crate::IdempotencyLayer) and have
/// it insert a `Principal` into the request's extensions once it has verified the credential
/// (a session cookie, a bearer token, an mTLS certificate, an API key). Keys are then per
/// principal: two users sending the same key never see each other's responses, and a client
/// whose token is refreshed between two attempts keeps its key (the principal, unlike the
/// credential, does not change).
///
/// ```
/// use http::Request;
/// use idempotent_tower::Principal;
///
/// let mut request = Request::new(());
/// // in the authentication middleware, after verifying the session:
/// request.extensions_mut().insert(Principal::new("user-4711").tenant("acme"));
/// ```
///
/// With tonic the same extension works: a tower layer in front of the server inserts it into
/// the `http::Request`, and handlers read it with `request.extensions()`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal {
    tenant: Option<Box<[u8]>>,
    id: Box<[u8]>,
}

impl Principal {
    /// The principal with this stable identifier (a user or account id, not a credential).
    pub fn new(id: impl AsRef<[u8]>) -> Self {
        Principal {
            tenant: None,
            id: id.as_ref().into(),
        }
    }

    /// The tenant the principal acts for, when ids are only unique within a tenant.
    pub fn tenant(mut self, tenant: impl AsRef<[u8]>) -> Self {
        self.tenant = Some(tenant.as_ref().into());
        self
    }

    /// The identifier.
    pub fn id(&self) -> &[u8] {
        &self.id
    }

    /// The scope of this principal's keys.
    pub fn scope(&self) -> Scope {
        let scope = Scope::new().principal(&self.id);
        match &self.tenant {
            Some(tenant) => scope.tenant(tenant),
            None => scope,
        }
    }
}

/// The default scope: the [`Principal`] in the request's extensions, or none (the request is
/// refused with `403 missing_scope` unless the layer
/// [allows anonymous requests](crate::IdempotencyLayer::allow_anonymous)).
pub fn scope_by_principal(parts: &Parts) -> Option<Scope> {
    parts.extensions.get::<Principal>().map(Principal::scope)
}

/// A scope from a digest of the `Authorization` header, or none without one.
///
/// Only right when the credential *is* the identity and never changes, such as a static API
/// key: a bearer token that is refreshed between two attempts of one operation puts the retry
/// in a new scope, where it runs again. Prefer [`scope_by_principal`].
pub fn scope_by_authorization(parts: &Parts) -> Option<Scope> {
    let value = parts.headers.get(header::AUTHORIZATION)?;
    let digest = blake3::derive_key("idempotent-tower authorization scope v1", value.as_bytes());
    Some(Scope::new().principal(digest))
}
