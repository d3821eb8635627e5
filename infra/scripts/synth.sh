#!/usr/bin/env bash
# cdk synth of every stack, offline (no AWS account, no lookups):
#   infra/cdk.out        <Prefix>-Stateful, <Prefix>-Stateless (cdk-nag checked)
#   infra/cdk.out.local  <Prefix>-Local (the LocalStack/Floci variant)
#   infra/cdk.out.rabbitmq  the AWS stacks with transport=rabbitmq (a new Amazon
#                        MQ broker, the ticketing topology; cdk-nag checked)
#   infra/cdk.out.nats   the AWS stacks with transport=nats (the holdco topology,
#                        an example cluster URL and secret)
# Needs `make build` first (build/lambda/<fn>/bootstrap). Extra arguments go
# to both `cdk synth` runs (e.g. -c prefix=Staging).
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
prepare_cdk
cd "$INFRA"
log "cdk synth (AWS stacks) -> infra/cdk.out"
cdk synth --quiet -o cdk.out "${ASSET_CONTEXT[@]}" "$@"
log "cdk synth -c local=true (local variant) -> infra/cdk.out.local"
cdk synth --quiet -o cdk.out.local -c local=true "${ASSET_CONTEXT[@]}" "$@"
log "cdk synth -c transport=rabbitmq -> infra/cdk.out.rabbitmq"
cdk synth --quiet -o cdk.out.rabbitmq -c transport=rabbitmq -c amqpTopology=../topologies/rabbitmq/ticketing.json "${ASSET_CONTEXT[@]}" "$@"
log "cdk synth -c transport=nats -> infra/cdk.out.nats"
cdk synth --quiet -o cdk.out.nats -c transport=nats -c natsTopology=../topologies/nats/holdco.json \
  -c natsUrl=nats://nats.example.internal:4222 \
  -c natsSecretArn=arn:aws:secretsmanager:eu-west-1:123456789012:secret:fifobox/nats-AbCdEf "${ASSET_CONTEXT[@]}" "$@"
node -e '
const fs = require("fs"), path = require("path");
for (const dir of process.argv.slice(1)) {
  for (const f of fs.readdirSync(dir).filter(f => f.endsWith(".template.json")).sort()) {
    const res = JSON.parse(fs.readFileSync(path.join(dir, f))).Resources || {};
    const byType = {};
    for (const r of Object.values(res)) byType[r.Type] = (byType[r.Type] || 0) + 1;
    const top = Object.entries(byType).sort((a, b) => b[1] - a[1]).slice(0, 6).map(([t, n]) => `${n} ${t.replace("AWS::", "")}`);
    console.log(`${path.join(dir, f)}: ${Object.keys(res).length} resources (${top.join(", ")}, ...)`);
  }
}' cdk.out cdk.out.local cdk.out.rabbitmq cdk.out.nats
