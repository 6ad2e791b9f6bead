#!/usr/bin/env bash
# Builds the examples with a guarantee deliberately broken and runs the nemesis against them:
# the checker must find anomalies (exit status 1). Run by hand (a build of its own takes a few
# minutes); RELIABILITY.md reports what each variant gave.
#
#   bash scripts/nemesis-broken.sh VARIANT [nemesis run options...]
#
# VARIANT:
#   ack-before-commit   the consumer runtime acknowledges a message before its effect
#                       commits (idempotent-consumer's runner)
#   no-fencing-redis    Redis's completion script no longer checks the claim's token and
#                       lease: a stale owner's completion overwrites the record
#
# Default options: --store redis --duration 120 --seed 1 (the caller's come after and win). The broken build lives in a git
# worktree under target/nemesis-broken (removed at the end) with its own target directory
# (kept, so a second run builds only what the patch touches). Needs what `nemesis` needs:
# root, redis-server, PostgreSQL's binaries, and this clone's `cargo build -p
# idempotent-nemesis`.
set -euo pipefail
cd "$(dirname "$0")/.."
variant="${1:?usage: nemesis-broken.sh ack-before-commit|no-fencing-redis [options]}"
shift
# The defaults first: a later flag of the caller's wins.
options=(--store redis --duration 120 --seed 1 "$@")

root="$PWD"
work="$root/target/nemesis-broken/tree"
export CARGO_TARGET_DIR="$root/target/nemesis-broken/target"
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only
# The broken tree is HEAD's: commit what it should hold first (the nemesis itself is built
# from the working tree).
git worktree remove --force "$work" 2>/dev/null || true
rm -rf "$work"
git worktree prune
git worktree add --detach "$work" HEAD >/dev/null
trap 'git worktree remove --force "$work"' EXIT

# Replaces `old` by `new` once in `file`; fails when `old` is not there (the code moved).
patch_once() {
    python3 - "$work/$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: the text to break is not there once; update scripts/nemesis-broken.sh")
open(path, "w").write(text.replace(old, new))
PY
}

# Each variant, and the anomaly it must produce (another kind of anomaly is not a catch).
case "$variant" in
ack-before-commit)
    expected="missing effect"
    patch_once idempotent-consumer/src/runner.rs \
        "        let processed = match prepared {" \
        "        let _ = self.source.ack(&received.delivery).await;
        let processed = match prepared {"
    ;;
no-fencing-redis)
    expected="replay mismatch"
    patch_once idempotent-redis/src/scripts.rs \
        'const COMPLETE: &str = r"
if owned then' \
        'const COMPLETE: &str = r"
if true then'
    ;;
*)
    echo "unknown variant $variant" >&2
    exit 2
    ;;
esac

# The examples from the broken tree; the nemesis (and its checker) from this clone's code.
(cd "$work" && cargo build --locked -p examples --examples --all-features)
cargo build --locked -p idempotent-nemesis
out="$root/target/nemesis-broken/$variant"
set +e
"$CARGO_TARGET_DIR/debug/nemesis" run "${options[@]}" --out "$out" \
    --bin-dir "$CARGO_TARGET_DIR/debug/examples"
status=$?
set -e
case $status in
1)
    if grep -q "^  $expected" "$out/report.txt"; then
        echo "$variant: caught ($expected; history in $out)"
    else
        echo "$variant: NOT caught as expected: anomalies, but none is \"$expected\" ($out/report.txt)"
        exit 1
    fi
    ;;
0) echo "$variant: NOT caught: the run passed"; exit 1 ;;
*) echo "$variant: the run could not be carried out (exit $status)"; exit "$status" ;;
esac
