#!/usr/bin/env bash
# The local AWS side.
#   emulator.sh install | start | stop | status
# FIFOBOX_EMULATOR picks it:
#   fauxqs (default, no Docker): the fauxqs SNS/SQS emulator on Node 22, both
#     installed from npm into localstack/node_modules (pinned by package-lock.json);
#   localstack | floci (Docker): docker-compose.yml's profile of that name
#     (LocalStack needs LOCALSTACK_AUTH_TOKEN; Floci needs no token).
# All listen on 127.0.0.1:4566 (fauxqs: FIFOBOX_EMULATOR_PORT). Endpoint for
# clients: source localstack/env.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kind="${FIFOBOX_EMULATOR:-fauxqs}"
port="${FIFOBOX_EMULATOR_PORT:-4566}"
case "$kind" in
  fauxqs) ;;
  localstack|floci)
    docker compose version >/dev/null 2>&1 || { echo "emulator: FIFOBOX_EMULATOR=$kind needs Docker with the compose plugin; unset it to use fauxqs" >&2; exit 1; }
    compose=(docker compose -f "$here/docker-compose.yml" --profile "$kind")
    case "${1:-}" in
      install) "${compose[@]}" pull ;;
      start) "${compose[@]}" up -d --wait; echo "emulator: $kind at http://127.0.0.1:4566" >&2 ;;
      stop) "${compose[@]}" down ;;
      status) curl -fsS -m 2 "http://127.0.0.1:4566/_localstack/health" >/dev/null && echo "running on 127.0.0.1:4566" || { echo "not running"; exit 1; } ;;
      *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
    esac
    exit 0 ;;
  *) echo "emulator: FIFOBOX_EMULATOR=$kind: want fauxqs, localstack or floci" >&2; exit 2 ;;
esac
pidfile="$here/.emulator-$port.pid"
logfile="$here/.emulator-$port.log"
node="$here/node_modules/.bin/node"

healthy() { curl -fsS -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1; }

install() {
  if [ -x "$node" ] && [ -d "$here/node_modules/fauxqs" ] && "$node" --version | grep -q '^v22\.'; then
    return
  fi
  command -v npm >/dev/null || { echo "emulator: npm is required to install Node 22 and fauxqs" >&2; exit 1; }
  echo "emulator: installing Node 22 and fauxqs from npm (package-lock.json)" >&2
  (cd "$here" && npm ci --no-audit --no-fund --loglevel=error)
  "$node" --version >/dev/null
}

start() {
  if healthy; then echo "emulator: already running on 127.0.0.1:$port" >&2; return; fi
  install
  FIFOBOX_EMULATOR_PORT="$port" FIFOBOX_EMULATOR_PIDFILE="$pidfile" nohup "$node" "$here/launcher.mjs" >"$logfile" 2>&1 &
  echo $! >"$pidfile"
  for _ in $(seq 1 100); do
    if healthy; then echo "emulator: fauxqs $("$node" -p 'require("'"$here"'/node_modules/fauxqs/package.json").version') on Node $("$node" --version) at http://127.0.0.1:$port" >&2; return; fi
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then break; fi
    sleep 0.2
  done
  echo "emulator: did not become healthy; log:" >&2; cat "$logfile" >&2; exit 1
}

# ours: the pid runs this directory's launcher (a stale pidfile may name a
# pid the system has since given to another process).
ours() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$here/launcher.mjs"; }

stop() {
  if [ -f "$pidfile" ]; then
    pid="$(cat "$pidfile")"
    if ! ours "$pid"; then
      rm -f "$pidfile"
      echo "emulator: not running (stale pidfile removed)" >&2
      return
    fi
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    echo "emulator: stopped" >&2
  fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) if healthy; then echo "running on 127.0.0.1:$port"; else echo "not running"; exit 1; fi ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
