#!/usr/bin/env bash
# CDK assertion, cdk-nag and cfn-guard tests of the infra module (one
# package, each app synthesised once; TestControlTowerGuardRules runs AWS
# Control Tower's proactive controls over the templates with the pinned
# cfn-guard). Offline apart from the Go module proxy and npm; needs no AWS
# account and no Lambda build. Extra arguments go to `go test`.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ensure_go
install_tools
ensure_node
export FIFOBOX_CFN_GUARD_DIR="$GUARD" FIFOBOX_REQUIRE_GUARD=1
cd "$INFRA"
# No -race: jsii-runtime-go's Close races under the race detector.
go test -count=1 "$@" ./...
