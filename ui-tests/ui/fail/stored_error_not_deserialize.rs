use idempotent_core::{Error, idempotent};
use serde::Serialize;

#[derive(Debug, Serialize)]
enum Declined {
    Card,
    Refused(String),
}

impl From<Error> for Declined {
    fn from(error: Error) -> Self {
        Declined::Refused(error.code().as_str().to_owned())
    }
}

#[idempotent(key = id, on_error = "store")]
async fn charge(id: u64) -> Result<u64, Declined> {
    if id == 0 {
        return Err(Declined::Card);
    }
    Ok(id)
}

fn main() {}
