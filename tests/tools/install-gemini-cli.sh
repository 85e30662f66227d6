#!/usr/bin/env bash
# Install the real Gemini CLI that tests/test_gemini_cli.py drives, into .gemini-cli/ of the
# checkout (git-ignored): `@google/gemini-cli@VERSION` from the npm registry, reachable as
# .gemini-cli/gemini. A fast no-op when that program already reports VERSION. Installs node and
# npm with apt where npm is missing. (npm skips node-pty's install script: `gemini -p` does not
# need it.)
# Usage: tests/tools/install-gemini-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=0.61.0
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.gemini-cli"
link="$dest/gemini"

if [ -x "$link" ] && [ "$("$link" --version 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
fi
mkdir -p "$dest"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error "@google/gemini-cli@$VERSION"
ln -sfn "node_modules/.bin/gemini" "$link"
if [ "$("$link" --version)" != "$VERSION" ]; then
  echo "install-gemini-cli: $link does not report version $VERSION" >&2
  exit 1
fi
