//! What a runtime can do, by what its store implements.
//!
//! A store implements [`Store`] (the key cycle) and, when it can,
//! [`SessionStore`] (client sessions) and [`CheckpointStore`] (steps, kept requests, a
//! completer's resumes). A runtime's type says which of them its store has, and the methods
//! that need one exist only where it is there, so misuse does not compile:
//!
//! | runtime | made by | serves |
//! |---|---|---|
//! | `Idempotency` (= `Idempotency<`[`Full`]`>`) | [`Idempotency::new`], [`Idempotency::builder`] | keys, sessions, steps, kept requests, a completer |
//! | `Idempotency<`[`KeysOnly`]`>` | [`Idempotency::keys_only`] | keys |
//! | `Idempotency<`[`KeysAndSessions`]`>` | [`Idempotency::with_sessions`] | keys and sessions |
//! | `Idempotency<`[`KeysAndCheckpoints`]`>` | [`Idempotency::with_checkpoints`] | keys, steps, kept requests, a completer |
//!
//! A call says what it needs by its type: [`Call::new`] makes a `Call<`[`NeedsKeys`]`>`,
//! [`Call::in_session`] a `Call<`[`NeedsSessions`]`>`, [`Call::resume`] a
//! `Call<`[`NeedsCheckpoints`]`>`; a runtime runs the calls its capabilities cover
//! ([`Runs`]). A claim's steps are on its [`ClaimHandle`](crate::ClaimHandle), which only a
//! runtime whose store keeps checkpoints hands out; elsewhere the work's claim is a
//! [`KeyClaim`](crate::KeyClaim). The completer and kept requests of `idempotent-tower` take a
//! runtime that keeps checkpoints.
//!
//! ```compile_fail
//! use idempotent_core::memory::MemoryStore;
//! use idempotent_core::session::InSession;
//! use idempotent_core::{Call, Idempotency};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! // A runtime told to serve keys only does not take a call in a session.
//! let keys = Idempotency::keys_only(MemoryStore::new());
//! let call = Call::in_session("device-7".parse()?, InSession::new(1, 0)?);
//! keys.run(&call, async { 1 }).await?;
//! # Ok(())
//! # }
//! ```
//!
//! [`Idempotency::new`]: crate::Idempotency::new
//! [`Idempotency::builder`]: crate::Idempotency::builder
//! [`Idempotency::keys_only`]: crate::Idempotency::keys_only
//! [`Idempotency::with_sessions`]: crate::Idempotency::with_sessions
//! [`Idempotency::with_checkpoints`]: crate::Idempotency::with_checkpoints
//! [`Call::new`]: crate::Call::new
//! [`Call::in_session`]: crate::Call::in_session
//! [`Call::resume`]: crate::Call::resume

use std::sync::Arc;

use crate::store::{CheckpointStore, DynCheckpoints, DynSessions, DynStore, Measured};
use crate::{SessionStore, Store};

/// The capabilities a runtime's store has. Sealed: the four markers of this module are all
/// there are.
pub trait Capabilities: sealed::Sealed + Send + Sync + 'static {
    /// Whether the store serves client sessions ([`SessionStore`]).
    const SESSIONS: bool;
    /// Whether the store keeps checkpoints ([`CheckpointStore`]).
    const CHECKPOINTS: bool;
}

/// Capabilities that include client sessions: [`Full`] and [`KeysAndSessions`].
pub trait ServesSessions: Capabilities {}

/// Capabilities that include checkpoints (steps, kept requests, resumes, a completer):
/// [`Full`] and [`KeysAndCheckpoints`].
pub trait KeepsCheckpoints: Capabilities {}

/// Whether a runtime with these capabilities runs a call that needs `N`.
#[diagnostic::on_unimplemented(
    message = "a runtime `Idempotency<{Self}>` cannot run a `Call<{N}>`: its store lacks the capability",
    label = "this runtime's store does not have what the call needs",
    note = "a call in a session needs a store that implements `SessionStore`; a resume call one that implements `CheckpointStore` (see `idempotent_core::capability`)"
)]
pub trait Runs<N>: Capabilities {}

impl<C: Capabilities> Runs<NeedsKeys> for C {}
impl<C: ServesSessions> Runs<NeedsSessions> for C {}
impl<C: KeepsCheckpoints> Runs<NeedsCheckpoints> for C {}

/// A store with every capability: keys, sessions and checkpoints. The default runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {}

/// A store that keeps plain keys only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysOnly {}

/// A store that keeps keys and client sessions, no checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysAndSessions {}

/// A store that keeps keys and checkpoints, no client sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysAndCheckpoints {}

/// A call any runtime runs: a plain key ([`Call::new`](crate::Call::new)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedsKeys {}

/// A call in a client session ([`Call::in_session`](crate::Call::in_session)): needs
/// [`ServesSessions`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedsSessions {}

/// A call that resumes an abandoned operation ([`Call::resume`](crate::Call::resume)):
/// needs [`KeepsCheckpoints`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedsCheckpoints {}

impl Capabilities for Full {
    const SESSIONS: bool = true;
    const CHECKPOINTS: bool = true;
}
impl Capabilities for KeysOnly {
    const SESSIONS: bool = false;
    const CHECKPOINTS: bool = false;
}
impl Capabilities for KeysAndSessions {
    const SESSIONS: bool = true;
    const CHECKPOINTS: bool = false;
}
impl Capabilities for KeysAndCheckpoints {
    const SESSIONS: bool = false;
    const CHECKPOINTS: bool = true;
}
impl ServesSessions for Full {}
impl ServesSessions for KeysAndSessions {}
impl KeepsCheckpoints for Full {}
impl KeepsCheckpoints for KeysAndCheckpoints {}

/// A store, timed and type-erased, with the capabilities the runtime may use.
pub(crate) struct Erased {
    pub(crate) keys: Arc<dyn DynStore>,
    pub(crate) sessions: Option<Arc<dyn DynSessions>>,
    pub(crate) checkpoints: Option<Arc<dyn DynCheckpoints>>,
}

/// The capabilities `C` of a runtime over a store `S`: implemented where `S` has them.
pub trait Admits<S>: Capabilities + sealed::Erase<S> {}
impl<C: Capabilities + sealed::Erase<S>, S> Admits<S> for C {}

pub(crate) mod sealed {
    use super::*;

    pub trait Sealed {}
    impl Sealed for Full {}
    impl Sealed for KeysOnly {}
    impl Sealed for KeysAndSessions {}
    impl Sealed for KeysAndCheckpoints {}

    /// Erases a store into what a runtime with these capabilities holds.
    #[allow(private_interfaces)]
    pub trait Erase<S> {
        fn erase(store: S) -> Erased;
    }

    impl<S: Store> Erase<S> for KeysOnly {
        #[allow(private_interfaces)]
        fn erase(store: S) -> Erased {
            Erased {
                keys: Arc::new(Measured::new(store)),
                sessions: None,
                checkpoints: None,
            }
        }
    }
    impl<S: SessionStore> Erase<S> for KeysAndSessions {
        #[allow(private_interfaces)]
        fn erase(store: S) -> Erased {
            let store = Arc::new(Measured::new(store));
            Erased {
                keys: store.clone(),
                sessions: Some(store),
                checkpoints: None,
            }
        }
    }
    impl<S: CheckpointStore> Erase<S> for KeysAndCheckpoints {
        #[allow(private_interfaces)]
        fn erase(store: S) -> Erased {
            let store = Arc::new(Measured::new(store));
            Erased {
                keys: store.clone(),
                sessions: None,
                checkpoints: Some(store),
            }
        }
    }
    impl<S: SessionStore + CheckpointStore> Erase<S> for Full {
        #[allow(private_interfaces)]
        fn erase(store: S) -> Erased {
            let store = Arc::new(Measured::new(store));
            Erased {
                keys: store.clone(),
                sessions: Some(store.clone()),
                checkpoints: Some(store),
            }
        }
    }
}
