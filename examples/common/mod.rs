//! What the example servers share: their environment settings and the store they select.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `PORT` | per example | listens on `127.0.0.1:$PORT` |
//! | `IDEMPOTENCY_STORE` | `memory` | `memory`, `redis://HOST:PORT[/DB]` (several, comma-separated: a Redis Cluster's nodes), `postgres://USER@HOST:PORT/DB` or `sqlite://PATH` |
//! | `IDEMPOTENCY_TTL` | `24h` | how long responses are replayed: `1ms` to `365d` |
//! | `IDEMPOTENCY_LEASE` | `30s` | how long a crashed request keeps its key locked: `100ms` to `365d` |
//! | `IDEMPOTENCY_IN_FLIGHT` | `reject` | `reject` or `wait` (up to one lease, then replay) |
//! | `IDEMPOTENCY_REDIS_REPLICAS` | `0` | on Redis, replicas that must acknowledge every claim and record (`WAIT`) |
//! | `IDEMPOTENCY_SESSION_IDLE` | `24h` | how long a client session nobody sends to is kept, with its answers: `1ms` to `365d` |
//! | `IDEMPOTENCY_SESSION_WINDOW` | `64` | how far past its acknowledged mark a session may number requests: `1` to `4096` |
//! | `IDEMPOTENCY_CACHE` | unset: none | a cache tier of finished records in front of the store: `memory:N` (in this process, `N` records) or `redis://HOST:PORT[/DB]` (a Redis every instance shares, in front of the store) |
//! | `IDEMPOTENCY_COMPLETER_AFTER` | unset: none | where an example has a completer (`payments`): how long an abandoned operation waits for its client's retry before the completer finishes it: `1ms` to `365d` |
//!
//! Durations are read by `idempotent_core::limits::parse_duration` (`500ms`, `30s`, `15m`,
//! `24h`, `7d`, `1h 30m`); the ranges are those of `idempotent_core::limits`, and a duration
//! variable without a range of its own (`CLAIM_IDLE`, `RELAY_BACKOFF`, …) is at most `365d`. A
//! bad value, or one out of its range, makes the example exit with status 2 and a message
//! naming the variable (and the range).

#![allow(dead_code)]

pub(crate) mod relay;
pub(crate) mod shutdown;

use std::time::Duration;

use idempotent_any::AnyStore;
use idempotent_core::limits::{self, DurationError};
use idempotent_core::{Defaults, Idempotency, InFlightPolicy};
use idempotent_postgres::PostgresStore;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Logs to stderr, `RUST_LOG` overriding the default filter.
pub(crate) fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,idempotent_tower=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

pub(crate) struct Settings {
    pub(crate) port: u16,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlightPolicy,
    pub(crate) session_idle: Duration,
    pub(crate) session_window: u64,
}

/// Reads `PORT` (default `default_port`) and the `IDEMPOTENCY_*` variables but the store's
/// (which [`idempotency`] reads).
pub(crate) fn settings(default_port: u16) -> Result<Settings, String> {
    let var =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let port = var("PORT", &default_port.to_string());
    let port = port
        .parse()
        .map_err(|_| format!("PORT={port:?} is not a port number"))?;
    let ttl = checked_duration(
        "IDEMPOTENCY_TTL",
        &var("IDEMPOTENCY_TTL", "24h"),
        limits::check_ttl,
    )?;
    let lease = checked_duration(
        "IDEMPOTENCY_LEASE",
        &var("IDEMPOTENCY_LEASE", "30s"),
        limits::check_lease,
    )?;
    let in_flight = match var("IDEMPOTENCY_IN_FLIGHT", "reject").as_str() {
        "reject" => InFlightPolicy::Reject,
        "wait" => InFlightPolicy::Wait { max: lease },
        other => {
            return Err(format!(
                "IDEMPOTENCY_IN_FLIGHT={other:?} is not supported; use `reject` or `wait`"
            ));
        }
    };
    let session_idle = checked_duration(
        "IDEMPOTENCY_SESSION_IDLE",
        &var("IDEMPOTENCY_SESSION_IDLE", "24h"),
        limits::check_ttl,
    )?;
    let window = var("IDEMPOTENCY_SESSION_WINDOW", "64");
    let session_window =
        limits::check_session_window(positive("IDEMPOTENCY_SESSION_WINDOW", &window)?)
            .map_err(|error| format!("IDEMPOTENCY_SESSION_WINDOW={window:?}: {error}"))?;
    Ok(Settings {
        port,
        ttl,
        lease,
        in_flight,
        session_idle,
        session_window,
    })
}

/// Reads `IDEMPOTENCY_COMPLETER_AFTER`: how long an abandoned operation waits for its client's
/// retry before a completer finishes it (`1ms` to `365d`); `None` when unset (no completer).
pub(crate) fn completer_after() -> Result<Option<Duration>, String> {
    const NAME: &str = "IDEMPOTENCY_COMPLETER_AFTER";
    match std::env::var(NAME) {
        Ok(value) => checked_duration(NAME, &value, limits::check_ttl).map(Some),
        Err(_) => Ok(None),
    }
}

/// Parses `value`, the variable `name`'s, as a duration greater than zero, with
/// [`limits::parse_duration`]: `500ms`, `30s`, `15m`, `24h`, `7d`, `1h 30m`.
pub(crate) fn parse_duration(name: &str, value: &str) -> Result<Duration, String> {
    let duration = limits::parse_duration(value).map_err(|_| {
        format!("{name}={value:?} is not a duration like 500ms, 30s, 15m, 24h or 7d")
    })?;
    if duration.is_zero() {
        return Err(format!("{name}={value:?} must be greater than zero"));
    }
    Ok(duration)
}

/// The longest a duration variable without a range of its own may be (`CLAIM_IDLE`,
/// `RELAY_BACKOFF`, …): 365 days, the library's longest settings'
/// (`idempotent_core::limits::MAX_TTL`). Longer values are refused, not clamped: someone who
/// wrote `18446744073709551615s` meant something this process cannot do.
pub(crate) const MAX_SETTING: Duration = limits::MAX_TTL;

/// Parses `value`, the variable `name`'s, as [`parse_duration`] does, and refuses one longer
/// than [`MAX_SETTING`] (365 days).
pub(crate) fn bounded_duration(name: &str, value: &str) -> Result<Duration, String> {
    let duration = parse_duration(name, value)?;
    if duration > MAX_SETTING {
        return Err(format!(
            "{name}={value:?} is longer than 365d, the longest it may be"
        ));
    }
    Ok(duration)
}

/// Parses `value`, the variable `name`'s, as a whole number greater than zero.
pub(crate) fn positive<T: std::str::FromStr + Default + PartialOrd>(
    name: &str,
    value: &str,
) -> Result<T, String> {
    match value.parse() {
        Ok(n) if n > T::default() => Ok(n),
        _ => Err(format!(
            "{name}={value:?} is not a whole number greater than zero"
        )),
    }
}

/// Parses `value`, the variable `name`'s, as a duration that `check` accepts.
fn checked_duration(
    name: &str,
    value: &str,
    check: fn(Duration) -> Result<Duration, DurationError>,
) -> Result<Duration, String> {
    check(parse_duration(name, value)?).map_err(|error| format!("{name}={value:?}: {error}"))
}

/// Installs the process's metrics recorder (Prometheus text format, with Prometheus's
/// recommended names: `idempotency_requests_total`, `…_duration_seconds`), before any runtime
/// is created, since runtimes register their metrics with the recorder installed when they
/// are created. Returns what renders the scrape; histograms are drained into it every 5 s.
pub(crate) fn install_metrics() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .with_recommended_naming(true)
        .set_buckets(&[
            0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0,
        ])
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// `GET /metrics`: the scrape, in Prometheus's text format.
pub(crate) fn metrics_route<S: Clone + Send + Sync + 'static>(
    handle: PrometheusHandle,
) -> axum::routing::MethodRouter<S> {
    axum::routing::get(move || {
        let handle = handle.clone();
        async move {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                handle.render(),
            )
        }
    })
}

/// The runtime over the store `IDEMPOTENCY_STORE` names ([`AnyStore::from_env`], which reads
/// `IDEMPOTENCY_REDIS_REPLICAS` and `IDEMPOTENCY_CACHE` too; on PostgreSQL it creates the table
/// and reaps expired rows every minute), and the PostgreSQL store it is, if it is one (for the
/// steps that commit with their checkpoint: `PostgresStore::step_in_transaction`).
pub(crate) async fn idempotency(
    settings: &Settings,
    namespace: &str,
) -> Result<(Idempotency, Option<PostgresStore>), String> {
    // Its errors name the variable and never print a password.
    let store = AnyStore::from_env()
        .await
        .map_err(|error| error_chain(&error))?;
    let postgres = store.postgres().cloned();
    let idempotency = Idempotency::builder(store)
        .namespace(namespace)
        .defaults(
            Defaults::new()
                .ttl(settings.ttl)
                .lease(settings.lease)
                .in_flight(settings.in_flight)
                .session_idle(settings.session_idle)
                .session_window(settings.session_window),
        )
        .build();
    Ok((idempotency, postgres))
}

/// `error` and its sources, `: `-separated.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
