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
    /// `until` ends the lease; the record is kept until `kept` for a takeover of the same
    /// request to continue its `lifetime`.
    InFlight {
        token: FencingToken,
        lifetime: FencingToken,
        fingerprint: Fingerprint,
        until: Duration,
        kept: Duration,
    },
    Completed {
        token: FencingToken,
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
        op: impl FnOnce(&mut Record, Duration),
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut records = self.records.lock().unwrap();
        let owned = matches!(records.get(key), Some(Record::InFlight { token: current, until, .. })
            if *current == token && *until > now);
        match records.get_mut(key) {
            Some(record) if owned => {
                op(record, now);
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
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let now = self.clock.now();
        let mut records = self.records.lock().unwrap();
        let mut continues = None;
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
                ..
            }) if *until > now => {
                return Ok(Claim::Completed {
                    fingerprint: *fingerprint,
                    payload: payload.clone(),
                    expires_in: *until - now,
                });
            }
            Some(Record::InFlight {
                lifetime,
                fingerprint: recorded,
                kept,
                ..
            }) if *kept > now && recorded == fingerprint => continues = Some(*lifetime),
            // Another request's abandoned claim: the key is still that request's.
            Some(Record::InFlight {
                fingerprint: recorded,
                kept,
                ..
            }) if *kept > now => {
                return Ok(Claim::InFlight {
                    fingerprint: *recorded,
                    retry_after: Duration::ZERO,
                });
            }
            _ => {}
        }
        let token = FencingToken::new(self.last_token.fetch_add(1, Ordering::SeqCst) + 1);
        records.insert(
            *key,
            Record::InFlight {
                token,
                lifetime: continues.unwrap_or(token),
                fingerprint: *fingerprint,
                until: now + lease,
                kept: now + ttl.max(lease),
            },
        );
        Ok(match continues {
            Some(lifetime) => Claim::TakenOver { token, lifetime },
            None => Claim::Claimed(token),
        })
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        {
            let now = self.clock.now();
            let records = self.records.lock().unwrap();
            if let Some(Record::Completed {
                token: current,
                until,
                ..
            }) = records.get(key)
            {
                // The owner's earlier completion landed: done already.
                return if *current == token && *until > now {
                    Ok(())
                } else {
                    Err(StoreError::TokenRejected)
                };
            }
        }
        self.with_owned(key, token, |record, now| {
            if let Record::InFlight { fingerprint, .. } = record {
                let fingerprint = *fingerprint;
                *record = Record::Completed {
                    token,
                    fingerprint,
                    payload,
                    until: now + ttl,
                };
            }
        })
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        self.with_owned(key, token, |record, now| {
            if let Record::InFlight { until, .. } = record {
                *until = now;
            }
        })
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.with_owned(key, token, |record, now| {
            if let Record::InFlight { until, kept, .. } = record {
                *until = now + lease;
                *kept = (*kept).max(*until);
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

// Its store implements `Store` only: the session and step checks say they do not apply.
idempotent_core::store_conformance_tests!(Custom);

#[tokio::test]
async fn the_runtime_runs_on_a_custom_store() {
    let idempotency = Idempotency::keys_only(MutexStore::new(ManualClock::new()));
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
