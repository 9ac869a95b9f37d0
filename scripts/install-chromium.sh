#!/usr/bin/env bash
# Installs Debian's chromium (headless, for tests/integration/test_demo_page.py) unless a chromium is on PATH.
set -euo pipefail
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install Chromium with your system's package manager (the demo page's test needs it)" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
