use idempotent_core::{Error, idempotent};

#[derive(Debug)]
enum ChargeError {
    Idempotency(Error),
}

impl From<Error> for ChargeError {
    fn from(error: Error) -> Self {
        ChargeError::Idempotency(error)
    }
}

#[idempotent(key = id, on_error = "store")]
async fn charge(id: u64) -> Result<u64, ChargeError> {
    Ok(id)
}

fn main() {}
