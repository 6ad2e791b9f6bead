//! Generic functions: over the key, the value, the error, and with lifetimes and where clauses.

use std::fmt::Display;

use idempotent_core::{Error, ToKey, idempotent};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[idempotent(key = key)]
async fn generic_key<K: ToKey + Display>(key: K) -> Result<String, Error> {
    Ok(key.to_string())
}

#[idempotent(key = key, fingerprint = value)]
async fn generic_value<'a, T, E>(key: &'a str, value: T) -> Result<T, E>
where
    T: Serialize + DeserializeOwned + Send,
    E: From<Error>,
{
    Ok(value)
}

#[idempotent(key = N)]
async fn const_generic<const N: usize>() -> Result<Vec<u8>, Error> {
    Ok(vec![0; N])
}

fn main() {
    drop(generic_key(7_u32));
    drop(generic_value::<Vec<u8>, Error>("k", vec![1]));
    drop(const_generic::<4>());
}
