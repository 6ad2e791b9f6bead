//! The notification relay of the `ledger` example: run inside each consumer, or alone as the
//! `relay` example.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `NOTIFY_URL` | unset | where notifications go: an `http://` URL they are POSTed to, or `kafka://HOST:PORT[,HOST:PORT]/TOPIC`, a Kafka topic they are produced to (idempotent producer, `acks=all`; the notification's key as the Kafka key and in the header `idempotency-key`); unset: nothing is enqueued or relayed |
//! | `RELAY_MAX_ATTEMPTS` | `10` | delivery attempts before a notification is dead-lettered |
//! | `RELAY_BACKOFF` | `1s` | the wait after a first failed attempt, doubling up to a minute |
//! | `RELAY_POLL` | `1s` | how often the relay looks for due notifications without a `NOTIFY` |
//! | `RELAY_DELIVERY_TIMEOUT` | `30s` | how long one delivery may take; a relay frozen mid-batch holds its notifications for twice this plus 5 s |
//!
//! The three durations are greater than zero and at most `365d`; a bad value exits with status 2
//! naming the variable.

use std::time::Duration;

use idempotent_postgres::outbox::{BoxFuture, KafkaSink, Outbox, Relay, Relayed, Sink, SinkError};
use idempotent_tower::client::HttpSink;
use sqlx::PgPool;

/// Where notifications go, as `NOTIFY_URL` says.
#[derive(Clone)]
pub(crate) enum NotifySink {
    Http(Box<HttpSink>),
    Kafka(KafkaSink),
}

impl Sink for NotifySink {
    fn deliver<'a>(&'a self, message: &'a Relayed) -> BoxFuture<'a, Result<(), SinkError>> {
        match self {
            NotifySink::Http(sink) => sink.deliver(message),
            NotifySink::Kafka(sink) => sink.deliver(message),
        }
    }
}

/// `NOTIFY_URL`'s sink: `kafka://BROKERS/TOPIC`, else HTTP.
fn sink(url: &str, delivery_timeout: Duration) -> Result<NotifySink, String> {
    let bad = |e: &dyn std::fmt::Display| format!("NOTIFY_URL={url:?}: {e}");
    if let Some(rest) = url.strip_prefix("kafka://") {
        let Some((brokers, topic)) = rest
            .split_once('/')
            .filter(|(b, t)| !b.is_empty() && !t.is_empty())
        else {
            return Err(bad(&"a Kafka URL is kafka://HOST:PORT[,HOST:PORT]/TOPIC"));
        };
        let mut config = rdkafka::ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        // Under the relay's own bound, so that a delivery fails (and is retried) first.
        let timeout = delivery_timeout.mul_f64(0.8).max(Duration::from_millis(1));
        return KafkaSink::with_config(&config, topic, timeout)
            .map(NotifySink::Kafka)
            .map_err(|e| bad(&e));
    }
    HttpSink::new(url)
        .map(|sink| NotifySink::Http(Box::new(sink)))
        .map_err(|e| bad(&e))
}

/// The outbox destination of the ledger's notifications.
pub(crate) const NOTIFICATIONS: &str = "notifications";

/// The relay's settings, from the environment: `None` without `NOTIFY_URL`.
pub(crate) struct RelaySettings {
    pub(crate) notify_url: String,
    sink: NotifySink,
    max_attempts: u32,
    backoff: Duration,
    poll: Duration,
    delivery_timeout: Duration,
}

pub(crate) fn relay_settings() -> Result<Option<RelaySettings>, String> {
    let Ok(notify_url) = std::env::var("NOTIFY_URL") else {
        return Ok(None);
    };
    let var =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let max_attempts = super::positive("RELAY_MAX_ATTEMPTS", &var("RELAY_MAX_ATTEMPTS", "10"))?;
    let backoff = super::bounded_duration("RELAY_BACKOFF", &var("RELAY_BACKOFF", "1s"))?;
    let poll = super::bounded_duration("RELAY_POLL", &var("RELAY_POLL", "1s"))?;
    let delivery_timeout = super::bounded_duration(
        "RELAY_DELIVERY_TIMEOUT",
        &var("RELAY_DELIVERY_TIMEOUT", "30s"),
    )?;
    // Built now, so that a bad URL stops the process at startup.
    let sink = sink(&notify_url, delivery_timeout)?;
    Ok(Some(RelaySettings {
        notify_url,
        sink,
        max_attempts,
        backoff,
        poll,
        delivery_timeout,
    }))
}

/// The relay of `outbox`'s notifications to `NOTIFY_URL`.
pub(crate) fn relay(pool: PgPool, outbox: Outbox, settings: &RelaySettings) -> Relay {
    Relay::builder(pool, outbox)
        .sink(NOTIFICATIONS, settings.sink.clone())
        .max_attempts(settings.max_attempts)
        .backoff(
            settings.backoff,
            Duration::from_secs(60).max(settings.backoff),
        )
        .poll_interval(settings.poll)
        .delivery_timeout(settings.delivery_timeout)
        .build()
}
