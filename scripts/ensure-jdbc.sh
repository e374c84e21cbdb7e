#!/usr/bin/env bash
# Install Debian's PostgreSQL and SQLite JDBC drivers when they are missing.
set -euo pipefail
need=()
ls /usr/share/java/postgresql*.jar >/dev/null 2>&1 || need+=(libpostgresql-jdbc-java)
ls /usr/share/java/sqlite-jdbc*.jar >/dev/null 2>&1 || need+=(libxerial-sqlite-jdbc-java)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "missing JDBC drivers (${need[*]}): install them with apt-get as root" >&2
  exit 1
fi
echo "installing ${need[*]} from Debian" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
