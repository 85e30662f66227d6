#!/usr/bin/env bash
# Install an agent CLI from the npm registry into a git-ignored folder of the checkout, for the
# install-*.sh scripts whose CLI is a plain npm package: PACKAGE@VERSION into DIR/, reachable as
# DIR/BIN. A fast no-op when that program already reports VERSION. Installs node and npm with
# apt where npm is missing. SHOWN: how `BIN --version` prints the version (a printf format,
# default `%s`; Codex prints `codex-cli %s`).
# Usage: tests/tools/npm-cli.sh PACKAGE VERSION DIR BIN [SHOWN]
set -euo pipefail
package="$1" version="$2"
# shellcheck disable=SC2059  # SHOWN is the caller's format
shown="$(printf "${5:-%s}" "$version")"
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/$3"
link="$dest/$4"

if [ -x "$link" ] && [ "$("$link" --version 2>/dev/null)" = "$shown" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
fi
mkdir -p "$dest"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error "$package@$version"
ln -sfn "node_modules/.bin/$4" "$link"
if [ "$("$link" --version)" != "$shown" ]; then
  echo "$(basename "$0"): $link does not report version $version" >&2
  exit 1
fi
