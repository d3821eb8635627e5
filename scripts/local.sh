#!/usr/bin/env bash
# make local: the whole pipeline on this machine, no Docker, no AWS account.
# Installs what it needs (PostgreSQL if missing; Node 22 and the fauxqs
# emulator from npm), starts the emulator, then runs cmd/fifobox-local:
# migrate, create the topology, dispatcher loop, demo producer, queue readers.
# With FIFOBOX_TRANSPORT=rabbitmq or nats the same demo runs through the
# machine's RabbitMQ (vhost fifobox) or NATS JetStream (stream of the default
# topology) instead, each installed from Debian packages and started if
# missing; no emulator then.
# Ctrl-C stops everything it started. Extra arguments go to fifobox-local
# (e.g. make local ARGS="-orders 1000 -rate 500").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure-postgres.sh
case "${FIFOBOX_TRANSPORT:-sns}" in
  rabbitmq) ./scripts/ensure-rabbitmq.sh; exec go run ./cmd/fifobox-local "$@" ;;
  nats) ./scripts/ensure-nats.sh; exec go run ./cmd/fifobox-local "$@" ;;
esac
started=0
if ! ./localstack/emulator.sh status >/dev/null 2>&1; then
  ./localstack/emulator.sh start
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then ./localstack/emulator.sh stop; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM
# shellcheck disable=SC1091
source ./localstack/env.sh
go run ./cmd/fifobox-local "$@"
