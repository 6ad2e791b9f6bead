#!/usr/bin/env bash
# The consumer runtime's throughput on four brokers (Redis Streams, NATS JetStream, RabbitMQ and
# Kafka), against each broker's own limit measured in the same run (a bare consumer loop on the
# broker's client crate), with a no-op effect on the memory store and with a PostgreSQL effect
# in the transactional mode. BENCHMARKS.md ("0.3: the consumer runtime on three brokers" and
# "0.4: the consumer runtime on Kafka") explains the rows and how to read them.
#
#   bash scripts/bench_consumer.sh                      # every row once, 20,000 messages each,
#                                                       # then the paced rows (about 2 minutes
#                                                       # on 2 vCPUs, the build not counted)
#   bash scripts/bench_consumer.sh --rounds 3           # each row's median of three rounds
#   bash scripts/bench_consumer.sh --only redis,runtime # any option of the binary (--help)
#
# Redis, PostgreSQL, NATS, RabbitMQ and the Kafka-protocol broker nisshi come from
# scripts/services.sh (installed from Debian packages when missing, nisshi built once into a
# cache, started on free loopback ports, stopped on exit). The binary is
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
# nisshi's own pid, once known (below): stop_services kills the pid in nisshi.pid, which is
# setsid's rather than the broker's when setsid forked (it does when it starts as a process
# group leader, as under a shell with job control), and would leave the broker running.
nisshi_pid=
stop_all() {
    if [ -n "$nisshi_pid" ]; then
        kill -KILL "$nisshi_pid" 2>/dev/null || true
    fi
    stop_services
}
trap stop_all EXIT
start_redis >&2
start_postgres >&2
start_nats >&2
start_rabbitmq >&2
start_kafka >&2

# nisshi, found by its listener's port (nisshi.pid may hold setsid's pid, above); the pid file
# if that finds nothing.
nisshi_pid="$(pgrep -f -- "--kafka-listener-url tcp://127.0.0.1:${IDEMPOTENT_TEST_KAFKA_URL##*:} " | head -n 1)" ||
    nisshi_pid="$(cat "$SERVICES_DIR/kafka/nisshi.pid")"

# The servers' processes, so that each row also reports their CPU time per message: Redis's,
# NATS's and nisshi's pids, RabbitMQ's process group (its Erlang VM), PostgreSQL's postmaster
# (and so its backends, its children).
CONSUMER_BENCH_SERVICES="redis=$(cat "$SERVICES_DIR/redis/redis.pid"),nats=$(cat "$SERVICES_DIR/nats/nats.pid"),rabbitmq=$(cat "$SERVICES_DIR/rabbitmq/pgid"),kafka=$nisshi_pid,postgres=$(head -n 1 "$SERVICES_DIR/postgres/data/postmaster.pid")"
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
