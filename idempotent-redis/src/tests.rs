//! The Redis store's own tests against a real server: expiry checks, resent claims, the
//! scripts' answers to garbage, the fields checkpoints and requests keep (feature
//! `test-util`).

use super::*;
use idempotent_core::conformance::{backend_url, fresh_key};

#[test]
fn expiries_are_whole_milliseconds_up_to_the_ceiling() {
    assert_eq!(MAX_EXPIRY_MS, 365 * 24 * 3600 * 1000);
    assert_eq!(millis(Duration::ZERO), 1);
    assert_eq!(millis(Duration::from_micros(1500)), 1);
    assert_eq!(millis(Duration::from_secs(2)), 2000);
    assert_eq!(millis(Duration::MAX), MAX_EXPIRY_MS);
}

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

/// An expiry a script cannot use is refused before the script writes anything: no claim
/// without an expiry, no completed record with the lease's expiry, no lease changed, no
/// session started or refreshed.
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

        let session = idempotent_core::conformance::fresh_session();
        let session_key = store.redis_key(&session.record_key());
        let gate = async |connection: &mut Connection, idle: &str| -> Result<Value, _> {
            scripts()
                .session
                .key(&session_key)
                .arg(1)
                .arg(0)
                .arg(8)
                .arg(idle)
                .invoke_async(connection)
                .await
        };
        let started = gate(&mut connection, bad).await;
        assert!(started.is_err(), "session with {bad}: {started:?}");
        let exists: i64 = redis::cmd("EXISTS")
            .arg(&session_key)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert_eq!(exists, 0, "a session started with {bad}");
        session_gate(&gate(&mut connection, "5000").await.unwrap()).unwrap();
        let refreshed = gate(&mut connection, bad).await;
        assert!(refreshed.is_err(), "session with {bad}: {refreshed:?}");
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&session_key)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(
            (1..=5_000).contains(&pttl),
            "{bad}: the session's expiry stays: {pttl}"
        );
    }
}

/// The session script's replies, and anything else, as the gate's decision or a corrupt store.
#[test]
fn session_gate_replies_decode_or_are_corrupt() {
    let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
    let reply = |parts: &[&str]| Value::Array(parts.iter().map(|p| text(p)).collect());
    assert_eq!(
        session_gate(&reply(&["open", "1764000000000000"])).unwrap(),
        SessionGate::Open {
            epoch: 1_764_000_000_000_000
        }
    );
    assert_eq!(
        session_gate(&reply(&["ack", "7"])).unwrap(),
        SessionGate::Acknowledged { ack: 7 }
    );
    assert_eq!(
        session_gate(&reply(&["window", "0"])).unwrap(),
        SessionGate::WindowFull { ack: 0 }
    );
    assert_eq!(
        session_gate(&reply(&["expired"])).unwrap(),
        SessionGate::Expired
    );
    for garbage in [
        reply(&["?", "ack"]),
        reply(&["open", "x"]),
        reply(&["open", "-1"]),
        reply(&["open"]),
        reply(&["ack", "1", "2"]),
        reply(&["closed", "1"]),
        reply(&[]),
        text("open"),
        Value::Int(1),
        Value::Nil,
        Value::Array(vec![text("open"), Value::Int(5)]),
    ] {
        assert!(
            matches!(session_gate(&garbage), Err(StoreError::Corrupt(_))),
            "{garbage:?}"
        );
    }
}

/// Every kind of storage key is named by its member of the index of saved requests, and
/// anything else names none.
#[test]
fn index_members_name_their_keys() {
    let key = fresh_key();
    let session = idempotent_core::SessionKey::from_bytes(*key.as_bytes());
    let seq = session.seq_key(1_764_000_000_000_000, 42);
    for k in [key, session.record_key(), seq] {
        let name = member(&k);
        assert_eq!(key_of_member(name.as_bytes()), Some(k), "{name}");
    }
    assert_eq!(member(&key), key.to_hex());
    let upper = key.to_hex().to_uppercase();
    assert_eq!(key_of_member(upper.as_bytes()), Some(key));
    let hex = key.to_hex();
    for garbage in [
        String::new(),
        "abandoned".into(),
        hex[..63].into(),
        format!("{hex}0"),
        format!("{}g", &hex[..63]),
        format!("{{{hex}"),
        format!("{{{hex}}}:"),
        format!("{{{hex}}}:1"),
        format!("{{{hex}}}:1:"),
        format!("{{{hex}}}:x:1"),
        format!("{{{hex}}}:+1:1"),
        format!("{{{hex}}}:1:2:3"),
        format!("{{{hex}}}:1:99999999999999999999"),
        format!("{{{hex}}}x"),
        format!("{{{}}}", &hex[..62]),
        "é".repeat(32),
    ] {
        assert_eq!(key_of_member(garbage.as_bytes()), None, "{garbage:?}");
    }
}

#[test]
fn decimals_of_replies() {
    let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
    assert_eq!(decimal(&text("1764000000000")), Some(1_764_000_000_000));
    assert_eq!(decimal(&Value::Int(7)), Some(7));
    for garbage in [
        text(""),
        text("-1"),
        text("+1"),
        text("1.5"),
        text("1e12"),
        text("99999999999999999999"),
        Value::Int(-1),
        Value::Nil,
    ] {
        assert_eq!(decimal(&garbage), None, "{garbage:?}");
    }
}

/// The checkpoints (its chunks `k`, `k1`.. `k<kn>` joined; `None` when the record has no
/// field of them at all, `kn` included) and the request (`r`) of a record, as Redis has them.
async fn fields(connection: &mut Connection, name: &str) -> Vec<Option<Vec<u8>>> {
    let all: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(name)
        .query_async(connection)
        .await
        .unwrap();
    let chunked = |field: &str| {
        field == "k"
            || field
                .strip_prefix('k')
                .is_some_and(|n| n == "n" || n.parse::<u32>().is_ok())
    };
    let steps = all.keys().any(|field| chunked(field)).then(|| {
        let count: u32 = all
            .get("kn")
            .map_or(0, |n| std::str::from_utf8(n).unwrap().parse().unwrap());
        let mut joined = all.get("k").cloned().unwrap_or_default();
        for i in 1..=count {
            joined.extend_from_slice(&all[&format!("k{i}")]);
        }
        joined
    });
    vec![steps, all.get("r").cloned()]
}

/// The score of `key`'s member of the index of saved requests.
async fn score(store: &RedisStore, key: &StorageKey) -> Option<u64> {
    let mut connection = store.connection.clone();
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(store.index_key())
        .arg(member(key))
        .query_async(&mut connection)
        .await
        .unwrap();
    score.map(|s| s as u64)
}

/// The checkpoints (`k`) and the request (`r`) are kept by a takeover and dropped, in the
/// record's own script, by a claim that begins a new lifetime and by a completion; the index
/// follows.
#[tokio::test]
async fn checkpoints_and_request_fields_follow_the_lifetime() {
    let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
        return;
    };
    let prefix = format!("fields-{}:", &fresh_key().to_hex()[..16]);
    let store = RedisStore::builder(&url)
        .key_prefix(prefix)
        .connect()
        .await
        .unwrap();
    let mut connection = store.connection.clone();
    let key = fresh_key();
    let name = store.redis_key(&key);
    let (f, other) = (
        Fingerprint::from_bytes(b"one"),
        Fingerprint::from_bytes(b"two"),
    );
    let terms = (Duration::from_secs(30), Duration::from_secs(60));
    let claim = async |f: &Fingerprint| store.claim(&key, f, terms.0, terms.1).await.unwrap();
    let saved = Some(b"step".to_vec());
    let request = Some(b"request".to_vec());

    let Claim::Claimed(token) = claim(&f).await else {
        panic!("a fresh key is claimed");
    };
    assert_eq!(fields(&mut connection, &name).await, [None, None]);
    store.save_step(&key, token, "st".into()).await.unwrap();
    store.save_step(&key, token, "ep".into()).await.unwrap();
    store
        .save_request(&key, token, "request".into())
        .await
        .unwrap();
    assert_eq!(
        fields(&mut connection, &name).await,
        [saved.clone(), request.clone()]
    );
    // Indexed before the request was written, scored with the server's time: at most the
    // lease's end.
    let lease_end: u64 = redis::cmd("HGET")
        .arg(&name)
        .arg("l")
        .query_async(&mut connection)
        .await
        .unwrap();
    let indexed = score(&store, &key).await.expect("indexed");
    assert!(indexed > 0 && indexed <= lease_end, "{indexed} {lease_end}");

    // A release ends the lease now, and moves the score with it.
    store.release(&key, token).await.unwrap();
    let released: u64 = redis::cmd("HGET")
        .arg(&name)
        .arg("l")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(
        released > 0 && released < lease_end,
        "{released} {lease_end}"
    );
    assert_eq!(score(&store, &key).await, Some(released));

    let Claim::TakenOver { token, .. } = claim(&f).await else {
        panic!("the same request takes over");
    };
    assert_eq!(
        fields(&mut connection, &name).await,
        [saved.clone(), request.clone()],
        "a takeover keeps them"
    );
    store.release(&key, token).await.unwrap();

    // Another request is refused while the record is kept, and changes nothing.
    assert!(matches!(claim(&other).await, Claim::InFlight { .. }));
    assert_eq!(
        fields(&mut connection, &name).await,
        [saved.clone(), request.clone()],
        "another request's claim keeps them"
    );
    // A record written before lifetimes (no `o`): its request's claim begins one.
    let _: () = redis::cmd("HDEL")
        .arg(&name)
        .arg("o")
        .query_async(&mut connection)
        .await
        .unwrap();
    let Claim::Claimed(token) = claim(&f).await else {
        panic!("a record without a lifetime begins a new one");
    };
    assert_eq!(
        fields(&mut connection, &name).await,
        [None, None],
        "a new lifetime drops them"
    );
    assert!(
        score(&store, &key).await.is_some(),
        "its member is left for `abandoned` to remove"
    );
    assert!(
        store
            .abandoned(Duration::ZERO, 10, None)
            .await
            .unwrap()
            .is_empty()
    );
    // In flight without a request (one may be on its way): kept, read again once its lease
    // has ended.
    let lease_end: u64 = redis::cmd("HGET")
        .arg(&name)
        .arg("l")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        score(&store, &key).await,
        Some(lease_end),
        "scored with the new lease's end once read"
    );

    store.save_step(&key, token, "step".into()).await.unwrap();
    store
        .save_request(&key, token, "request".into())
        .await
        .unwrap();
    assert!(score(&store, &key).await.is_some());
    store
        .complete(&key, token, "done".into(), terms.1)
        .await
        .unwrap();
    assert_eq!(
        fields(&mut connection, &name).await,
        [None, None],
        "a completion drops them"
    );
    assert_eq!(
        score(&store, &key).await,
        None,
        "and the member of the index"
    );
    // A repeated completion changes nothing.
    store
        .complete(&key, token, "done".into(), terms.1)
        .await
        .unwrap();
    match claim(&f).await {
        Claim::Completed { payload, .. } => assert_eq!(&payload[..], b"done"),
        other => panic!("the record is completed: {other:?}"),
    }
}

/// A key of another type is an error for every step operation, never a panic or a
/// checkpoint written over it.
#[tokio::test]
async fn steps_on_a_key_of_another_type_are_errors() {
    let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let mut connection = store.connection.clone();
    let key = fresh_key();
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&key))
        .arg("x")
        .query_async(&mut connection)
        .await
        .unwrap();
    let token = FencingToken::new(1);
    assert!(matches!(
        store.save_step(&key, token, "x".into()).await,
        Err(StoreError::Backend(_))
    ));
    assert!(matches!(
        store.load_steps(&key, token).await,
        Err(StoreError::Backend(_))
    ));
    assert!(matches!(
        store.save_request(&key, token, "x".into()).await,
        Err(StoreError::Backend(_))
    ));
    let kept: String = redis::cmd("GET")
        .arg(store.redis_key(&key))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(kept, "x");
}

/// Saving a checkpoint writes a field of its own (`k`, then `k1`, `k2`, ...), never the
/// earlier ones again: the work of one save does not grow with the operation's steps. A
/// record written before chunks (everything in `k`) reads the same and takes more; a damaged
/// count is a corrupt record, not a panic or a short read.
#[tokio::test]
async fn each_checkpoint_is_a_field_of_its_own() {
    let Some(url) = backend_url("IDEMPOTENT_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let mut connection = store.connection.clone();
    let key = fresh_key();
    let name = store.redis_key(&key);
    let f = Fingerprint::from_bytes(b"chunks");
    let Claim::Claimed(token) = store
        .claim(&key, &f, Duration::from_secs(30), Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let mut expected = Vec::new();
    for i in 0..100u32 {
        let entry = format!("<{i}>");
        store
            .save_step(&key, token, entry.clone().into())
            .await
            .unwrap();
        expected.extend_from_slice(entry.as_bytes());
    }
    let field = async |connection: &mut Connection, field: &str| -> Option<Vec<u8>> {
        redis::cmd("HGET")
            .arg(&name)
            .arg(field)
            .query_async(connection)
            .await
            .unwrap()
    };
    assert_eq!(
        field(&mut connection, "k").await.as_deref(),
        Some(&b"<0>"[..])
    );
    assert_eq!(
        field(&mut connection, "k99").await.as_deref(),
        Some(&b"<99>"[..])
    );
    assert_eq!(
        field(&mut connection, "kn").await.as_deref(),
        Some(&b"99"[..])
    );
    assert_eq!(
        &store.load_steps(&key, token).await.unwrap()[..],
        &expected[..]
    );

    // As 0.3 wrote them: all in `k`; one more save goes to a chunk after it.
    let _: () = redis::cmd("HDEL")
        .arg(&name)
        .arg((1..=99).map(|i| format!("k{i}")).collect::<Vec<_>>())
        .arg("kn")
        .query_async(&mut connection)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&name)
        .arg("k")
        .arg("<a><b>")
        .query_async(&mut connection)
        .await
        .unwrap();
    store.save_step(&key, token, "<c>".into()).await.unwrap();
    assert_eq!(
        &store.load_steps(&key, token).await.unwrap()[..],
        b"<a><b><c>"
    );

    // Garbage in the count, or a chunk gone: corrupt.
    for (field, value) in [("kn", "x"), ("kn", "5"), ("kn", "1000000000")] {
        let _: () = redis::cmd("HSET")
            .arg(&name)
            .arg(field)
            .arg(value)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(
            matches!(
                store.load_steps(&key, token).await,
                Err(StoreError::Corrupt(_))
            ),
            "{field}={value}"
        );
    }
    // A completion drops every chunk, found by name whatever the count says.
    let _: () = redis::cmd("HSET")
        .arg(&name)
        .arg("kn")
        .arg("x")
        .query_async(&mut connection)
        .await
        .unwrap();
    store
        .complete(&key, token, "done".into(), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(fields(&mut connection, &name).await, [None, None]);
}

/// A server that answers every command (`+PONG` to `PING`, `+OK` to the rest) until told to
/// hold its answers, which it sends once told to speak again; counts the connections it took.
struct Holding {
    url: String,
    hold: tokio::sync::watch::Sender<bool>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl Holding {
    async fn start() -> Holding {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let (hold, holding) = tokio::sync::watch::channel(false);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut holding = holding.clone();
                tokio::spawn(async move {
                    let (read, mut write) = socket.into_split();
                    let mut read = tokio::io::BufReader::new(read);
                    let mut line = String::new();
                    loop {
                        // One command: `*N`, then N bulk strings.
                        line.clear();
                        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let parts: usize = line.trim()[1..].parse().unwrap_or(0);
                        let mut first = Vec::new();
                        for i in 0..parts {
                            line.clear();
                            if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            let len: usize = line.trim()[1..].parse().unwrap_or(0);
                            let mut bulk = vec![0; len + 2];
                            if read.read_exact(&mut bulk).await.is_err() {
                                return;
                            }
                            if i == 0 {
                                bulk.truncate(len);
                                first = bulk;
                            }
                        }
                        if holding.wait_for(|hold| !hold).await.is_err() {
                            return;
                        }
                        let answer: &[u8] = if first.eq_ignore_ascii_case(b"PING") {
                            b"+PONG\r\n"
                        } else {
                            b"+OK\r\n"
                        };
                        if write.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Holding {
            url,
            hold,
            accepted,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A command its caller gave up on (the runtime's own limit on a store call can be shorter
/// than the response timeout) after it waited past `GIVEN_UP_AFTER` makes its connection
/// suspect, like a timeout: the next command goes to a new connection rather than queue
/// behind the silent one (after a partition, that one waits for TCP's next retransmission).
#[tokio::test]
async fn a_command_given_up_unanswered_replaces_its_connection() {
    let server = Holding::start().await;
    let store = RedisStore::builder(&server.url)
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    let ping = |store: &RedisStore| {
        let mut connection = store.connection.clone();
        async move {
            redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
        }
    };
    assert_eq!(ping(&store).await.unwrap(), "PONG");
    let connections = server.accepted();

    // Given up sooner than GIVEN_UP_AFTER: nothing is replaced.
    server.hold.send_replace(true);
    let quick = tokio::time::timeout(super::builder::GIVEN_UP_AFTER / 5, ping(&store)).await;
    assert!(quick.is_err(), "held");
    server.hold.send_replace(false);
    assert_eq!(ping(&store).await.unwrap(), "PONG");
    assert_eq!(
        server.accepted(),
        connections,
        "a caller that went away early"
    );

    // Given up after it: the next command connects anew.
    server.hold.send_replace(true);
    let given_up = tokio::time::timeout(
        super::builder::GIVEN_UP_AFTER + Duration::from_millis(200),
        ping(&store),
    )
    .await;
    assert!(given_up.is_err(), "held");
    server.hold.send_replace(false);
    assert_eq!(ping(&store).await.unwrap(), "PONG");
    assert_eq!(
        server.accepted(),
        connections + 1,
        "the suspect connection was replaced"
    );
}
