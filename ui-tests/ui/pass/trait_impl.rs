//! `async fn` in trait implementations, for traits declared with `async fn` and with
//! `-> impl Future + Send`.

use std::future::Future;

use idempotent_core::{Error, idempotent};

trait Handler {
    async fn handle(&self, id: u64) -> Result<u64, Error>;
}

trait SendHandler {
    fn handle(&self, id: u64) -> impl Future<Output = Result<u64, Error>> + Send;
}

struct Charge {
    amount: u64,
}

impl Handler for Charge {
    #[idempotent(key = id)]
    async fn handle(&self, id: u64) -> Result<u64, Error> {
        Ok(id + self.amount)
    }
}

impl SendHandler for Charge {
    #[idempotent(key = id, name = "charge::send")]
    async fn handle(&self, id: u64) -> Result<u64, Error> {
        Ok(id * self.amount)
    }
}

fn main() {
    let charge = Charge { amount: 1 };
    drop(Handler::handle(&charge, 1));
    drop(SendHandler::handle(&charge, 1));
}
