#![doc = include_str!("../../docs/tower-client.md")]

mod body;
mod config;
mod error;
mod key;
mod layer;
mod metrics;
mod policy;
mod protocol;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;
mod session;
#[cfg(feature = "outbox")]
mod sink;
mod verdict;

pub use body::{RebuildBody, ResendBody};
pub use error::{ClientError, GiveUp};
pub use key::{Delivery, IdempotencyKey};
pub use layer::ClientLayer;
pub use metrics::{CLIENT_ATTEMPTS, CLIENT_CALLS, CLIENT_RETRIES};
pub use policy::{
    DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_REQUEST_BODY,
    RetryPolicy,
};
pub use protocol::ClientProtocol;
#[cfg(feature = "reqwest")]
pub use reqwest::IdempotencyMiddleware;
pub use service::{ClientFuture, ClientService};
pub use session::{ClientSession, SessionSeq};
#[cfg(feature = "outbox")]
pub use sink::{HttpSink, HttpSinkError};
