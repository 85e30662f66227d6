#!/usr/bin/env bash
# Install the real Gemini CLI that tests/e2e/test_gemini_cli.py drives, into .gemini-cli/ of the
# checkout (git-ignored): `@google/gemini-cli@VERSION` from the npm registry, reachable as
# .gemini-cli/gemini (tests/tools/npm-cli.sh; a fast no-op when installed). (npm skips
# node-pty's install script: `gemini -p` does not need it.)
# Usage: tests/tools/install-gemini-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=0.61.0
exec bash "$(dirname "$0")/npm-cli.sh" @google/gemini-cli "$VERSION" .gemini-cli gemini
