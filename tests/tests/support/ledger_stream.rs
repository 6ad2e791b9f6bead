//! A PostgreSQL database and a Redis stream of one ledger test's own: publishing entries,
//! reading what the consumer group has pending and delivered, the dead-letter stream, and the
//! balances the consumers wrote.

use std::collections::BTreeMap;
use std::time::Duration;

use idempotent_test_kit::backend::redis_url;
use idempotent_test_kit::postgres::Database;
use redis::Value;
use redis::aio::MultiplexedConnection;
use sqlx::PgPool;

use super::ledger::Deadline;

/// The consumer group the example creates.
pub const GROUP: &str = "ledger";

/// The example's table, created here by tests that need a row before a consumer starts.
pub const ACCOUNTS_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS accounts (account text PRIMARY KEY, balance bigint NOT NULL)";

/// A PostgreSQL database and a Redis stream of one test's own.
pub struct Fixture {
    pub db: Database,
    pub redis_url: String,
    pub stream: String,
    pub redis: MultiplexedConnection,
}

impl Fixture {
    /// `None` when the backends are not configured (and not required).
    pub async fn new(name: &str) -> Option<Fixture> {
        let redis_url = redis_url()?;
        let db = Database::create(&format!("ledger_{name}_{}", std::process::id())).await?;
        let stream = db.name.clone();
        let client = redis::Client::open(redis_url.as_str()).unwrap();
        let mut redis = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .arg(format!("{stream}:dead"))
            .query_async(&mut redis)
            .await
            .unwrap();
        Some(Fixture {
            db,
            redis_url,
            stream,
            redis,
        })
    }

    /// The consumers' environment: this fixture's servers and stream, and `settings`.
    pub fn env(&self, settings: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("REDIS_URL", self.redis_url.clone()),
            ("DATABASE_URL", self.db.url.clone()),
            ("STREAM", self.stream.clone()),
        ];
        env.extend(settings.iter().map(|(k, v)| (*k, (*v).to_owned())));
        env
    }

    pub async fn db(&self) -> PgPool {
        self.db.pool().await
    }

    /// Adds an entry with `fields` to the stream; its id.
    pub async fn publish(&mut self, fields: &[(&str, &[u8])]) -> String {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream).arg("*");
        for (name, value) in fields {
            cmd.arg(*name).arg(*value);
        }
        cmd.query_async(&mut self.redis).await.unwrap()
    }

    /// Publishes a posting; its entry id.
    pub async fn post(&mut self, id: &str, account: &str, amount: i64) -> String {
        let amount = amount.to_string();
        self.publish(&[
            ("id", id.as_bytes()),
            ("account", account.as_bytes()),
            ("amount", amount.as_bytes()),
        ])
        .await
    }

    /// Creates the group and delivers every entry published so far to `consumer`, which never
    /// acknowledges them: they stay pending under its name, as with a consumer that died.
    pub async fn deliver_to_dead_consumer(&mut self, consumer: &str) {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(GROUP)
            .arg("0")
            .query_async(&mut self.redis)
            .await
            .unwrap();
        let _: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(consumer)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.redis)
            .await
            .unwrap();
    }

    pub async fn balances(&self, db: &PgPool) -> BTreeMap<String, i64> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT account, balance FROM accounts")
            .fetch_all(db)
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    /// How many times the group delivered `entry`, if it is pending.
    pub async fn deliveries(&mut self, entry: &str) -> Option<u64> {
        let reply: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(entry)
            .arg(entry)
            .arg(1)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        match reply {
            Value::Array(rows) => match rows.first() {
                Some(Value::Array(row)) => match row.get(3) {
                    Some(Value::Int(n)) => u64::try_from(*n).ok(),
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        }
    }

    /// The dead-letter stream's entries, oldest first.
    pub async fn dead_letters(&mut self) -> Vec<DeadLetter> {
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(format!("{}:dead", self.stream))
            .arg("-")
            .arg("+")
            .query_async(&mut self.redis)
            .await
            .unwrap();
        entries
            .into_iter()
            .map(|(_, fields)| DeadLetter { fields })
            .collect()
    }

    /// Whether the group has nothing pending and has delivered everything up to `last_id`.
    ///
    /// The group's last delivered entry is read before its pending entries: read the other way
    /// round, an entry delivered between the two reads would be seen delivered and, not yet
    /// pending at the first read, acknowledged while it is still being handled. Read this way,
    /// an entry seen delivered was pending before the second read began, and is not pending at
    /// it only once acknowledged.
    pub async fn drained(&mut self, last_id: &str) -> bool {
        let groups: Vec<Value> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.stream)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        let delivered = groups.iter().any(|group| {
            let fields: Vec<(String, Value)> = match group {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|kv| match (&kv[0], kv.get(1)) {
                        (Value::BulkString(k), Some(v)) => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                Value::Map(pairs) => pairs
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Value::BulkString(k) => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        Value::SimpleString(k) => Some((k.clone(), v.clone())),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            fields.iter().any(|(k, v)| {
                k == "last-delivered-id"
                    && matches!(v, Value::BulkString(id) if id == last_id.as_bytes())
            })
        });
        if !delivered {
            return false;
        }
        let pending: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(GROUP)
            .query_async(&mut self.redis)
            .await
            .unwrap();
        match pending {
            Value::Array(v) => matches!(v.first(), Some(Value::Int(0))),
            _ => false,
        }
    }

    pub async fn wait_drained(&mut self, last_id: &str, within: Duration) {
        let deadline = Deadline::after(within, "the group never drained");
        while !self.drained(last_id).await {
            deadline.tick().await;
        }
    }

    pub async fn drop_database(self) {
        self.db.drop_database().await;
    }
}

/// A stream entry's fields, in order.
pub type Fields = Vec<(String, Vec<u8>)>;

/// One entry of the dead-letter stream.
pub struct DeadLetter {
    pub fields: Fields,
}

impl DeadLetter {
    /// The first field called `name`, as text.
    pub fn field(&self, name: &str) -> String {
        let (_, value) = self
            .fields
            .iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("dead letter without `{name}`"));
        String::from_utf8_lossy(value).into_owned()
    }

    /// The original entry's fields, after `reason`, `entry` and `deliveries`.
    pub fn original_fields(&self) -> &[(String, Vec<u8>)] {
        let names: Vec<&str> = self
            .fields
            .iter()
            .take(3)
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(names, ["reason", "entry", "deliveries"]);
        &self.fields[3..]
    }
}
