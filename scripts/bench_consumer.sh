#!/usr/bin/env bash
# The consumer runtime's throughput on Redis Streams, NATS JetStream and RabbitMQ, against each
# broker's own limit measured in the same run (a bare consumer loop on the broker's client
# crate), with a no-op effect on the memory store and with a PostgreSQL effect in the
# transactional mode. BENCHMARKS.md ("0.3: the consumer runtime on three brokers") explains the
# rows and how to read them.
#
#   bash scripts/bench_consumer.sh                      # every row once, 20,000 messages each,
#                                                       # then the paced rows (about 2 minutes
#                                                       # on 2 vCPUs, the build not counted)
#   bash scripts/bench_consumer.sh --rounds 3           # each row's median of three rounds
#   bash scripts/bench_consumer.sh --only redis,runtime # any option of the binary (--help)
#
# Redis, PostgreSQL, NATS and RabbitMQ come from scripts/services.sh (installed from Debian
# packages when missing, started on free loopback ports, stopped on exit). The binary is
# `consumer` of the idempotent-bench package (bench/src/bin/consumer.rs), built in release. It
# prints one JSON object per row and then a table; target/bench/consumer.json gets the rows
# (under CARGO_TARGET_DIR when set), target/bench/consumer-paced.json the paced rows. Exits
# non-zero when a row did not apply every posting exactly once.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"

echo "==> building the consumer benchmark (release)" >&2
cargo build --release --locked -p idempotent-bench --bin consumer

source scripts/services.sh
trap stop_services EXIT
start_redis >&2
start_postgres >&2
start_nats >&2
start_rabbitmq >&2

# The servers' processes, so that each row also reports their CPU time per message: Redis's and
# NATS's pids, RabbitMQ's process group (its Erlang VM), PostgreSQL's postmaster (and so its
# backends, its children).
CONSUMER_BENCH_SERVICES="redis=$(cat "$SERVICES_DIR/redis/redis.pid"),nats=$(cat "$SERVICES_DIR/nats/nats.pid"),rabbitmq=$(cat "$SERVICES_DIR/rabbitmq/pgid"),postgres=$(head -n 1 "$SERVICES_DIR/postgres/data/postmaster.pid")"
export CONSUMER_BENCH_SERVICES

echo "==> $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# Redis's own rate for the command every message begins with, for reference: XADD of a
# three-field entry from 16 clients, one command per round trip and 16 pipelined.
if command -v redis-benchmark >/dev/null; then
    port="${IDEMPOTENT_TEST_REDIS_URL##*:}"
    for pipeline in 1 16; do
        echo "==> redis-benchmark XADD, 16 clients, pipeline $pipeline" >&2
        redis-benchmark -p "$port" -c 16 -P "$pipeline" -n 200000 -q \
            XADD consumer_bench_xadd '*' id pay-__rand_int__ account acct-1 amount 1 |
            tr '\r' '\n' | grep -v '^$' | tail -n 1 >&2
        redis-cli -p "$port" DEL consumer_bench_xadd >/dev/null
    done
fi

mkdir -p "$target_dir/bench"
"$target_dir/release/consumer" --out "$target_dir/bench/consumer.json" "$@"

# A full run (no options) also measures latency at a steady rate: 100 messages a second for
# 3 s, published while the consumer runs, through the PostgreSQL rows (bare-pg, runtime-pg).
if [ $# -eq 0 ]; then
    echo "==> paced: 100 messages a second, latency from receipt and from publication to the ack" >&2
    "$target_dir/release/consumer" --paced 100 --paced-seconds 3 --only bare-pg,runtime-pg \
        --out "$target_dir/bench/consumer-paced.json"
fi
