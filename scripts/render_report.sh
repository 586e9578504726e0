#!/usr/bin/env bash
# Render a report in headless Chromium (Debian package `chromium`) to a PNG to look at.
# usage: scripts/render_report.sh REPORT.html OUT.png
set -euo pipefail
html=$(realpath "$1"); out=$2
prof=$(mktemp -d)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$prof" --window-size=1200,4000 --screenshot="$out" "file://$html" 2>/dev/null
rm -rf "$prof"
echo "wrote $out"
