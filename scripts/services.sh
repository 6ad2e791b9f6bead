# Starting and stopping the real backend servers the tests use. Sourced by scripts/test.sh and
# scripts/bench.sh; usable by hand:
#
#   source scripts/services.sh && start_redis && start_postgres && start_nats && start_rabbitmq && start_kafka
#   ... run tests ...
#   stop_services
#
# Each server runs on a free loopback port in its own temporary directory; its URL is exported
# as IDEMPOTENT_TEST_REDIS_URL / IDEMPOTENT_TEST_POSTGRES_URL / IDEMPOTENT_TEST_NATS_URL /
# IDEMPOTENT_TEST_AMQP_URL / IDEMPOTENT_TEST_KAFKA_URL.
#
# The Kafka-protocol broker is nisshi, built from crates.io (no Debian package has one) into a
# cache outside the clone, $IDEMPOTENT_TOOLS_CACHE (default ~/.cache/idempotent-tools): about
# ten minutes on two cores the first time, reused afterwards.

SERVICES_DIR="${SERVICES_DIR:-$(mktemp -d -t idempotent-services.XXXXXX)}"
chmod 755 "$SERVICES_DIR"

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
    echo "installing $* from Debian packages"
    if [ -z "${APT_UPDATED:-}" ]; then
        as_root apt-get update -qq
        APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

start_redis() {
    if ! command -v redis-server >/dev/null; then
        apt_install redis-server
    fi
    local port dir
    port="$(free_port)"
    dir="$SERVICES_DIR/redis"
    mkdir -p "$dir"
    # AOF on: records written before a restart survive it, as in a production setup.
    redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" \
        --appendonly yes --appendfsync everysec --maxmemory-policy noeviction \
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
    for _ in $(seq 1 100); do
        if redis-cli -p "$port" ping >/dev/null 2>&1; then
            export IDEMPOTENT_TEST_REDIS_URL="redis://127.0.0.1:$port"
            echo "redis-server $(redis-server --version | awk '{print $3}') on $IDEMPOTENT_TEST_REDIS_URL"
            return 0
        fi
        sleep 0.1
    done
    echo "redis-server did not start; log:" >&2
    cat "$dir/redis.log" >&2
    return 1
}

# Whether the cluster node on `port` sees every slot served and three replicas.
cluster_ready() {
    redis-cli -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok' &&
        [ "$(redis-cli -p "$1" cluster nodes 2>/dev/null | awk '$3 ~ /slave/' | wc -l)" = 3 ]
}

# A Redis Cluster of three primaries with one replica each, on six free loopback ports, for
# the cluster tests. Exports IDEMPOTENT_TEST_REDIS_CLUSTER_URLS (the six nodes' URLs, comma-
# separated, as the store and the examples take them) and IDEMPOTENT_TEST_REDIS_CLUSTER_DIR
# (one directory per node, named by its port, holding its pid file).
start_redis_cluster() {
    if ! command -v redis-server >/dev/null; then
        apt_install redis-server
    fi
    local ports=() port dir urls=() addresses=()
    # A cluster node also listens on its port + 10000 (the cluster bus): six ports that are
    # free, together with their bus ports, both below the lower half of the range below the
    # kernel's ephemeral range (tests kill a node and start it again on its ports: while it is
    # down, no outbound connection's source port and no bind to port 0 can take one of them,
    # nor a test's restartable_port in test-kit/src/names.rs, which draws from that half).
    read -r -a ports <<<"$(python3 -c '
import random, socket
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first = int(f.read().split()[0])
except (OSError, ValueError, IndexError):
    first = 32768
low, high = (2048, first // 2 - 10001) if first // 2 >= 14000 else (20000, 55535)
def free(port):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()
ports = []
while len(ports) < 6:
    port = random.randint(low, high)
    if all(port not in (p, p + 10000, p - 10000) for p in ports) and free(port) and free(port + 10000):
        ports.append(port)
print(*ports)
')"
    for port in "${ports[@]}"; do
        dir="$SERVICES_DIR/redis-cluster/$port"
        mkdir -p "$dir"
        # The node's command line, kept so a test can restart a node it killed (it rejoins
        # the cluster from its nodes.conf).
        printf 'exec redis-server --port %s --bind 127.0.0.1 --dir %q --save "" --appendonly yes --appendfsync everysec --maxmemory-policy noeviction --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 --daemonize yes --pidfile %q --logfile %q\n' \
            "$port" "$dir" "$dir/redis.pid" "$dir/redis.log" >"$dir/start.sh"
        bash "$dir/start.sh"
        addresses+=("127.0.0.1:$port")
        urls+=("redis://127.0.0.1:$port")
    done
    for port in "${ports[@]}"; do
        for _ in $(seq 1 100); do
            redis-cli -p "$port" ping >/dev/null 2>&1 && break
            sleep 0.1
        done
        if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
            echo "cluster node on port $port did not start; log:" >&2
            cat "$SERVICES_DIR/redis-cluster/$port/redis.log" >&2
            return 1
        fi
    done
    if ! redis-cli --cluster create "${addresses[@]}" --cluster-replicas 1 --cluster-yes \
        >"$SERVICES_DIR/redis-cluster/create.log" 2>&1; then
        echo "redis-cli --cluster create failed:" >&2
        cat "$SERVICES_DIR/redis-cluster/create.log" >&2
        return 1
    fi
    # Every node must see all slots served and every primary's replica attached before the
    # tests use the cluster (replicas join a moment after the slots are assigned).
    for port in "${ports[@]}"; do
        for _ in $(seq 1 300); do
            cluster_ready "$port" && break
            sleep 0.1
        done
        if ! cluster_ready "$port"; then
            echo "the Redis Cluster did not come up on port $port:" >&2
            redis-cli -p "$port" cluster nodes >&2
            return 1
        fi
    done
    IDEMPOTENT_TEST_REDIS_CLUSTER_URLS="$(IFS=,; echo "${urls[*]}")"
    export IDEMPOTENT_TEST_REDIS_CLUSTER_URLS
    export IDEMPOTENT_TEST_REDIS_CLUSTER_DIR="$SERVICES_DIR/redis-cluster"
    echo "redis cluster (3 primaries, 3 replicas) on ${addresses[*]}"
}

pg_bin() {
    local dir
    for dir in /usr/lib/postgresql/*/bin; do
        if [ -x "$dir/initdb" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

start_postgres() {
    local bin
    if ! bin="$(pg_bin)"; then
        apt_install postgresql
        bin="$(pg_bin)"
    fi
    local port dir run=()
    port="$(free_port)"
    dir="$SERVICES_DIR/postgres"
    mkdir -p "$dir"
    # PostgreSQL refuses to run as root: run it as the postgres user in a directory it owns.
    if [ "$(id -u)" = 0 ]; then
        chown postgres:postgres "$dir"
        # /usr/sbin may be off a non-login PATH (the nats-server binary's place too).
        run=("$(command -v runuser || echo /usr/sbin/runuser)" -u postgres --)
    fi
    "${run[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 || {
        cat "$dir/initdb.log" >&2
        return 1
    }
    "${run[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 -c shared_buffers=2GB" start >/dev/null || {
        cat "$dir/postgres.log" >&2
        return 1
    }
    export IDEMPOTENT_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$port/postgres"
    export IDEMPOTENT_TEST_PG_BIN="$bin"
    echo "postgres $("$bin/postgres" --version | awk '{print $3}') on $IDEMPOTENT_TEST_POSTGRES_URL"
}

# The nats-server binary: on PATH, or in /usr/sbin (the Debian package's place, often not on a
# user's PATH).
nats_bin() {
    if command -v nats-server 2>/dev/null; then
        return 0
    fi
    if [ -x /usr/sbin/nats-server ]; then
        echo /usr/sbin/nats-server
        return 0
    fi
    return 1
}

# A nats-server with JetStream (file store in its directory), on a free loopback port. Exports
# IDEMPOTENT_TEST_NATS_URL.
start_nats() {
    local bin
    if ! bin="$(nats_bin)"; then
        apt_install nats-server
        bin="$(nats_bin)" || {
            echo "nats-server is not installed" >&2
            return 1
        }
    fi
    local port dir line
    port="$(free_port)"
    dir="$SERVICES_DIR/nats"
    mkdir -p "$dir/store"
    # Its own session (setsid): a Ctrl-C in the terminal that sourced this does not reach it.
    setsid "$bin" -a 127.0.0.1 -p "$port" -js -sd "$dir/store" -P "$dir/nats.pid" \
        -l "$dir/nats.log" </dev/null >>"$dir/nats.log" 2>&1 &
    disown  # no "Terminated" notice from this shell when stop_services stops it
    # Ready when it greets a client with an INFO line announcing JetStream (enabled before the
    # client listener opens, so also after a restart that recovers streams).
    for _ in $(seq 1 200); do
        if line="$(timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" && read -r -t 1 line <&3 && echo "$line"' _ "$port" 2>/dev/null)" &&
            [[ "$line" == INFO*'"jetstream":true'* ]]; then
            export IDEMPOTENT_TEST_NATS_URL="nats://127.0.0.1:$port"
            echo "nats-server $("$bin" --version | awk '{print $2}') (JetStream) on $IDEMPOTENT_TEST_NATS_URL"
            return 0
        fi
        sleep 0.05
    done
    echo "nats-server did not start on port $port within 10 s; log:" >&2
    cat "$dir/nats.log" >&2
    return 1
}

# The directory of RabbitMQ's own scripts (rabbitmq-server, rabbitmqctl). Debian's /usr/sbin
# ones are wrappers that, run as root, switch to the rabbitmq user (its home, its Erlang
# cookie) and refuse any other user: the real scripts are in /usr/lib/rabbitmq/bin. Elsewhere
# (a generic-unix install), the ones on PATH.
rabbitmq_scripts() {
    local dir
    for dir in /usr/lib/rabbitmq/bin "$(dirname "$(command -v rabbitmq-server 2>/dev/null || echo /nonexistent/x)")"; do
        if [ -x "$dir/rabbitmq-server" ] && [ -x "$dir/rabbitmqctl" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

# Whether process `pid` is still running (not a zombie).
pid_alive() {
    case "$(ps -o stat= -p "$1" 2>/dev/null)" in
    "" | Z*) return 1 ;;
    *) return 0 ;;
    esac
}

# Whether a thread of process group `pgid` still runs. Zombies do not count (this machine's
# init may never reap orphans), but a killed Erlang VM whose main thread is already a zombie
# holds its ports and files until its other threads are gone: threads are what is looked at.
group_alive() {
    ps -e -L -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# A RabbitMQ node of its own on a free loopback port (AMQP; its distribution port is another
# free one), with its own node name (rabbit-PORT@localhost), data and log directories, config
# and Erlang cookie (HOME is its directory: the tests' and the user's home are not touched), no
# plugins. Exports IDEMPOTENT_TEST_AMQP_URL, and IDEMPOTENT_TEST_RABBITMQCTL: a rabbitmqctl
# bound to this node (`$SERVICES_DIR/rabbitmq/rabbitmqctl ARGS`).
start_rabbitmq() {
    local scripts
    if ! scripts="$(rabbitmq_scripts)"; then
        apt_install rabbitmq-server
        scripts="$(rabbitmq_scripts)" || {
            echo "rabbitmq-server is not installed" >&2
            return 1
        }
    fi
    local port dist dir node started started_ns
    port="$(free_port)"
    dist="$(free_port)"
    dir="$SERVICES_DIR/rabbitmq"
    node="rabbit-$port@localhost"
    mkdir -p "$dir/mnesia" "$dir/log"
    # The cookie the node and the CLI share, written before either starts (both would create
    # one if missing, racing).
    python3 -c 'import secrets, string; print("".join(secrets.choice(string.ascii_uppercase) for _ in range(20)), end="")' \
        >"$dir/.erlang.cookie"
    chmod 400 "$dir/.erlang.cookie"
    echo '[].' >"$dir/enabled_plugins"
    : >"$dir/rabbitmq-env.conf"
    printf '# written by scripts/services.sh; listener, node name and ports come from the environment\nloopback_users.guest = true\n' \
        >"$dir/rabbitmq.conf"
    # The environment of both the node and the CLI, kept in a file that `rabbitmqctl` below and
    # a restart source. ERL_EPMD_ADDRESS: epmd, if this node starts it, listens on loopback.
    # The CLI's own distribution port is left to the system (0), not 35672-35682.
    cat >"$dir/env.sh" <<EOF
for v in \$(compgen -e | grep '^RABBITMQ_'); do unset "\$v"; done
export HOME=$(printf %q "$dir")
export RABBITMQ_NODENAME=$node
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=$port
export RABBITMQ_DIST_PORT=$dist
export RABBITMQ_MNESIA_BASE=$(printf %q "$dir/mnesia")
export RABBITMQ_LOG_BASE=$(printf %q "$dir/log")
export RABBITMQ_LOGS=$(printf %q "$dir/log/rabbit.log")
export RABBITMQ_PID_FILE=$(printf %q "$dir/rabbit.pid")
export RABBITMQ_CONFIG_FILE=$(printf %q "$dir/rabbitmq.conf")
export RABBITMQ_ADVANCED_CONFIG_FILE=$(printf %q "$dir/advanced.config")
export RABBITMQ_CONF_ENV_FILE=$(printf %q "$dir/rabbitmq-env.conf")
export RABBITMQ_ENABLED_PLUGINS_FILE=$(printf %q "$dir/enabled_plugins")
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}'
export RABBITMQ_CTL_DIST_PORT_MIN=0 RABBITMQ_CTL_DIST_PORT_MAX=0
export ERL_EPMD_ADDRESS=127.0.0.1
EOF
    printf '#!/usr/bin/env bash\nsource %q\nexec %q -n %q "$@"\n' "$dir/env.sh" "$scripts/rabbitmqctl" "$node" \
        >"$dir/rabbitmqctl"
    chmod +x "$dir/rabbitmqctl"
    # In a session of its own, whose id (the process group that `stop_services` kills: the
    # rabbitmq-server script and the Erlang VM it starts) is written first.
    started=$SECONDS
    started_ns=$(date +%s%N)
    setsid bash -c 'source "$1/env.sh" && echo $$ >"$1/pgid" && exec "$2/rabbitmq-server"' \
        _ "$dir" "$scripts" </dev/null >"$dir/stdout.log" 2>&1 &
    disown  # no "Killed" notice from this shell when stop_services kills it
    # Ready when the AMQP port accepts connections and the node says it has booted
    # (`await_startup` fails at once while the node is not yet registered with epmd, so it
    # comes after the port).
    local up=
    while [ $((SECONDS - started)) -lt 90 ]; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            up=1
            break
        fi
        if [ -s "$dir/pgid" ] && ! group_alive "$(cat "$dir/pgid")"; then
            break
        fi
        sleep 0.1
    done
    if [ -n "$up" ] && timeout 60 "$dir/rabbitmqctl" -q await_startup --timeout 50 >"$dir/await.log" 2>&1; then
        export IDEMPOTENT_TEST_AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2f"
        export IDEMPOTENT_TEST_RABBITMQCTL="$dir/rabbitmqctl"
        local version
        version="$(grep -aom1 'Starting RabbitMQ [0-9.]*' "$dir/log/rabbit.log" | awk '{print $3}')" || true
        echo "rabbitmq-server ${version:-?} (node $node) on $IDEMPOTENT_TEST_AMQP_URL, ready in $((($(date +%s%N) - started_ns) / 1000000)) ms"
        return 0
    fi
    echo "rabbitmq-server did not start on port $port; its output, await_startup's and its log:" >&2
    cat "$dir/stdout.log" "$dir/await.log" >&2 2>/dev/null
    tail -n 100 "$dir/log/rabbit.log" >&2 2>/dev/null
    return 1
}

NISSHI_VERSION=0.8.1
TOOLS_CACHE="${IDEMPOTENT_TOOLS_CACHE:-$HOME/.cache/idempotent-tools}"

# The cached nisshi binary, building it first if it is missing: `cargo install` of the pinned
# version with its lock file and only the SQLite storage engine (`libsql`), into the cache.
# `--ignore-rust-version`: its lock file asks for a newer rustc than this project's, and
# builds with ours.
nisshi_bin() {
    local root="$TOOLS_CACHE/nisshi-$NISSHI_VERSION"
    if [ ! -x "$root/bin/nisshi" ]; then
        echo "building nisshi $NISSHI_VERSION (a Kafka-protocol broker) into $root; about 10 minutes the first time" >&2
        mkdir -p "$TOOLS_CACHE"
        if ! cargo install nisshi --version "$NISSHI_VERSION" --locked --ignore-rust-version \
            --no-default-features --features libsql --root "$root" \
            --target-dir "$TOOLS_CACHE/nisshi-build" >"$TOOLS_CACHE/nisshi-build.log" 2>&1; then
            echo "cargo install nisshi failed; its log:" >&2
            tail -n 40 "$TOOLS_CACHE/nisshi-build.log" >&2
            return 1
        fi
        # The build directory is gigabytes; the binary is all that is reused.
        rm -rf "$TOOLS_CACHE/nisshi-build"
    fi
    echo "$root/bin/nisshi"
}

# A nisshi broker on a free loopback port, its log in an SQLite file in its directory (a
# SIGKILL and a restart keep it). Exports IDEMPOTENT_TEST_KAFKA_URL (kafka://127.0.0.1:PORT)
# and IDEMPOTENT_TEST_NISSHI (the binary, for tests that start brokers of their own).
start_kafka() {
    local bin port dir
    bin="$(nisshi_bin)" || return 1
    port="$(free_port)"
    dir="$SERVICES_DIR/kafka"
    mkdir -p "$dir"
    # Its own session, in its directory (the SQLite path is relative to it; it reads a .env
    # there, and there is none). The shell in the new session writes its own pid, then becomes
    # nisshi (`exec`): `$!` would be setsid's, which forks and exits under job control.
    (cd "$dir" && env -u STORAGE_ENGINE -u LISTENER_URL -u ADVERTISED_LISTENER_URL RUST_LOG=warn \
        setsid bash -c 'echo $$ >nisshi.pid && exec "$0" broker --kafka-listener-url "$1" \
        --kafka-advertised-listener-url "$1" --storage-engine sqlite://kafka.db \
        --group-initial-rebalance-delay 0s' "$bin" "tcp://127.0.0.1:$port" \
        </dev/null >>"$dir/nisshi.log" 2>&1 &)
    for _ in $(seq 1 300); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            export IDEMPOTENT_TEST_KAFKA_URL="kafka://127.0.0.1:$port"
            export IDEMPOTENT_TEST_NISSHI="$bin"
            echo "nisshi $NISSHI_VERSION (Kafka protocol, SQLite storage) on $IDEMPOTENT_TEST_KAFKA_URL"
            return 0
        fi
        sleep 0.1
    done
    echo "nisshi did not start on port $port within 30 s; log:" >&2
    cat "$dir/nisshi.log" >&2
    return 1
}

# Kills RabbitMQ's process group (if it was started) and waits, bounded, until it is gone.
stop_rabbitmq_group() {
    local pgid
    pgid="$(cat "$1/pgid" 2>/dev/null)" || return 0
    [ -n "$pgid" ] || return 0
    kill -KILL -- "-$pgid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        group_alive "$pgid" || return 0
        sleep 0.1
    done
    echo "RabbitMQ (process group $pgid) is still running after SIGKILL" >&2
}

stop_services() {
    local dir="$SERVICES_DIR" pidfile
    if [ -f "$dir/redis/redis.pid" ]; then
        kill "$(cat "$dir/redis/redis.pid")" 2>/dev/null || true
    fi
    for pidfile in "$dir"/redis-cluster/*/redis.pid; do
        if [ -f "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
        fi
    done
    if [ -d "$dir/postgres/data" ]; then
        local bin run=()
        bin="$(pg_bin)"
        [ "$(id -u)" = 0 ] && run=(runuser -u postgres --)
        "${run[@]}" "$bin/pg_ctl" -D "$dir/postgres/data" -m immediate stop >/dev/null 2>&1 || true
    fi
    if [ -f "$dir/nats/nats.pid" ]; then
        local nats
        nats="$(cat "$dir/nats/nats.pid")"
        kill "$nats" 2>/dev/null || true
        for _ in $(seq 1 50); do
            pid_alive "$nats" || break
            sleep 0.1
        done
        if pid_alive "$nats"; then
            kill -KILL "$nats" 2>/dev/null || true
        fi
    fi
    if [ -d "$dir/rabbitmq" ]; then
        stop_rabbitmq_group "$dir/rabbitmq"
    fi
    if [ -f "$dir/kafka/nisshi.pid" ]; then
        kill -KILL "$(cat "$dir/kafka/nisshi.pid")" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
