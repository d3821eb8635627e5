#!/usr/bin/env bash
# CDK assertion and cdk-nag tests of the infra module (one package, each app
# synthesised once). Offline apart from the Go module proxy and npm; needs no
# AWS account and no Lambda build. Extra arguments go to `go test`.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ensure_go
ensure_node
cd "$INFRA"
# No -race: jsii-runtime-go's Close races under the race detector.
go test -count=1 "$@" ./...
