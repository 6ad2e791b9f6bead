#!/usr/bin/env bash
# The HTTP benchmark (idempotent-tower against a bare handler and the peer crates, on the memory
# store and, when available, Redis and PostgreSQL, with pgbench and redis-benchmark running the
# stores' own statements and scripts as the limits their rows are compared with; the same rows
# again with 1M and 10M records already in each store; client sessions, each connection numbering
# its requests in an Idempotency-Session, beside the fresh-key rows), the memory store's footprint
# per record, and the bytes each store holds for one client session of 100 to 100,000 requests
# against as many requests with a key each (the `sessions` mode). BENCHMARKS.md explains the rows
# and how to read them.
#
#   bash scripts/bench.sh                  # full run: 3 rounds of 3 s warm-up + 10 s timed per row
#                                          # (about 40 minutes with Redis and PostgreSQL)
#   bash scripts/bench.sh --quick          # 3 rounds of 1 s + 2 s per row (each row its median
#                                          # round), 1M prefilled records only, then the relay
#                                          # row (outbox --quick, three runs) and the consumer's
#                                          # PostgreSQL rows on Redis Streams (three rounds), and
#                                          # the summary's ratios of all of them (each
#                                          # ratio of two HTTP rows measured again with
#                                          # the two rows taking turns; the others paired
#                                          # by round where their rows share rounds)
#   bash scripts/bench.sh --no-backends    # without the Redis and PostgreSQL rows
#   bash scripts/bench.sh --only idempotent-tower --duration 20   # any idempotent-bench option
#
# The harness is the `idempotent-bench` package (bench/), built in release. The peer crates are
# compiled in with RUSTFLAGS="--cfg idempotent_bench_peers", and the build uses
# `cargo --ignore-rust-version` because `idempotent` 2.0.0 declares rust-version 1.98, above the
# toolchain this workspace uses (it builds and runs on it).
#
# Redis and PostgreSQL come from scripts/services.sh (installed from Debian packages when
# missing, started on free loopback ports, stopped on exit) unless IDEMPOTENT_TEST_REDIS_URL and
# IDEMPOTENT_TEST_POSTGRES_URL are already set. The table is printed; the JSON goes to
# target/bench/http.json (under CARGO_TARGET_DIR when set). Exits non-zero when a row had
# errors or did not replay.
set -euo pipefail
cd "$(dirname "$0")/.."

backends=1
quick=0
args=()
for arg in "$@"; do
    case "$arg" in
        --no-backends) backends=0 ;;
        --quick) quick=1; args+=("$arg") ;;
        *) args+=("$arg") ;;
    esac
done

target_dir="${CARGO_TARGET_DIR:-target}"

echo "==> building idempotent-bench (release, peers compiled in, --ignore-rust-version)" >&2
RUSTFLAGS="${RUSTFLAGS:-} --cfg idempotent_bench_peers" \
    cargo build --release --locked -p idempotent-bench --ignore-rust-version

if [ "$backends" = 1 ]; then
    source scripts/services.sh
    if [ -z "${IDEMPOTENT_TEST_REDIS_URL:-}" ] || [ -z "${IDEMPOTENT_TEST_POSTGRES_URL:-}" ]; then
        trap stop_services EXIT
        [ -n "${IDEMPOTENT_TEST_REDIS_URL:-}" ] || start_redis >&2
        [ -n "${IDEMPOTENT_TEST_POSTGRES_URL:-}" ] || start_postgres >&2
    fi
else
    unset IDEMPOTENT_TEST_REDIS_URL IDEMPOTENT_TEST_POSTGRES_URL
fi

echo "==> $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
status=0
"$target_dir/release/idempotent-bench" all --out "$target_dir/bench/http.json" "${args[@]}" || status=$?

# --quick with the stores: the summary's two rows that other binaries measure (the relay's
# messages per second, one relay, the discarding sink; the consumer runtime with the
# PostgreSQL effect beside the bare loop doing the same work, on Redis Streams), then the
# summary's ratios of the whole run.
if [ "$quick" = 1 ] && [ "$backends" = 1 ]; then
    echo "==> the relay (outbox --quick, three runs: one relay, the discarding sink, 20,000 messages)" >&2
    mkdir -p "$target_dir/bench"
    : > "$target_dir/bench/outbox.json"
    for run in 1 2 3; do
        "$target_dir/release/outbox" --quick | tee -a "$target_dir/bench/outbox.json" || status=$?
    done
    echo "==> the consumer's PostgreSQL rows on Redis Streams (10,000 messages each, three rounds)" >&2
    "$target_dir/release/consumer" --only redis,bare-pg,runtime-pg --messages 10000 --rounds 3 \
        --out "$target_dir/bench/consumer.json" || status=$?
    "$target_dir/release/idempotent-bench" summary --out "$target_dir/bench/http.json" \
        --outbox "$target_dir/bench/outbox.json" --consumer "$target_dir/bench/consumer.json" ||
        status=$?
fi
exit "$status"
