#!/usr/bin/env bash
# Makes sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth for
# user postgres and a database "test": starts the Debian cluster if it is
# down, installs it from Debian packages if it is missing.
set -euo pipefail

PGHOST=127.0.0.1
PGPORT=5432
ready() { pg_isready -q -h "$PGHOST" -p "$PGPORT" 2>/dev/null; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v pg_isready >/dev/null 2>&1 || ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  echo "ensure-postgres: PostgreSQL not installed; installing from Debian packages" >&2
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq postgresql >/dev/null
fi

ver=$(ls /etc/postgresql | sort -V | tail -1)
if ! ready; then
  echo "ensure-postgres: starting cluster $ver/main" >&2
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 1 30); do ready && break; sleep 1; done
fi
ready || { echo "ensure-postgres: PostgreSQL does not answer on $PGHOST:$PGPORT" >&2; exit 1; }

# Trust auth on loopback for the test user (a fresh Debian install asks for a password).
if ! psql -h "$PGHOST" -p "$PGPORT" -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
  echo "ensure-postgres: enabling trust auth on loopback" >&2
  hba="/etc/postgresql/$ver/main/pg_hba.conf"
  as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main reload
  sleep 1
fi
for db in test fifobox; do
  if ! psql -h "$PGHOST" -p "$PGPORT" -U postgres -d postgres -Atc "select 1 from pg_database where datname='$db'" | grep -q 1; then
    psql -h "$PGHOST" -p "$PGPORT" -U postgres -d postgres -qc "CREATE DATABASE $db" >/dev/null
  fi
done
echo "ensure-postgres: PostgreSQL $(psql -h "$PGHOST" -p "$PGPORT" -U postgres -d test -Atc 'show server_version') ready on $PGHOST:$PGPORT" >&2
