//! A Redis store for the `idempotent` family: one shared record per key for many app
//! instances, on one Redis server or a Redis Cluster, optionally acknowledged by replicas; and
//! (feature `cache`) a Redis cache tier in front of a slower store.
//!
//! ```no_run
//! use idempotent_core::Idempotency;
//! use idempotent_redis::RedisStore;
//!
//! # async fn example() -> Result<(), idempotent_core::StoreError> {
//! // Several URLs, comma-separated, are a Redis Cluster's nodes.
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let idempotency = Idempotency::builder(store).namespace("billing").build();
//! # let _ = idempotency;
//! # Ok(())
//! # }
//! ```
//!
//! Where to read on: [`RedisStore`] (one Lua script per operation, the Cluster, replicas,
//! what a Redis that is down, full or slow does), [`RedisStoreBuilder`] (every setting), and
//! with `cache`, `RedisCacheBuilder` (a tier every instance shares). The store keeps client
//! sessions, checkpoints and kept requests, and passes the whole conformance suite of
//! `idempotent_core::conformance`. It is built on `idempotent_core::store`, the contract any
//! store uses, and nothing else of core.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod builder;
mod inspect;
mod scripts;
#[cfg(feature = "cache")]
mod tier;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, Script, ServerErrorKind,
    Value,
};

use self::builder::Node;
pub use self::builder::{DEFAULT_TIMEOUT, RedisStoreBuilder};
use self::scripts::{MAX_EXPIRY_MS, scripts};
#[cfg(feature = "cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "cache")))]
pub use self::tier::{DEFAULT_CACHE_PREFIX, DEFAULT_CACHE_TIMEOUT, RedisCacheBuilder};
use idempotent_core::session::{MAX_SEQ, MAX_SESSION_WINDOW};
use idempotent_core::steps::Abandoned;
use idempotent_core::store::Unanswered;
use idempotent_core::{
    CheckpointStore, Claim, FencingToken, Fingerprint, SessionClaim, SessionGate, SessionKey,
    SessionPlace, SessionRequest, SessionStore, StorageKey, Store, StoreError, limits,
};

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
/// slot; a session's records are named as [Sessions](#sessions) says): field `s` (state: `i` in
/// flight, `c` completed), `f` (the 32-byte fingerprint), `t` (the fencing token), `o` (the
/// token that began the record's lifetime) and, in flight, `l` (when the lease ends, in the
/// server's milliseconds; the release time once released) and `n` (the claimant number that
/// gives back a claim whose caller stopped waiting), `k` (the [checkpoints](idempotent_core::steps): the
/// entries saved, one after another) and `r` (the request a completer may run again), or, once
/// completed, `p` (the payload). The key's Redis expiry is the TTL
/// (at least the lease) while in flight and the TTL once completed, so Redis deletes records
/// itself: a claim whose lease ended, or which was released, stays until the TTL it was claimed
/// with, for the next owner of the same request to continue its lifetime. Expiries are whole
/// milliseconds, at least one; a lease above [`limits::MAX_LEASE`] or a TTL above
/// [`limits::MAX_TTL`] is recorded as that ceiling, and each script checks its expiry before it
/// writes, so no record is ever left without one. Times are the server's: leases and expiry run
/// on its clock, and tokens are derived from `TIME` (microseconds since the epoch), so they
/// increase per key across deletions as long as the server's clock does not go backwards (a
/// claim that finds a kept record takes a token above the record's even then).
///
/// Checkpoints and the request belong to the record's lifetime: a takeover keeps them, a claim
/// that begins a new lifetime and a completion drop them (in the same script). Records that
/// hold a request are also members of one sorted set, the *index of saved requests* at
/// `PREFIX + "abandoned"` (member: the record's name without the prefix; score: at most the
/// end of its lease, in the server's milliseconds), so that [`CheckpointStore::abandoned`] reads the
/// records whose lease ended long enough ago rather than scanning every key. On a Redis
/// Cluster the index is a key of its own, in its own slot: no record's script touches it.
/// Saving a request adds the record to it first (scored with the server's time, then with its
/// lease's end by the first [`CheckpointStore::abandoned`] that reads it), so that no request is kept
/// that no member points to; a release moves its score to the release;
/// [`CheckpointStore::abandoned`] reads a bounded number of the lowest scores, checks each record, moves
/// the score of one renewed or taken over since to its lease's end, and removes members whose
/// record expired, completed or holds no request; a completion removes its record's member.
/// Those follow the record's own script rather than share it, so a member can be left behind
/// (the next [`CheckpointStore::abandoned`] that reads it removes it) or keep a score below its lease's
/// end (the record is then read early and scored again); a request whose index write failed is
/// reported as not saved, and not written. A record that cannot be read (garbage) is skipped
/// by [`CheckpointStore::abandoned`] and left as it is; the others are still listed.
///
/// A request that names an owner ([`RequestOwner`](idempotent_core::RequestOwner): a runtime sharing the
/// store) is indexed in that owner's own sorted set, `PREFIX + "abandoned:" + hex(owner)`, and
/// the record keeps the owner's digits in field `w`, so that a completer reads its own
/// runtime's operations only, however many another runtime left; `PREFIX + "abandoned"` holds
/// the requests that name none (and those kept before owners had indexes, which an owner's
/// listing reads after its own).
///
/// A claim whose reply does not come back (the server is frozen, the response timeout
/// passed) may still be made when the server runs again; the store then gives it back in the
/// background (ends its lease) as soon as the server answers, so the retry of the caller that
/// was told "unavailable" does not wait for a lease.
///
/// # Sessions
///
/// The records of a [client session](idempotent_core::session) share one Redis Cluster hash tag, the
/// session's digest, so they sit in one slot and its gate ([`SessionStore::open_session`]) is one
/// script on one primary, as every other operation is. The session's own record is a hash at
/// `PREFIX + "{" + hex(session) + "}"`: field `e` (its epoch), `a` (the acknowledged mark) and
/// `h` (the highest number admitted), decimal; each request's record is an ordinary record (as
/// above) at that name plus `":<epoch>:<seq>"`. The gate's script raises the mark, deletes the
/// request records it covers and extends the expiry of those above it to at least the session's
/// idle time, all in one step; the session's own record expires the idle time after its last
/// request (refused ones included), so a session nobody sends to is forgotten with its records,
/// and one in use holds about its window of them however many requests it makes. A session's
/// epoch is the server's `TIME` in microseconds when it starts, as a claim's token: a session
/// started again after it expired gets a new one as long as the server's clock does not go
/// backwards. With [`RedisStoreBuilder::replicas`], the gate's writes count only once that many
/// replicas have them, as a claim's.
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
///   some of its nodes, comma-separated. Every record is one key, and a session's records share
///   one slot, so each operation is one script on one slot's primary; the client follows
///   `MOVED` and `ASK` redirections and learns the new primaries after a failover, so the app
///   rides a failover out without a restart (operations meanwhile fail with
///   [`StoreError::Unavailable`]: HTTP 503).
/// - **Replication and failover**: replication is asynchronous. A coordinated failover
///   (`CLUSTER FAILOVER`, a switchover) waits for the replica to catch up and loses nothing.
///   A primary that dies takes with it what it acknowledged and had not replicated yet: a claim
///   or record lost that way lets a duplicate arriving right after the failover run again.
///   [`RedisStoreBuilder::replicas`] closes that window: a claim or record (or checkpoint, or
///   saved request) counts only once that many replicas have it, so the replica promoted in a
///   dead primary's place has every claim and record the store reported (at the cost of a second round trip per claim and
///   the replicas' delay on every claim and completion). Without it, or where a replica may
///   be promoted that did not acknowledge, use the PostgreSQL store with synchronous
///   replication.
/// - **Outages**: operations fail with [`StoreError::Unavailable`] (fail closed: HTTP 503)
///   after the connection and response timeouts (default 2 s each); the connection manager
///   reconnects by itself when the server is back.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) connection: Connection,
    pub(crate) prefix: Arc<str>,
    /// Replicas that must acknowledge each claim, completion, checkpoint and saved request
    /// (`WAIT`), and how long to wait for them; none by default.
    pub(crate) replicas: Option<(usize, Duration)>,
}

/// One server, or a Redis Cluster. Both pipeline whatever is concurrent over their
/// connections and reconnect by themselves.
#[derive(Clone)]
pub(crate) enum Connection {
    /// Replaced by a new connection when a command on it times out (see [`Node`]).
    Node(Node),
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
    /// use idempotent_redis::RedisStore;
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
        scripts::claim_and_complete_sources()
    }

    /// The Redis key of a record: `PREFIX` and the key's 64 hex digits; for a record of a
    /// [client session](idempotent_core::session), the session's digits in braces (its hash tag, so
    /// one Cluster slot for all of its records), followed by `:<epoch>:<seq>` for a request's
    /// record (see [Sessions](RedisStore#sessions)).
    pub fn redis_key(&self, key: &StorageKey) -> String {
        let mut out = String::with_capacity(self.prefix.len() + 64 + 36);
        out.push_str(&self.prefix);
        push_name(&mut out, key);
        out
    }

    /// The Redis key of the index of saved requests (see [Data layout](RedisStore#data-layout)).
    fn index_key(&self) -> String {
        format!("{}abandoned", self.prefix)
    }

    /// The Redis key of the index of one owner's saved requests, from the owner's digits
    /// ([`owner_digits`]; empty: the index of requests that name no owner).
    fn owner_index_key(&self, digits: &str) -> String {
        if digits.is_empty() {
            self.index_key()
        } else {
            format!("{}abandoned:{digits}", self.prefix)
        }
    }
}

/// The hex digits of the owner `request` names ([`RequestOwner::of`](idempotent_core::RequestOwner::of)),
/// or an empty string when it names none.
fn owner_digits(owner: Option<&idempotent_core::RequestOwner>) -> String {
    owner.map_or_else(String::new, |owner| {
        owner
            .as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// A record's member of the index of saved requests: its Redis key without the prefix.
fn member(key: &StorageKey) -> String {
    let mut out = String::with_capacity(64 + 36);
    push_name(&mut out, key);
    out
}

/// The storage key of a member of the index of saved requests ([`member`]), or `None` when it
/// is not one.
fn key_of_member(member: &[u8]) -> Option<StorageKey> {
    fn digest(hex: &[u8]) -> Option<[u8; 32]> {
        let mut out = [0u8; 32];
        if hex.len() != 64 {
            return None;
        }
        for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
            let high = char::from(pair[0]).to_digit(16)?;
            let low = char::from(pair[1]).to_digit(16)?;
            *byte = u8::try_from(high * 16 + low).ok()?;
        }
        Some(out)
    }
    let number = |digits: &str| -> Option<u64> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    };
    let Some(rest) = member.strip_prefix(b"{") else {
        return digest(member).map(StorageKey::from_bytes);
    };
    let session = digest(rest.get(..64)?)?;
    let place = rest.get(64..)?.strip_prefix(b"}")?;
    if place.is_empty() {
        return Some(StorageKey::session(session));
    }
    let place = std::str::from_utf8(place.strip_prefix(b":")?).ok()?;
    let (epoch, seq) = place.split_once(':')?;
    Some(StorageKey::seq(session, number(epoch)?, number(seq)?))
}

/// Appends the name of `key`'s record without the prefix (see [`RedisStore::redis_key`]).
fn push_name(out: &mut String, key: &StorageKey) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let place = key.session_place();
    if place.is_some() {
        out.push('{');
    }
    for byte in key.as_bytes() {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    match place {
        None => {}
        Some(SessionPlace::Session) => out.push('}'),
        Some(SessionPlace::Seq { epoch, seq }) => {
            use std::fmt::Write as _;
            let _ = write!(out, "}}:{epoch}:{seq}");
        }
    }
}

pub(crate) fn store_error(error: RedisError) -> StoreError {
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

/// `script` on the Redis key `name` as one `EVALSHA` command, its arguments still to be added.
fn evalsha_on(script: &Script, name: &[u8]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(1).arg(name);
    cmd
}

/// A future of [`join_all`], and its output once it is ready.
type Joined<F> = (Pin<Box<F>>, Option<<F as Future>::Output>);

/// Awaits every future of `futures` at once, and their outputs in the same order.
async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<Joined<F>> = futures
        .into_iter()
        .map(|future| (Box::pin(future), None))
        .collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (future, output) in &mut pending {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => done = false,
                }
            }
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    pending
        .into_iter()
        .filter_map(|(_, output)| output)
        .collect()
}

/// A decimal number of a script's reply (a bulk string or an integer).
fn decimal(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => text(value)
            .filter(|t| !t.is_empty() && t.iter().all(u8::is_ascii_digit))
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse().ok()),
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
        evalsha_on(script, self.redis_key(key).as_bytes())
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
            // Redis refuses a timeout past `i64` milliseconds from now: an endless one waits
            // the longest an expiry may be (365 days), no limit in practice.
            .arg(millis(wait))
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

    /// Runs a token-guarded script that writes (a checkpoint, a request) and replies `0` when
    /// the caller does not hold the claim; with [`RedisStoreBuilder::replicas`], what it wrote
    /// counts only once that many replicas have it, as a completion.
    async fn fenced_write(&self, script: &Script, cmd: Cmd) -> Result<Value, StoreError> {
        let reply: Value = match self.replicas {
            None => self.query(script, cmd).await?,
            Some(required) => {
                let (reply, acknowledged): (Value, usize) =
                    self.query_then_wait(script, cmd, required).await?;
                if reply != Value::Int(0) {
                    enough(acknowledged, required)?;
                }
                reply
            }
        };
        if reply == Value::Int(0) {
            Err(StoreError::TokenRejected)
        } else {
            Ok(reply)
        }
    }

    /// Gives `key`'s member of the index of saved requests the score `score` (the end of
    /// the record's lease), adding it if it is not there; waited for by the replicas as a
    /// request saved.
    /// `owner` is the owner's digits ([`owner_digits`]) that choose the index.
    async fn index(&self, key: &StorageKey, owner: &str, score: u64) -> Result<(), StoreError> {
        self.index_waiting(key, owner, Some(score), self.replicas)
            .await
    }

    /// [`index`](Self::index), waiting for `replicas` (none: not waiting).
    async fn index_waiting(
        &self,
        key: &StorageKey,
        owner: &str,
        score: Option<u64>,
        replicas: Option<(usize, Duration)>,
    ) -> Result<(), StoreError> {
        let script = &scripts().index;
        let mut cmd = evalsha_on(script, self.owner_index_key(owner).as_bytes());
        match score {
            Some(score) => cmd.arg(score),
            None => cmd.arg(""),
        };
        cmd.arg(member(key));
        match replicas {
            None => self.query::<Value>(script, cmd).await.map(drop),
            Some(required) => {
                let (_, acknowledged): (Value, usize) =
                    self.query_then_wait(script, cmd, required).await?;
                enough(acknowledged, required)
            }
        }
    }

    /// Removes `key`'s member from the index of saved requests, after its record completed.
    /// Best effort: a member left behind is removed by the next [`CheckpointStore::abandoned`] that
    /// reads it.
    async fn forget(&self, key: &StorageKey) {
        let mut connection = self.connection.clone();
        // The owner's digits stay on the completed record (field `w`).
        let owner: Result<Option<String>, _> = redis::cmd("HGET")
            .arg(self.redis_key(key))
            .arg("w")
            .query_async(&mut connection)
            .await;
        let owner = owner.ok().flatten().unwrap_or_default();
        let _: Result<Value, _> = redis::cmd("ZREM")
            .arg(self.owner_index_key(&owner))
            .arg(member(key))
            .query_async(&mut connection)
            .await;
    }
}

impl RedisStore {
    /// A claim, or with `resume` a takeover only ([`CheckpointStore::resume`]): `None` when there was
    /// nothing of the request to take over.
    async fn claim_or_resume(
        &self,
        key: &StorageKey,
        fingerprint_arg: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        resume: bool,
        label: Option<&idempotent_core::inspect::KeyLabel>,
    ) -> Result<Option<Claim>, StoreError> {
        let script = &scripts().claim;
        let claimant = idempotent_core::store::claimant();
        let mut cmd = self.evalsha(script, key);
        cmd.arg(fingerprint_arg.as_bytes().as_slice())
            .arg(millis(limits::clamp_lease(lease)))
            .arg(millis(limits::clamp_ttl(ttl)))
            .arg(claimant);
        cmd.arg(if resume { "1" } else { "0" });
        match label {
            Some(label) => cmd.arg(label.as_bytes().as_ref()),
            None => cmd.arg(""),
        };
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
        let claim = match claim_reply(&mut reply) {
            Ok(Some(claim @ (Claim::Claimed(_) | Claim::TakenOver { .. }))) => claim,
            other => {
                unanswered.answered();
                return other;
            }
        };
        self.confirmed(key, claim, unanswered).await.map(Some)
    }

    /// A claim the script made, answered once it is confirmed: with replicas required, one
    /// the key's primary no longer holds (it died before replicating it) fails, and one too
    /// few replicas acknowledged is given back so a retry need not wait for its lease.
    /// Dropped while it waits for the replicas, `unanswered` gives it back.
    async fn confirmed(
        &self,
        key: &StorageKey,
        claim: Claim,
        mut unanswered: Unanswered,
    ) -> Result<Claim, StoreError> {
        let (Claim::Claimed(token) | Claim::TakenOver { token, .. }) = claim else {
            unanswered.answered();
            return Ok(claim);
        };
        if let Some(required) = self.replicas {
            let confirmed = self.confirm_claim(key, token, required).await;
            unanswered.answered();
            match confirmed {
                Ok(true) => {}
                Ok(false) => {
                    return Err(StoreError::Unavailable(
                        "the claim was lost with its primary before a replica had it".into(),
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
        Ok(claim)
    }
}

/// What the claim script's reply says (`None`: a resume with nothing to take over).
fn claim_reply(reply: &mut [Value]) -> Result<Option<Claim>, StoreError> {
    match reply {
        [state, token, lifetime] if text(state) == Some(b"claimed") => {
            let number = |value: &Value| {
                text(value)
                    .and_then(|t| std::str::from_utf8(t).ok())
                    .and_then(|t| t.parse().ok())
                    .map(FencingToken::new)
                    .ok_or_else(|| corrupt("token"))
            };
            let (token, lifetime) = (number(token)?, number(lifetime)?);
            Ok(Some(if lifetime == token {
                Claim::Claimed(token)
            } else {
                Claim::TakenOver { token, lifetime }
            }))
        }
        [state, f, ttl] if text(state) == Some(b"i") => {
            let ttl = match ttl {
                Value::Int(ms) => u64::try_from(*ms).unwrap_or(0),
                _ => return Err(corrupt("lease")),
            };
            Ok(Some(Claim::InFlight {
                fingerprint: fingerprint(f)?,
                retry_after: Duration::from_millis(ttl),
            }))
        }
        [state, f, payload, ttl] if text(state) == Some(b"c") => match (payload, ttl) {
            // Taken, not copied: the reply is dropped right after. A record without an
            // expiry (`PTTL` -1, written by hand) is never cached: zero time left.
            (Value::BulkString(p), Value::Int(ms)) => Ok(Some(Claim::Completed {
                fingerprint: fingerprint(f)?,
                payload: Bytes::from(std::mem::take(p)),
                expires_in: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            })),
            _ => Err(corrupt("completed record without a payload")),
        },
        // A resume with nothing of its request to take over: nothing changed.
        [state] if text(state) == Some(b"none") => Ok(None),
        [state, _] if text(state) == Some(b"?") => Err(corrupt("unknown record state")),
        _ => Err(corrupt("unexpected claim reply")),
    }
}

impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), false, None)
            .await?
            .ok_or_else(|| corrupt("a claim answered that there was nothing to resume"))
    }

    async fn claim_labelled(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        terms: (Duration, Duration),
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<Claim, StoreError> {
        self.claim_or_resume(key, fingerprint, terms, false, Some(label))
            .await?
            .ok_or_else(|| corrupt("a claim answered that there was nothing to resume"))
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
        // `2`: completed now, and the record held a request, whose member of the index of
        // saved requests goes with it.
        let Some(required) = self.replicas else {
            let written: i64 = match self.query(script, cmd).await {
                Err(StoreError::Capacity { what }) => {
                    return self.completed_already(key, token, None, what).await;
                }
                other => other?,
            };
            return match written {
                1 => Ok(()),
                2 => {
                    self.forget(key).await;
                    Ok(())
                }
                _ => Err(StoreError::TokenRejected),
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
        if written != 1 && written != 2 {
            return Err(StoreError::TokenRejected);
        }
        enough(acknowledged, required)?;
        if written == 2 {
            self.forget(key).await;
        }
        Ok(())
    }

    async fn release(&self, key: &StorageKey, token: FencingToken) -> Result<(), StoreError> {
        let script = &scripts().release;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get());
        let reply: Value = self.query(script, cmd).await?;
        let (ended, has_request, owner) = match &reply {
            Value::Int(0) => return Err(StoreError::TokenRejected),
            Value::Array(parts) => match parts.as_slice() {
                [ended, Value::Int(has), owner] => (
                    decimal(ended),
                    *has == 1,
                    text(owner).map(String::from_utf8_lossy),
                ),
                _ => return Err(corrupt("unexpected release reply")),
            },
            _ => return Err(corrupt("unexpected release reply")),
        };
        // Released: a record that holds a request is abandoned from now on, for
        // `CheckpointStore::abandoned`. Best effort (the release is done): a member whose score stays
        // at its lease's planned end is listed that much later.
        if let (true, Some(ended)) = (has_request, ended) {
            let owner = owner.unwrap_or_default();
            let _ = self.index(key, &owner, ended).await;
        }
        Ok(())
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

impl SessionStore for RedisStore {
    async fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        check_session_request(request)?;
        let script = &scripts().session;
        let mut cmd = self.evalsha(script, &session.record_key());
        cmd.arg(request.seq)
            .arg(request.ack)
            .arg(request.window)
            .arg(millis(limits::clamp_ttl(request.idle)));
        let Some(required) = self.replicas else {
            return session_gate(&self.query::<Value>(script, cmd).await?);
        };
        // A session start, a raised mark or a dropped record a failover loses would let a
        // retry start the session anew (a new epoch: the request runs again) or find answers
        // the client was told are gone: the gate counts once the replicas have its writes.
        // A refusal as expired wrote nothing.
        let (reply, acknowledged): (Value, usize) =
            self.query_then_wait(script, cmd, required).await?;
        let gate = session_gate(&reply)?;
        if gate != SessionGate::Expired {
            enough(acknowledged, required)?;
        }
        Ok(gate)
    }

    /// One script (see `scripts::session_claim_source`): the gate and, admitted, the claim,
    /// atomically, so no check of the mark follows. With replicas required, the script is
    /// followed by `WAIT` in one pipeline, and any answer but "expired" counts once the
    /// replicas have its writes; a claim too few replicas acknowledged is released.
    async fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint_arg: &Fingerprint,
        lease: Duration,
        label: &idempotent_core::inspect::KeyLabel,
    ) -> Result<SessionClaim, StoreError> {
        check_session_request(request)?;
        let script = &scripts().session_claim;
        let claimant = idempotent_core::store::claimant();
        let idle = millis(limits::clamp_ttl(request.idle));
        let mut cmd = self.evalsha(script, &session.record_key());
        cmd.arg(fingerprint_arg.as_bytes().as_slice())
            .arg(millis(limits::clamp_lease(lease)))
            .arg(idle)
            .arg(claimant)
            .arg("0")
            .arg(label.as_bytes().as_ref())
            .arg(request.seq)
            .arg(request.ack)
            .arg(request.window)
            .arg(idle);
        // A claim made after its caller stopped waiting is given back through the session's
        // epoch (the reply that named it was lost).
        let mut unanswered = Unanswered::new({
            let (store, session, seq) = (self.clone(), *session, request.seq);
            Box::new(move || {
                let store = store.clone();
                Box::pin(async move {
                    let script = &scripts().session_give_back;
                    let mut cmd = store.evalsha(script, &session.record_key());
                    cmd.arg(claimant).arg(seq);
                    let given: i64 = store.query(script, cmd).await?;
                    Ok(given == 1)
                })
            })
        });
        // The gate's writes (a start, a raised mark, dropped answers) count once the replicas
        // have them, whatever the claim found.
        let sent = match self.replicas {
            None => self.query(script, cmd).await.map(|reply| (reply, None)),
            Some(required) => self.query_then_wait(script, cmd, required).await.map(
                |(reply, acknowledged): (Value, usize)| (reply, Some((acknowledged, required))),
            ),
        };
        let (mut reply, replicas) = match sent {
            Ok(sent) => sent,
            Err(error @ StoreError::Unavailable(_)) => return Err(error),
            // Refused whole for want of memory: the gate alone still runs for a known session
            // (its `ack` frees answers), and the claim is refused on its own.
            Err(StoreError::Capacity { .. }) => {
                unanswered.answered();
                return idempotent_core::store::claim_in_session_in_steps(
                    self,
                    session,
                    request,
                    fingerprint_arg,
                    lease,
                    label,
                )
                .await;
            }
            Err(error) => return Err(error),
        };
        if let Some((acknowledged, required)) = replicas
            && let Err(error) = enough(acknowledged, required)
        {
            if let Ok(SessionClaim::Admitted {
                epoch,
                claim: Claim::Claimed(token) | Claim::TakenOver { token, .. },
            }) = session_claim_reply(&mut reply.clone())
            {
                unanswered.answered();
                let _ = self
                    .release(&session.seq_key(epoch, request.seq), token)
                    .await;
                return Err(error);
            }
            if !matches!(session_gate(&reply), Ok(SessionGate::Expired)) {
                unanswered.answered();
                return Err(error);
            }
        }
        // Answered once read: with replicas required, the `WAIT` behind the script covered its
        // claim; a reply that cannot be read leaves the claim it may have made to be given
        // back.
        let answer = session_claim_reply(&mut reply)?;
        unanswered.answered();
        Ok(answer)
    }

    /// One `HMGET` of the session's record: Redis forgets it when its idle time ends, so a
    /// record that is there is live.
    async fn session_mark(
        &self,
        session: &SessionKey,
    ) -> Result<Option<idempotent_core::SessionMark>, StoreError> {
        let mut connection = self.connection.clone();
        let fields: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
            .arg(self.redis_key(&session.record_key()))
            .arg("e")
            .arg("a")
            .query_async(&mut connection)
            .await
            .map_err(store_error)?;
        session_mark(&fields)
    }
}

impl CheckpointStore for RedisStore {
    async fn resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.claim_or_resume(key, fingerprint, (lease, ttl), true, None)
            .await
    }

    async fn save_step(
        &self,
        key: &StorageKey,
        token: FencingToken,
        entry: Bytes,
    ) -> Result<(), StoreError> {
        let script = &scripts().save_step;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get()).arg(entry.as_ref());
        match self.fenced_write(script, cmd).await? {
            Value::Int(1) => Ok(()),
            _ => Err(corrupt("unexpected checkpoint reply")),
        }
    }

    async fn load_steps(&self, key: &StorageKey, token: FencingToken) -> Result<Bytes, StoreError> {
        let script = &scripts().load_steps;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get());
        let reply: Value = self.query(script, cmd).await?;
        match reply {
            Value::Int(0) => Err(StoreError::TokenRejected),
            Value::Array(parts) => match parts.as_slice() {
                [Value::BulkString(tag), chunks @ ..] if tag == b"ok" => {
                    let mut steps = Vec::new();
                    for chunk in chunks {
                        match chunk {
                            Value::BulkString(chunk) => steps.extend_from_slice(chunk),
                            _ => return Err(corrupt("unexpected checkpoints reply")),
                        }
                    }
                    Ok(Bytes::from(steps))
                }
                [Value::BulkString(tag), Value::BulkString(_)] if tag == b"?" => Err(corrupt(
                    "a checkpoint chunk of the record is missing or its count is not a number",
                )),
                _ => Err(corrupt("unexpected checkpoints reply")),
            },
            _ => Err(corrupt("unexpected checkpoints reply")),
        }
    }

    /// Adds the record to the index of saved requests (see
    /// [Data layout](RedisStore#data-layout)), then keeps the request on the record.
    async fn save_request(
        &self,
        key: &StorageKey,
        token: FencingToken,
        request: Bytes,
    ) -> Result<(), StoreError> {
        // Indexed first, scored with the server's time (at most the lease's end): a process
        // that dies between the two writes leaves a member without a request (removed by an
        // `abandoned` that reads it once its lease has ended), never a request no member
        // points to, which no completer would find. An `abandoned` that reads it while its
        // lease lasts scores it with the lease's end. Not waited for by replicas: the
        // request's write is, after it, and a member lost in a failover only hides a request
        // that a later release or save indexes again.
        let owner = owner_digits(idempotent_core::RequestOwner::of(&request).as_ref());
        self.index_waiting(key, &owner, None, None).await?;
        let script = &scripts().save_request;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get()).arg(request.as_ref()).arg(&owner);
        match self.fenced_write(script, cmd).await? {
            Value::Array(parts) => match parts.as_slice() {
                [ends] => decimal(ends).ok_or_else(|| corrupt("lease end")).map(drop),
                _ => Err(corrupt("unexpected request reply")),
            },
            _ => Err(corrupt("unexpected request reply")),
        }
    }

    /// Reads up to `4 × limit` (at least 16, at most 4,096) of the lowest scores of the
    /// owner's index that are at least `idle` old, then each of their records; tidies the
    /// index as it goes (see [Data layout](RedisStore#data-layout)). An owner's listing that
    /// finds fewer than `limit` reads the index of requests that name no owner after its
    /// own, for its requests kept before owners had indexes.
    async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&idempotent_core::RequestOwner>,
    ) -> Result<Vec<Abandoned>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let digits = owner_digits(owner);
        let mut listed = self
            .abandoned_in(&self.owner_index_key(&digits), idle, limit, owner)
            .await?;
        if owner.is_some() && listed.len() < limit {
            let earlier = self
                .abandoned_in(&self.index_key(), idle, limit - listed.len(), owner)
                .await?;
            listed.extend(earlier);
            listed.sort_by_key(|(ends, _)| *ends);
        }
        Ok(listed.into_iter().map(|(_, abandoned)| abandoned).collect())
    }
}

impl RedisStore {
    /// [`CheckpointStore::abandoned`] on one index: up to `limit` records of `owner`, with their lease's
    /// end, longest idle first. Members of another owner's records (in the index of requests
    /// that name none, kept before owners had indexes) are left as they are.
    async fn abandoned_in(
        &self,
        index: &str,
        idle: Duration,
        limit: usize,
        owner: Option<&idempotent_core::RequestOwner>,
    ) -> Result<Vec<(u64, Abandoned)>, StoreError> {
        // Whole milliseconds, rounded up (at least `idle`), and below 2^53 (exact in Lua).
        let idle_ms = u64::try_from(idle.as_nanos().div_ceil(1_000_000))
            .unwrap_or(u64::MAX)
            .min(1 << 52);
        let budget = limit.saturating_mul(4).clamp(16, MAX_CANDIDATES);
        let script = &scripts().candidates;
        let mut cmd = evalsha_on(script, index.as_bytes());
        cmd.arg(idle_ms).arg(budget);
        let reply: Value = self.query(script, cmd).await?;
        let found = match &reply {
            Value::Array(parts) => match parts.as_slice() {
                [Value::Int(_), Value::Array(found)] if found.len() % 2 == 0 => found,
                _ => return Err(corrupt("unexpected index reply")),
            },
            _ => return Err(corrupt("unexpected index reply")),
        };
        let mut candidates = Vec::with_capacity(found.len() / 2);
        // Threes of the tidy script: member, score read, new score ('' to remove).
        let mut tidy: Vec<Vec<u8>> = Vec::new();
        for pair in found.chunks_exact(2) {
            let (Some(name), Some(score)) = (text(&pair[0]), text(&pair[1])) else {
                return Err(corrupt("unexpected index reply"));
            };
            match key_of_member(name) {
                Some(key) => candidates.push((key, name, score)),
                // Not a record's name: nothing to list under it, and nothing to keep.
                None => {
                    tracing::warn!(member = %String::from_utf8_lossy(name), "the index of saved requests holds a member that names no record; removed");
                    tidy.extend([name.to_vec(), score.to_vec(), Vec::new()]);
                }
            }
        }
        let peek = &scripts().peek;
        let replies = join_all(candidates.iter().map(|(key, _, _)| {
            let cmd = self.evalsha(peek, key);
            self.query::<Value>(peek, cmd)
        }))
        .await;
        let mut listed: Vec<(u64, Abandoned)> = Vec::new();
        for ((key, name, score), reply) in candidates.iter().zip(replies) {
            // One record that cannot be read is skipped (and left as it is), not the call:
            // the others are still listed.
            match examine(reply, idle_ms) {
                Ok(Examined::Abandoned { request, .. })
                    if idempotent_core::RequestOwner::of(&request).as_ref() != owner => {}
                Ok(Examined::Abandoned {
                    ends,
                    fingerprint,
                    request,
                    idle,
                }) => listed.push((
                    ends,
                    Abandoned {
                        key: *key,
                        fingerprint,
                        request,
                        idle,
                    },
                )),
                Ok(Examined::Rescore(new_score)) => {
                    tidy.extend([name.to_vec(), score.to_vec(), new_score]);
                }
                Err(error) => tracing::warn!(
                    storage_key = %key,
                    error = &error as &dyn std::error::Error,
                    "a record in the index of saved requests cannot be read; skipped"
                ),
            }
        }
        if !tidy.is_empty() {
            // Best effort: a member left as it was is read again by the next call.
            let script = &scripts().tidy;
            let mut cmd = evalsha_on(script, index.as_bytes());
            for arg in &tidy {
                cmd.arg(arg.as_slice());
            }
            let _ = self.query::<Value>(script, cmd).await;
        }
        listed.sort_by_key(|(ends, _)| *ends);
        listed.truncate(limit);
        Ok(listed)
    }
}

/// What [`CheckpointStore::abandoned`] makes of one record of the index of saved requests.
enum Examined {
    /// Abandoned long enough: listed.
    Abandoned {
        ends: u64,
        fingerprint: Fingerprint,
        request: Bytes,
        idle: Duration,
    },
    /// Not (yet) abandoned: its member's new score, or `''` to remove it.
    Rescore(Vec<u8>),
}

/// Reads the peek script's reply about one record.
fn examine(reply: Result<Value, StoreError>, idle_ms: u64) -> Result<Examined, StoreError> {
    let mut reply = reply?;
    let Value::Array(fields) = &mut reply else {
        return Err(corrupt("unexpected record reply"));
    };
    let [now, state, f, ends, Value::Int(has), request] = fields.as_mut_slice() else {
        return Err(corrupt("unexpected record reply"));
    };
    let now = decimal(now).ok_or_else(|| corrupt("server time"))?;
    match (text(state), *has) {
        (Some(b"i"), 1) => {
            let ends = decimal(ends).ok_or_else(|| corrupt("lease end"))?;
            let fingerprint = fingerprint(f)?;
            if ends.saturating_add(idle_ms) <= now {
                let Value::BulkString(request) = request else {
                    return Err(corrupt("request"));
                };
                return Ok(Examined::Abandoned {
                    ends,
                    fingerprint,
                    request: Bytes::from(std::mem::take(request)),
                    idle: Duration::from_millis(now - ends),
                });
            }
            // Renewed or taken over since its score was set: read again once its lease has
            // ended.
            Ok(Examined::Rescore(ends.to_string().into_bytes()))
        }
        // In flight without a request yet (its save is on its way): read again once its
        // lease has ended.
        (Some(b"i"), 0) => match decimal(ends) {
            Some(ends) if ends > now => Ok(Examined::Rescore(ends.to_string().into_bytes())),
            _ => Ok(Examined::Rescore(Vec::new())),
        },
        // Expired, completed, or a new lifetime that saved no request.
        (Some(b"c"), _) | (Some(b""), 0) => Ok(Examined::Rescore(Vec::new())),
        _ => Err(corrupt("unknown record state")),
    }
}

/// The most records one [`CheckpointStore::abandoned`] reads.
const MAX_CANDIDATES: usize = 4096;

/// A session record's `e` (epoch) and `a` (mark) fields as its state: `None` when it has
/// neither (no live session).
fn session_mark(
    fields: &[Option<Vec<u8>>],
) -> Result<Option<idempotent_core::SessionMark>, StoreError> {
    let number = |field: &Option<Vec<u8>>| {
        field
            .as_deref()
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse::<u64>().ok())
            .filter(|n| *n <= MAX_SEQ.max(1 << 53))
    };
    match fields {
        [None, None] => Ok(None),
        [epoch, ack] => match (number(epoch), number(ack)) {
            (Some(epoch), Some(ack)) if epoch > 0 && ack <= MAX_SEQ => {
                Ok(Some(idempotent_core::SessionMark { epoch, ack }))
            }
            _ => Err(corrupt("session record fields e and a")),
        },
        _ => Err(corrupt("unexpected session record reply")),
    }
}

/// The scripts keep numbers exactly (below 2^53) and walk at most a window of records per
/// request: a request outside the ranges the runtime sends is refused before it is sent.
fn check_session_request(request: SessionRequest) -> Result<(), StoreError> {
    if request.seq > MAX_SEQ || request.ack > MAX_SEQ || request.window > MAX_SESSION_WINDOW {
        return Err(StoreError::Backend(
            format!(
                "session request out of range: seq {}, ack {} (at most {MAX_SEQ}), \
                 window {} (at most {MAX_SESSION_WINDOW})",
                request.seq, request.ack, request.window
            )
            .into(),
        ));
    }
    Ok(())
}

/// What the session claim script's reply says: `{'open', epoch, claim reply}`, or the gate's
/// refusal.
fn session_claim_reply(reply: &mut Value) -> Result<SessionClaim, StoreError> {
    if let Value::Array(parts) = reply
        && let [gate, epoch, Value::Array(claim)] = parts.as_mut_slice()
        && text(gate) == Some(b"open")
    {
        let epoch = text(epoch)
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse::<u64>().ok())
            .filter(|&epoch| epoch > 0)
            .ok_or_else(|| corrupt("session epoch"))?;
        let claim = claim_reply(claim)?
            .ok_or_else(|| corrupt("a claim answered that there was nothing to resume"))?;
        return Ok(SessionClaim::Admitted { epoch, claim });
    }
    match session_gate(reply)? {
        SessionGate::Open { .. } => Err(corrupt("a session gate opened without a claim")),
        refused => Ok(SessionClaim::Refused(refused)),
    }
}

/// The session script's reply as the gate's decision.
fn session_gate(reply: &Value) -> Result<SessionGate, StoreError> {
    let number = |value: &Value| {
        text(value)
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse::<u64>().ok())
    };
    let Value::Array(parts) = reply else {
        return Err(corrupt("unexpected session gate reply"));
    };
    match parts.as_slice() {
        [gate] if text(gate) == Some(b"expired") => Ok(SessionGate::Expired),
        [gate, field] if text(gate) == Some(b"?") => Err(corrupt(&format!(
            "session record field {}",
            text(field).map_or("?".into(), String::from_utf8_lossy)
        ))),
        [gate, n] => match (text(gate), number(n)) {
            (Some(b"open"), Some(epoch)) => Ok(SessionGate::Open { epoch }),
            (Some(b"ack"), Some(ack)) => Ok(SessionGate::Acknowledged { ack }),
            (Some(b"window"), Some(ack)) => Ok(SessionGate::WindowFull { ack }),
            _ => Err(corrupt("unexpected session gate reply")),
        },
        _ => Err(corrupt("unexpected session gate reply")),
    }
}

#[cfg(test)]
mod tests;
