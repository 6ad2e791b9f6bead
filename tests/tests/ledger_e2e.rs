//! The `ledger` consumer with real Redis, PostgreSQL and processes: 1,000 stream entries over
//! 200 accounts, 20% of them duplicate ids (some adjacent, some far apart) and a few malformed,
//! consumed by two consumers that are killed with SIGKILL at random moments and restarted.
//! When the group has nothing pending and nothing unread, every balance must equal the sum over
//! distinct ids, and the dead-letter stream must hold exactly the malformed entries.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::Duration;

use idempotent_core::conformance::backend_url;
use redis::aio::MultiplexedConnection;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A small deterministic generator, so a failing run can be repeated from its printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

enum Entry {
    Posting {
        id: String,
        account: String,
        amount: i64,
    },
    Malformed(Vec<(&'static str, String)>),
}

/// 800 distinct postings, 200 duplicates (half right after their original, half far later),
/// and 6 malformed entries, in publication order.
fn workload(rng: &mut Rng) -> Vec<Entry> {
    let posting = |i: u64| Entry::Posting {
        id: format!("pay-{i}"),
        account: format!("acct-{}", i % 200),
        amount: ((i * 7919) % 2001) as i64 - 1000,
    };
    let mut entries = Vec::new();
    let mut far = Vec::new();
    for i in 0..800u64 {
        entries.push(posting(i));
        if i % 8 == 0 {
            entries.push(posting(i)); // a producer retry, adjacent
        }
        if i % 8 == 4 {
            far.push(i);
        }
    }
    for i in far {
        // a redelivery far from the original
        let at = entries.len() - rng.below(entries.len() as u64 / 4) as usize;
        entries.insert(at, posting(i));
    }
    let malformed: [Vec<(&'static str, String)>; 6] = [
        vec![("id", "bad-1".into()), ("amount", "5".into())],
        vec![
            ("id", "bad-2".into()),
            ("account", "acct-1".into()),
            ("amount", "12.5".into()),
        ],
        vec![
            ("id", "bad-3".into()),
            ("account", "acct-2".into()),
            ("amount", "abc".into()),
        ],
        vec![("account", "acct-3".into()), ("amount", "7".into())],
        vec![
            ("id", "".into()),
            ("account", "acct-4".into()),
            ("amount", "7".into()),
        ],
        vec![
            ("id", "bad-6".into()),
            ("account", "acct-5".into()),
            ("amount", "99999999999999999999".into()),
        ],
    ];
    for (n, fields) in malformed.into_iter().enumerate() {
        let at = (n + 1) * entries.len() / 7;
        entries.insert(at, Entry::Malformed(fields));
    }
    entries
}

struct Consumer {
    child: Child,
    name: String,
}

async fn start_consumer(env: &[(&str, String)], name: String) -> Consumer {
    let mut child = Command::new(support::example_binary("ledger"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("CONSUMER", &name)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the ledger example");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the consumer did not start within 30 s")
        .unwrap()
        .expect("the consumer exited before it was ready");
    assert!(
        line.starts_with("consuming ") && line.ends_with(&format!(" as {name}")),
        "{line}"
    );
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Consumer { child, name }
}

fn signal(child: &Child, signal: &str) {
    let pid = child.id().expect("running consumer");
    let ok = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{signal} {pid}");
}

async fn group_drained(redis: &mut MultiplexedConnection, stream: &str, last_id: &str) -> bool {
    let pending: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg("ledger")
        .query_async(redis)
        .await
        .unwrap();
    let pending = match pending {
        redis::Value::Array(v) => matches!(v.first(), Some(redis::Value::Int(0))),
        _ => false,
    };
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(redis)
        .await
        .unwrap();
    let delivered = groups.iter().any(|group| {
        let fields: Vec<(String, redis::Value)> = match group {
            redis::Value::Array(flat) => flat
                .chunks(2)
                .filter_map(|kv| match (&kv[0], kv.get(1)) {
                    (redis::Value::BulkString(k), Some(v)) => {
                        Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                    }
                    _ => None,
                })
                .collect(),
            redis::Value::Map(pairs) => pairs
                .iter()
                .filter_map(|(k, v)| match k {
                    redis::Value::BulkString(k) => {
                        Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                    }
                    redis::Value::SimpleString(k) => Some((k.clone(), v.clone())),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        fields.iter().any(|(k, v)| {
            k == "last-delivered-id"
                && matches!(v, redis::Value::BulkString(id) if id == last_id.as_bytes())
        })
    });
    pending && delivered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_are_exact_after_duplicates_malformed_entries_and_kills() {
    let Some(redis_url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
        return;
    };
    let Some(postgres_url) = backend_url("IDEMPOTENT_TEST_POSTGRES_URL") else {
        return;
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("ledger e2e seed: {seed}");
    let mut rng = Rng(seed);

    // A database and a stream of our own.
    let tag = format!("ledger_e2e_{}", std::process::id());
    let admin = sqlx::PgPool::connect(&postgres_url).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {tag}"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {tag}"))
        .execute(&admin)
        .await
        .unwrap();
    let database_url = format!("{}/{tag}", postgres_url.rsplit_once('/').unwrap().0);
    let stream = tag.clone();
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .arg(format!("{stream}:dead"))
        .query_async(&mut redis)
        .await
        .unwrap();

    let entries = workload(&mut rng);
    assert_eq!(entries.len(), 1006);
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for entry in &entries {
        if let Entry::Posting {
            id,
            account,
            amount,
        } = entry
        {
            if seen.insert(id.clone()) {
                *expected.entry(account.clone()).or_default() += amount;
            }
        }
    }
    assert_eq!(seen.len(), 800);

    let env = vec![
        ("REDIS_URL", redis_url.clone()),
        ("DATABASE_URL", database_url.clone()),
        ("STREAM", stream.clone()),
        ("CLAIM_IDLE", "1s".to_owned()),
        ("EFFECT_DELAY_MS", "3".to_owned()),
    ];
    let mut consumers = vec![
        start_consumer(&env, "c0-0".into()).await,
        start_consumer(&env, "c1-0".into()).await,
    ];

    // Publish while the consumers run.
    let publisher = tokio::spawn({
        let mut redis = redis.clone();
        let stream = stream.clone();
        async move {
            let (mut malformed_ids, mut last) = (BTreeSet::new(), String::new());
            for (n, entry) in entries.iter().enumerate() {
                let mut cmd = redis::cmd("XADD");
                cmd.arg(&stream).arg("*");
                match entry {
                    Entry::Posting {
                        id,
                        account,
                        amount,
                    } => {
                        cmd.arg("id")
                            .arg(id)
                            .arg("account")
                            .arg(account)
                            .arg("amount")
                            .arg(amount);
                    }
                    Entry::Malformed(fields) => {
                        for (k, v) in fields {
                            cmd.arg(*k).arg(v);
                        }
                    }
                }
                last = cmd.query_async(&mut redis).await.unwrap();
                if matches!(entry, Entry::Malformed(_)) {
                    malformed_ids.insert(last.clone());
                }
                if n % 50 == 49 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            (malformed_ids, last)
        }
    });

    // Kill consumers at random moments, and restart them.
    for round in 1..=6 {
        tokio::time::sleep(Duration::from_millis(150 + rng.below(500))).await;
        let victim = rng.below(2) as usize;
        signal(&consumers[victim].child, "KILL");
        let _ = consumers[victim].child.wait().await;
        eprintln!("killed {} in round {round}", consumers[victim].name);
        consumers[victim] = start_consumer(&env, format!("c{victim}-{round}")).await;
    }

    let (malformed_ids, last_id) = publisher.await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while !group_drained(&mut redis, &stream, &last_id).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the group never drained"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // SIGTERM: each consumer finishes the entry in hand and exits 0.
    for consumer in &mut consumers {
        signal(&consumer.child, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(10), consumer.child.wait())
            .await
            .expect("the consumer did not stop on SIGTERM")
            .unwrap();
        assert!(status.success(), "{}: {status}", consumer.name);
    }

    let db = sqlx::PgPool::connect(&database_url).await.unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT account, balance FROM accounts")
        .fetch_all(&db)
        .await
        .unwrap();
    let balances: BTreeMap<String, i64> = rows.into_iter().collect();
    assert_eq!(balances.len(), 200);
    assert_eq!(
        balances, expected,
        "every balance is the sum over distinct ids"
    );

    let dead: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(format!("{stream}:dead"))
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    let dead_entries: Vec<String> = dead
        .iter()
        .map(|(_, fields)| {
            fields
                .iter()
                .find(|(k, _)| k == "entry")
                .expect("entry field")
                .1
                .clone()
        })
        .collect();
    assert_eq!(
        dead_entries.len(),
        malformed_ids.len(),
        "each malformed entry dead-lettered once"
    );
    assert_eq!(
        dead_entries.into_iter().collect::<BTreeSet<_>>(),
        malformed_ids
    );
    assert!(
        dead.iter()
            .all(|(_, f)| f.iter().any(|(k, v)| k == "reason" && !v.is_empty()))
    );

    drop(db);
    sqlx::query(&format!("DROP DATABASE IF EXISTS {tag} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}
