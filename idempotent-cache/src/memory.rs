//! The in-process tier: a `moka` cache bounded by entries and bytes, each entry expiring with
//! its record.

use std::time::{Duration, Instant};

use moka::Expiry;
use moka::sync::Cache;

use super::Finished;
use idempotent_core::StorageKey;

pub(super) struct MemoryTier {
    cache: Cache<StorageKey, Finished>,
}

/// Each entry lives exactly as long as its record has left, and no longer: there is no time
/// to live of the cache's own.
struct UntilTheRecordExpires;

impl Expiry<StorageKey, Finished> for UntilTheRecordExpires {
    fn expire_after_create(
        &self,
        _key: &StorageKey,
        value: &Finished,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(
            value
                .expires_at
                .into_std()
                .saturating_duration_since(created_at),
        )
    }

    fn expire_after_update(
        &self,
        _key: &StorageKey,
        value: &Finished,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(
            value
                .expires_at
                .into_std()
                .saturating_duration_since(updated_at),
        )
    }
}

impl MemoryTier {
    /// At most `entries` entries and `max_bytes` bytes: every entry weighs at least an even
    /// share of the bytes, so the byte bound also bounds the entries.
    pub(super) fn new(entries: u64, max_bytes: u64) -> Self {
        let share = max_bytes.div_ceil(entries.max(1)).max(1);
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(move |_key, value: &Finished| {
                u32::try_from(value.weight().max(share)).unwrap_or(u32::MAX)
            })
            .expire_after(UntilTheRecordExpires)
            .build();
        MemoryTier { cache }
    }

    pub(super) fn get(&self, key: &StorageKey) -> Option<Finished> {
        self.cache.get(key)
    }

    pub(super) fn insert(&self, key: StorageKey, finished: Finished) {
        self.cache.insert(key, finished);
    }

    pub(super) fn entries(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }
}
