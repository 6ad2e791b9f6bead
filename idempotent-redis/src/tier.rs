//! The Redis tier: finished records every instance shares, in front of a slower store. Only a
//! hint: an entry is read to replay and for nothing else, checked whole before it is, and a
//! failing Redis is skipped for a while.
//!
//! An entry is one Redis string at `PREFIX + hex(storage key)` (one key: one Redis Cluster
//! slot), expiring with its record twice over: Redis drops it (`PX`, the time the record has
//! left, rounded down), and a reader ignores it once the wall-clock deadline it carries has
//! passed. The second guards against a write Redis runs late (a stalled Redis works through
//! its backlog with the `PX` it was sent, counted from then); it trusts the app servers' clocks
//! to agree within what a replay near the end of a record's life may be off by.
//!
//! ```text
//! offset  size  field
//! 0       2     magic "IC"
//! 2       1     format version (1)
//! 3       8     first 8 bytes of blake3(deadline ‖ fingerprint ‖ payload)
//! 11      8     deadline: Unix time in milliseconds, big-endian, when the record expires
//! 19      32    the record's fingerprint
//! 51      n     the record's payload (its envelope), byte for byte
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use redis::{AsyncCommands as _, Value};

use idempotent_cache::{BoxFuture, CacheTier, Finished, SharedTier, TierUnavailable, TierWrites};

use crate::{Connection, RedisStore};
use idempotent_core::{Claim, Fingerprint, StorageKey, StoreError};

/// The default prefix of the Redis tier's keys.
pub const DEFAULT_CACHE_PREFIX: &str = "idempotent:cache:";
/// The default connection and response timeout of the Redis tier: 100 ms. A hint that takes
/// longer than a round trip to the store is worth nothing.
pub const DEFAULT_CACHE_TIMEOUT: Duration = Duration::from_millis(100);
/// How long the tier is skipped after a failure, by default.
const DEFAULT_REST: Duration = Duration::from_secs(1);
/// Writes in the background at once, at most; more are dropped (a hint can be).
const MAX_PENDING_WRITES: usize = 256;

const MAGIC: &[u8; 2] = b"IC";
const VERSION: u8 = 1;
const HEADER: usize = 2 + 1 + 8 + 8 + 32;

/// Configures the Redis tier: `RedisCacheBuilder::new(url).connect().await` is a
/// [`CacheTier`] for [`Cached`](idempotent_cache::Cached).
#[derive(Clone)]
#[must_use]
pub struct RedisCacheBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    rest: Duration,
}

impl fmt::Debug for RedisCacheBuilder {
    /// Leaves the URL out: it may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCacheBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("rest", &self.rest)
            .finish_non_exhaustive()
    }
}

impl RedisCacheBuilder {
    /// A Redis tier on `url` (one server, or a Redis Cluster's nodes comma-separated), with the
    /// defaults below.
    pub fn new(url: impl Into<String>) -> Self {
        RedisCacheBuilder {
            url: url.into(),
            prefix: DEFAULT_CACHE_PREFIX.to_owned(),
            timeout: DEFAULT_CACHE_TIMEOUT,
            rest: DEFAULT_REST,
        }
    }

    /// The prefix of every key the tier writes (default [`DEFAULT_CACHE_PREFIX`]); give each
    /// namespace sharing one Redis its own if their storage keys could meet.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The connection and response timeout (default [`DEFAULT_CACHE_TIMEOUT`]). A lookup
    /// that takes longer counts as a failure: the request goes to the store.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long the tier is skipped after a failure (default 1 s): while Redis is down or
    /// stalled, only one lookup per period waits for it.
    pub fn rest(mut self, rest: Duration) -> Self {
        self.rest = rest;
        self
    }

    /// The tier. Connecting does not wait for Redis: when it cannot be reached (or refuses
    /// the connection: a wrong password, say), the tier starts resting and connects in the
    /// background, logging why, and every request goes to the store meanwhile. Fails only with
    /// a malformed URL ([`StoreError::Backend`]).
    pub async fn connect(self) -> Result<CacheTier, StoreError> {
        for node in self.url.split(',').map(str::trim) {
            redis::Client::open(node).map_err(|e| StoreError::Backend(Box::new(e)))?;
        }
        let tier = RedisTier {
            shared: Arc::new(Shared {
                connection: OnceLock::new(),
                builder: self.clone(),
                epoch: Instant::now(),
                resting_until: AtomicU64::new(0),
                connecting: std::sync::atomic::AtomicBool::new(false),
                writes: Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_WRITES)),
            }),
        };
        if let Err(error) = tier.shared.open().await {
            tracing::warn!(%error, "the Redis cache tier cannot be reached; requests go to the store until it can");
            tier.shared.rest();
        }
        Ok(CacheTier::shared(tier))
    }
}

struct RedisTier {
    shared: Arc<Shared>,
}

struct Shared {
    /// Set once connected: the connection reconnects by itself after that.
    connection: OnceLock<Connection>,
    builder: RedisCacheBuilder,
    epoch: Instant,
    /// Until when (milliseconds after `epoch`) the tier is skipped after a failure.
    resting_until: AtomicU64,
    connecting: std::sync::atomic::AtomicBool,
    writes: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    async fn open(&self) -> Result<(), StoreError> {
        let store = RedisStore::builder(&self.builder.url)
            .timeout(self.builder.timeout)
            .connect()
            .await?;
        let _ = self.connection.set(store.connection);
        Ok(())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn rest(&self) {
        let until = self
            .now_ms()
            .saturating_add(u64::try_from(self.builder.rest.as_millis()).unwrap_or(u64::MAX));
        self.resting_until.fetch_max(until, Ordering::Relaxed);
    }

    /// The connection, unless the tier is resting after a failure or has none yet (then a
    /// connection is opened in the background).
    fn connection(self: &Arc<Self>) -> Option<Connection> {
        if self.now_ms() < self.resting_until.load(Ordering::Relaxed) {
            return None;
        }
        let connection = self.connection.get().cloned();
        if connection.is_none() && !self.connecting.swap(true, Ordering::AcqRel) {
            let shared = Arc::clone(self);
            tokio::spawn(async move {
                if let Err(error) = shared.open().await {
                    tracing::warn!(%error, "the Redis cache tier still cannot be reached");
                    shared.rest();
                }
                shared.connecting.store(false, Ordering::Release);
            });
        }
        connection
    }

    fn redis_key(&self, key: &StorageKey) -> String {
        let mut out = String::with_capacity(self.builder.prefix.len() + 64);
        out.push_str(&self.builder.prefix);
        out.push_str(&key.to_hex());
        out
    }

    /// After a failed command: the tier rests when Redis is away or slow (logged once, as it
    /// begins to rest); an answer Redis gave (a key of another type at the entry's name, say)
    /// is only this command's failure.
    fn failed(&self, error: &redis::RedisError) {
        let away = error.is_io_error()
            || error.is_timeout()
            || error.is_connection_dropped()
            || error.is_connection_refusal()
            || error.is_unrecoverable_error();
        if !away {
            tracing::debug!(%error, "a Redis cache tier command failed");
            return;
        }
        if self.now_ms() >= self.resting_until.load(Ordering::Relaxed) {
            tracing::warn!(%error, rest = ?self.builder.rest, "the Redis cache tier failed; requests go to the store meanwhile");
        }
        self.rest();
    }
}

/// Milliseconds since the Unix epoch, now.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

fn checksum(deadline: u64, fingerprint: &Fingerprint, payload: &[u8]) -> [u8; 8] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&deadline.to_be_bytes());
    hasher.update(fingerprint.as_bytes());
    hasher.update(payload);
    let mut out = [0; 8];
    out.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    out
}

/// The entry of a finished record (`fingerprint`, `payload`) that expires at `deadline` (Unix
/// milliseconds).
fn encode(fingerprint: &Fingerprint, payload: &[u8], deadline: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&checksum(deadline, fingerprint, payload));
    out.extend_from_slice(&deadline.to_be_bytes());
    out.extend_from_slice(fingerprint.as_bytes());
    out.extend_from_slice(payload);
    out
}

impl RedisTier {
    /// The store's answer the entry of `key` stands for; `Err` when Redis failed (or the tier
    /// rests). One `GET`: Redis expires the entry with its record, so an entry it returns is
    /// live; the time it has left is not read (the answer says zero: "not told"), so a tier
    /// stacked in front of this one does not keep it.
    async fn get(&self, key: &StorageKey) -> Result<Option<Claim>, TierUnavailable> {
        let Some(mut connection) = self.shared.connection() else {
            return Err(TierUnavailable);
        };
        let reply: Result<Value, _> = connection.get(self.shared.redis_key(key)).await;
        match reply {
            Ok(Value::BulkString(bytes)) => {
                let entry = match decode_entry(bytes) {
                    // Past its deadline: a write Redis ran late. No entry.
                    Some((deadline, fingerprint, payload)) => {
                        (deadline > wall_ms()).then_some((fingerprint, payload))
                    }
                    None => {
                        tracing::warn!(storage_key = %key, "ignoring a Redis cache entry that is not whole");
                        None
                    }
                };
                Ok(entry.map(|(fingerprint, payload)| Claim::Completed {
                    fingerprint,
                    payload,
                    expires_in: Duration::ZERO,
                }))
            }
            Ok(_) => Ok(None),
            Err(error) => {
                self.shared.failed(&error);
                Err(TierUnavailable)
            }
        }
    }

    /// Writes `finished` in the background, expiring with its record.
    fn insert(&self, key: StorageKey, finished: Finished, writes: TierWrites) {
        let Some(mut connection) = self.shared.connection() else {
            writes.failed();
            return;
        };
        let Ok(permit) = Arc::clone(&self.shared.writes).try_acquire_owned() else {
            writes.dropped();
            return;
        };
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            let _permit = permit;
            // Whole milliseconds left, rounded down: the entry expires no later than its
            // record (a copy with under a millisecond left is not worth writing).
            let left = finished
                .expires_at()
                .saturating_duration_since(tokio::time::Instant::now());
            let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
            if ms == 0 {
                return;
            }
            let deadline = wall_ms().saturating_add(ms);
            let written: Result<(), _> = connection
                .pset_ex(
                    shared.redis_key(&key),
                    encode(finished.fingerprint(), finished.payload(), deadline),
                    ms,
                )
                .await;
            match written {
                Ok(()) => writes.written(),
                Err(error) => {
                    writes.failed();
                    shared.failed(&error);
                }
            }
        });
    }
}

impl SharedTier for RedisTier {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn get<'a>(
        &'a self,
        key: &'a StorageKey,
    ) -> BoxFuture<'a, Result<Option<Claim>, TierUnavailable>> {
        Box::pin(RedisTier::get(self, key))
    }

    fn insert(&self, key: StorageKey, finished: Finished, writes: TierWrites) {
        RedisTier::insert(self, key, finished, writes);
    }
}

/// The deadline, fingerprint and payload `bytes` hold, if they are one whole entry; anything
/// else (written by something else, damaged, of another version) is no entry.
fn decode_entry(bytes: Vec<u8>) -> Option<(u64, Fingerprint, Bytes)> {
    if bytes.len() < HEADER || &bytes[..2] != MAGIC || bytes[2] != VERSION {
        return None;
    }
    let stored: [u8; 8] = bytes[3..11].try_into().ok()?;
    let deadline = u64::from_be_bytes(bytes[11..19].try_into().ok()?);
    let fingerprint = Fingerprint::from_digest(bytes[19..HEADER].try_into().ok()?);
    let payload = Bytes::from(bytes).slice(HEADER..);
    (checksum(deadline, &fingerprint, &payload) == stored).then_some((
        deadline,
        fingerprint,
        payload,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(payload: &'static [u8], deadline: u64) -> Vec<u8> {
        encode(&Fingerprint::from_bytes(b"request"), payload, deadline)
    }

    #[test]
    fn an_entry_reads_back_whole() {
        let (deadline, fingerprint, payload) =
            decode_entry(entry(b"the envelope", 1_700_000_000_123)).expect("whole");
        assert_eq!(deadline, 1_700_000_000_123);
        assert_eq!(fingerprint, Fingerprint::from_bytes(b"request"));
        assert_eq!(payload, Bytes::from_static(b"the envelope"));
    }

    #[test]
    fn a_damaged_or_foreign_entry_is_no_entry() {
        let bytes = entry(b"the envelope", 1_700_000_000_123);
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x01;
            assert!(
                decode_entry(damaged).is_none(),
                "a flipped bit at {at} went unnoticed"
            );
        }
        for foreign in [Vec::new(), b"IC".to_vec(), b"{\"status\":200}".to_vec()] {
            assert!(decode_entry(foreign).is_none());
        }
        assert!(decode_entry(bytes[..HEADER - 1].to_vec()).is_none());
    }
}
