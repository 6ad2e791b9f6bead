//! Every kind of key: strings, integers, uuids, `Key`, smart pointers, computed expressions and
//! a user type implementing `ToKey`.

use std::borrow::Cow;
use std::sync::Arc;

use idempotent_core::{Error, Key, KeyError, ToKey, idempotent};
use uuid::Uuid;

struct DeliveryId {
    queue: String,
    sequence: u64,
}

impl ToKey for DeliveryId {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(format!("{}/{}", self.queue, self.sequence))
    }
}

#[idempotent(key = id)]
async fn str_key(id: &str) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn string_key(id: String) -> Result<String, Error> {
    Ok(id)
}

#[idempotent(key = id)]
async fn cow_key(id: Cow<'_, str>) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn arc_key(id: Arc<str>) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn u8_key(id: u8) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn i128_key(id: i128) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn usize_key(id: usize) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn uuid_key(id: Uuid) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id)]
async fn key_key(id: Key) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = delivery)]
async fn custom_key(delivery: DeliveryId) -> Result<u64, Error> {
    Ok(delivery.sequence)
}

#[idempotent(key = format!("{tenant}:{id}"))]
async fn computed_key(tenant: &str, id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = id + 1)]
async fn arithmetic_key(id: u64) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = ids[0])]
async fn indexed_key(ids: Vec<u64>) -> Result<(), Error> {
    Ok(())
}

#[idempotent(key = "nightly-report")]
async fn constant_key() -> Result<(), Error> {
    Ok(())
}

fn main() {
    drop(str_key("a"));
    drop(string_key("a".into()));
    drop(cow_key(Cow::Borrowed("a")));
    drop(arc_key(Arc::from("a")));
    drop(u8_key(1));
    drop(i128_key(-1));
    drop(usize_key(1));
    drop(uuid_key(Uuid::nil()));
    drop(key_key(Key::new("a").unwrap()));
    drop(custom_key(DeliveryId {
        queue: "q".into(),
        sequence: 1,
    }));
    drop(computed_key("t", 1));
    drop(arithmetic_key(1));
    drop(indexed_key(vec![1]));
    drop(constant_key());
}
