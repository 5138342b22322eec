#!/usr/bin/env bash
# Install headless Chromium and its WebDriver (Debian packages chromium, chromium-driver) for
# the report's browser test, only when they are missing. Needs root (or sudo) and apt; on a
# machine without either it says so and exits 0, and the browser test then skips with a reason.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no apt-get here; install chromium + chromedriver yourself to run the browser test" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "install_browser: not root and no password-less sudo; the browser test will be skipped" >&2
    exit 0
  fi
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
echo "install_browser: $(chromium --version 2>/dev/null || echo chromium installed)"
