//! The Redis store: one shared record per key for many app instances.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, Script, ServerErrorKind,
    Value,
};

use crate::{Claim, FencingToken, Fingerprint, StorageKey, Store, StoreError, limits};

/// The default prefix of every Redis key this store writes.
pub const DEFAULT_KEY_PREFIX: &str = "idempotent:";

/// A [`Store`] on Redis, shared by every app instance that points at the same server or
/// Redis Cluster.
///
/// Every operation is one Lua script: one atomic step and one round trip. A replay costs one
/// round trip (`claim`); a fresh request two (`claim`, `complete`) plus a `renew` every third of
/// the lease while the work runs.
///
/// # Data layout
///
/// One Redis hash per record at `PREFIX + hex(storage key)` (one key, so one Redis Cluster
/// slot): field `s` (state: `i` in flight, `c` completed), `f` (the 32-byte fingerprint), `t`
/// (the fencing token) and, once completed, `p` (the payload). The key's Redis expiry is the
/// lease while in flight and the TTL once completed, so Redis deletes records itself and a
/// record is live exactly while its key exists. Expiries are whole milliseconds, at least one;
/// a lease above [`limits::MAX_LEASE`] or a TTL above [`limits::MAX_TTL`] is recorded as that
/// ceiling, and each script checks its expiry before it writes, so no record is ever left
/// without one. Times are the server's: expiry runs on its
/// clock, and tokens are derived from `TIME` (microseconds since the epoch), so they increase
/// per key across deletions as long as the server's clock does not go backwards.
///
/// # Deployment
///
/// - **`maxmemory-policy noeviction`**: an evicted in-flight claim or completed record is a
///   second execution waiting to happen. With `noeviction`, a full Redis refuses writes, which
///   this store reports as [`StoreError::Capacity`] (HTTP 503), and nothing is lost.
/// - **Persistence**: without it, a Redis restart forgets every record, and retries of requests
///   completed before the restart run again. With AOF (`appendonly yes`, `appendfsync
///   everysec`) at most about a second of records is lost in a crash; `appendfsync always`
///   loses none at a write-latency cost.
/// - **Redis Cluster**: give [`RedisStore::connect`] (or [`RedisStore::builder`]) the URLs of
///   some of its nodes, comma-separated. Every record is one key, so each operation is one
///   script on one slot's primary; the client follows `MOVED` and `ASK` redirections and
///   learns the new primaries after a failover, so the app rides a failover out without a
///   restart (operations meanwhile fail with [`StoreError::Unavailable`]: HTTP 503).
/// - **Replication and failover**: replication is asynchronous. A coordinated failover
///   (`CLUSTER FAILOVER`, a switchover) waits for the replica to catch up and loses nothing.
///   A primary that dies takes with it what it acknowledged and had not replicated yet: a claim
///   or record lost that way lets a duplicate arriving right after the failover run again.
///   [`RedisStoreBuilder::replicas`] closes that window: a claim or record counts only once
///   that many replicas have it, so the replica promoted in a dead primary's place has every
///   claim and record the store reported (at the cost of a second round trip per claim and
///   completion). Without it, or where a replica may be promoted that did not acknowledge, use
///   the PostgreSQL store with synchronous replication.
/// - **Outages**: operations fail with [`StoreError::Unavailable`] (fail closed: HTTP 503)
///   after the connection and response timeouts (default 2 s each); the connection manager
///   reconnects by itself when the server is back.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    /// Replicas that must acknowledge each claim and completion (`WAIT`), and how long
    /// to wait for them; none by default.
    replicas: Option<(usize, Duration)>,
}

/// One server, or a Redis Cluster. Both pipeline whatever is concurrent over their
/// connections and reconnect by themselves.
#[derive(Clone)]
enum Connection {
    Node(ConnectionManager),
    /// Routes each script by its one key's slot, follows `MOVED` and `ASK` redirections, and
    /// refreshes its view of the slots after a failover.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Node(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Node(connection) => connection.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Node(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

// Every script that sets an expiry checks it before it writes anything: a Lua error does not
// undo the writes before it, so a `PEXPIRE` that failed after the `HSET` would leave a claim
// with no expiry, or a completed record with the lease's. `EXPIRY_MS` is replaced by the
// argument that holds the expiry, `MAX_MS` by the longest one (`limits`).
const CHECK_EXPIRY: &str = r"
local ms = tonumber(EXPIRY_MS)
if not ms or ms < 1 or ms > MAX_MS or ms ~= math.floor(ms) then
  return redis.error_reply('ERR idempotent: expiry out of range: ' .. tostring(EXPIRY_MS))
end
";

const CLAIM: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'p')
if rec[1] == 'i' then
  return {'i', rec[2], redis.call('PTTL', KEYS[1])}
elseif rec[1] == 'c' then
  return {'c', rec[2], rec[3]}
elseif rec[1] then
  return {'?', rec[1]}
end
local now = redis.call('TIME')
local token = string.format('%.0f', tonumber(now[1]) * 1000000 + tonumber(now[2]))
redis.call('HSET', KEYS[1], 's', 'i', 'f', ARGV[1], 't', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'claimed', token}
";

const COMPLETE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', 'c', 'p', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
";

const RELEASE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
";

const RENEW: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// `script` with the expiry in `ARGV[arg]` checked first.
fn checked(arg: usize, script: &str) -> Script {
    Script::new(&checked_source(arg, script))
}

/// The source of [`checked`]'s script.
fn checked_source(arg: usize, script: &str) -> String {
    let check = CHECK_EXPIRY
        .replace("EXPIRY_MS", &format!("ARGV[{arg}]"))
        .replace("MAX_MS", &MAX_EXPIRY_MS.to_string());
    format!("{check}{script}")
}

/// The longest expiry sent to Redis, in milliseconds: the longest TTL or lease.
const MAX_EXPIRY_MS: u64 = {
    let max = if limits::MAX_TTL.as_millis() > limits::MAX_LEASE.as_millis() {
        limits::MAX_TTL
    } else {
        limits::MAX_LEASE
    };
    max.as_secs() * 1000 + max.subsec_millis() as u64
};

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
    renew: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        claim: checked(2, CLAIM),
        complete: checked(3, COMPLETE),
        release: Script::new(RELEASE),
        renew: checked(2, RENEW),
    })
}

/// The default connection and response timeout of a [`RedisStore`]: 2 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Configures a [`RedisStore`]. Created by [`RedisStore::builder`].
#[derive(Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    replicas: usize,
}

impl fmt::Debug for RedisStoreBuilder {
    /// Leaves the URL out: it may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// The prefix of every Redis key the store writes (default [`DEFAULT_KEY_PREFIX`]), to
    /// separate applications sharing one Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Makes every claim and every completion wait until at least `replicas` replicas of the
    /// record's primary have acknowledged it (`WAIT`), for at most half the
    /// [`timeout`](Self::timeout); default 0, none.
    ///
    /// An acknowledged claim or record survives its primary's death: the replica promoted in
    /// its place has it, so no request answered before a failover runs again after it. The
    /// cost is a second round trip per claim and per completion, and the replicas' own delay
    /// (see BENCHMARKS.md). Fails closed: when fewer replicas acknowledge in time, a claim is
    /// given back (released) and fails with [`StoreError::Unavailable`] (HTTP 503; nothing
    /// ran), and a completion fails with [`StoreError::Unavailable`]: the result is on the
    /// primary, not yet safe, and the runtime retries the write while it keeps the claim; a
    /// completion repeated with the token of the record it completed only waits for the
    /// replicas again (this is the one place this store departs from the contract's "a
    /// completed record is never completed again": it writes nothing). With more replicas
    /// required than exist, every claim fails.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// How long connecting, and each operation, may take before it fails with
    /// [`StoreError::Unavailable`] (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects: to one server, or, when the URL is several comma-separated URLs, to the
    /// Redis Cluster they are nodes of. Fails with [`StoreError::Backend`] for a malformed URL
    /// and [`StoreError::Unavailable`] when no server can be reached.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let malformed = |e: RedisError| StoreError::Backend(Box::new(e));
        let nodes: Vec<&str> = self.url.split(',').map(str::trim).collect();
        let connection = if nodes.len() > 1 {
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(self.timeout)
                .response_timeout(self.timeout)
                .build()
                .map_err(malformed)?;
            Connection::Cluster(client.get_async_connection().await.map_err(store_error)?)
        } else {
            let client = redis::Client::open(self.url.as_str()).map_err(malformed)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.timeout))
                .set_response_timeout(Some(self.timeout))
                .set_number_of_retries(1);
            Connection::Node(
                ConnectionManager::new_with_config(client, config)
                    .await
                    .map_err(store_error)?,
            )
        };
        Ok(RedisStore {
            connection,
            prefix: self.prefix.into(),
            replicas: (self.replicas > 0).then_some((self.replicas, self.timeout / 2)),
        })
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://HOST:PORT[/DB]`, or a Redis Cluster's nodes as
    /// `redis://HOST1:PORT1,redis://HOST2:PORT2,…`) with the default key prefix and timeouts:
    /// `RedisStore::builder(url).connect()`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    /// Configures a store on `url`: `redis://HOST:PORT[/DB]` for one server, or several such
    /// URLs separated by commas for a Redis Cluster (any of its nodes; the client learns the
    /// rest from them). Records are one key each, so any cluster serves them.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), idempotent_core::StoreError> {
    /// use idempotent_core::redis::RedisStore;
    /// use std::time::Duration;
    ///
    /// let store = RedisStore::builder("redis://127.0.0.1:6379")
    ///     .key_prefix("billing:")
    ///     .timeout(Duration::from_millis(500))
    ///     .connect()
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: DEFAULT_KEY_PREFIX.into(),
            timeout: DEFAULT_TIMEOUT,
            replicas: 0,
        }
    }

    /// The claim and completion scripts, exactly as the store sends them: the claim takes
    /// the record's key, `ARGV[1]` fingerprint and `ARGV[2]` lease in milliseconds; the
    /// completion the key, `ARGV[1]` token, `ARGV[2]` payload and `ARGV[3]` TTL in
    /// milliseconds. For measuring what Redis itself does with them (the benchmark's
    /// `redis-benchmark` rows); not a stable API.
    #[doc(hidden)]
    pub fn claim_and_complete_scripts() -> [String; 2] {
        [checked_source(2, CLAIM), checked_source(3, COMPLETE)]
    }

    /// The Redis key of a record.
    pub fn redis_key(&self, key: &StorageKey) -> String {
        let mut out = String::with_capacity(self.prefix.len() + 64);
        out.push_str(&self.prefix);
        out.push_str(&key.to_hex());
        out
    }
}

fn store_error(error: RedisError) -> StoreError {
    let message = error.to_string();
    if error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || matches!(
            error.kind(),
            ErrorKind::Io
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::ReadOnly
                )
        )
    {
        StoreError::Unavailable(Box::new(error))
    } else if message.contains("OOM") {
        StoreError::Capacity {
            what: "redis maxmemory",
        }
    } else {
        StoreError::Backend(Box::new(error))
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("unexpected record data from redis: {what}").into())
}

fn fingerprint(value: &Value) -> Result<Fingerprint, StoreError> {
    match value {
        Value::BulkString(bytes) => <[u8; 32]>::try_from(bytes.as_slice())
            .map(Fingerprint::from_digest)
            .map_err(|_| corrupt("fingerprint is not 32 bytes")),
        _ => Err(corrupt("missing fingerprint")),
    }
}

fn text(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// An expiry as Redis takes it: whole milliseconds, at least 1 (`PEXPIRE 0` deletes the key).
/// The caller clamps it to the ceiling first.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).map_or(MAX_EXPIRY_MS, |ms| ms.clamp(1, MAX_EXPIRY_MS))
}

impl RedisStore {
    /// `script` on `key` as one `EVALSHA` command, its arguments still to be added: built
    /// directly rather than through `Script::key(..).arg(..)`, which copies every argument
    /// (the payload included) once more and allocates for each.
    fn evalsha(&self, script: &Script, key: &StorageKey) -> Cmd {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut redis_key = Vec::with_capacity(self.prefix.len() + 64);
        redis_key.extend_from_slice(self.prefix.as_bytes());
        for byte in key.as_bytes() {
            redis_key.push(HEX[usize::from(byte >> 4)]);
            redis_key.push(HEX[usize::from(byte & 0x0f)]);
        }
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash()).arg(1).arg(redis_key.as_slice());
        cmd
    }

    /// Sends `cmd` (from [`evalsha`](Self::evalsha)); a server that does not have `script`
    /// yet (after a restart or `SCRIPT FLUSH`) gets it loaded, then the command again.
    async fn query<T: FromRedisValue>(&self, script: &Script, cmd: Cmd) -> Result<T, StoreError> {
        let mut connection = self.connection.clone();
        match cmd.query_async(&mut connection).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script
                    .load_async(&mut connection)
                    .await
                    .map_err(store_error)?;
                cmd.query_async(&mut connection).await
            }
            other => other,
        }
        .map_err(store_error)
    }

    /// With [`RedisStoreBuilder::replicas`], waits until that many replicas of `key`'s
    /// primary have acknowledged the writes sent before (`WAIT`, on the connection the write
    /// went over, so it covers it).
    async fn replicated(&self, key: &StorageKey) -> Result<(), StoreError> {
        let Some((replicas, wait)) = self.replicas else {
            return Ok(());
        };
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas)
            .arg(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1));
        let acknowledged: usize = match &self.connection {
            Connection::Node(connection) => cmd.query_async(&mut connection.clone()).await,
            Connection::Cluster(connection) => {
                let route = Route::with_key(self.redis_key(key), SlotAddr::Master);
                connection
                    .clone()
                    .route_command(
                        cmd,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await
                    .and_then(|value| Ok(usize::from_redis_value(value)?))
            }
        }
        // The write itself landed; whatever kept the replicas from confirming it (a timeout,
        // a node that just turned replica and refuses `WAIT`), it is not yet safe.
        .map_err(|error| StoreError::Unavailable(Box::new(error)))?;
        if acknowledged >= replicas {
            Ok(())
        } else {
            Err(StoreError::Unavailable(
                format!(
                    "the write was acknowledged by {acknowledged} of the {replicas} replicas \
                     required within {wait:?}"
                )
                .into(),
            ))
        }
    }

    /// Whether `key` holds a completed record written with `token`.
    async fn completed_with(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let (state, written_with): (Option<Vec<u8>>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.redis_key(key))
            .arg("s")
            .arg("t")
            .query_async(&mut self.connection.clone())
            .await
            .map_err(store_error)?;
        Ok(state.as_deref() == Some(b"c") && written_with == Some(token.get()))
    }

    /// Runs a token-guarded script; `1` means the caller held the claim.
    async fn run_flag(&self, script: &Script, cmd: Cmd) -> Result<(), StoreError> {
        let ok: i64 = self.query(script, cmd).await?;
        if ok == 1 {
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }
}

impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint_arg: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let script = &scripts().claim;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(fingerprint_arg.as_bytes().as_slice())
            .arg(millis(limits::clamp_lease(lease)));
        let mut reply: Vec<Value> = self.query(script, cmd).await?;
        match reply.as_mut_slice() {
            [state, token] if text(state) == Some(b"claimed") => {
                let token = text(token)
                    .and_then(|t| std::str::from_utf8(t).ok())
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| corrupt("token"))?;
                let token = FencingToken::new(token);
                if let Err(error) = self.replicated(key).await {
                    // Nothing runs on a claim that could be lost: give it back so a retry
                    // need not wait for its lease.
                    let _ = self.release(key, token).await;
                    return Err(error);
                }
                Ok(Claim::Claimed(token))
            }
            [state, f, ttl] if text(state) == Some(b"i") => {
                let ttl = match ttl {
                    Value::Int(ms) => u64::try_from(*ms).unwrap_or(0),
                    _ => return Err(corrupt("lease")),
                };
                Ok(Claim::InFlight {
                    fingerprint: fingerprint(f)?,
                    retry_after: Duration::from_millis(ttl),
                })
            }
            [state, f, payload] if text(state) == Some(b"c") => match payload {
                // Taken, not copied: the reply is dropped right after.
                Value::BulkString(p) => Ok(Claim::Completed {
                    fingerprint: fingerprint(f)?,
                    payload: Bytes::from(std::mem::take(p)),
                }),
                _ => Err(corrupt("completed record without a payload")),
            },
            [state, _] if text(state) == Some(b"?") => Err(corrupt("unknown record state")),
            _ => Err(corrupt("unexpected claim reply")),
        }
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let script = &scripts().complete;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get())
            .arg(payload.as_ref())
            .arg(millis(limits::clamp_ttl(ttl)));
        match self.run_flag(script, cmd).await {
            // With replicas required, a completion that landed but was not acknowledged in
            // time is retried by the runtime: repeated with the token of the record it
            // completed, it only waits for the replicas again.
            Err(StoreError::TokenRejected)
                if self.replicas.is_some() && self.completed_with(key, token).await? => {}
            other => other?,
        }
        self.replicated(key).await
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let script = &scripts().release;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get());
        self.run_flag(script, cmd).await
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let script = &scripts().renew;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get()).arg(millis(limits::clamp_lease(lease)));
        self.run_flag(script, cmd).await
    }
}

#[cfg(all(test, feature = "test-util"))]
mod tests {
    use super::*;
    use crate::conformance::{backend_url, fresh_key};

    #[test]
    fn expiries_are_whole_milliseconds_up_to_the_ceiling() {
        assert_eq!(MAX_EXPIRY_MS, 365 * 24 * 3600 * 1000);
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(1500)), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
        assert_eq!(millis(Duration::MAX), MAX_EXPIRY_MS);
    }

    /// An expiry a script cannot use is refused before the script writes anything: no claim
    /// without an expiry, no completed record with the lease's expiry, no lease changed.
    #[tokio::test]
    async fn scripts_check_the_expiry_before_they_write() {
        let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
            return;
        };
        let store = RedisStore::connect(&url).await.unwrap();
        let mut connection = store.connection.clone();
        let too_long = (MAX_EXPIRY_MS + 1).to_string();
        for bad in ["0", "-5", "1.5", "soon", "18446744073709551615", &too_long] {
            let key = fresh_key();
            let redis_key = store.redis_key(&key);

            let claimed: Result<Vec<Value>, _> = scripts()
                .claim
                .key(&redis_key)
                .arg(Fingerprint::empty().as_bytes().as_slice())
                .arg(bad)
                .invoke_async(&mut connection)
                .await;
            assert!(claimed.is_err(), "claim with {bad}: {claimed:?}");
            let exists: i64 = redis::cmd("EXISTS")
                .arg(&redis_key)
                .query_async(&mut connection)
                .await
                .unwrap();
            assert_eq!(exists, 0, "claim with {bad} wrote a record");

            let Ok(Claim::Claimed(token)) = store
                .claim(&key, &Fingerprint::empty(), Duration::from_secs(5))
                .await
            else {
                panic!("a fresh key is claimed");
            };
            let token = token.get().to_string();
            let completed: Result<i64, _> = scripts()
                .complete
                .key(&redis_key)
                .arg(&token)
                .arg(b"result".as_slice())
                .arg(bad)
                .invoke_async(&mut connection)
                .await;
            assert!(completed.is_err(), "complete with {bad}: {completed:?}");
            let renewed: Result<i64, _> = scripts()
                .renew
                .key(&redis_key)
                .arg(&token)
                .arg(bad)
                .invoke_async(&mut connection)
                .await;
            assert!(renewed.is_err(), "renew with {bad}: {renewed:?}");

            let state: Option<String> = redis::cmd("HGET")
                .arg(&redis_key)
                .arg("s")
                .query_async(&mut connection)
                .await
                .unwrap();
            assert_eq!(
                state.as_deref(),
                Some("i"),
                "{bad}: the claim stays in flight"
            );
            let pttl: i64 = redis::cmd("PTTL")
                .arg(&redis_key)
                .query_async(&mut connection)
                .await
                .unwrap();
            assert!(
                (1..=5_000).contains(&pttl),
                "{bad}: the lease stays: {pttl}"
            );
        }
    }
}
