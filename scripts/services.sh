# Starting and stopping the real backend servers the tests use. Sourced by scripts/test.sh and
# scripts/bench.sh; usable by hand:
#
#   source scripts/services.sh && start_redis && start_postgres
#   ... run tests ...
#   stop_services
#
# Each server runs on a free loopback port in its own temporary directory; its URL is exported
# as IDEMPOTENT_TEST_REDIS_URL / IDEMPOTENT_TEST_POSTGRES_URL.

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
    # free, together with their bus ports, and at most 55535.
    read -r -a ports <<<"$(python3 -c '
import random, socket
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
    port = random.randint(20000, 55535)
    if port not in ports and port + 10000 not in ports and free(port) and free(port + 10000):
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
        run=(runuser -u postgres --)
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
    rm -rf "$dir"
}
