#!/usr/bin/env bash
# The README's test command (and CI's, via .ci/run). On a fresh machine it
# installs and starts what the tests need: PostgreSQL and RabbitMQ (Debian
# packages), Node 22 and the fauxqs SNS/SQS emulator (npm), pgbouncer (Debian package),
# the pinned CDK CLI (npm). Then it runs every Go test of both modules.
set -euo pipefail
cd "$(dirname "$0")/.."
export CDK_DISABLE_CLI_TELEMETRY=true
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
step() { printf '\n==> %s\n' "$*"; }

step "PostgreSQL"
./scripts/ensure-postgres.sh

step "RabbitMQ (the AMQP transport's tests)"
./scripts/ensure-rabbitmq.sh

step "pgbouncer (for the transaction-pooling test)"
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  as_root apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq pgbouncer >/dev/null || echo "pgbouncer install failed; its test will skip" >&2
fi

step "SNS/SQS emulator"
./localstack/emulator.sh install   # even if one is running: the outage test starts its own
./localstack/emulator.sh start
trap './localstack/emulator.sh stop >/dev/null 2>&1 || true' EXIT
# shellcheck disable=SC1091
source ./localstack/env.sh

step "go vet"
go vet ./...

step "go test (application module)"
go test -count=1 -timeout 30m ./...

if [ -x ./infra/scripts/test.sh ]; then
  step "go test (infra module: CDK assertions and cdk-nag)"
  ./infra/scripts/test.sh
fi
