//! `idempotent-admin`: find any operation by the key a customer quotes, list what is in flight
//! or abandoned, and repair it without racing a live owner, over any store URL.
//!
//! ```text
//! idempotent-admin --store postgres://app@db/app --namespace payments-example \
//!     inspect --key order-17 --principal alice
//! idempotent-admin list --state abandoned --older-than 5m
//! idempotent-admin release --key order-17 --principal alice --reason "INC-42: stuck after deploy"
//! idempotent-admin session --id device-7 --principal alice
//! ```
//!
//! Every answer is JSON (one object, or one a line for `list`) unless `--format table`. Exit
//! status: 0 done, 1 refused (a live lease, a record that changed since it was read, a repair
//! that does not apply: the answer says why), 2 a bad argument or a store that cannot be
//! reached (the message names what). See the crate's README for every field.

mod args;
mod render;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser as _;
use idempotent_any::AnyStore;
use idempotent_core::inspect::{
    self, InspectStore, ListQuery, RecordInfo, Refusal, Repair, Repaired,
};
use idempotent_core::{Key, Scope, SessionKey, StorageKey, StoreError};
use serde_json::{Value, json};

use args::{Args, Command, Format, Target};

/// The least TTL of a give-up's answer (the record's own time left when longer): a record
/// about to expire must not let its key run again soon after an operator gave it up.
const GIVE_UP_TTL: Duration = Duration::from_secs(24 * 3600);

/// How the command ended.
enum Ended {
    Done,
    Refused,
}

/// A failure: exit status 2, with a message naming what.
struct Failed(String);

impl From<StoreError> for Failed {
    fn from(error: StoreError) -> Self {
        Failed(format!("the store failed: {}", chain(&error)))
    }
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEMPOTENT_ADMIN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idempotent-admin: cannot start: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(Ended::Done) => ExitCode::SUCCESS,
        Ok(Ended::Refused) => ExitCode::from(1),
        Err(Failed(message)) => {
            eprintln!("idempotent-admin: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<Ended, Failed> {
    if args.store.is_empty() {
        return Err(Failed(
            "no store: give --store URL or set IDEMPOTENCY_STORE".into(),
        ));
    }
    // Arguments first: a bad key is told without touching the store.
    match &args.command {
        Command::Inspect { target, .. }
        | Command::Release { target, .. }
        | Command::GiveUp { target, .. }
        | Command::Forget { target, .. } => {
            target.storage_key(&args.namespace)?;
        }
        Command::Session { id, .. } => {
            Key::new(id.as_str()).map_err(|error| {
                Failed(format!("--id {id:?} is not a valid session id: {error}"))
            })?;
        }
        Command::List { .. } => {}
    }
    let store = connect(&args.store, args.timeout).await?;
    let (timeout, url) = (args.timeout, redacted(&args.store));
    tokio::time::timeout(timeout, execute(&store, args))
        .await
        .unwrap_or_else(|_| {
            Err(Failed(format!(
                "the store at {url} did not answer within {timeout:?}"
            )))
        })
}

async fn execute(store: &AnyStore, args: Args) -> Result<Ended, Failed> {
    let format = args.format;
    match args.command {
        Command::Inspect {
            target,
            show_result,
        } => {
            let key = target.storage_key(&args.namespace)?;
            let found = store.inspect(&key).await?;
            let answer = match &found {
                Some(info) => render::record(info, Some(&target.key), show_result, store),
                None => render::absent(&target.key, &key),
            };
            render::print(format, &[answer]);
            Ok(Ended::Done)
        }
        Command::List {
            state,
            older_than,
            limit,
        } => {
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            let mut query = ListQuery::new(state.0);
            query.older_than = older_than.0;
            let mut listed: Vec<Value> = Vec::new();
            let mut pages = 0usize;
            while listed.len() < limit {
                query.limit = (limit - listed.len()).min(1000);
                let page = store.list(&query).await?;
                pages += 1;
                listed.extend(
                    page.records
                        .iter()
                        .take(limit - listed.len())
                        .map(|info| render::record(info, None, false, store)),
                );
                match page.next {
                    Some(next) if pages < 100_000 => query.after = Some(next),
                    _ => break,
                }
            }
            render::print(format, &listed);
            Ok(Ended::Done)
        }
        Command::Release { target, repair } => {
            repair_one(store, &args.namespace, &target, &repair, format, |_| {
                Repair::Release
            })
            .await
        }
        Command::GiveUp { target, repair } => {
            let reason = repair.reason.clone();
            repair_one(store, &args.namespace, &target, &repair, format, |info| {
                Repair::GiveUp {
                    payload: idempotent_tower::operation_failed_record(&format!(
                        "an operator gave it up ({reason})"
                    )),
                    ttl: info.expires_in.max(GIVE_UP_TTL),
                }
            })
            .await
        }
        Command::Forget { target, repair } => {
            repair_one(store, &args.namespace, &target, &repair, format, |_| {
                Repair::Forget
            })
            .await
        }
        Command::Session { id, scope } => {
            let id = Key::new(id.as_str()).map_err(|error| {
                Failed(format!("--id {id:?} is not a valid session id: {error}"))
            })?;
            let session = SessionKey::derive(args.namespace.as_bytes(), &scope.scope(), &id);
            let answer = match inspect::session(store, &session).await? {
                Some(info) => json!({
                    "session": id.as_str(),
                    "state": "open",
                    "epoch": info.epoch,
                    "mark": info.mark,
                    "high": info.high,
                    "held": info.held,
                }),
                None => json!({ "session": id.as_str(), "state": "absent" }),
            };
            render::print(format, &[answer]);
            Ok(Ended::Done)
        }
    }
}

/// Reads the record, then applies the repair `make` builds for it, fenced by the token read.
async fn repair_one(
    store: &AnyStore,
    namespace: &str,
    target: &Target,
    options: &args::RepairOptions,
    format: Format,
    make: impl FnOnce(&RecordInfo) -> Repair,
) -> Result<Ended, Failed> {
    let key = target.storage_key(namespace)?;
    let Some(info) = store.inspect(&key).await? else {
        let mut answer = render::absent(&target.key, &key);
        answer["done"] = json!(false);
        answer["refused"] = json!(Refusal::Absent.to_string());
        render::print(format, &[answer]);
        return Ok(Ended::Refused);
    };
    let repair = make(&info);
    let operator = options.operator.clone().unwrap_or_else(operator);
    let repaired = inspect::repair(
        store,
        &key,
        info.token,
        &repair,
        options.force,
        (&operator, &options.reason),
    )
    .await?;
    let mut answer = json!({
        "repair": repair.name(),
        "key": target.key,
        "storage_key": key.to_hex(),
        "reason": options.reason,
        "operator": operator,
        "forced": options.force,
    });
    let ended = match &repaired {
        Repaired::Done => {
            answer["done"] = json!(true);
            answer["note"] = json!(match repair {
                Repair::Release =>
                    "released: the operation runs again when its client retries (or a completer takes it), from its saved steps",
                Repair::GiveUp { .. } =>
                    "given up: retries answer 500 operation_failed; nothing more runs under this key",
                Repair::Forget =>
                    "forgotten: the key may run again, as a new operation (a payment with it charges again)",
            });
            Ended::Done
        }
        Repaired::Refused(why) => {
            answer["done"] = json!(false);
            answer["refused"] = json!(why.to_string());
            if let Refusal::LeaseLive { left } = why {
                answer["lease_left_s"] = json!(render::seconds(*left));
            }
            Ended::Refused
        }
    };
    render::print(format, &[answer]);
    Ok(ended)
}

/// Who runs the tool: `$USER`, `$LOGNAME`, or `unknown`.
fn operator() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// The store `url` names, without migrating or reaping (a running service does that).
async fn connect(url: &str, timeout: Duration) -> Result<AnyStore, Failed> {
    if url == "memory" {
        return Err(Failed(
            "--store memory names this process's own memory: give the URL of the store the service uses (redis://, postgres://, sqlite://)".into(),
        ));
    }
    let connecting = AnyStore::builder(url).migrate(false).reaper(None).connect();
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(store)) => Ok(store),
        Ok(Err(error)) => Err(Failed(format!(
            "cannot open the store {}: {}",
            redacted(url),
            chain(&error)
        ))),
        Err(_) => Err(Failed(format!(
            "cannot open the store {} within {timeout:?}",
            redacted(url)
        ))),
    }
}

/// `url` without a password.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

impl Target {
    fn storage_key(&self, namespace: &str) -> Result<StorageKey, Failed> {
        let key = Key::new(self.key.as_str())
            .map_err(|error| Failed(format!("--key {:?} is not a valid key: {error}", self.key)))?;
        Ok(StorageKey::derive(
            namespace.as_bytes(),
            &self.scope.scope(),
            &key,
        ))
    }
}

impl args::ScopeArgs {
    fn scope(&self) -> Scope {
        let mut scope = Scope::new();
        if let Some(tenant) = &self.tenant {
            scope = scope.tenant(tenant);
        }
        if let Some(principal) = &self.principal {
            scope = scope.principal(principal);
        }
        if let Some(operation) = &self.operation {
            scope = scope.operation(operation);
        }
        scope
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_not_printed() {
        assert_eq!(
            redacted("postgres://app:secret@db:5432/app"),
            "postgres://app:***@db:5432/app"
        );
        assert_eq!(redacted("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redacted("postgres://app@db/app"), "postgres://app@db/app");
    }
}
