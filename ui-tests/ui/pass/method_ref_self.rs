//! A `&self` method whose key, scope, fingerprint and runtime come from fields.

use idempotent_core::memory::MemoryStore;
use idempotent_core::{Error, Idempotency, Scope, idempotent};

struct Consumer {
    tenant: String,
    idempotency: Idempotency,
}

struct Delivery {
    id: String,
    body: Vec<u8>,
}

impl Consumer {
    #[idempotent(
        key = delivery.id,
        scope = Scope::new().tenant(&self.tenant),
        fingerprint = delivery.body,
        runtime = &self.idempotency,
    )]
    async fn apply(&self, delivery: &Delivery) -> Result<usize, Error> {
        Ok(delivery.body.len() + self.tenant.len())
    }

    #[idempotent(key = self.tenant, runtime = self.idempotency)]
    async fn once_per_tenant(&self) -> Result<(), Error> {
        Ok(())
    }
}

fn main() {
    let consumer = Consumer {
        tenant: "acme".into(),
        idempotency: Idempotency::new(MemoryStore::new()),
    };
    let delivery = Delivery {
        id: "d-1".into(),
        body: vec![1, 2, 3],
    };
    drop(consumer.apply(&delivery));
    drop(consumer.once_per_tenant());
}
