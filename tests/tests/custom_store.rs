//! A store written outside `idempotent-core`, against its public API only, passes the
//! conformance suite and drives the runtime: the "Implementing a custom store" guide works.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::clock::{Clock, ManualClock};
use idempotent_core::conformance::Harness;
use idempotent_core::{
    Call, Claim, FencingToken, Fingerprint, Idempotency, StorageKey, Store, StoreError,
};

enum Record {
    InFlight {
        token: FencingToken,
        fingerprint: Fingerprint,
        until: Duration,
    },
    Completed {
        fingerprint: Fingerprint,
        payload: Bytes,
        until: Duration,
    },
}

#[derive(Clone)]
struct MutexStore {
    records: Arc<Mutex<HashMap<StorageKey, Record>>>,
    last_token: Arc<AtomicU64>,
    clock: ManualClock,
}

impl MutexStore {
    fn new(clock: ManualClock) -> Self {
        MutexStore {
            records: Arc::default(),
            last_token: Arc::default(),
            clock,
        }
    }

    /// Runs `op` on the record if it is the caller's live in-flight claim.
    fn with_owned(
        &self,
        key: &StorageKey,
        token: FencingToken,
        op: impl FnOnce(&mut HashMap<StorageKey, Record>, Duration),
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut records = self.records.lock().unwrap();
        match records.get(key) {
            Some(Record::InFlight {
                token: current,
                until,
                ..
            }) if *current == token && *until > now => {
                op(&mut records, now);
                Ok(())
            }
            _ => Err(StoreError::TokenRejected),
        }
    }
}

impl Store for MutexStore {
    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let now = self.clock.now();
        let mut records = self.records.lock().unwrap();
        match records.get(key) {
            Some(Record::InFlight {
                fingerprint, until, ..
            }) if *until > now => {
                return Ok(Claim::InFlight {
                    fingerprint: *fingerprint,
                    retry_after: *until - now,
                });
            }
            Some(Record::Completed {
                fingerprint,
                payload,
                until,
            }) if *until > now => {
                return Ok(Claim::Completed {
                    fingerprint: *fingerprint,
                    payload: payload.clone(),
                });
            }
            _ => {}
        }
        let token = FencingToken::new(self.last_token.fetch_add(1, Ordering::SeqCst) + 1);
        records.insert(
            *key,
            Record::InFlight {
                token,
                fingerprint: *fingerprint,
                until: now + lease,
            },
        );
        Ok(Claim::Claimed(token))
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.with_owned(key, token, |records, now| {
            if let Some(Record::InFlight { fingerprint, .. }) = records.get(key) {
                let fingerprint = *fingerprint;
                records.insert(
                    *key,
                    Record::Completed {
                        fingerprint,
                        payload,
                        until: now + ttl,
                    },
                );
            }
        })
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.with_owned(key, token, |records, _| {
            records.remove(key);
        })
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.with_owned(key, token, |records, now| {
            if let Some(Record::InFlight { until, .. }) = records.get_mut(key) {
                *until = now + lease;
            }
        })
    }
}

struct Custom {
    clock: ManualClock,
    store: MutexStore,
}

impl Harness for Custom {
    type Store = MutexStore;

    async fn setup() -> Self {
        let clock = ManualClock::new();
        Custom {
            store: MutexStore::new(clock.clone()),
            clock,
        }
    }

    fn store(&self) -> &MutexStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    fn time_unit(&self) -> Duration {
        Duration::from_secs(1)
    }
}

idempotent_core::store_conformance_tests!(Custom);

#[tokio::test]
async fn the_runtime_runs_on_a_custom_store() {
    let idempotency = Idempotency::new(MutexStore::new(ManualClock::new()));
    let call = Call::new("k".parse().unwrap());
    let first = idempotency
        .run(&call, async { vec![1u8, 2, 3] })
        .await
        .unwrap();
    let retry = idempotency.run(&call, async { vec![9u8] }).await.unwrap();
    assert!(!first.is_replayed());
    assert!(retry.is_replayed());
    assert_eq!(retry.into_inner(), vec![1, 2, 3]);
}
