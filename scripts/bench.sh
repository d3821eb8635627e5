#!/usr/bin/env bash
# make bench: every benchmark, each printing its figures beside the reference
# it is judged against, measured in the same run. Needs PostgreSQL and the
# SNS/SQS emulator (both started here if absent). Figures are noisy on a
# shared 2-core machine: run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = longtx ]; then
  # Only the long-transaction benchmark: it needs no shared service.
  go test -count=1 -run '^$' -bench 'BenchmarkLongTransaction' -benchtime 1x -timeout 30m ./pkg/outbox/ |
    { grep -v 'migration applied' || true; }
  exit 0
fi
./scripts/ensure-postgres.sh
started=0
if ! ./localstack/emulator.sh status >/dev/null 2>&1; then
  ./localstack/emulator.sh start
  started=1
fi
trap '[ "$started" = 1 ] && ./localstack/emulator.sh stop >/dev/null 2>&1 || true' EXIT
# shellcheck disable=SC1091
source ./localstack/env.sh
quiet() { grep -v -e 'migration applied' -e '^emulatortest:' || true; }
# Before each section, settle PostgreSQL:
# - CHECKPOINT finishes the checkpoint the previous section's WAL set off:
#   PostgreSQL spreads its writes over minutes (checkpoint_completion_target),
#   and they would land in the next section's figures (the 1M-row case alone
#   writes over 1 GB of WAL);
# - VACUUM clears the system catalogs of the schemas earlier tests created and
#   dropped (pgtest makes one per test): where autovacuum is off, as on this
#   project's CI machines, their dead rows pile up run after run and slow
#   every new connection and plan (171,598 dead pg_attribute rows seen).
# Needs superuser (or pg_checkpoint) and ownership; skipped if refused.
settle() {
  local url="${FIFOBOX_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"
  psql "$url" -qAtc CHECKPOINT >/dev/null 2>&1 && psql "$url" -qAtc VACUUM >/dev/null 2>&1 ||
    echo "bench: CHECKPOINT or VACUUM refused; figures may carry earlier sections' checkpoint writes or catalog bloat" >&2
}
settle
echo "==> outbox dispatcher vs the raw SQL limit (PostgreSQL, in-process publisher), QueryExecModeExec (as through RDS Proxy); PostgreSQL CPU and outbox bytes per event"
go test -count=1 -run '^$' -bench 'BenchmarkDispatch$' -benchtime 100000x -timeout 30m ./pkg/outbox/ | quiet

settle
echo "==> the same with cached prepared statements (pgx default; a direct connection without a proxy)"
FIFOBOX_TEST_QUERY_MODE=cache go test -count=1 -run '^$' -bench 'BenchmarkDispatch$' -benchtime 100000x -timeout 30m ./pkg/outbox/ | quiet

settle
echo "==> the dispatcher under skew: hot, deep, parked and zipf-spread aggregates beside uniform (in-process publisher); PostgreSQL CPU and outbox bytes per event per shape"
go test -count=1 -run '^$' -bench 'BenchmarkDispatchSkew' -benchtime 1x -timeout 60m ./pkg/outbox/ | quiet

settle
echo "==> outbox storage per event by relation: the skew benchmark's rows, Enqueue's envelopes, a pruned retention window"
go test -count=1 -run '^$' -bench 'BenchmarkOutboxStorage' -benchtime 1x -timeout 30m ./pkg/outbox/ | quiet

settle
echo "==> end to end through the emulator: dispatcher vs raw PublishBatch"
go test -run '^$' -bench 'BenchmarkThroughEmulator' -benchtime 20000x -timeout 30m ./pkg/transport/sns/ | quiet

settle
echo "==> one deep aggregate through the emulator: its own rate (SNS FIFO allows 300 messages/s per group)"
go test -run '^$' -bench 'BenchmarkDeepAggregateThroughEmulator' -benchtime 5000x -timeout 30m ./pkg/transport/sns/ | quiet

settle
echo "==> commit-to-publish latency at 1,000 events/s offered (emulator)"
go test -run '^$' -bench 'BenchmarkLatencyAt1000' -benchtime 1x -timeout 30m ./pkg/transport/sns/ | quiet

settle
echo "==> dispatcher Lambda handler: one invocation, latency of events committed during it"
go test -run '^$' -bench 'BenchmarkInvocationLatency' -benchtime 3x -timeout 30m ./pkg/lambdafn/dispatcher/ | quiet

settle
echo "==> enqueue: SQL function fifobox_enqueue vs Go's Enqueue (4 producers; one-event and ten-event transactions; one hot aggregate)"
go test -count=1 -run '^$' -bench 'BenchmarkEnqueueSQL' -benchtime 20000x -timeout 30m ./pkg/outbox/ | quiet

settle
echo "==> consumer: messages/s through the consumer engine with the inbox vs the same side effect without (and CPU per event)"
go test -run '^$' -bench 'BenchmarkConsumer' -benchtime 20000x -timeout 30m ./pkg/inbox/ | quiet

# --- RabbitMQ transport (pkg/transport/amqp; needs the RabbitMQ of make test) ---
./scripts/ensure-rabbitmq.sh >/dev/null
settle
echo "==> RabbitMQ: dispatcher through the holdco topology vs raw publish-with-confirms (same client, messages, concurrency)"
go test -count=1 -run '^$' -bench 'BenchmarkThroughRabbitMQ' -benchtime 20000x -timeout 30m ./pkg/transport/amqp/ | quiet

settle
echo "==> wire profiles: dispatch through the holdco profile and a template profile vs fifobox's envelope (same events, exchange and queues)"
go test -count=1 -run '^$' -bench 'BenchmarkProfileDispatch' -benchtime 20000x -timeout 30m ./pkg/transport/amqp/ | quiet
go test -count=1 -run '^$' -bench 'BenchmarkRender' -benchtime 200000x ./pkg/wire/ | quiet

settle
echo "==> RabbitMQ: commit-to-consume latency at 100 and 1,000 events/s offered (whole pipeline, inbox included)"
go test -count=1 -run '^$' -bench 'BenchmarkLatency' -benchtime 1x -timeout 30m ./pkg/transport/amqp/ | quiet

# --- NATS JetStream transport (pkg/transport/nats; needs the NATS of make test) ---
./scripts/ensure-nats.sh >/dev/null 2>&1
settle
echo "==> NATS: dispatcher through JetStream (holdco) vs raw JetStream publish (same client, messages, concurrency)"
go test -count=1 -run '^$' -bench 'BenchmarkThroughNATS' -benchtime 20000x -timeout 30m ./pkg/transport/nats/ | quiet

settle
echo "==> NATS: commit-to-consume latency at 100 and 1,000 events/s offered (whole pipeline, inbox included; beside RabbitMQ's above)"
go test -count=1 -run '^$' -bench 'BenchmarkLatency' -benchtime 1x -timeout 30m ./pkg/transport/nats/ | quiet

# --- Long transaction (opt-in: about 6 minutes) ---
# A transaction held open on the server during a steady 300 events/s, on a
# private PostgreSQL cluster with autovacuum on (started and deleted by the
# benchmark, port 55400-55499): FIFOBOX_BENCH_LONGTX=1 make bench, or run it
# alone with scripts/bench.sh longtx. FIFOBOX_LONGTX_HOLD shortens the hold
# (default 5m).
if [ "${FIFOBOX_BENCH_LONGTX:-0}" = 1 ]; then
  echo "==> a transaction held open for ${FIFOBOX_LONGTX_HOLD:-5m} at 300 events/s (private cluster, autovacuum on): rate and p99 per 10 s, dead tuples"
  go test -count=1 -run '^$' -bench 'BenchmarkLongTransaction' -benchtime 1x -timeout 30m ./pkg/outbox/ | quiet
fi
