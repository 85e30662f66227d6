#!/usr/bin/env bash
# Install the real Claude Code CLI that tests/e2e/test_claude_code.py drives, into .claude-code/ of
# the checkout (git-ignored): `@anthropic-ai/claude-code@VERSION` from the npm registry, with
# its native binary put in place, reachable as .claude-code/claude. A fast no-op when that
# binary already reports VERSION. Installs node and npm with apt where npm is missing.
# Usage: tests/tools/install-claude-code.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=2.1.197
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.claude-code"
link="$dest/claude"

if [ -x "$link" ] && "$link" --version 2>/dev/null | grep -q "^$VERSION "; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
fi
mkdir -p "$dest"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error \
  "@anthropic-ai/claude-code@$VERSION"
package="$dest/node_modules/@anthropic-ai/claude-code"
# npm may skip the package's postinstall (it puts the platform's native binary over the
# placeholder bin/claude.exe); run it here, it is idempotent.
(cd "$package" && node install.cjs)
ln -sfn "node_modules/@anthropic-ai/claude-code/bin/claude.exe" "$link"
if ! "$link" --version | grep -q "^$VERSION "; then
  echo "install-claude-code: $link does not report version $VERSION" >&2
  exit 1
fi
