//! [`RedisStoreBuilder`]: key prefix, replicas to wait for, timeouts, and connecting to one
//! server or a Redis Cluster.

use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use super::{Connection, RedisStore, store_error};
use idempotent_core::StoreError;

/// The default connection and response timeout of a [`RedisStore`]: 2 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Configures a [`RedisStore`]. Created by [`RedisStore::builder`].
#[derive(Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    pub(super) url: String,
    pub(super) prefix: String,
    pub(super) timeout: Duration,
    pub(super) replicas: usize,
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
    /// The prefix of every Redis key the store writes (default [`DEFAULT_KEY_PREFIX`](super::DEFAULT_KEY_PREFIX)), to
    /// separate applications sharing one Redis.
    ///
    /// A prefix holding a Redis Cluster hash tag (`{…}`) puts every record in that tag's one
    /// slot. On a cluster, a prefix whose first `{` is followed by `}` is refused by
    /// [`connect`](Self::connect): it would spread a client session's records over slots
    /// (see [Sessions](RedisStore#sessions)).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Makes every claim and every completion (and every [checkpoint](idempotent_core::steps) and saved
    /// request) wait until at least `replicas` replicas of the record's primary have
    /// acknowledged it (`WAIT`), for at most half the [`timeout`](Self::timeout); default 0,
    /// none.
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
    /// [`StoreError::Unavailable`] (default [`DEFAULT_TIMEOUT`]). [`Duration::MAX`] is no
    /// timeout; each [`replicas`](Self::replicas) `WAIT` then waits at most 365 days (Redis
    /// refuses an endless one), in practice no limit either.
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
            if self
                .prefix
                .find('{')
                .is_some_and(|at| self.prefix[at + 1..].starts_with('}'))
            {
                return Err(StoreError::Backend(
                    format!(
                        "the key prefix {:?} begins an empty hash tag: a Redis Cluster would \
                         spread a session's records over slots",
                        self.prefix
                    )
                    .into(),
                ));
            }
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
            let manager = ConnectionManager::new_with_config(client.clone(), config.clone())
                .await
                .map_err(store_error)?;
            Connection::Node(Node::new(client, config, manager))
        };
        Ok(RedisStore {
            connection,
            prefix: self.prefix.into(),
            replicas: (self.replicas > 0).then_some((self.replicas, self.timeout / 2)),
        })
    }
}

/// One server's connection: a [`ConnectionManager`] (one multiplexed connection, reconnected
/// when it breaks), replaced by a new one when a command on it times out.
///
/// A timeout does not break the connection as far as the manager is concerned, so it would
/// keep it; but on a link that stopped carrying packets (a network partition) the commands
/// written to it wait for TCP to retransmit them, and once the link is back that happens only
/// at the next step of TCP's backoff, seconds later: every command pipelined on the connection
/// meanwhile would time out too. A connection whose command timed out is suspect: the next
/// command goes to a new one (connected on first use), and the old one is closed when the
/// commands still on it are done. A command is never sent again by this: one that timed out
/// is reported as such, whether or not the server ran it.
#[derive(Clone)]
pub(crate) struct Node(Arc<NodeInner>);

struct NodeInner {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// The manager in use, and how many were replaced before it.
    current: RwLock<(u64, ConnectionManager)>,
}

impl Node {
    fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        manager: ConnectionManager,
    ) -> Self {
        Node(Arc::new(NodeInner {
            client,
            config,
            current: RwLock::new((0, manager)),
        }))
    }

    /// The manager in use and its generation.
    fn current(&self) -> (u64, ConnectionManager) {
        self.0
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// After a command on the manager of `generation` ended with `result`: a timeout replaces
    /// that manager, unless another command replaced it already.
    fn settle<T>(&self, generation: u64, result: &RedisResult<T>) {
        let Err(error) = result else {
            return;
        };
        if !error.is_timeout() {
            return;
        }
        self.replace(generation, error);
    }

    /// Replaces the manager of `generation`, unless another command replaced it already.
    fn replace(&self, generation: u64, error: &(dyn std::error::Error + 'static)) {
        let mut current = self
            .0
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if current.0 != generation {
            return;
        }
        // Lazy: connects on the next command, so a partition that lasts costs each command
        // one connection attempt (bounded by the connection timeout), not a reconnect loop.
        match ConnectionManager::new_lazy_with_config(self.0.client.clone(), self.0.config.clone())
        {
            Ok(manager) => {
                tracing::debug!(
                    error,
                    "a redis command timed out; its connection is replaced"
                );
                *current = (generation + 1, manager);
            }
            // Only a configuration this store never makes fails here; keep the old one.
            Err(error) => tracing::warn!(
                error = &error as &dyn std::error::Error,
                "could not replace a redis connection whose command timed out"
            ),
        }
    }
}

/// A command given up by its caller (its future dropped: the runtime bounds each store call
/// by its own limit, which can be shorter than the response timeout) after waiting this long
/// for its answer is taken as a timeout: its connection is replaced. A healthy server answers
/// in well under a millisecond; a caller that merely went away sooner (a client that closed
/// its connection) replaces nothing.
pub(crate) const GIVEN_UP_AFTER: Duration = Duration::from_millis(500);

/// Watches one command: dropped before its answer came, after [`GIVEN_UP_AFTER`], it replaces
/// the connection as a timeout would.
struct Watch<'a> {
    node: &'a Node,
    generation: u64,
    sent: Instant,
    answered: bool,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        if !self.answered && self.sent.elapsed() >= GIVEN_UP_AFTER {
            let error = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "a redis command was given up unanswered",
            );
            self.node.replace(self.generation, &error);
        }
    }
}

impl ConnectionLike for Node {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let (generation, mut manager) = self.current();
        let node: &Node = self;
        Box::pin(async move {
            let mut watch = Watch {
                node,
                generation,
                sent: Instant::now(),
                answered: false,
            };
            let result = manager.send_packed_command(cmd).await;
            watch.answered = true;
            node.settle(generation, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let (generation, mut manager) = self.current();
        let node: &Node = self;
        Box::pin(async move {
            let mut watch = Watch {
                node,
                generation,
                sent: Instant::now(),
                answered: false,
            };
            let result = manager.send_packed_commands(pipeline, offset, count).await;
            watch.answered = true;
            node.settle(generation, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().1.get_db()
    }
}
