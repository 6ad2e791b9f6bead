#!/usr/bin/env bash
# Runs every check the project has: formatting, lints, all tests of all features (unit,
# conformance, property, integration, examples, benchmarks in test mode, doc tests) and docs.
#
#   bash scripts/test.sh
#
# CARGO_TARGET_DIR is respected; one target directory serves every step.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, all features, warnings denied)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "cargo test (all targets, all features)"
cargo test --workspace --all-targets --all-features --locked

step "cargo test --doc"
cargo test --workspace --all-features --doc --locked

step "cargo doc (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps --locked

step "examples run"
cargo run --locked --example quickstart >/dev/null

printf '\nall checks passed\n'
