use idempotent_core::{Error, idempotent, memory::MemoryStore};

struct App {
    store: MemoryStore,
}

impl App {
    #[idempotent(key = id, runtime = &self.store)]
    async fn charge(&self, id: u64) -> Result<u64, Error> {
        Ok(id)
    }
}

fn main() {}
