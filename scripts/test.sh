#!/usr/bin/env bash
# The README's test command (and CI's, via .ci/run). On a fresh machine it
# installs and starts what the tests need: PostgreSQL, RabbitMQ and NATS
# (Debian packages), Node 22 and the fauxqs SNS/SQS emulator (npm), pgbouncer (Debian
# package), the pinned CDK CLI and cfn-guard (npm), node-postgres (npm) and
# psycopg (Debian) for the producers-in-other-languages test, and the seed
# systems' clients (amqplib from npm; pika and boto3 from Debian). It synthesises the CDK
# templates (the runtime contract tests check each function's environment
# against them), then runs every Go test of both modules. An emulator that
# was already running is used and left running; one this script starts, it stops.
set -euo pipefail
cd "$(dirname "$0")/.."
export CDK_DISABLE_CLI_TELEMETRY=true
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
step() { printf '\n==> %s\n' "$*"; }

step "PostgreSQL"
./scripts/ensure-postgres.sh

step "RabbitMQ (the AMQP transport's tests)"
./scripts/ensure-rabbitmq.sh

step "NATS with JetStream (the NATS transport's tests)"
./scripts/ensure-nats.sh

step "pgbouncer (for the transaction-pooling test)"
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  as_root apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq pgbouncer >/dev/null || echo "pgbouncer install failed; its test will skip" >&2
fi

step "Clients of other languages: producers for the SQL enqueue test, the seed systems' consumers (internal/seeds)"
(cd examples/producers && npm ci --no-audit --no-fund --silent)
(cd examples/seeds && npm ci --no-audit --no-fund --silent)   # amqplib, pg
# Debian's python3-psycopg (producers, ticketing), python3-pika (ticketing),
# python3-boto3 (transfers); /usr/bin/python3 is the interpreter they install into.
if ! /usr/bin/python3 -c 'import psycopg, pika, boto3' 2>/dev/null; then
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-psycopg python3-pika python3-boto3 >/dev/null 2>&1 ||
    { as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-psycopg python3-pika python3-boto3 >/dev/null; }
fi
export FIFOBOX_REQUIRE_CLIENTS=1

step "SNS/SQS emulator"
./localstack/emulator.sh install   # even if one is running: the outage test starts its own
started_emulator=0
if ! ./localstack/emulator.sh status >/dev/null 2>&1; then
  ./localstack/emulator.sh start
  started_emulator=1
else
  echo "emulator: using the one already running on 127.0.0.1:${FIFOBOX_EMULATOR_PORT:-4566}"
fi
trap 'if [ "$started_emulator" = 1 ]; then ./localstack/emulator.sh stop >/dev/null 2>&1 || true; fi' EXIT
# shellcheck disable=SC1091
source ./localstack/env.sh

step "go vet"
go vet ./...

step "Lambda bootstraps and CDK templates (for the runtime contract tests)"
./scripts/build-lambda.sh build/lambda
./infra/scripts/synth.sh
export FIFOBOX_REQUIRE_SYNTH=1

step "go test (application module)"
go test -count=1 -timeout 30m ./...

if [ -x ./infra/scripts/test.sh ]; then
  step "go test (infra module: CDK assertions, cdk-nag, cfn-guard)"
  ./infra/scripts/test.sh
fi
