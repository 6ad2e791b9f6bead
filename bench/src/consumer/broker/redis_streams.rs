//! Redis Streams in the consumer benchmark: the runtime's source, the bare loop (`XREADGROUP`
//! on one connection, `XACK` on another: a blocking read holds up every later command on its
//! connection), publishing with `XADD`, the server's command counts, and clearing a stream away.

use std::collections::BTreeMap;

use idempotent_consumer::redis_streams::RedisStreams;
use redis::Value;
use redis::aio::MultiplexedConnection;

use super::GROUP;
use crate::consumer::bare::{Bare, RECEIVE_WAIT};
use crate::consumer::postings::Posting;

/// The runtime's source over stream `name`.
pub(crate) async fn source(url: &str, name: &str) -> RedisStreams {
    RedisStreams::builder(url, name, GROUP, "runtime")
        .connect()
        .await
        .unwrap()
}

pub(crate) async fn connection(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Appends `postings` to stream `name` in one pipeline.
pub(crate) async fn publish(
    connection: &mut MultiplexedConnection,
    name: &str,
    postings: &[Posting],
) {
    let mut pipe = redis::pipe();
    for p in postings {
        let command = pipe
            .cmd("XADD")
            .arg(name)
            .arg("*")
            .arg("id")
            .arg(&p.id)
            .arg("account")
            .arg(&p.account)
            .arg("amount")
            .arg(p.amount);
        if let Some(sent) = p.sent {
            command.arg("sent").arg(sent);
        }
        command.ignore();
    }
    let () = pipe.query_async(connection).await.unwrap();
}

/// Per-command call counts from `INFO commandstats`.
pub(crate) async fn calls(url: &str) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut connection(url).await)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Deletes stream `name` and its dead-letter stream.
pub(crate) async fn delete(url: &str, name: &str) {
    let _: redis::RedisResult<i64> = redis::cmd("DEL")
        .arg(name)
        .arg(format!("{name}:dead"))
        .query_async(&mut connection(url).await)
        .await;
}

pub(crate) struct RedisEntry {
    id: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

pub(crate) struct BareRedis {
    /// For `XREADGROUP`: a blocking read holds up every later command on its connection.
    reader: MultiplexedConnection,
    /// For `XACK`.
    acker: MultiplexedConnection,
    stream: String,
}

impl BareRedis {
    /// The bare loop's group on stream `name`, created with the stream if need be.
    pub(crate) async fn open(url: &str, name: &str) -> BareRedis {
        let reader = connection(url).await;
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(name)
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut reader.clone())
            .await
            .unwrap();
        BareRedis {
            reader,
            acker: connection(url).await,
            stream: name.to_owned(),
        }
    }
}

fn entries(reply: Value) -> Vec<RedisEntry> {
    let per_stream = match reply {
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut pair) if pair.len() == 2 => Some(pair.remove(1)),
                _ => None,
            })
            .collect(),
        Value::Map(streams) => streams.into_iter().map(|(_, e)| e).collect(),
        _ => Vec::new(),
    };
    let mut out = Vec::new();
    for entries in per_stream {
        let Value::Array(entries) = entries else {
            continue;
        };
        for entry in entries {
            let Value::Array(mut pair) = entry else {
                continue;
            };
            let (Some(fields), Some(Value::BulkString(id))) = (pair.pop(), pair.pop()) else {
                continue;
            };
            let fields = match fields {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|pair| match pair {
                        [Value::BulkString(n), Value::BulkString(v)] => {
                            Some((n.clone(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                Value::Map(pairs) => pairs
                    .into_iter()
                    .filter_map(|pair| match pair {
                        (Value::BulkString(n), Value::BulkString(v)) => Some((n, v)),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            out.push(RedisEntry {
                id: String::from_utf8(id).unwrap(),
                fields,
            });
        }
    }
    out
}

impl Bare for BareRedis {
    type Item = RedisEntry;

    async fn receive(&self, max: usize) -> Vec<RedisEntry> {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("bare")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(RECEIVE_WAIT.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.reader.clone())
            .await
            .unwrap();
        entries(reply)
    }

    fn posting(item: &RedisEntry) -> Posting {
        let field = |name: &str| {
            let (_, value) = item.fields.iter().find(|(n, _)| n == name.as_bytes())?;
            Some(std::str::from_utf8(value).unwrap().to_owned())
        };
        Posting {
            id: field("id").expect("an id"),
            account: field("account").expect("an account"),
            amount: field("amount").expect("an amount").parse().unwrap(),
            sent: field("sent").and_then(|s| s.parse().ok()),
        }
    }

    async fn ack(&self, item: &RedisEntry) {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&item.id)
            .query_async(&mut self.acker.clone())
            .await
            .unwrap();
    }

    async fn ack_all(&self, items: &[RedisEntry]) {
        if items.is_empty() {
            return;
        }
        let ids: Vec<&str> = items.iter().map(|e| e.id.as_str()).collect();
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&ids)
            .query_async(&mut self.acker.clone())
            .await
            .unwrap();
    }
}
