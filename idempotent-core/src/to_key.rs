//! What can be an idempotency key: [`ToKey`], the `key` of an `#[idempotent]` function.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

use crate::{Key, KeyError};

/// A value that can identify a call: the `key` of an
/// [`#[idempotent]`](macro@crate::idempotent) function.
///
/// Implemented for strings, integers (as their decimal digits), [`Key`] itself, `uuid::Uuid`
/// (feature `uuid`; hyphenated lowercase), and references and smart pointers to any of them.
/// Implement it for your own identifiers:
///
/// ```
/// use idempotent_core::{Key, KeyError, ToKey};
///
/// struct DeliveryId {
///     queue: &'static str,
///     sequence: u64,
/// }
///
/// impl ToKey for DeliveryId {
///     fn to_key(&self) -> Result<Key, KeyError> {
///         Key::new(format!("{}/{}", self.queue, self.sequence))
///     }
/// }
///
/// let id = DeliveryId { queue: "orders", sequence: 42 };
/// assert_eq!(id.to_key()?.as_str(), "orders/42");
/// # Ok::<(), KeyError>(())
/// ```
///
/// A key that fails to convert (an empty string, say) fails the call with
/// [`Error::InvalidKey`](crate::Error::InvalidKey) before the function's body runs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency key",
    label = "not convertible into an idempotency key",
    note = "keys are strings, integers, `uuid::Uuid` (feature `uuid`) or `idempotent_core::Key`; \
            implement `idempotent_core::ToKey` for `{Self}` to use it as a key"
)]
pub trait ToKey {
    /// The key; fails if the value is not a valid [`Key`] (see its rules).
    fn to_key(&self) -> Result<Key, KeyError>;
}

impl ToKey for Key {
    fn to_key(&self) -> Result<Key, KeyError> {
        Ok(self.clone())
    }
}

impl ToKey for str {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self)
    }
}

impl ToKey for String {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self.as_str())
    }
}

impl ToKey for Cow<'_, str> {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self.as_ref())
    }
}

impl<T: ToKey + ?Sized> ToKey for &T {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

impl<T: ToKey + ?Sized> ToKey for &mut T {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

impl<T: ToKey + ?Sized> ToKey for Box<T> {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

impl<T: ToKey + ?Sized> ToKey for Arc<T> {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

impl<T: ToKey + ?Sized> ToKey for Rc<T> {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

macro_rules! integer_keys {
    ($($int:ty)*) => {$(
        impl ToKey for $int {
            fn to_key(&self) -> Result<Key, KeyError> {
                Key::new(self.to_string())
            }
        }
    )*};
}

integer_keys!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

#[cfg(feature = "uuid")]
impl ToKey for uuid::Uuid {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self.hyphenated().to_string())
    }
}
