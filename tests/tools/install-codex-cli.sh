#!/usr/bin/env bash
# Install the real Codex CLI that tests/test_codex_cli.py drives, into .codex-cli/ of the
# checkout (git-ignored): `@openai/codex@VERSION` from the npm registry (its native binary comes
# in an optional dependency package), reachable as .codex-cli/codex. A fast no-op when that
# program already reports VERSION. Installs node and npm with apt where npm is missing.
# Usage: tests/tools/install-codex-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=0.171.0
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.codex-cli"
link="$dest/codex"

if [ -x "$link" ] && [ "$("$link" --version 2>/dev/null)" = "codex-cli $VERSION" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
fi
mkdir -p "$dest"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error "@openai/codex@$VERSION"
ln -sfn "node_modules/.bin/codex" "$link"
if [ "$("$link" --version)" != "codex-cli $VERSION" ]; then
  echo "install-codex-cli: $link does not report version $VERSION" >&2
  exit 1
fi
