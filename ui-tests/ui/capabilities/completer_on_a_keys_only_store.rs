// A completer needs a layer whose runtime keeps checkpoints.
use std::convert::Infallible;

use idempotent_core::Idempotency;
use idempotent_core::conformance::KeysOnlyStore;
use idempotent_core::memory::MemoryStore;
use idempotent_tower::{Completer, IdempotencyLayer};

fn main() {
    let layer = IdempotencyLayer::http(Idempotency::keys_only(KeysOnlyStore::new(
        MemoryStore::new(),
    )));
    let handler = tower::service_fn(|_: http::Request<idempotent_tower::RequestBody<http_body_util::Empty<bytes::Bytes>>>| async {
        Ok::<_, Infallible>(http::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
    });
    let _ = Completer::new(&layer, handler);
}
