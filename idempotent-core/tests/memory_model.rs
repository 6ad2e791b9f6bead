//! Model-based property tests of `MemoryStore`: random sequences of claims, completions,
//! releases, renewals, clock advances and sweeps must give exactly the answers, tokens, record
//! lifetimes,
//! counts and byte counts of a simple reference model, with and without a `max_entries` bound.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::clock::ManualClock;
use idempotent_core::memory::{MemoryStore, RECORD_OVERHEAD};
use idempotent_core::{Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;
use tokio::runtime::Runtime;

/// The capacity-sweep gap of a store built with `sweep_interval(None)`: a tenth of the default
/// sweep interval, in milliseconds.
const CAPACITY_SWEEP_GAP_MS: u64 = 1_000;

/// Which token an operation presents for its key.
#[derive(Debug, Clone)]
enum TokenChoice {
    /// The latest token issued for the key (a never-issued value if none was).
    Latest,
    /// A token issued for the key before the latest one (a never-issued value if none was).
    Older(Index),
    /// A token issued for the key `offset` keys further on (a never-issued value if none was).
    OtherKey(u8, Index),
    /// A value never issued: 0 or `u64::MAX`.
    Never(bool),
}

#[derive(Debug, Clone)]
enum Op {
    Claim {
        key: u8,
        fp: u8,
        lease_ms: u64,
        ttl_ms: u64,
    },
    Complete {
        key: u8,
        token: TokenChoice,
        payload: Vec<u8>,
        ttl_ms: u64,
    },
    Release {
        key: u8,
        token: TokenChoice,
    },
    Renew {
        key: u8,
        token: TokenChoice,
        lease_ms: u64,
    },
    Advance {
        millis: u64,
    },
    Sweep,
}

/// A store answer reduced to something comparable (the token of `Claimed` is checked apart).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Claimed,
    /// A takeover continuing the lifetime that began with this token.
    TakenOver(FencingToken),
    Found(Claim),
    Done,
    TokenRejected,
    Capacity,
    Other(String),
}

impl Answer {
    fn of_error(e: &StoreError) -> Self {
        match e {
            StoreError::TokenRejected => Answer::TokenRejected,
            StoreError::Capacity { .. } => Answer::Capacity,
            other => Answer::Other(format!("{other:?}")),
        }
    }

    fn of_unit(r: &Result<(), StoreError>) -> Self {
        match r {
            Ok(()) => Answer::Done,
            Err(e) => Answer::of_error(e),
        }
    }

    fn of_claim(r: &Result<Claim, StoreError>) -> Self {
        match r {
            Ok(Claim::Claimed(_)) => Answer::Claimed,
            Ok(Claim::TakenOver { lifetime, .. }) => Answer::TakenOver(*lifetime),
            Ok(found) => Answer::Found(found.clone()),
            Err(e) => Answer::of_error(e),
        }
    }
}

fn storage_key(key: u8) -> StorageKey {
    StorageKey::from_bytes([key; 32])
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint::from_digest([fp; 32])
}

/// A record as the model sees it; times in milliseconds since the clock's origin.
#[derive(Debug, Clone)]
enum Rec {
    InFlight {
        token: FencingToken,
        lifetime: FencingToken,
        fp: u8,
        lease_until: u64,
        kept_until: u64,
    },
    Completed {
        token: FencingToken,
        fp: u8,
        payload: Vec<u8>,
        expires: u64,
    },
}

impl Rec {
    /// Kept by a sweep while its lease or TTL instant is strictly after `now`, or, unless the
    /// store is full (`pressed`), while an abandoned claim's TTL is.
    fn is_kept(&self, now: u64, pressed: bool) -> bool {
        match self {
            Rec::InFlight {
                lease_until,
                kept_until,
                ..
            } => *lease_until > now || (!pressed && *kept_until > now),
            Rec::Completed { expires, .. } => *expires > now,
        }
    }

    fn cost(&self) -> usize {
        match self {
            Rec::InFlight { .. } => RECORD_OVERHEAD,
            Rec::Completed { payload, .. } => RECORD_OVERHEAD + payload.len(),
        }
    }
}

/// The reference model.
#[derive(Debug)]
struct Model {
    keys: u8,
    /// Milliseconds since the clock's origin.
    now: u64,
    /// Records the store holds: live, or expired and not yet swept or reclaimed.
    records: BTreeMap<u8, Rec>,
    /// Every token issued per key, in order of issue.
    issued: BTreeMap<u8, Vec<FencingToken>>,
    max_entries: usize,
    last_capacity_sweep: Option<u64>,
}

impl Model {
    fn new(keys: u8, max_entries: usize) -> Self {
        Model {
            keys,
            now: 0,
            records: BTreeMap::new(),
            issued: BTreeMap::new(),
            max_entries,
            last_capacity_sweep: None,
        }
    }

    fn issued(&self, key: u8) -> &[FencingToken] {
        self.issued.get(&key).map_or(&[], Vec::as_slice)
    }

    fn pick_token(&self, key: u8, choice: &TokenChoice) -> FencingToken {
        let never = FencingToken::new(0);
        match choice {
            TokenChoice::Latest => self.issued(key).last().copied().unwrap_or(never),
            TokenChoice::Older(i) => {
                let own = self.issued(key);
                if own.len() >= 2 {
                    own[i.index(own.len() - 1)]
                } else {
                    never
                }
            }
            TokenChoice::OtherKey(offset, i) => {
                let other = self.issued((key + offset) % self.keys);
                if other.is_empty() {
                    never
                } else {
                    other[i.index(other.len())]
                }
            }
            TokenChoice::Never(high) => FencingToken::new(if *high { u64::MAX } else { 0 }),
        }
    }

    fn kept_count(&self) -> usize {
        self.records
            .values()
            .filter(|r| r.is_kept(self.now, false))
            .count()
    }

    fn bytes(&self) -> usize {
        self.records.values().map(Rec::cost).sum()
    }

    /// Deletes every expired record (and, if `pressed`, every abandoned claim); returns how
    /// many.
    fn sweep(&mut self, pressed: bool) -> usize {
        let before = self.records.len();
        let now = self.now;
        self.records.retain(|_, r| r.is_kept(now, pressed));
        before - self.records.len()
    }

    /// What a claim on `key` must answer. Performs the capacity sweep a full store does, when
    /// one is due. `Answer::Claimed` means the caller must then report the token to `claimed`.
    fn expect_claim(&mut self, key: u8, fp: u8) -> Answer {
        match self.records.get(&key) {
            Some(Rec::InFlight {
                fp, lease_until, ..
            }) if *lease_until > self.now => Answer::Found(Claim::InFlight {
                fingerprint: fingerprint(*fp),
                retry_after: Duration::from_millis(lease_until - self.now),
            }),
            Some(Rec::Completed {
                fp,
                payload,
                expires,
                ..
            }) if *expires > self.now => Answer::Found(Claim::Completed {
                fingerprint: fingerprint(*fp),
                payload: Bytes::from(payload.clone()),
                expires_in: Duration::from_millis(expires - self.now),
            }),
            // Abandoned by the same request: taken over in place, in the same lifetime.
            Some(Rec::InFlight {
                lifetime,
                fp: recorded,
                kept_until,
                ..
            }) if *kept_until > self.now && *recorded == fp => Answer::TakenOver(*lifetime),
            // Abandoned by another request: still that request's, reported and unchanged.
            Some(Rec::InFlight {
                fp: recorded,
                kept_until,
                ..
            }) if *kept_until > self.now => Answer::Found(Claim::InFlight {
                fingerprint: fingerprint(*recorded),
                retry_after: Duration::ZERO,
            }),
            // Expired: reclaimed in place, needs no capacity.
            Some(_) => Answer::Claimed,
            None if self.records.len() < self.max_entries => Answer::Claimed,
            None => {
                let due = self
                    .last_capacity_sweep
                    .is_none_or(|last| self.now >= last + CAPACITY_SWEEP_GAP_MS);
                if due {
                    self.last_capacity_sweep = Some(self.now);
                    if self.sweep(true) > 0 {
                        return Answer::Claimed;
                    }
                }
                Answer::Capacity
            }
        }
    }

    fn claimed(
        &mut self,
        key: u8,
        (token, lifetime): (FencingToken, FencingToken),
        fp: u8,
        (lease_ms, ttl_ms): (u64, u64),
    ) {
        self.records.insert(
            key,
            Rec::InFlight {
                token,
                lifetime,
                fp,
                lease_until: self.now + lease_ms,
                kept_until: self.now + ttl_ms.max(lease_ms),
            },
        );
        self.issued.entry(key).or_default().push(token);
    }

    /// The current record of `key` if it is a live in-flight record held with `token`.
    fn owned(&mut self, key: u8, token: FencingToken) -> Option<&mut Rec> {
        let now = self.now;
        self.records.get_mut(&key).filter(|r| {
            matches!(r, Rec::InFlight { token: current, lease_until, .. }
                if *current == token && *lease_until > now)
        })
    }

    fn complete(&mut self, key: u8, token: FencingToken, payload: &[u8], ttl_ms: u64) -> Answer {
        let (now, expires) = (self.now, self.now + ttl_ms);
        // The owner's repeated completion finds its own live record: done, nothing changes.
        if matches!(self.records.get(&key), Some(Rec::Completed { token: current, expires, .. })
            if *current == token && *expires > now)
        {
            return Answer::Done;
        }
        match self.owned(key, token) {
            Some(rec) => {
                let fp = match rec {
                    Rec::InFlight { fp, .. } | Rec::Completed { fp, .. } => *fp,
                };
                *rec = Rec::Completed {
                    token,
                    fp,
                    payload: payload.to_vec(),
                    expires,
                };
                Answer::Done
            }
            None => Answer::TokenRejected,
        }
    }

    /// Ends the lease; the record is kept as an abandoned claim.
    fn release(&mut self, key: u8, token: FencingToken) -> Answer {
        let now = self.now;
        match self.owned(key, token) {
            Some(Rec::InFlight { lease_until, .. }) => {
                *lease_until = now;
                Answer::Done
            }
            _ => Answer::TokenRejected,
        }
    }

    fn renew(&mut self, key: u8, token: FencingToken, lease_ms: u64) -> Answer {
        let until = self.now + lease_ms;
        match self.owned(key, token) {
            Some(Rec::InFlight {
                lease_until,
                kept_until,
                ..
            }) => {
                *lease_until = until;
                *kept_until = (*kept_until).max(until);
                Answer::Done
            }
            _ => Answer::TokenRejected,
        }
    }
}

/// The store under test, its clock, and the model it is checked against.
struct Harness {
    runtime: Runtime,
    clock: ManualClock,
    store: MemoryStore,
    model: Model,
}

impl Harness {
    fn new(keys: u8, max_entries: Option<usize>) -> Result<Self, TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TestCaseError::fail(format!("cannot build a runtime: {e}")))?;
        let clock = ManualClock::new();
        let mut builder = MemoryStore::builder()
            .clock(clock.clone())
            .sweep_interval(None);
        if let Some(max) = max_entries {
            builder = builder.max_entries(max);
        }
        // Built inside the runtime, as a real caller would; no sweeper starts without an interval.
        let store = runtime.block_on(async { builder.build() });
        let model = Model::new(keys, max_entries.unwrap_or(usize::MAX));
        Ok(Harness {
            runtime,
            clock,
            store,
            model,
        })
    }

    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for (step, op) in ops.iter().enumerate() {
            self.step(op)
                .map_err(|e| TestCaseError::fail(format!("step {step}, {op:?}: {e}")))?;
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Claim {
                key,
                fp,
                lease_ms,
                ttl_ms,
            } => {
                let got = self.runtime.block_on(self.store.claim(
                    &storage_key(*key),
                    &fingerprint(*fp),
                    Duration::from_millis(*lease_ms),
                    Duration::from_millis(*ttl_ms),
                ));
                let expected = self.model.expect_claim(*key, *fp);
                prop_assert_eq!(
                    &Answer::of_claim(&got),
                    &expected,
                    "model: {:?}",
                    self.model
                );
                let owner = match got {
                    Ok(Claim::Claimed(token)) => Some((token, token)),
                    Ok(Claim::TakenOver { token, lifetime }) => Some((token, lifetime)),
                    _ => None,
                };
                if let Some((token, lifetime)) = owner {
                    for earlier in self.model.issued(*key) {
                        prop_assert!(
                            token > *earlier,
                            "token {:?} not above earlier {:?} for key {}",
                            token,
                            earlier,
                            key
                        );
                    }
                    self.model
                        .claimed(*key, (token, lifetime), *fp, (*lease_ms, *ttl_ms));
                }
            }
            Op::Complete {
                key,
                token,
                payload,
                ttl_ms,
            } => {
                let token = self.model.pick_token(*key, token);
                let got = self.runtime.block_on(self.store.complete(
                    &storage_key(*key),
                    token,
                    Bytes::from(payload.clone()),
                    Duration::from_millis(*ttl_ms),
                ));
                let expected = self.model.complete(*key, token, payload, *ttl_ms);
                prop_assert_eq!(Answer::of_unit(&got), expected, "token {:?}", token);
            }
            Op::Release { key, token } => {
                let token = self.model.pick_token(*key, token);
                let got = self
                    .runtime
                    .block_on(self.store.release(&storage_key(*key), token));
                let expected = self.model.release(*key, token);
                prop_assert_eq!(Answer::of_unit(&got), expected, "token {:?}", token);
            }
            Op::Renew {
                key,
                token,
                lease_ms,
            } => {
                let token = self.model.pick_token(*key, token);
                let got = self.runtime.block_on(self.store.renew(
                    &storage_key(*key),
                    token,
                    Duration::from_millis(*lease_ms),
                ));
                let expected = self.model.renew(*key, token, *lease_ms);
                prop_assert_eq!(Answer::of_unit(&got), expected, "token {:?}", token);
            }
            Op::Advance { millis } => {
                self.clock.advance(Duration::from_millis(*millis));
                self.model.now += millis;
            }
            Op::Sweep => {
                let removed = self.store.sweep();
                prop_assert_eq!(removed, self.model.sweep(false), "records swept");
                let live = self.model.kept_count();
                let live_bytes = self.model.bytes();
                let stats = self.store.stats();
                prop_assert_eq!(stats.records, live, "records after a sweep");
                prop_assert_eq!(stats.bytes, live_bytes, "bytes after a sweep");
            }
        }
        let stats = self.store.stats();
        prop_assert_eq!(stats.records, self.model.records.len(), "records held");
        prop_assert_eq!(stats.bytes, self.model.bytes(), "bytes held");
        prop_assert!(stats.records <= self.model.max_entries, "over max_entries");
        Ok(())
    }
}

fn token_choice(keys: u8) -> impl Strategy<Value = TokenChoice> {
    prop_oneof![
        8 => Just(TokenChoice::Latest),
        2 => any::<Index>().prop_map(TokenChoice::Older),
        1 => (1..keys, any::<Index>()).prop_map(|(offset, i)| TokenChoice::OtherKey(offset, i)),
        1 => any::<bool>().prop_map(TokenChoice::Never),
    ]
}

/// Operations on keys `0..keys`, with every duration a whole number of `unit_ms`: leases of
/// 1..20 units, TTLs of 1..50 units, clock advances of `0..max_advance` units.
fn op(keys: u8, unit_ms: u64, max_advance: u64) -> impl Strategy<Value = Op> {
    let units = move |n: u64| n * unit_ms;
    prop_oneof![
        4 => (0..keys, 0..3u8, 1..20u64, 1..50u64).prop_map(move |(key, fp, lease, ttl)| {
            Op::Claim {
                key,
                fp,
                lease_ms: units(lease),
                ttl_ms: units(ttl),
            }
        }),
        3 => (0..keys, token_choice(keys), prop::collection::vec(any::<u8>(), 0..8), 1..50u64)
            .prop_map(move |(key, token, payload, ttl)| Op::Complete {
                key,
                token,
                payload,
                ttl_ms: units(ttl),
            }),
        2 => (0..keys, token_choice(keys)).prop_map(|(key, token)| Op::Release { key, token }),
        2 => (0..keys, token_choice(keys), 1..20u64).prop_map(move |(key, token, lease)| {
            Op::Renew {
                key,
                token,
                lease_ms: units(lease),
            }
        }),
        2 => (0..max_advance).prop_map(move |n| Op::Advance { millis: units(n) }),
        1 => Just(Op::Sweep),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        // This suite writes no regression files; a failure prints its minimal sequence.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// An unbounded store, three keys, whole seconds: leases 1..20 s, TTLs 1..50 s, advances
    /// 0..30 s.
    #[test]
    fn memory_store_matches_model(ops in prop::collection::vec(op(3, 1_000, 30), 1..60)) {
        Harness::new(3, None)?.run(&ops)?;
    }

    /// A store bounded to two records, four keys, time in quarter seconds so that records
    /// expire both inside and outside the one-second gap between capacity sweeps.
    #[test]
    fn bounded_memory_store_matches_model(ops in prop::collection::vec(op(4, 250, 8), 1..60)) {
        Harness::new(4, Some(2))?.run(&ops)?;
    }
}
