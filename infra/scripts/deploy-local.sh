#!/usr/bin/env bash
# cdklocal deploy of the local variant (<Prefix>-Local: no VPC, Aurora or RDS
# Proxy) to an AWS emulator on AWS_ENDPOINT_URL (default http://localhost:4566):
#   LocalStack: docker run -d -p 4566:4566 -e LOCALSTACK_AUTH_TOKEN=... \
#                 -v /var/run/docker.sock:/var/run/docker.sock localstack/localstack
#   Floci (MIT, no token): docker run -d -p 4566:4566 \
#                 -v /var/run/docker.sock:/var/run/docker.sock floci/floci
# Both need Docker (they run the Lambda functions in containers, linux/arm64:
# on x86 hosts install QEMU binfmt). The functions reach PostgreSQL at
# FIFOBOX_LOCAL_DATABASE_URL (the databaseUrl context), by default the host's
# database through host.docker.internal. The fauxqs emulator of `make local`
# serves only SNS/SQS and cannot take a CloudFormation deploy.
# Extra arguments go to `cdklocal deploy`.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
prepare_cdk
export AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-http://localhost:4566}"
export AWS_REGION="${AWS_REGION:-us-east-1}" AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-${AWS_REGION:-us-east-1}}"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-test}" AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-test}"
db="${FIFOBOX_LOCAL_DATABASE_URL:-postgres://postgres:postgres@host.docker.internal:5432/fifobox?sslmode=disable}"
# The emulator must serve CloudFormation (LocalStack and Floci do; fauxqs,
# the SNS/SQS-only emulator of `make local`, does not). The probe is unsigned
# apart from a dummy credential scope, which is how emulators route requests.
if [ "${FIFOBOX_SKIP_EMULATOR_CHECK:-0}" != 1 ] && ! command -v curl >/dev/null; then
  echo "deploy-local: curl not found, so the CloudFormation probe of $AWS_ENDPOINT_URL is skipped" >&2
elif [ "${FIFOBOX_SKIP_EMULATOR_CHECK:-0}" != 1 ]; then
  probe=$(curl -sS --max-time 5 -H 'Content-Type: application/x-www-form-urlencoded' \
    -H "Authorization: AWS4-HMAC-SHA256 Credential=test/20260101/$AWS_REGION/cloudformation/aws4_request, SignedHeaders=host, Signature=0" \
    -d 'Action=ListStacks&Version=2010-05-15' "$AWS_ENDPOINT_URL/" 2>&1) ||
    die "no emulator answers on $AWS_ENDPOINT_URL: start LocalStack or Floci (see the top of this script)"
  case "$probe" in
    *ListStacksResult*|*ListStacksResponse*) ;;
    *) die "$AWS_ENDPOINT_URL answers but serves no CloudFormation (is it the SNS/SQS-only fauxqs of \`make local\`?). Start LocalStack or Floci there, or set FIFOBOX_SKIP_EMULATOR_CHECK=1" ;;
  esac
fi
cd "$INFRA"
cdklocal bootstrap -o cdk.out.local -c local=true -c "databaseUrl=$db" "${ASSET_CONTEXT[@]}"
cdklocal deploy --all -o cdk.out.local -c local=true -c "databaseUrl=$db" "${ASSET_CONTEXT[@]}" --require-approval never "$@"
