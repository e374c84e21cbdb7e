#!/usr/bin/env bash
# Install Debian's Chromium when it is missing: the console's browser tests (tests/browser)
# drive it through Playwright, which downloads no browser of its own here.
set -euo pipefail
chromium="${QMQ_CHROMIUM:-/usr/bin/chromium}"
[ -x "$chromium" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "missing Chromium ($chromium): install Debian's chromium package with apt-get as root" >&2
  exit 1
fi
echo "installing chromium from Debian" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
if [ ! -x "$chromium" ]; then
  echo "chromium installed, but $chromium is still missing (QMQ_CHROMIUM points elsewhere?)" >&2
  exit 1
fi
