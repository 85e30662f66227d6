#!/usr/bin/env bash
# Install the real OpenCode CLI that tests/test_opencode.py drives, into .opencode-cli/ of the
# checkout (git-ignored): `opencode-ai@VERSION` from the npm registry, reachable as
# .opencode-cli/opencode. A fast no-op when that program already reports VERSION. Installs node and
# npm with apt where npm is missing. (npm picks the native binary for this platform from
# opencode-ai's optional dependencies.)
# Usage: tests/tools/install-opencode-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=1.18.33
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.opencode-cli"
link="$dest/opencode"

if [ -x "$link" ] && [ "$("$link" --version 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
fi
mkdir -p "$dest"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error "opencode-ai@$VERSION"
ln -sfn "node_modules/.bin/opencode" "$link"
if [ "$("$link" --version)" != "$VERSION" ]; then
  echo "install-opencode-cli: $link does not report version $VERSION" >&2
  exit 1
fi
