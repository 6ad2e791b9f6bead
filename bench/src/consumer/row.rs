//! One row, one round: publish the backlog (or pace it), consume it with the row's bare loop or
//! the runtime, check that every posting was applied exactly once, clear the broker.

use std::time::{Duration, Instant};

use super::bare::BareRow;
use super::broker::kafka::{self, BareKafka};
use super::broker::nats::{self, BareNats};
use super::broker::rabbitmq::{self, BareRabbit};
use super::broker::redis_streams::{self, BareRedis};
use super::broker::{self, Publisher};
use super::latency::reset_histograms;
use super::options::Options;
use super::postgres::Postgres;
use super::postings::{ACCOUNTS, backlog};
use super::progress::Measured;
use super::rows::{Broker, Mode};
use super::runtime::runtime_row;

/// Round `round` of the row of `broker` and `mode`; `None` when its broker's URL or the
/// PostgreSQL it needs was not given.
pub(crate) async fn row(
    broker: Broker,
    mode: Mode,
    round: usize,
    options: &Options,
    postgres: Option<&Postgres>,
) -> Option<Measured> {
    let url = options.url(broker)?;
    let postgres = match mode.postgres() {
        true => Some(postgres?),
        false => None,
    };
    let name = format!(
        "consumer_bench_{}_{}_{round}_{}",
        broker.name(),
        mode.name().replace('-', "_"),
        std::process::id()
    );
    let duplicates = if mode.duplicates() {
        options.duplicates
    } else {
        0
    };
    // Paced: the messages are published while the consumer runs, `rate` a second.
    let paced = options.paced;
    let messages = match paced {
        Some(rate) => (rate * options.paced_seconds) as usize,
        None => options.messages,
    };
    let (postings, sum) = backlog(&name, messages, duplicates);
    let total = postings.len();
    if let Some(pg) = postgres {
        pg.clear().await;
    }
    let mut publisher = Publisher::open(broker, &url, &name).await;
    let publishing = match paced {
        None => {
            let started = Instant::now();
            publisher.publish(&name, &postings).await;
            publisher.close().await;
            eprintln!(
                "    published {total} messages in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            // Whatever the broker does right after a burst of writes (RabbitMQ's quorum
            // queue log, Redis's AOF) is not the consumer's.
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
        Some(rate) => Some(tokio::spawn(publisher.paced(
            name.clone(),
            postings,
            rate,
            Duration::from_millis(500),
        ))),
    };
    reset_histograms();
    let calls_before = match broker {
        Broker::Redis => Some(redis_streams::calls(&url).await),
        _ => None,
    };
    let bare = BareRow {
        total,
        concurrency: options.concurrency(mode),
        postgres: postgres.map(|pg| pg.pool.clone()),
        paced: paced.is_some(),
        batch: options.bare_batch,
    };
    let (mut measured, runs) = match (broker, mode.runtime()) {
        (Broker::Redis, false) => (bare.run(BareRedis::open(&url, &name).await).await, 0),
        (Broker::Nats, false) => (bare.run(BareNats::open(&url, &name).await).await, 0),
        (Broker::RabbitMq, false) => (bare.run(BareRabbit::open(&url, &name).await).await, 0),
        (Broker::Kafka, false) => (bare.run(BareKafka::open(&url, &name).await).await, 0),
        (Broker::Redis, true) => {
            let source = redis_streams::source(&url, &name).await;
            runtime_row(source, options, postgres, total).await
        }
        (Broker::Nats, true) => {
            let source = nats::source(&url, &name).await;
            runtime_row(source, options, postgres, total).await
        }
        (Broker::RabbitMq, true) => {
            let source = rabbitmq::source(&url, &name).await;
            runtime_row(source, options, postgres, total).await
        }
        (Broker::Kafka, true) => {
            let source = kafka::source(&url, &name, options.kafka_buffer).await;
            runtime_row(source, options, postgres, total).await
        }
    };
    if let Some(publishing) = publishing {
        publishing.await.unwrap();
    }
    // Exactly once: memory rows count the handler's runs; PostgreSQL rows add the balances up.
    measured.effects = match postgres {
        Some(pg) => {
            let (rows, balance) = pg.balances().await;
            measured.correct = balance == sum && rows as usize == ACCOUNTS.min(messages);
            if !measured.correct {
                eprintln!(
                    "consumer bench: {} {}: the balances add up to {balance}, not {sum}",
                    broker.name(),
                    mode.name()
                );
            }
            // The postings applied, if each was applied at most once.
            if measured.correct { messages as u64 } else { 0 }
        }
        None if mode.runtime() => {
            measured.correct = runs == messages as u64;
            runs
        }
        None => {
            measured.correct = measured.messages == messages as u64;
            measured.messages
        }
    };
    measured.correct &= measured.retried == 0 && measured.dead_lettered == 0;
    if let Some(before) = calls_before {
        let after = redis_streams::calls(&url).await;
        let per_message = |command: &str| {
            (after.get(command).copied().unwrap_or(0) - before.get(command).copied().unwrap_or(0))
                as f64
                / total as f64
        };
        eprintln!(
            "    redis commands per message: xreadgroup {:.3}, xack {:.3}, xautoclaim {:.4}, all {:.3}",
            per_message("xreadgroup"),
            per_message("xack"),
            per_message("xautoclaim"),
            after
                .values()
                .sum::<u64>()
                .saturating_sub(before.values().sum::<u64>()) as f64
                / total as f64
        );
    }
    // The consumers above are gone.
    broker::delete(broker, &url, &name).await;
    Some(measured)
}
