#!/usr/bin/env bash
# make bench: every benchmark, each printing its figures beside the reference
# it is judged against, measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure-postgres.sh

echo "==> outbox dispatcher vs the raw SQL limit (PostgreSQL)"
go test -run '^$' -bench 'BenchmarkDispatch$' -benchtime 100000x -timeout 30m ./pkg/outbox/ | grep -v 'migration applied'
