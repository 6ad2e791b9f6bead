//! The command line.

use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use idempotent_core::inspect::Listed;

/// Find any idempotent operation by the key a customer quotes, list what is in flight or
/// abandoned, and repair it without racing a live owner.
///
/// Exit status: 0 done, 1 refused (the answer says why), 2 a bad argument or a store that
/// cannot be reached.
#[derive(Debug, Parser)]
#[command(name = "idempotent-admin", version)]
pub(crate) struct Args {
    /// The store's URL: redis://HOST:PORT[/DB] (several, comma-separated: a Redis Cluster),
    /// postgres://USER@HOST:PORT/DB or sqlite://PATH.
    #[arg(long, env = "IDEMPOTENCY_STORE", global = true, default_value = "")]
    pub(crate) store: String,

    /// The runtime's namespace (`IdempotencyBuilder::namespace`; the payments example's is
    /// `payments-example`).
    #[arg(long, env = "IDEMPOTENCY_NAMESPACE", global = true, default_value = "")]
    pub(crate) namespace: String,

    /// `json` (one object, or one a line for `list`) or `table`.
    #[arg(long, value_enum, global = true, default_value = "json")]
    pub(crate) format: Format,

    /// How long the store may take to answer, in all.
    #[arg(long, global = true, default_value = "30s", value_parser = parse_timeout)]
    pub(crate) timeout: Duration,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    Json,
    Table,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// One record, by the key a client sent and its scope.
    Inspect {
        #[command(flatten)]
        target: Target,
        /// Show a completed record's body too (`result`).
        #[arg(long)]
        show_result: bool,
    },
    /// Records in one state, oldest first where the store keeps an order (one JSON object a
    /// line).
    List {
        /// in_flight (a live lease), abandoned (its lease ended, or released), completed or
        /// released.
        #[arg(long, value_parser = parse_state)]
        state: State,
        /// Only records at least this old in their state (`30s`, `15m`, `2h`, `7d`).
        #[arg(long, value_parser = parse_age, default_value = "0s")]
        older_than: Age,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        limit: u64,
    },
    /// Ends a claim: its retry (or a completer) runs the operation again, from its saved steps.
    Release {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        repair: RepairOptions,
    },
    /// Records `500 operation_failed` as the operation's answer: nothing more runs under the key.
    GiveUp {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        repair: RepairOptions,
    },
    /// Deletes the record: the key may run again, as a new operation.
    Forget {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        repair: RepairOptions,
    },
    /// A client session: its epoch, acknowledged mark and the numbers whose answers it holds.
    Session {
        /// The session's id, as the client sends it.
        #[arg(long)]
        id: String,
        #[command(flatten)]
        scope: ScopeArgs,
    },
}

/// A record: the key as the client sent it, and its scope.
#[derive(Debug, clap::Args)]
pub(crate) struct Target {
    /// The idempotency key, as the client sent it.
    #[arg(long)]
    pub(crate) key: String,
    #[command(flatten)]
    pub(crate) scope: ScopeArgs,
}

/// The scope parts, as the service sets them. The tower layer's default scope is the
/// authenticated principal (and its tenant, if it has one).
#[derive(Debug, clap::Args)]
pub(crate) struct ScopeArgs {
    /// The principal (the user or API client) the key belongs to.
    #[arg(long)]
    pub(crate) principal: Option<String>,
    /// The tenant the key belongs to.
    #[arg(long)]
    pub(crate) tenant: Option<String>,
    /// The operation the key belongs to, when the service scopes by one.
    #[arg(long)]
    pub(crate) operation: Option<String>,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RepairOptions {
    /// Why: goes to the log with who asked ($USER, or --operator).
    #[arg(long)]
    pub(crate) reason: String,
    /// Repair even while the owner's lease is live: its work then cannot record its answer.
    #[arg(long)]
    pub(crate) force: bool,
    /// Who asks, for the log (default $USER).
    #[arg(long)]
    pub(crate) operator: Option<String>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct State(pub(crate) Listed);

#[derive(Debug, Clone, Copy)]
pub(crate) struct Age(pub(crate) Duration);

fn parse_state(text: &str) -> Result<State, String> {
    text.parse().map(State)
}

fn parse_age(text: &str) -> Result<Age, String> {
    idempotent_core::limits::parse_duration(text)
        .map(Age)
        .map_err(|error| error.to_string())
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    let timeout = idempotent_core::limits::parse_duration(text).map_err(|e| e.to_string())?;
    if timeout.is_zero() || timeout > Duration::from_secs(3600) {
        return Err("between 1ms and 1h".into());
    }
    Ok(timeout)
}
