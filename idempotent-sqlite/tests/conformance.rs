//! The whole store conformance suite of `idempotent-core` (keys, client sessions and
//! checkpoints) against `SqliteStore`, each check on a fresh database file.

use std::time::Duration;

use idempotent_core::conformance::Harness;
use idempotent_sqlite::SqliteStore;
use tempfile::TempDir;

struct Sqlite {
    store: SqliteStore,
    // Removed (with the database) when the check ends.
    _dir: TempDir,
}

impl Harness for Sqlite {
    type Store = SqliteStore;

    async fn setup() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = SqliteStore::open(dir.path().join("conformance.db"))
            .await
            .expect("open a fresh database");
        Sqlite { store, _dir: dir }
    }

    fn store(&self) -> &SqliteStore {
        &self.store
    }

    // Leases and TTLs are wall-clock times in the rows: time passes by sleeping.
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    fn time_unit(&self) -> Duration {
        Duration::from_millis(200)
    }
}

idempotent_core::store_conformance_tests!(Sqlite);
