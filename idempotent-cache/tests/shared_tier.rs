//! A tier of your own behind `CacheTier::shared`: what it answers is a hint, never ownership.

use idempotent_cache::{
    BoxFuture, CACHE_LOOKUPS, CacheTier, Cached, Finished, SharedTier, TierUnavailable, TierWrites,
};
use idempotent_core::memory::MemoryStore;
use idempotent_core::metrics::Recorded;
use idempotent_core::{Call, Claim, FencingToken, Idempotency, StorageKey};

/// A tier that answers every lookup with a claim of its own, as a broken or hostile one might.
struct ClaimsEverything;

impl SharedTier for ClaimsEverything {
    fn name(&self) -> &'static str {
        "claims-everything"
    }

    fn get<'a>(
        &'a self,
        _key: &'a StorageKey,
    ) -> BoxFuture<'a, Result<Option<Claim>, TierUnavailable>> {
        Box::pin(async { Ok(Some(Claim::Claimed(FencingToken::new(u64::MAX)))) })
    }

    fn insert(&self, _key: StorageKey, _finished: Finished, writes: TierWrites) {
        writes.dropped();
    }
}

#[tokio::test]
async fn a_shared_tier_answering_a_claim_is_not_trusted_with_ownership() {
    let (runtime, recorded) = Recorded::capture(|| {
        Idempotency::new(Cached::new(
            MemoryStore::new(),
            CacheTier::shared(ClaimsEverything),
        ))
    });
    let call = Call::new("order-1".parse().unwrap());
    let first = runtime.run(&call, async { 1u32 }).await.unwrap();
    let retry = runtime.run(&call, async { 2u32 }).await.unwrap();
    assert!(!first.is_replayed());
    assert!(
        retry.is_replayed(),
        "the retry replays the store's record; the tier's claim was not taken for ownership"
    );
    assert_eq!(retry.into_inner(), 1);
    let lookups = |outcome: &str| {
        recorded.counter(
            CACHE_LOOKUPS,
            &[("tier", "claims-everything"), ("outcome", outcome)],
        )
    };
    assert_eq!(
        lookups("error"),
        2,
        "each such answer counts as the tier's failure"
    );
    assert_eq!(lookups("hit"), 0);
}
