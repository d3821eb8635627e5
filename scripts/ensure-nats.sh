#!/usr/bin/env bash
# Makes sure a NATS server with JetStream answers on 127.0.0.1:4222 for the
# NATS transport's tests and make bench: installs Debian's nats-server if it
# is missing and starts it (loopback only, JetStream on, its store under
# .data/nats) if nothing listens there. A server that is already running is
# used as it is and never restarted; the tests keep to streams and subjects
# of their own (a random prefix per test) and delete them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
listening() { (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; }

if listening; then
  echo "ensure-nats: a NATS server answers on 127.0.0.1:4222" >&2
  exit 0
fi
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
  echo "ensure-nats: NATS not installed; installing nats-server from Debian packages" >&2
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq nats-server >/dev/null || true
fi
server=$(command -v nats-server || echo /usr/sbin/nats-server)
[ -x "$server" ] || { echo "ensure-nats: installing nats-server failed" >&2; exit 1; }
mkdir -p .data/nats
echo "ensure-nats: starting $("$server" --version) with JetStream on 127.0.0.1:4222 (store .data/nats)" >&2
nohup "$server" -a 127.0.0.1 -p 4222 -js -sd "$PWD/.data/nats" >.data/nats/server.log 2>&1 &
for _ in $(seq 1 30); do listening && break; sleep 0.5; done
listening || { echo "ensure-nats: nothing listens on 127.0.0.1:4222 (see .data/nats/server.log)" >&2; exit 1; }
