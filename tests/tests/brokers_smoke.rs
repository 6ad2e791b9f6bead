//! The test kit's private brokers (`idempotent_test_kit::brokers`) themselves: each starts, is killed with `SIGKILL`
//! (its port then refuses connections), starts again on the same port with the same data, and
//! accepts connections again.
//!
//! - NATS: a JetStream stream (file storage) and a message it acknowledged just before the kill
//!   are there after the restart (spoken to in the NATS protocol directly: no client library).
//! - RabbitMQ: a quorum queue, declared before the kill (`rabbitmqctl eval`), is listed by
//!   `rabbitmqctl list_queues` after the restart.
//! - Kafka (nisshi on SQLite): records the idempotent producer had acknowledged (`acks=all`)
//!   just before the kill, and a consumer group's committed offset, are there after the
//!   restart.
//!
//! How long each start and restart took is printed (`--nocapture` shows it). Without the
//! brokers installed the tests say loudly that they did not run, or fail where backends are
//! required (`IDEMPOTENT_REQUIRE_BACKENDS=1`, CI).

mod support;

use std::time::Duration;

use idempotent_test_kit::brokers::{PrivateKafka, PrivateNats, PrivateRabbit, accepts};
use idempotent_test_kit::process::within;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::{Instant, sleep};

/// A NATS request on a connection of its own: `payload` to `subject`; the reply's payload.
async fn nats_request(port: u16, subject: &str, payload: &str) -> serde_json::Value {
    within(
        &format!("a NATS request to {subject}"),
        Duration::from_secs(10),
        async {
            let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            let (read, mut write) = stream.into_split();
            let mut read = BufReader::new(read);
            let mut line = String::new();
            read.read_line(&mut line).await.unwrap();
            assert!(line.starts_with("INFO "), "no INFO greeting: {line:?}");
            // The server handles a connection's commands in order: subscribed before the
            // request goes out.
            let inbox = "_INBOX.brokers_smoke";
            let commands = format!(
                "CONNECT {{\"verbose\":false,\"pedantic\":false}}\r\nSUB {inbox} 1\r\n\
                 PUB {subject} {inbox} {}\r\n{payload}\r\n",
                payload.len()
            );
            write.write_all(commands.as_bytes()).await.unwrap();
            loop {
                line.clear();
                let n = read.read_line(&mut line).await.unwrap();
                assert!(n > 0, "nats-server closed the connection");
                if line.starts_with("PING") {
                    write.write_all(b"PONG\r\n").await.unwrap();
                } else if line.starts_with("-ERR") {
                    panic!("nats-server: {line}");
                } else if let Some(header) = line.strip_prefix("MSG ") {
                    let len: usize = header
                        .split_whitespace()
                        .last()
                        .and_then(|n| n.parse().ok())
                        .unwrap_or_else(|| panic!("MSG line {line:?}"));
                    let mut body = vec![0; len + 2];
                    read.read_exact(&mut body).await.unwrap();
                    body.truncate(len);
                    return serde_json::from_slice(&body).unwrap_or_else(|e| {
                        panic!("reply not JSON ({e}): {}", String::from_utf8_lossy(&body))
                    });
                }
            }
        },
    )
    .await
}

/// Milliseconds since `start`, for the printed timings.
fn ms(start: Instant) -> u128 {
    start.elapsed().as_millis()
}

#[tokio::test]
async fn nats_survives_sigkill_with_its_jetstream_store() {
    let started = Instant::now();
    let Some(mut nats) = PrivateNats::start().await else {
        return;
    };
    eprintln!("nats-server started in {} ms", ms(started));
    let port = nats.port();

    let created = nats_request(
        port,
        "$JS.API.STREAM.CREATE.SMOKE",
        r#"{"name":"SMOKE","subjects":["smoke.>"],"storage":"file"}"#,
    )
    .await;
    assert!(created.get("error").is_none(), "stream create: {created}");
    // Acknowledged by JetStream, then killed at once.
    let ack = nats_request(port, "smoke.one", "hello").await;
    assert_eq!(ack["seq"], 1, "publish: {ack}");

    nats.kill().await;
    assert!(nats.pid().is_none());
    assert!(
        !accepts(port).await,
        "port {port} still accepts connections after SIGKILL"
    );

    let restarted = Instant::now();
    nats.restart().await;
    eprintln!("nats-server restarted in {} ms", ms(restarted));
    assert!(accepts(port).await);
    assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));

    let info = nats_request(port, "$JS.API.STREAM.INFO.SMOKE", "").await;
    assert_eq!(
        info["config"]["name"], "SMOKE",
        "the stream is gone after the restart: {info}"
    );
    assert_eq!(
        info["state"]["messages"], 1,
        "the acknowledged message is gone after the restart: {info}"
    );
}

#[tokio::test]
async fn rabbitmq_survives_sigkill_with_its_quorum_queues() {
    let started = Instant::now();
    let Some(mut rabbit) = PrivateRabbit::start().await else {
        return;
    };
    eprintln!("RabbitMQ started in {} ms", ms(started));
    let port = rabbit.port();
    assert_eq!(
        rabbit.url(),
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    );
    let beam = rabbit.beam_pid().expect("the node's pid file");

    let declared = rabbit
        .rabbitmqctl(&[
            "eval",
            r#"{new, _} = rabbit_amqqueue:declare(rabbit_misc:r(<<"/">>, queue, <<"smoke">>), true, false, [{<<"x-queue-type">>, longstr, <<"quorum">>}], none, <<"brokers_smoke">>), ok."#,
        ])
        .await;
    assert!(declared.status.success(), "declare: {declared:?}");

    rabbit.kill().await;
    assert!(rabbit.beam_pid().is_none());
    assert!(
        !accepts(port).await,
        "port {port} still accepts connections after SIGKILL"
    );
    let state = std::fs::read_to_string(format!("/proc/{beam}/stat")).unwrap_or_default();
    assert!(
        state.is_empty()
            || state
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        "the Erlang VM {beam} survived the kill: {state}"
    );

    let restarted = Instant::now();
    rabbit.restart().await;
    eprintln!("RabbitMQ restarted in {} ms", ms(restarted));
    assert!(accepts(port).await);

    // The queue is listed once the node has recovered it (at once, in practice).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = rabbit
            .rabbitmqctl(&["-q", "list_queues", "name", "type", "durable"])
            .await;
        assert!(listed.status.success(), "list_queues: {listed:?}");
        let text = String::from_utf8_lossy(&listed.stdout);
        if text
            .lines()
            .any(|line| line.split_whitespace().collect::<Vec<_>>() == ["smoke", "quorum", "true"])
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the quorum queue is gone after the restart: {text}"
        );
        sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_survives_sigkill_with_its_log_and_group_offsets() {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let started = Instant::now();
    let Some(mut kafka) = PrivateKafka::start().await else {
        return;
    };
    eprintln!("nisshi started in {} ms", ms(started));
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", kafka.brokers());
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        config.create().unwrap();
    let topic =
        rdkafka::admin::NewTopic::new("smoke", 1, rdkafka::admin::TopicReplication::Fixed(1));
    for result in admin
        .create_topics([&topic], &rdkafka::admin::AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    let producer: FutureProducer = config
        .clone()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap();
    for n in 0..10 {
        let value = format!("record {n}");
        producer
            .send(
                FutureRecord::<str, str>::to("smoke").payload(&value),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    // A group that has consumed (and committed) the first four records.
    let group = config.clone().set("group.id", "smoke").clone();
    let commit = group.clone();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = commit.create().unwrap();
        let mut list = rdkafka::TopicPartitionList::new();
        list.add_partition_offset("smoke", 0, rdkafka::Offset::Offset(4))
            .unwrap();
        consumer.commit(&list, CommitMode::Sync).unwrap();
    })
    .await
    .unwrap();
    kafka.kill().await;
    assert!(kafka.pid().is_none());
    let restarted = Instant::now();
    kafka.restart().await;
    eprintln!("nisshi restarted in {} ms", ms(restarted));
    let (committed, values) = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = group
            .clone()
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        let mut list = rdkafka::TopicPartitionList::new();
        list.add_partition("smoke", 0);
        let committed = consumer
            .committed_offsets(list, Duration::from_secs(10))
            .unwrap()
            .find_partition("smoke", 0)
            .unwrap()
            .offset();
        consumer.subscribe(&["smoke"]).unwrap();
        let mut values = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while values.len() < 6 && std::time::Instant::now() < deadline {
            if let Some(record) = consumer.poll(Duration::from_millis(200)) {
                let record = record.unwrap();
                values.push(String::from_utf8_lossy(record.payload().unwrap()).into_owned());
            }
        }
        (committed, values)
    })
    .await
    .unwrap();
    assert_eq!(committed, rdkafka::Offset::Offset(4));
    let expected: Vec<String> = (4..10).map(|n| format!("record {n}")).collect();
    assert_eq!(
        values, expected,
        "the group resumes at its committed offset"
    );
}
