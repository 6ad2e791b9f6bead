use idempotent_core::{Error, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Session {
    token: String,
}

#[idempotent(key = user)]
async fn open_session(user: &str) -> Result<Session, Error> {
    Ok(Session { token: user.to_owned() })
}

fn main() {}
