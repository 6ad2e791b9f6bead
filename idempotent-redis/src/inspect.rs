//! [`InspectStore`] for [`RedisStore`]: a record by key (one script), listings by `SCAN` over
//! the store's prefix (Redis keeps no index by state: a listing is a pass over the keyspace,
//! a slice per page), repairs as one script each.

use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

use idempotent_core::inspect::{
    Cursor, InspectStore, KeyLabel, ListQuery, Page, RecordInfo, RecordState, Refusal, Repair,
    Repaired,
};
use idempotent_core::session::SessionState;
use idempotent_core::{FencingToken, SessionKey, StorageKey, StoreError, limits};

use crate::scripts::scripts;
use crate::{Connection, RedisStore, corrupt, fingerprint, key_of_member, millis, text};

/// How many keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 200;

/// The most `SCAN` steps one page takes.
const MAX_STEPS_PER_PAGE: usize = 50;

/// Where a listing is: the primary (0 on one server), its `SCAN` cursor, and the keys of that
/// step already listed (when a page ended within the step's keys).
#[derive(Debug, Clone, Default)]
struct ScanAt {
    node: usize,
    cursor: u64,
    listed: Vec<Vec<u8>>,
}

/// Hex digits of `bytes`, or `None` when they are not.
fn unhex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(hex.get(at..at + 2)?, 16).ok())
        .collect()
}

impl ScanAt {
    /// `node:cursor`, or `node:cursor:` and the listed keys in hex, comma-separated.
    fn parse(text: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::Backend(format!("not a listing cursor: {text:?}").into());
        let mut parts = text.splitn(3, ':');
        let node = parts.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        let cursor = parts.next().and_then(|c| c.parse().ok()).ok_or_else(bad)?;
        let listed = match parts.next() {
            None => Vec::new(),
            Some(keys) => keys
                .split(',')
                .map(|hex| unhex(hex).filter(|k| !k.is_empty() && k.len() <= 1024))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(bad)?,
        };
        Ok(ScanAt {
            node,
            cursor,
            listed,
        })
    }

    /// Where the scan goes after a step that answered `next`, over `nodes` primaries; `None`
    /// when it is done.
    fn step(&self, next: u64, nodes: usize) -> Option<ScanAt> {
        if next != 0 {
            Some(ScanAt {
                node: self.node,
                cursor: next,
                listed: Vec::new(),
            })
        } else if self.node + 1 < nodes {
            Some(ScanAt {
                node: self.node + 1,
                cursor: 0,
                listed: Vec::new(),
            })
        } else {
            None
        }
    }
}

impl std::fmt::Display for ScanAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.node, self.cursor)?;
        for (i, key) in self.listed.iter().enumerate() {
            f.write_str(if i == 0 { ":" } else { "," })?;
            for b in key {
                write!(f, "{b:02x}")?;
            }
        }
        Ok(())
    }
}

fn number(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        other => text(other)
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse().ok()),
    }
}

fn optional(value: &Value) -> Option<Bytes> {
    match value {
        Value::Array(items) => items.first().and_then(text).map(Bytes::copy_from_slice),
        _ => None,
    }
}

fn ms(value: i64) -> Duration {
    Duration::from_millis(u64::try_from(value).unwrap_or(0))
}

/// The `INSPECT` script's reply as what an operator reads; `None` for `{'absent'}`.
fn record_info(key: StorageKey, reply: &[Value]) -> Result<Option<RecordInfo>, StoreError> {
    if reply.first().and_then(text) == Some(b"absent") {
        return Ok(None);
    }
    let [
        ok,
        now,
        pttl,
        state,
        f,
        token,
        lease_end,
        released,
        attempts,
        since,
        label,
        payload,
        request,
        chunks @ ..,
    ] = reply
    else {
        return Err(corrupt("unexpected inspect reply"));
    };
    if text(ok) != Some(b"ok") {
        return Err(corrupt("unexpected inspect reply"));
    }
    let now = number(now).ok_or_else(|| corrupt("time"))?;
    let pttl = number(pttl).unwrap_or(0);
    let token = number(token)
        .and_then(|t| u64::try_from(t).ok())
        .map(FencingToken::new)
        .ok_or_else(|| corrupt("token"))?;
    let since = number(since).map_or(Duration::ZERO, |since| ms(now.saturating_sub(since)));
    let attempts = number(attempts)
        .and_then(|a| u32::try_from(a).ok())
        .unwrap_or(0);
    let label = optional(label).map(KeyLabel::from_bytes);
    let info = |state, lease_left, expires_in, age, steps: Bytes| RecordInfo {
        key,
        state,
        token,
        fingerprint: fingerprint(f)
            .unwrap_or_else(|_| idempotent_core::Fingerprint::from_digest([0; 32])),
        label: label.clone(),
        lease_left,
        expires_in,
        age,
        attempts,
        steps,
        request: None,
        payload: None,
    };
    let record = match text(state) {
        Some(b"c") => {
            let mut record = info(
                RecordState::Completed,
                Duration::ZERO,
                ms(pttl),
                since,
                Bytes::new(),
            );
            record.payload = optional(payload);
            record
        }
        Some(b"i") => {
            // A record written before leases were kept apart has its lease as its expiry.
            let lease_end = number(lease_end).unwrap_or(now.saturating_add(pttl));
            let left = ms(lease_end.saturating_sub(now));
            // Released only once its lease ended: a record an older release took over keeps
            // the flag it does not know to clear, under a live lease.
            let released = text(released) == Some(b"1") && left.is_zero();
            let state = if released {
                RecordState::Released
            } else {
                RecordState::InFlight
            };
            let mut steps = Vec::new();
            for chunk in chunks {
                steps.extend_from_slice(text(chunk).unwrap_or_default());
            }
            let (lease_left, age) = if left.is_zero() || released {
                (Duration::ZERO, ms(now.saturating_sub(lease_end)))
            } else {
                (left, since)
            };
            let mut record = info(state, lease_left, ms(pttl), age, Bytes::from(steps));
            record.request = optional(request);
            record
        }
        _ => return Err(corrupt("unknown record state")),
    };
    fingerprint(f)?;
    Ok(Some(record))
}

impl RedisStore {
    async fn inspect_one(&self, key: &StorageKey) -> Result<Option<RecordInfo>, StoreError> {
        let script = &scripts().inspect;
        let cmd = self.evalsha(script, key);
        let reply: Vec<Value> = self.query(script, cmd).await?;
        record_info(*key, &reply)
    }

    /// `pattern` for `SCAN MATCH` of every key under the prefix (glob characters escaped).
    fn scan_pattern(&self) -> String {
        let mut out = String::with_capacity(self.prefix.len() + 2);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('*');
        out
    }
}

impl InspectStore for RedisStore {
    async fn inspect(&self, key: &StorageKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inspect_one(key).await
    }

    /// `SCAN` steps over the prefix's keys, each record found read by the inspect script, until
    /// the page is full or a bounded number of steps is taken. The cursor names the scan's
    /// place (on a Redis Cluster, the primary's place among the primaries sorted by address,
    /// too: a listing walks them one after another, as they are when each page is read) and,
    /// when a page ended within one step's keys, the keys of that step it listed: the next
    /// page takes the step again and skips them. `SCAN` returns every key present throughout
    /// at least once, so a record is never skipped; one may be listed twice when the keyspace
    /// is rehashed between steps. In the order the scan meets them; a page may hold fewer
    /// than `limit` (none, even) with more to come.
    async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let limit = query.limit.clamp(1, 10_000);
        let mut at = match &query.after {
            None => ScanAt::default(),
            Some(cursor) => ScanAt::parse(&cursor.0)?,
        };
        let primaries = match &self.connection {
            Connection::Node(_) => None,
            Connection::Cluster(cluster) => Some(primaries(&mut cluster.clone()).await?),
        };
        let mut records = Vec::new();
        for _ in 0..MAX_STEPS_PER_PAGE {
            let mut scan = redis::cmd("SCAN");
            scan.arg(at.cursor)
                .arg("MATCH")
                .arg(self.scan_pattern())
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let (next, names): (u64, Vec<Vec<u8>>) = match (&self.connection, &primaries) {
                (Connection::Cluster(cluster), Some(primaries)) => {
                    let Some((host, port)) = primaries.get(at.node) else {
                        return Ok(Page {
                            records,
                            next: None,
                        });
                    };
                    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    });
                    let reply = cluster
                        .clone()
                        .route_command(scan, routing)
                        .await
                        .map_err(crate::store_error)?;
                    redis::from_redis_value(reply)
                        .map_err(|e| StoreError::Corrupt(e.to_string().into()))?
                }
                _ => {
                    let mut connection = self.connection.clone();
                    scan.query_async(&mut connection)
                        .await
                        .map_err(crate::store_error)?
                }
            };
            // A step taken again (the page before ended within it) skips what it listed: the
            // keys, not their places, which a rehash may have moved.
            let mut listed = std::mem::take(&mut at.listed);
            let skip: std::collections::HashSet<Vec<u8>> = listed.iter().cloned().collect();
            for (i, name) in names.iter().enumerate() {
                if skip.contains(name) {
                    continue;
                }
                let Some(key) = name
                    .strip_prefix(self.prefix.as_bytes())
                    .and_then(key_of_member)
                else {
                    continue;
                };
                // A key that is not a record (a session's own, a cache tier's copy) reads as
                // absent; a damaged one is left out of the listing rather than ending it.
                match self.inspect_one(&key).await {
                    Ok(Some(info))
                        if query.state.matches(&info) && info.age >= query.older_than =>
                    {
                        records.push(info);
                        listed.push(name.clone());
                    }
                    Ok(_) => {}
                    Err(StoreError::Corrupt(why)) => {
                        tracing::warn!(storage_key = %key, why, "listing skipped a damaged record");
                    }
                    Err(error) => return Err(error),
                }
                if records.len() == limit {
                    let more = names[i + 1..].iter().any(|n| !skip.contains(n));
                    let next = if more {
                        Some(ScanAt {
                            node: at.node,
                            cursor: at.cursor,
                            listed,
                        })
                    } else {
                        at.step(next, primaries.as_ref().map_or(1, Vec::len))
                    };
                    return Ok(Page {
                        records,
                        next: next.map(|at| Cursor(at.to_string())),
                    });
                }
            }
            match at.step(next, primaries.as_ref().map_or(1, Vec::len)) {
                Some(following) => at = following,
                None => {
                    return Ok(Page {
                        records,
                        next: None,
                    });
                }
            }
        }
        Ok(Page {
            records,
            next: Some(Cursor(at.to_string())),
        })
    }

    async fn repair(
        &self,
        key: &StorageKey,
        token: FencingToken,
        repair: &Repair,
        force: bool,
    ) -> Result<Repaired, StoreError> {
        let script = &scripts().repair;
        let mut cmd = self.evalsha(script, key);
        cmd.arg(token.get()).arg(match repair {
            Repair::Release => "release",
            Repair::GiveUp { .. } => "give_up",
            Repair::Forget => "forget",
        });
        cmd.arg(if force { "1" } else { "0" });
        match repair {
            Repair::GiveUp { payload, ttl } => cmd
                .arg(payload.as_ref())
                .arg(millis(limits::clamp_ttl(*ttl)).max(1)),
            _ => cmd.arg("").arg(1),
        };
        let reply: Vec<Value> = self.query(script, cmd).await?;
        match reply.as_slice() {
            [done] if text(done) == Some(b"done") => Ok(Repaired::Done),
            // Released with a kept request: its member of the index moves to the lease's
            // end, so a completer sees it at once (best effort, as after a release).
            [done, ended, owner] if text(done) == Some(b"done") => {
                if let (Some(ended), Some(owner)) = (
                    number(ended).and_then(|e| u64::try_from(e).ok()),
                    text(owner).and_then(|o| std::str::from_utf8(o).ok()),
                ) {
                    let _ = self.index(key, owner, ended).await;
                }
                Ok(Repaired::Done)
            }
            [absent] if text(absent) == Some(b"absent") => Ok(Repaired::Refused(Refusal::Absent)),
            [completed] if text(completed) == Some(b"completed") => {
                Ok(Repaired::Refused(Refusal::Completed))
            }
            [moved, now] if text(moved) == Some(b"moved") => {
                Ok(Repaired::Refused(Refusal::TokenMoved {
                    now: FencingToken::new(
                        number(now).and_then(|n| u64::try_from(n).ok()).unwrap_or(0),
                    ),
                }))
            }
            [live, left] if text(live) == Some(b"live") => {
                Ok(Repaired::Refused(Refusal::LeaseLive {
                    left: ms(number(left).unwrap_or(0)),
                }))
            }
            _ => Err(corrupt("unexpected repair reply")),
        }
    }

    async fn session_state(
        &self,
        session: &SessionKey,
    ) -> Result<Option<SessionState>, StoreError> {
        let script = &scripts().session_state;
        let cmd = self.evalsha(script, &session.record_key());
        let reply: Vec<Value> = self.query(script, cmd).await?;
        match reply.as_slice() {
            [] => Ok(None),
            [epoch, ack, high] => {
                let n = |v: &Value| number(v).and_then(|n| u64::try_from(n).ok());
                match (n(epoch), n(ack), n(high)) {
                    (Some(epoch), Some(ack), Some(high)) => {
                        Ok(Some(SessionState { epoch, ack, high }))
                    }
                    _ => Err(corrupt("a session's record is not a valid session")),
                }
            }
            _ => Err(corrupt("unexpected session reply")),
        }
    }
}

/// A Redis Cluster's primaries (`CLUSTER SLOTS`), by address, sorted.
async fn primaries(cluster: &mut ClusterConnection) -> Result<Vec<(String, u16)>, StoreError> {
    let reply = cluster
        .route_command(
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await
        .map_err(crate::store_error)?;
    let Value::Array(ranges) = reply else {
        return Err(corrupt("unexpected CLUSTER SLOTS reply"));
    };
    let mut found = Vec::new();
    for range in &ranges {
        let Value::Array(parts) = range else { continue };
        let Some(Value::Array(primary)) = parts.get(2) else {
            continue;
        };
        let (Some(host), Some(port)) = (
            primary.first().and_then(text),
            primary.get(1).and_then(number),
        ) else {
            continue;
        };
        if let (Ok(host), Ok(port)) = (std::str::from_utf8(host), u16::try_from(port)) {
            found.push((host.to_owned(), port));
        }
    }
    found.sort();
    found.dedup();
    Ok(found)
}
