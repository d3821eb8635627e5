#!/usr/bin/env bash
# Builds the Lambda bootstrap binaries, the one place their build flags live
# (`make build` and the runtime contract tests in functions/runtimetest both
# call it):
#   scripts/build-lambda.sh [outdir [function...]]
# writes <outdir>/<function>/bootstrap (default build/lambda, all three
# functions) for provided.al2023: GOOS=linux, CGO_ENABLED=0, -tags
# lambda.norpc (no RPC mode, smaller binary), -trimpath, stripped.
# FIFOBOX_LAMBDA_GOARCH picks the architecture (default arm64, what the CDK
# app deploys; the tests build for the host's).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/lambda}"
[ $# -gt 0 ] && shift
fns=("$@")
[ ${#fns[@]} -gt 0 ] || fns=(dispatcher consumer redrive)
arch="${FIFOBOX_LAMBDA_GOARCH:-arm64}"
for f in "${fns[@]}"; do
  echo "build $f (linux/$arch)" >&2
  GOOS=linux GOARCH="$arch" CGO_ENABLED=0 "${GO:-go}" build -tags lambda.norpc -trimpath -ldflags='-s -w' \
    -o "$out/$f/bootstrap" "./functions/$f"
done
