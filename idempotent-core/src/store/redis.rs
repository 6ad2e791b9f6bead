//! The Redis store: one shared record per key for many app instances.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, Script, ServerErrorKind,
    Value,
};

use super::Unanswered;
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
/// (the fencing token), `o` (the token that began the record's lifetime) and, in flight, `l`
/// (when the lease ends, in the server's milliseconds) and `n` (the claimant number that
/// gives back a claim whose caller stopped waiting) or, once completed, `p` (the payload).
/// The key's Redis expiry is the TTL (at least the lease) while in flight and the TTL once
/// completed, so Redis deletes records itself: a claim whose lease ended, or which was
/// released, stays until the TTL it was claimed with, for the next owner of the same request
/// to continue its lifetime. Expiries are whole milliseconds, at least one;
/// a lease above [`limits::MAX_LEASE`] or a TTL above [`limits::MAX_TTL`] is recorded as that
/// ceiling, and each script checks its expiry before it writes, so no record is ever left
/// without one. Times are the server's: leases and expiry run on its
/// clock, and tokens are derived from `TIME` (microseconds since the epoch), so they increase
/// per key across deletions as long as the server's clock does not go backwards (a claim that
/// finds a kept record takes a token above the record's even then).
///
/// A claim whose reply does not come back (the server is frozen, the response timeout
/// passed) may still be made when the server runs again; the store then gives it back in the
/// background (ends its lease) as soon as the server answers, so the retry of the caller that
/// was told "unavailable" does not wait for a lease.
///
/// # Deployment
///
/// - **Redis 7.0 or later**: the renewal, release and give-back scripts are flagged to run
///   when Redis is out of memory, which earlier versions refuse.
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
///   the replicas' delay on every claim and completion). Without it, or where a replica may
///   be promoted that did not acknowledge, use the PostgreSQL store with synchronous
///   replication.
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

// The server's time in milliseconds, as `ms`.
const NOW_MS: &str = r"
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
";

// `ARGV[1]` fingerprint, `ARGV[2]` lease and `ARGV[3]` TTL in milliseconds, `ARGV[4]` the
// claimant. A record in flight whose lease (`l`, server milliseconds) ended is kept until the
// TTL it was claimed with: the same request takes it over and keeps its lifetime (`o`).
const CLAIM: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'p')
if rec[1] == 'c' then return {'c', rec[2], rec[3]} end
if rec[1] and rec[1] ~= 'i' then return {'?', rec[1]} end
if rec[1] then
  local more = redis.call('HMGET', KEYS[1], 'l', 'o', 't', 'n')
  rec[4], rec[5], rec[6], rec[7] = more[1], more[2], more[3], more[4]
end
";

// The rest of the claim, once the server's time is read (a replay above does not need it).
const CLAIM_IN_TIME: &str = r"
if rec[1] == 'i' then
  local left
  if rec[4] then left = tonumber(rec[4]) - ms else left = redis.call('PTTL', KEYS[1]) end
  if left > 0 then
    -- The same claim sent again (the client resent it after a dropped connection): its own.
    if rec[7] == ARGV[4] then return {'claimed', rec[6], rec[5] or rec[6]} end
    return {'i', rec[2], left}
  end
end
-- From the server's clock, and above the record's last token even if the clock stepped back.
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
if rec[6] and tonumber(rec[6]) and tonumber(rec[6]) >= micros then micros = tonumber(rec[6]) + 1 end
local token = string.format('%.0f', micros)
local lifetime = token
if rec[1] == 'i' and rec[2] == ARGV[1] and rec[5] then lifetime = rec[5] end
redis.call('HSET', KEYS[1], 's', 'i', 'f', ARGV[1], 't', token, 'o', lifetime,
  'l', string.format('%.0f', ms + tonumber(ARGV[2])), 'n', ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]), tonumber(ARGV[3])))
return {'claimed', token, lifetime}
";

// Whether the record is in flight with token `ARGV[1]` and a lease that has not ended, as
// `owned`.
const OWNED: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'l')
local owned = rec[1] == 'i' and rec[2] == ARGV[1] and (not rec[3] or tonumber(rec[3]) > ms)
";

// A completion repeated by the owner whose completion landed (its reply was lost, or it
// retries with the 'not retained' record) finds its own token on the completed record and
// succeeds, changing nothing; with `ARGV[4]` set (replicas required) it writes the token
// again for `WAIT` to cover.
const COMPLETE: &str = r"
if owned then
  redis.call('HSET', KEYS[1], 's', 'c', 'p', ARGV[2])
  redis.call('HDEL', KEYS[1], 'l', 'n')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if rec[1] == 'c' and rec[2] == ARGV[1] then
  if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 't', ARGV[1]) end
  return 1
end
return 0
";

// Ends the lease; the record is kept for the next claim of the same request to take over.
const RELEASE: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 'l', '0')
return 1
";

// Whether the record is still claimed with token `ARGV[1]`; if so, writes the token again
// (changing nothing), a write for `WAIT` to cover that reaches the replicas after the claim.
const CONFIRM: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[1])
return 1
";

const RENEW: &str = r"
if not owned then return 0 end
redis.call('HSET', KEYS[1], 'l', string.format('%.0f', ms + tonumber(ARGV[2])))
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
";

// Whether the record is completed with token `ARGV[1]` (the owner's completion landed and its
// retry was refused for want of memory); with `ARGV[2]` set (replicas required), writes the
// token again for `WAIT` to cover.
const COMPLETED: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'c' or rec[2] ~= ARGV[1] then return 0 end
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 't', ARGV[1]) end
return 1
";

// Ends the lease of the claim made by claimant `ARGV[1]` after its caller stopped waiting
// for the reply (see `Unanswered`).
const GIVE_BACK: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'n', 'l')
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] or not rec[3] or tonumber(rec[3]) <= ms then
  return 0
end
redis.call('HSET', KEYS[1], 'l', '0')
return 1
";

/// `parts` (with [`NOW_MS`] before the first part that reads the server's time), with the
/// expiries in `expiries` (argument numbers) checked before anything.
fn checked(expiries: &[usize], parts: &[&str]) -> Script {
    Script::new(&checked_source(expiries, parts))
}

/// Like [`checked`], for a script that must run when Redis is out of memory (`maxmemory`
/// reached, policy `noeviction`): it only rewrites a field in place (a lease's end, its
/// token) or ends a lease, so a running claim keeps its lease, can be given up, and
/// recognises its own completed record while the store refuses new data. Redis 7 runs
/// flagged scripts only; earlier versions refuse them.
fn checked_in_oom(expiries: &[usize], parts: &[&str]) -> Script {
    Script::new(&format!(
        "#!lua flags=allow-oom\n{}",
        checked_source(expiries, parts)
    ))
}

/// Where in a script's parts its expiry checks go, when not first: after parts that only
/// read (a replay returns before it, and pays for no check).
const EXPIRY_CHECKS: &str = "--[[ the expiry checks ]]";

/// The source of [`checked`]'s script.
fn checked_source(expiries: &[usize], parts: &[&str]) -> String {
    let checks: String = expiries
        .iter()
        .map(|arg| {
            CHECK_EXPIRY
                .replace("EXPIRY_MS", &format!("ARGV[{arg}]"))
                .replace("MAX_MS", &MAX_EXPIRY_MS.to_string())
        })
        .collect();
    let placed = parts.contains(&EXPIRY_CHECKS);
    let mut source = if placed {
        String::new()
    } else {
        checks.clone()
    };
    for part in parts {
        if *part == EXPIRY_CHECKS {
            source.push_str(&checks);
        } else {
            source.push_str(part);
        }
    }
    source
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
    confirm: Script,
    give_back: Script,
    completed: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        claim: checked(&[2, 3], &[CLAIM, EXPIRY_CHECKS, NOW_MS, CLAIM_IN_TIME]),
        complete: checked(&[3], &[NOW_MS, OWNED, COMPLETE]),
        release: checked_in_oom(&[], &[NOW_MS, OWNED, RELEASE]),
        renew: checked_in_oom(&[2], &[NOW_MS, OWNED, RENEW]),
        confirm: checked(&[], &[NOW_MS, OWNED, CONFIRM]),
        give_back: checked_in_oom(&[], &[NOW_MS, GIVE_BACK]),
        completed: checked_in_oom(&[], &[COMPLETED]),
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
    /// cost is a second round trip per claim (a confirmation with its `WAIT`), a completion
    /// that waits with its `WAIT`, and the replicas' own delay, which every operation
    /// pipelined behind a `WAIT` on the same connection shares (see BENCHMARKS.md). Fails
    /// closed: when fewer replicas acknowledge in time, a claim is given back (released) and
    /// fails with [`StoreError::Unavailable`] (HTTP 503; nothing ran), and a completion fails with [`StoreError::Unavailable`]: the result is on the
    /// primary, not yet safe, and the runtime retries the write while it keeps the claim; a
    /// completion repeated with the token and the payload of the record it completed only
    /// waits for the replicas again (it changes nothing; any other completion of a completed
    /// record is refused, as the contract says). With more replicas required than exist,
    /// every claim fails.
    ///
    /// Each `WAIT` travels in one pipeline with the write it confirms, so it counts the
    /// replicas of the node that made that write and no other: a claim whose primary died
    /// before a replica had it is not confirmed by another node, and fails.
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
    /// the record's key, `ARGV[1]` fingerprint, `ARGV[2]` lease and `ARGV[3]` TTL in
    /// milliseconds and `ARGV[4]` a claimant number; the completion the key, `ARGV[1]` token,
    /// `ARGV[2]` payload and `ARGV[3]` TTL in milliseconds. For measuring what Redis itself
    /// does with them (the benchmark's `redis-benchmark` rows); not a stable API.
    #[doc(hidden)]
    pub fn claim_and_complete_scripts() -> [String; 2] {
        [
            checked_source(&[2, 3], &[CLAIM, EXPIRY_CHECKS, NOW_MS, CLAIM_IN_TIME]),
            checked_source(&[3], &[NOW_MS, OWNED, COMPLETE]),
        ]
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

/// Fails closed unless `acknowledged` replicas are at least the `required` ones.
fn enough(acknowledged: usize, (replicas, wait): (usize, Duration)) -> Result<(), StoreError> {
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

    /// Sends `cmd` (from [`evalsha`](Self::evalsha)) with `WAIT` for `replicas` replicas right
    /// behind it, in one pipeline, and returns the script's reply and how many replicas
    /// acknowledged. One pipeline goes to one node over one connection, so the `WAIT` covers
    /// exactly the writes of the script before it, on the node that ran it. (A `WAIT` sent on
    /// its own could land elsewhere: after a reconnect on a connection that wrote nothing, or,
    /// on a cluster whose primary just died, on another node, which answers at once.) A
    /// redirected or retried pipeline is sent again whole.
    async fn query_then_wait<T: FromRedisValue>(
        &self,
        script: &Script,
        cmd: Cmd,
        (replicas, wait): (usize, Duration),
    ) -> Result<(T, usize), StoreError> {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd)
            .cmd("WAIT")
            .arg(replicas)
            .arg(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1))
            .ignore_errors();
        let mut connection = self.connection.clone();
        let mut replies: Vec<redis::RedisResult<Value>> = pipe
            .query_async(&mut connection)
            .await
            .map_err(store_error)?;
        if matches!(replies.first(), Some(Err(error)) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
        {
            script
                .load_async(&mut connection)
                .await
                .map_err(store_error)?;
            replies = pipe
                .query_async(&mut connection)
                .await
                .map_err(store_error)?;
        }
        let mut replies = replies.into_iter();
        let (Some(reply), Some(acknowledged), None) =
            (replies.next(), replies.next(), replies.next())
        else {
            return Err(corrupt("unexpected reply to a script and WAIT"));
        };
        let reply = reply
            .and_then(|value| Ok(T::from_redis_value(value)?))
            .map_err(store_error)?;
        // The script's write landed; whatever kept the replicas from confirming it (a node
        // that just turned replica and refuses `WAIT`, say), it is not yet safe.
        let acknowledged = acknowledged
            .and_then(|value| Ok(usize::from_redis_value(value)?))
            .map_err(|error| StoreError::Unavailable(Box::new(error)))?;
        Ok((reply, acknowledged))
    }

    /// With [`RedisStoreBuilder::replicas`], whether `key` is still claimed with `token` on
    /// its primary, which then writes the token again, a write that reaches the replicas after
    /// the claim; and whether enough replicas acknowledged it. `Ok(false)` when the claim is
    /// not there.
    async fn confirm_claim(
        &self,
        key: &StorageKey,
        token: FencingToken,
        required: (usize, Duration),
    ) -> Result<bool, StoreError> {
        let script = &scripts().confirm;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get());
        let (held, acknowledged): (i64, usize) =
            self.query_then_wait(script, cmd, required).await?;
        if held != 1 {
            return Ok(false);
        }
        enough(acknowledged, required)?;
        Ok(true)
    }

    /// A completion Redis refused for want of memory: succeeds if this owner's earlier
    /// completion landed (its record is completed with `token`, waited for by `required`
    /// replicas again), and is refused as full (`what`) otherwise.
    async fn completed_already(
        &self,
        key: &StorageKey,
        token: FencingToken,
        required: Option<(usize, Duration)>,
        what: &'static str,
    ) -> Result<(), StoreError> {
        let script = &scripts().completed;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get()).arg(u8::from(required.is_some()));
        let done = match required {
            None => self.query::<i64>(script, cmd).await? == 1,
            Some(required) => {
                let (done, acknowledged): (i64, usize) =
                    self.query_then_wait(script, cmd, required).await?;
                if done == 1 {
                    enough(acknowledged, required)?;
                }
                done == 1
            }
        };
        if done {
            Ok(())
        } else {
            Err(StoreError::Capacity { what })
        }
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
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let script = &scripts().claim;
        let claimant = super::claimant();
        let mut cmd = self.evalsha(script, key);
        cmd.arg(fingerprint_arg.as_bytes().as_slice())
            .arg(millis(limits::clamp_lease(lease)))
            .arg(millis(limits::clamp_ttl(ttl)))
            .arg(claimant);
        let mut unanswered = Unanswered::new({
            let (store, key) = (self.clone(), *key);
            Box::new(move || {
                let store = store.clone();
                Box::pin(async move {
                    let script = &scripts().give_back;
                    let mut cmd = store.evalsha(script, &key);
                    cmd.arg(claimant);
                    let given: i64 = store.query(script, cmd).await?;
                    Ok(given == 1)
                })
            })
        });
        let reply = self.query(script, cmd).await;
        // An error from the server is an answer; a timeout or a broken connection may not
        // be: the claim may be made when the server runs again. A claim made is answered only
        // once it is confirmed (or given up) below: dropped while it waits for the replicas,
        // it is given back too.
        let mut reply: Vec<Value> = match reply {
            Err(error @ StoreError::Unavailable(_)) => return Err(error),
            other => other?,
        };
        if !matches!(reply.first().and_then(text), Some(b"claimed")) {
            unanswered.answered();
        }
        match reply.as_mut_slice() {
            [state, token, lifetime] if text(state) == Some(b"claimed") => {
                let number = |value: &Value| {
                    text(value)
                        .and_then(|t| std::str::from_utf8(t).ok())
                        .and_then(|t| t.parse().ok())
                        .map(FencingToken::new)
                        .ok_or_else(|| corrupt("token"))
                };
                let numbers = number(token).and_then(|token| Ok((token, number(lifetime)?)));
                let (token, lifetime) = match numbers {
                    Ok(numbers) => numbers,
                    Err(error) => {
                        unanswered.answered();
                        return Err(error);
                    }
                };
                if let Some(required) = self.replicas {
                    // Nothing runs on a claim that could be lost: one the key's primary no
                    // longer holds (it died before replicating it) fails, and one too few
                    // replicas acknowledged is given back so a retry need not wait for its
                    // lease.
                    let confirmed = self.confirm_claim(key, token, required).await;
                    unanswered.answered();
                    match confirmed {
                        Ok(true) => {}
                        Ok(false) => {
                            return Err(StoreError::Unavailable(
                                "the claim was lost with its primary before a replica had it"
                                    .into(),
                            ));
                        }
                        Err(error) => {
                            let _ = self.release(key, token).await;
                            return Err(error);
                        }
                    }
                } else {
                    unanswered.answered();
                }
                Ok(if lifetime == token {
                    Claim::Claimed(token)
                } else {
                    Claim::TakenOver { token, lifetime }
                })
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
        let Some(required) = self.replicas else {
            return match self.run_flag(script, cmd).await {
                Err(StoreError::Capacity { what }) => {
                    self.completed_already(key, token, None, what).await
                }
                other => other,
            };
        };
        // A completion that landed but was not acknowledged in time is retried by the
        // runtime: repeated, it only waits for the replicas again.
        cmd.arg(1);
        let (written, acknowledged): (i64, usize) =
            match self.query_then_wait(script, cmd, required).await {
                Err(StoreError::Capacity { what }) => {
                    return self
                        .completed_already(key, token, Some(required), what)
                        .await;
                }
                other => other?,
            };
        if written != 1 {
            return Err(StoreError::TokenRejected);
        }
        enough(acknowledged, required)
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
    // A claim the client sent twice (it resends a command after a dropped connection) found
    // its own first copy in flight and answered "in flight": its caller waited out a lease
    // that was its own.
    #[tokio::test]
    async fn a_claim_sent_twice_is_its_own() {
        let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
            return;
        };
        let store = RedisStore::connect(&url).await.unwrap();
        let mut connection = store.connection.clone();
        let redis_key = store.redis_key(&fresh_key());
        let mut claim = async |claimant: &str| -> Vec<Value> {
            scripts()
                .claim
                .key(&redis_key)
                .arg(Fingerprint::empty().as_bytes().as_slice())
                .arg(30_000)
                .arg(60_000)
                .arg(claimant)
                .invoke_async(&mut connection)
                .await
                .unwrap()
        };
        let first = claim("41").await;
        let again = claim("41").await;
        assert_eq!(text(&first[0]), Some(&b"claimed"[..]));
        assert_eq!(first, again, "the same claim, answered again");
        let other = claim("42").await;
        assert_eq!(text(&other[0]), Some(&b"i"[..]), "another claimant waits");
    }

    // Tokens came from the server's clock alone: after the clock stepped back, a takeover of
    // a kept record could get a token below the record's own.
    #[tokio::test]
    async fn a_takeover_token_is_above_the_kept_record_even_if_the_clock_stepped_back() {
        let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
            return;
        };
        let store = RedisStore::connect(&url).await.unwrap();
        let mut connection = store.connection.clone();
        let key = fresh_key();
        let f = Fingerprint::empty();
        let lease = Duration::from_millis(50);
        store
            .claim(&key, &f, lease, Duration::from_secs(60))
            .await
            .unwrap();
        // A token from a clock far ahead of the server's current one.
        let ahead: u64 = 9_000_000_000_000_000;
        let _: () = redis::cmd("HSET")
            .arg(store.redis_key(&key))
            .arg("t")
            .arg(ahead)
            .query_async(&mut connection)
            .await
            .unwrap();
        tokio::time::sleep(lease * 2).await;
        match store.claim(&key, &f, lease, Duration::from_secs(60)).await {
            Ok(Claim::TakenOver { token, .. }) => assert!(token.get() > ahead, "{token:?}"),
            other => panic!("a takeover: {other:?}"),
        }
    }

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
                .arg(1000)
                .arg(1)
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
                .claim(
                    &key,
                    &Fingerprint::empty(),
                    Duration::from_secs(5),
                    Duration::from_secs(5),
                )
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
