//! Redis Streams as a [`Source`] (feature `redis-streams`): a consumer group, `XREADGROUP`,
//! `XACK`, `XAUTOCLAIM` sweeps of the pending list, dead letters in a second stream.
//!
//! - **Receiving.** New entries are read with `XREADGROUP … BLOCK 1000`. Every
//!   `claim_idle / 2` (timed from the end of the previous sweep) the group's pending list is
//!   swept with `XAUTOCLAIM`: entries left pending for `claim_idle` by any consumer (one that
//!   crashed, one that gave up on them for now) become this consumer's, page after page,
//!   following the cursor until it wraps, so the tail of a long pending list is reached even
//!   when entries at its head keep failing. New entries are read between two sweeps, so a
//!   slow sweep cannot starve them.
//! - **Message.** [`position`](Message::position) is the entry id; the
//!   [fields](Message::fields) are the entry's, in order, all of them; the body is empty; the
//!   [message id](Message::id) is the field `id` when it occurs exactly once. The delivery
//!   count is the group's (`XPENDING`), so it holds across restarts and consumers.
//! - **Retry later.** The entry is left pending: the next sweep after `claim_idle` delivers it
//!   again. Redis cannot delay one entry, so the consumer's backoff does not apply here;
//!   `claim_idle` is the delay.
//! - **Keep-alive.** Every `claim_idle / 3` while the handler runs, `XCLAIM … 0 id JUSTID`
//!   resets the entry's idle time (without counting a delivery), so no sweep takes it from a
//!   handler that outlasts `claim_idle`.
//! - **Dead letters.** The stream `STREAM:dead` gets a new entry with the fields `reason`,
//!   `entry` (the original's id) and `deliveries`, then the original's fields (its first
//!   [`MAX_FIELDS`]). It is added and the original acknowledged in one script, only while
//!   the original is still pending: an entry is dead-lettered exactly once, even when two
//!   consumers give up on it at once. The original stays in `STREAM` until it is trimmed.
//!   Size is no limit: Redis bounds each field (512 MB), not an entry, and the dead letter
//!   holds the original's fields unchanged beside its own small ones, so an entry Redis took
//!   can always be dead-lettered (a Redis out of memory refuses it like any write: the entry
//!   stays pending and is dead-lettered on a later delivery).
//! - **Reconnecting.** Two [`ConnectionManager`]s, one for the blocking reads and one for
//!   everything else (Redis answers nothing else on a connection blocked in `XREADGROUP`):
//!   after Redis restarts, the next command reconnects. A group lost with the stream (Redis
//!   restarted without persistence)
//!   is created again.
//!
//! The consumer group is created (with the stream) when missing, reading from the start.
//!
//! Redis ≥ 6.2 (`XAUTOCLAIM`).

use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{DeadLettered, MAX_FIELDS, Message, Received, Source, SourceError};

/// Entries per `XAUTOCLAIM` page, at most.
const CLAIM_PAGE: usize = 64;

/// The cursor that starts a sweep of the pending list, and that `XAUTOCLAIM` returns when the
/// sweep has reached its end.
const SWEEP_START: &str = "0-0";

/// How long `XREADGROUP` waits for new entries, in milliseconds.
const BLOCK_MS: u64 = 1000;

/// The default [`RedisStreamsBuilder::claim_idle`].
pub const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(5);
/// The longest [`RedisStreamsBuilder::claim_idle`]: 365 days (a longer one is taken as this).
pub const MAX_CLAIM_IDLE: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Copies an entry to the dead-letter stream and acknowledges it, atomically: only an entry
/// still pending is copied, so an entry is never dead-lettered twice.
const DEAD_LETTER: &str = r"
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'reason', ARGV[3], 'entry', ARGV[2], 'deliveries', ARGV[4],
             unpack(ARGV, 5))
  return 1
end
return 0
";

/// Settings of a [`RedisStreams`] source: the Redis URL, the stream, the group, this
/// consumer's name.
#[derive(Debug, Clone)]
pub struct RedisStreamsBuilder {
    url: String,
    stream: String,
    group: String,
    consumer: String,
    claim_idle: Duration,
}

impl RedisStreamsBuilder {
    /// Entries pending this long, with any consumer, are delivered again (default
    /// [`DEFAULT_CLAIM_IDLE`]; between 1 ms and [`MAX_CLAIM_IDLE`], a value outside taken as
    /// the nearer end, so `Duration::MAX` means "as late as the source allows"). Shorter than
    /// any handler's usual run is fine: the entry in hand is kept alive.
    #[must_use]
    pub fn claim_idle(mut self, claim_idle: Duration) -> Self {
        self.claim_idle = claim_idle.clamp(Duration::from_millis(1), MAX_CLAIM_IDLE);
        self
    }

    /// Connects and creates the group (and the stream) when missing.
    pub async fn connect(self) -> Result<RedisStreams, SourceError> {
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| SourceError::new(format!("the Redis URL {:?}", self.url), e))?;
        // A blocking read waits up to BLOCK_MS on the server: the response timeout must be
        // longer, or entries the server delivered would wait for a sweep.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(10)))
            .set_max_delay(Duration::from_secs(2));
        let connect = || async {
            client
                .get_connection_manager_with_config(config.clone())
                .await
                .map_err(|e| SourceError::new(format!("connecting to Redis at {}", self.url), e))
        };
        // Two connections: Redis answers nothing else on a connection blocked in
        // `XREADGROUP … BLOCK`, so acknowledgements on the reading connection would wait for
        // the next entry or the end of the block.
        let (reader, redis) = (connect().await?, connect().await?);
        let source = RedisStreams {
            reader,
            redis,
            dead: format!("{}:dead", self.stream),
            stream: self.stream,
            group: self.group,
            consumer: self.consumer,
            claim_idle: self.claim_idle,
            sweep: Mutex::new(Sweep {
                cursor: SWEEP_START.to_owned(),
                next: next_sweep(self.claim_idle),
            }),
            dead_letter: redis::Script::new(DEAD_LETTER),
        };
        source.create_group().await?;
        Ok(source)
    }
}

/// When the next sweep is due: `claim_idle / 2` from now (the clock saturating).
fn next_sweep(claim_idle: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(claim_idle / 2)
        .unwrap_or_else(|| now + MAX_CLAIM_IDLE)
}

/// Where the sweep of the pending list stands.
#[derive(Debug)]
struct Sweep {
    cursor: String,
    /// When the next sweep begins, once the current one (if any) has ended.
    next: Instant,
}

/// A Redis Streams consumer group member as a [`Source`]; see the [module](self).
pub struct RedisStreams {
    /// Blocking reads only.
    reader: ConnectionManager,
    /// Everything else.
    redis: ConnectionManager,
    stream: String,
    dead: String,
    group: String,
    consumer: String,
    claim_idle: Duration,
    sweep: Mutex<Sweep>,
    dead_letter: redis::Script,
}

impl std::fmt::Debug for RedisStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreams")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("claim_idle", &self.claim_idle)
            .finish_non_exhaustive()
    }
}

/// The source's handle on one entry: its id.
#[derive(Debug, Clone)]
pub struct EntryId(String);

impl RedisStreams {
    /// A source reading `stream` as `consumer` of `group`, at the Redis of `url`.
    pub fn builder(
        url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> RedisStreamsBuilder {
        RedisStreamsBuilder {
            url: url.into(),
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            claim_idle: DEFAULT_CLAIM_IDLE,
        }
    }

    /// The stream read.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The stream dead letters go to: `STREAM:dead`.
    pub fn dead_stream(&self) -> &str {
        &self.dead
    }

    async fn create_group(&self) -> Result<(), SourceError> {
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.redis.clone())
            .await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => Err(SourceError::new(
                format!("creating the consumer group {}", self.group),
                e,
            )),
            _ => Ok(()),
        }
    }

    /// New entries for this consumer, waiting up to a second for some.
    async fn read_new(&self, max: usize) -> redis::RedisResult<Vec<Received<EntryId>>> {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(BLOCK_MS)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.reader.clone())
            .await?;
        // [[stream, [entries...]]] (a map in RESP3), or nil on timeout.
        Ok(match reply {
            Value::Array(streams) => streams
                .into_iter()
                .filter_map(|s| match s {
                    Value::Array(mut pair) if pair.len() == 2 => Some(entries(pair.remove(1))),
                    _ => None,
                })
                .flatten()
                .collect(),
            Value::Map(streams) => streams.into_iter().flat_map(|(_, e)| entries(e)).collect(),
            _ => Vec::new(),
        })
    }

    /// The next page of the sweep from `cursor`: entries left pending for longer than
    /// `claim_idle`, now ours, with their delivery counts; and the cursor to go on from.
    async fn claim_abandoned(
        &self,
        cursor: &str,
        max: usize,
    ) -> redis::RedisResult<(Vec<Received<EntryId>>, String)> {
        let mut redis = self.redis.clone();
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(u64::try_from(self.claim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(cursor)
            .arg("COUNT")
            .arg(max.min(CLAIM_PAGE))
            .query_async(&mut redis)
            .await?;
        // [next-cursor, [entries...], [deleted ids...]]
        let Value::Array(mut parts) = reply else {
            return Ok((Vec::new(), SWEEP_START.to_owned()));
        };
        let mut claimed = if parts.len() >= 2 {
            entries(parts.remove(1))
        } else {
            Vec::new()
        };
        let next = parts
            .first()
            .and_then(text)
            .unwrap_or_else(|| SWEEP_START.to_owned());
        if claimed.is_empty() {
            return Ok((claimed, next));
        }
        // XAUTOCLAIM does not report delivery counts: the pending list holds them.
        let mut lookups = redis::pipe();
        for received in &claimed {
            lookups
                .cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(&received.delivery.0)
                .arg(&received.delivery.0)
                .arg(1);
        }
        let counts: Vec<Value> = lookups.query_async(&mut redis).await?;
        for (received, count) in claimed.iter_mut().zip(&counts) {
            // An entry acknowledged meanwhile has no count; it is applied or dead-lettered
            // already, and handling it again changes nothing.
            received.message.deliveries = delivery_count(count).unwrap_or(1).max(1);
        }
        Ok((claimed, next))
    }

    fn failed(&self, context: &str, error: redis::RedisError) -> SourceError {
        SourceError::new(format!("{context} {}", self.stream), error)
    }
}

impl Source for RedisStreams {
    type Delivery = EntryId;

    fn name(&self) -> &'static str {
        "redis_streams"
    }

    async fn receive(&self, max: usize) -> Result<Vec<Received<EntryId>>, SourceError> {
        let mut sweep = self.sweep.lock().await;
        // A sweep, once begun, runs page after page until its cursor wraps.
        let sweeping = sweep.cursor != SWEEP_START || Instant::now() >= sweep.next;
        let read = if sweeping {
            match self.claim_abandoned(&sweep.cursor, max).await {
                Ok((claimed, next)) => {
                    sweep.cursor = next;
                    if sweep.cursor == SWEEP_START {
                        // Timed from the end of the sweep, however long it took: new
                        // entries get their turn before the next one.
                        sweep.next = next_sweep(self.claim_idle);
                    }
                    Ok(claimed)
                }
                Err(e) => Err(e),
            }
        } else {
            drop(sweep);
            self.read_new(max).await
        };
        match read {
            Ok(read) => Ok(read),
            Err(e) => {
                if e.code() == Some("NOGROUP") {
                    // The stream and its group are gone (Redis lost its data): start over.
                    self.create_group().await?;
                }
                Err(self.failed("reading", e))
            }
        }
    }

    async fn ack(&self, delivery: &EntryId) -> Result<(), SourceError> {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&delivery.0)
            .query_async(&mut self.redis.clone())
            .await
            .map_err(|e| self.failed("acknowledging an entry of", e))?;
        Ok(())
    }

    async fn retry(&self, _delivery: &EntryId, _delay: Duration) -> Result<(), SourceError> {
        // Left pending: the sweep delivers it again after `claim_idle`.
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &EntryId,
        reason: &str,
    ) -> Result<DeadLettered, SourceError> {
        let mut invocation = self.dead_letter.key(&self.stream);
        invocation
            .key(&self.dead)
            .arg(&self.group)
            .arg(&delivery.0)
            .arg(reason)
            .arg(message.deliveries());
        // Bounded: a script cannot pass thousands of arguments to a command.
        for (name, value) in message.fields().iter().take(MAX_FIELDS) {
            invocation.arg(name.as_str()).arg(value.as_ref());
        }
        let copied: i64 = invocation
            .invoke_async(&mut self.redis.clone())
            .await
            .map_err(|e| self.failed("dead-lettering an entry of", e))?;
        Ok(if copied == 1 {
            DeadLettered::Now
        } else {
            DeadLettered::Already
        })
    }

    async fn keep_alive(&self, delivery: &EntryId) -> Result<(), SourceError> {
        let _: Value = redis::cmd("XCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(&delivery.0)
            .arg("JUSTID")
            .query_async(&mut self.redis.clone())
            .await
            .map_err(|e| self.failed("keeping alive an entry of", e))?;
        Ok(())
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        Some((self.claim_idle / 3).max(Duration::from_millis(1)))
    }
}

/// Entries as `XREADGROUP` and `XAUTOCLAIM` return them, counted as first deliveries.
fn entries(value: Value) -> Vec<Received<EntryId>> {
    let Value::Array(items) = value else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|item| {
            let Value::Array(mut pair) = item else {
                return None;
            };
            if pair.len() != 2 {
                return None;
            }
            let fields = pair.pop()?;
            let entry_id = text(&pair.pop()?)?;
            let mut message = Message::new(entry_id.clone(), Bytes::new());
            let mut add = |name: &Value, value: &Value| {
                if let (Some(name), Some(value)) = (text(name), bytes(value)) {
                    message.fields.push((name, value));
                }
            };
            match &fields {
                Value::Array(flat) => {
                    for pair in flat.chunks(2) {
                        if let [name, value] = pair {
                            add(name, value);
                        }
                    }
                }
                Value::Map(pairs) => {
                    for (name, value) in pairs {
                        add(name, value);
                    }
                }
                _ => {}
            }
            if let Some(id) = message
                .field("id")
                .and_then(|id| std::str::from_utf8(id).ok())
            {
                message.id = Some(id.to_owned());
            }
            Some(Received {
                message,
                delivery: EntryId(entry_id),
            })
        })
        .collect()
}

/// The delivery count in an `XPENDING stream group id id 1` reply:
/// `[[id, consumer, idle-ms, deliveries]]`.
fn delivery_count(reply: &Value) -> Option<u64> {
    let Value::Array(rows) = reply else {
        return None;
    };
    let Some(Value::Array(row)) = rows.first() else {
        return None;
    };
    match row.get(3)? {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}
