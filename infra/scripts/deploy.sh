#!/usr/bin/env bash
# cdk deploy --all to the AWS account and region of your environment
# (AWS_PROFILE / AWS_REGION / credentials as for the AWS CLI). Deploys
# <Prefix>-Stateful, then <Prefix>-Stateless; the deploy runs the migrations
# (trigger -> redrive function, operation "migrate") before the schedule and
# consumers start. Needs `make build` first and a bootstrapped environment:
# set FIFOBOX_BOOTSTRAP=1 to run `cdk bootstrap` first. Extra arguments go to
# `cdk deploy` (e.g. -c alarmEmail=ops@example.com, --require-approval never).
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# Say plainly what is missing, before the CDK CLI builds the app and then
# fails on the account (its message, after a minute, names neither cause).
if [ -n "${AWS_ENDPOINT_URL:-}" ]; then
  die "AWS_ENDPOINT_URL is set ($AWS_ENDPOINT_URL; localstack/env.sh sets it): make deploy targets AWS. Unset it, or use make deploy-local"
fi
if command -v aws >/dev/null && ! aws sts get-caller-identity >/dev/null 2>&1; then
  die "no usable AWS credentials (aws sts get-caller-identity failed): set AWS_PROFILE (or run aws sso login / aws configure), and AWS_REGION"
fi
prepare_cdk
cd "$INFRA"
if [ "${FIFOBOX_BOOTSTRAP:-0}" = 1 ]; then
  cdk bootstrap "${ASSET_CONTEXT[@]}"
fi
cdk deploy --all "${ASSET_CONTEXT[@]}" "$@"
