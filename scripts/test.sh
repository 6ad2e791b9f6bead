#!/usr/bin/env bash
# Runs every check the project has: formatting, lints, all tests of all features (unit,
# conformance, property, trybuild, integration and end-to-end against real Redis and PostgreSQL
# servers, examples, benchmarks in test mode, doc tests), each published crate's tests again
# built on its own (the features it turns on itself, not the workspace's union) and docs.
#
#   bash scripts/test.sh
#
# It installs redis-server, PostgreSQL, nats-server and rabbitmq-server from Debian packages
# when they are missing, and the Kafka-protocol broker nisshi from crates.io into a cache
# outside the clone (~/.cache/idempotent-tools; ten minutes the first time), starts one of each
# on a free loopback port in a temporary directory (NATS with JetStream; a RabbitMQ node of its
# own; nisshi on SQLite), and a Redis Cluster of three primaries and three replicas, exports
# their URLs to the tests (IDEMPOTENT_TEST_REDIS_URL, IDEMPOTENT_TEST_REDIS_CLUSTER_URLS,
# IDEMPOTENT_TEST_POSTGRES_URL, IDEMPOTENT_TEST_NATS_URL, IDEMPOTENT_TEST_AMQP_URL,
# IDEMPOTENT_TEST_KAFKA_URL), and stops them on exit, also when a step fails. Backend tests fail
# (rather than skip) when a server is missing, because this script sets
# IDEMPOTENT_REQUIRE_BACKENDS=1. CARGO_TARGET_DIR is respected.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh

# Each step says when it began and how long the run has taken so far, so that a slow step
# shows in CI's log.
step() { printf '\n==> %s  [%s, %d s into the run]\n' "$*" "$(date +%T)" "$SECONDS"; }

# Disk: a cold run builds the workspace several times over (all features, each crate alone,
# trybuild's own target). With full debug info and incremental caches that came to 23 GB,
# more than a CI machine may have free. Line tables keep file:line in panics and backtraces;
# incremental caches only pay off on a second build, which a run never makes. Set either
# variable yourself to override.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
export CARGO_PROFILE_TEST_DEBUG="${CARGO_PROFILE_TEST_DEBUG:-line-tables-only}"
target_dir="${CARGO_TARGET_DIR:-target}"
df -h . | tail -1 | awk '{print "disk free before the run: " $4}'

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, all features, warnings denied)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

# The rust-version in Cargo.toml, as far as it can be checked here: the clippy step above
# refuses standard-library APIs newer than it (`incompatible_msrv`); this refuses dependencies
# that declare a newer one. Language features newer than it are not checked (only 1.95 runs
# here); see the comment on rust-version in Cargo.toml.
step "rust-version: no dependency declares a newer one"
python3 scripts/check_msrv.py

# The alert rules (promtool's check and unit tests) and the dashboard's JSON: a second, or
# about 15 s more the first time (promtool from Debian's prometheus package). That their metric
# names are the ones the examples export is checked by an end-to-end test below.
step "ops: alert rules and their unit tests (promtool), dashboard JSON"
bash scripts/check_ops.sh

step "starting Redis, a Redis Cluster, PostgreSQL, NATS (JetStream), RabbitMQ and Kafka (nisshi) on loopback"
trap stop_services EXIT
start_redis
start_redis_cluster
start_postgres
start_nats
start_rabbitmq
start_kafka
export IDEMPOTENT_REQUIRE_BACKENDS=1

step "cargo build --examples --bins (end-to-end tests run them as real processes)"
cargo build --workspace --examples --bins --all-features --locked

# Under cargo-nextest: every test in a process of its own, several at a time across all the
# test binaries (`cargo test` runs the binaries one after another, each waiting for its
# slowest test). How, in .config/nextest.toml's `ci` profile: the tests that use the Redis
# Cluster take turns (some fail its primaries over), the trybuild test runs first and alone
# (its compilation takes every core, and tests with wall-clock leases then miss them), a test
# hung for long is killed, and every failure is told again at the end. Without cargo-nextest
# (`cargo install cargo-nextest --locked`), `cargo test` runs the same tests, slower. Doc
# tests are the next step: nextest does not run them.
if cargo nextest --version >/dev/null 2>&1; then
    step "cargo nextest run (all targets, all features)"
    cargo nextest run --profile ci --workspace --all-targets --all-features --locked
else
    step "cargo test (all targets, all features; cargo-nextest is not installed)"
    cargo test --workspace --all-targets --all-features --locked
fi

# The nemesis (RELIABILITY.md): the whole system, two minutes on Redis and two on PostgreSQL
# at once, under a schedule of faults from a fixed seed (NEMESIS_SEED to change it): kills,
# pauses, store freezes and network partitions, broker restarts. Any anomaly fails the run;
# the history, the report and the timeline stay in target/nemesis/STORE-SEED/. A run that hangs
# is stopped after 15 minutes (SIGTERM: it removes its servers and namespaces; SIGKILL a
# minute later) and fails.
step "nemesis: two minutes on Redis and on PostgreSQL, under random faults"
seed="${NEMESIS_SEED:-1}"
nemesis="$target_dir/debug/nemesis"
timeout -k 60 900 "$nemesis" run --store redis --duration 120 --seed "$seed" \
    --out "$target_dir/nemesis/redis-$seed" >"$target_dir/nemesis-redis.log" 2>&1 &
redis_run=$!
timeout -k 60 900 "$nemesis" run --store postgres --duration 120 --seed "$seed" \
    --out "$target_dir/nemesis/postgres-$seed" >"$target_dir/nemesis-postgres.log" 2>&1 &
postgres_run=$!
# Stopped with the script (they remove their servers and namespaces on SIGTERM).
trap 'kill "$redis_run" "$postgres_run" 2>/dev/null || true; stop_services' EXIT
nemesis_failed=0
for store in redis postgres; do
    run="${store}_run"
    if wait "${!run}"; then status=0; else status=$?; fi
    echo "--- nemesis on $store (exit $status) ---"
    cat "$target_dir/nemesis-$store.log"
    [ "$status" -eq 0 ] || nemesis_failed=1
done
trap stop_services EXIT
[ "$nemesis_failed" -eq 0 ]

step "cargo test --doc"
cargo test --workspace --all-features --doc --locked

# The steps above build every crate with the union of the features the whole workspace turns
# on, so a crate that forgets one of its own (a tokio feature one of its doc tests uses, say)
# passes there and fails for whoever builds or tests it alone (`cargo test -p idempotent-core`,
# `cargo publish`'s verification build, docs.rs). So: each published crate built alone, with
# its own features only: its library and unit tests compiled and run, and its doc tests (the
# library's own code on its own features: a feature missing at run time, tokio's timer say,
# panics there). Its integration tests, which ran above against the same servers, are not
# built again: with nine crates that would double this step, and what differs alone is the
# library's build. The end-to-end suites (the `tests` crate) are not built again either.
# `idempotent-core` is also built with no feature at all: nothing of a backend, nothing of
# the attribute.
for crate in idempotent-core idempotent-macros idempotent-cache idempotent-redis \
    idempotent-postgres idempotent-sqlite idempotent-consumer idempotent-any idempotent-tower; do
    step "cargo test -p $crate alone (all its features, no other crate's)"
    started=$SECONDS
    cargo test -p "$crate" --all-features --locked --lib
    cargo test -p "$crate" --all-features --locked --doc
    echo "$crate alone: $((SECONDS - started)) s"
done
step "idempotent-core with no feature"
cargo check -p idempotent-core --no-default-features --locked

# The core is the contract, not a backend: none of the backends' client crates may enter its
# graph, with any of its features.
step "idempotent-core depends on no backend"
backends=$(cargo tree -p idempotent-core --all-features -e normal --prefix none --locked |
    awk '{print $1}' | grep -xE 'redis|sqlx|sqlx-core|lapin|async-nats|moka|deadpool|libsqlite3-sys' | sort -u || true)
if [ -n "$backends" ]; then
    echo "idempotent-core depends on: $backends" >&2
    exit 1
fi

# The crates find each other through traits, never by asking a value its type at run time:
# no downcast in library code (comments aside).
step "no downcast in library code"
downcasts=$(grep -rnE 'downcast|TypeId|as_any|dyn Any|std::any::Any' --include='*.rs' idempotent-*/src |
    grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' || true)
if [ -n "$downcasts" ]; then
    echo "downcasts in library code:" >&2
    echo "$downcasts" >&2
    exit 1
fi

# A store URL whose feature is off is refused by name (`AnyStore`), which only a build
# without those features can show: idempotent-any with `memory` alone.
step "AnyStore without the redis and postgres features"
cargo test -p idempotent-any --no-default-features --features memory --locked --test any_store

step "cargo doc (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps --locked

# Each published crate packages and its package builds. Packaged together, the nine are
# verified in dependency order, each against the others' fresh packages (a local registry
# overlay in target/package/tmp-registry), since they depend on one another at `=0.1.0` and
# are not on crates.io yet; works offline. Verification builds each crate's default features
# (the steps above test all of them). `--allow-dirty`: so it runs before a commit too. Each
# package must ship both license files (symlinks to the root's, packaged as files).
# docs.rs builds every feature with `--cfg docsrs` ([package.metadata.docs.rs]); a nightly
# feature, so checked by hand rather than here:
#   RUSTC_BOOTSTRAP=1 RUSTDOCFLAGS="--cfg docsrs" cargo doc -p CRATE --all-features --no-deps
step "cargo package (the published crates, verified against each other's packages)"
started=$SECONDS
# Cargo unpacks the overlay's packages under $CARGO_HOME/registry/src/-<id>/ and never unpacks
# a name and version again: a package from an earlier run of the same checkout (same version,
# other code) would be verified against instead of this one. Local registries' ids begin
# with `-`; crates.io's never do.
published=(idempotent-macros idempotent-core idempotent-cache idempotent-redis idempotent-postgres
    idempotent-sqlite
    idempotent-consumer idempotent-any idempotent-tower)
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/idempotent-*
packages=()
for crate in "${published[@]}"; do packages+=(-p "$crate"); done
cargo package "${packages[@]}" --locked --allow-dirty
for crate in "${published[@]}"; do
    files=$(cargo package -p "$crate" --list --locked --allow-dirty)
    for license in LICENSE-MIT LICENSE-APACHE; do
        grep -qx "$license" <<<"$files" || { echo "$crate does not package $license" >&2; exit 1; }
    done
done
echo "cargo package: $((SECONDS - started)) s"

# The binaries the examples step built (all features), not a `cargo run` that would build
# them again with other features.
step "examples run"
"$target_dir"/debug/examples/quickstart >/dev/null
"$target_dir"/debug/examples/macro >/dev/null

du -sh "$target_dir" 2>/dev/null | awk '{print "target directory after the run: " $1}'
printf '\nall checks passed\n'
