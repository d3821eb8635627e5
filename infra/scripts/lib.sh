# Sourced by the infra scripts: repository paths, Node 22, the pinned CDK CLI.
# shellcheck shell=bash
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
INFRA="$ROOT/infra"
TOOLS="$ROOT/.tools"   # package.json + package-lock.json pin aws-cdk, aws-cdk-local, cfn-guard (+ Control Tower rules), node 22
GUARD="$TOOLS/node_modules/@cdklabs/cdk-validator-cfnguard"
export CDK_DISABLE_CLI_TELEMETRY=true

log() { printf 'infra: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# install_tools: npm ci of .tools (CDK CLI, cdklocal, cfn-guard with AWS
# Control Tower's rules, Node 22) if any is missing.
install_tools() {
  if [ -x "$TOOLS/node_modules/.bin/cdk" ] && [ -x "$TOOLS/node_modules/node/bin/node" ] && [ -d "$GUARD/rules" ]; then
    return
  fi
  command -v npm >/dev/null || die "npm is required to install the pinned CDK CLI, cfn-guard and Node 22 (.tools/package-lock.json)"
  log "installing the pinned CDK CLI, cfn-guard and Node 22 into .tools (npm ci)"
  npm ci --prefix "$TOOLS" --no-audit --no-fund --loglevel=error >&2
}

# ensure_node: put Node 22 on PATH for jsii and the CLI. Prefers .tools, then
# the emulator's copy (localstack/), then installs .tools; falls back to the
# system node (>= 20) with jsii's end-of-life banner silenced.
ensure_node() {
  local n
  for n in "$TOOLS/node_modules/node/bin" "$ROOT/localstack/node_modules/node/bin"; do
    if [ -x "$n/node" ]; then
      export PATH="$n:$PATH"
      return
    fi
  done
  if command -v npm >/dev/null; then
    install_tools
    export PATH="$TOOLS/node_modules/node/bin:$PATH"
    return
  fi
  command -v node >/dev/null || die "Node.js is required (jsii runs the CDK in Node)"
  log "using system node $(node --version); Node 22 is recommended"
  export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION=1
}

ensure_go() {
  command -v go >/dev/null || die "Go is required"
}

# require_build: the Lambda bootstraps `make build` writes (linux/arm64).
# FIFOBOX_LAMBDA_DIR points elsewhere (it becomes the assetDir context).
require_build() {
  local dir="${FIFOBOX_LAMBDA_DIR:-$ROOT/build/lambda}" f
  for f in dispatcher consumer redrive; do
    [ -f "$dir/$f/bootstrap" ] || die "$dir/$f/bootstrap missing: run \`make build\` first"
  done
  ASSET_CONTEXT=(-c "assetDir=$(cd "$dir" && pwd)")
}

# prepare_cdk: what the scripts that run cdk/cdklocal need first: Go, the
# pinned CDK CLI, Node 22 and the Lambda build (sets ASSET_CONTEXT).
prepare_cdk() {
  ensure_go
  install_tools
  ensure_node
  require_build
}

cdk() { "$TOOLS/node_modules/.bin/cdk" --no-notices "$@"; }
cdklocal() { "$TOOLS/node_modules/.bin/cdklocal" --no-notices "$@"; }
