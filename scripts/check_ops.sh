#!/usr/bin/env bash
# Checks what ops/ ships: the Prometheus alert rules are valid and pass their unit tests, and
# the Grafana dashboard is valid JSON. (That every metric they name is one the examples export
# is an end-to-end test: tests/tests/ops_metrics_e2e.rs.)
#
#   bash scripts/check_ops.sh
#
# promtool comes from Debian's `prometheus` package, installed when missing (with
# --no-install-recommends: 12 packages instead of 35, no node exporter; about 15 s). On a
# machine with systemd and no policy-rc.d, installing the package also starts a Prometheus
# server (prometheus.service, port 9090); containers deny that.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v promtool >/dev/null; then
    echo "installing promtool (Debian package prometheus)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null
fi
promtool --version | head -1

promtool check rules ops/prometheus/alerts.yml
promtool test rules ops/prometheus/alerts_test.yml

for dashboard in ops/grafana/*.json; do
    python3 -m json.tool "$dashboard" >/dev/null || { echo "$dashboard is not valid JSON" >&2; exit 1; }
    echo "$dashboard: valid JSON"
done
