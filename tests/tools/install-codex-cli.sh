#!/usr/bin/env bash
# Install the real Codex CLI that tests/e2e/test_codex_cli.py drives, into .codex-cli/ of the
# checkout (git-ignored): `@openai/codex@VERSION` from the npm registry (its native binary comes
# in an optional dependency package), reachable as .codex-cli/codex (tests/tools/npm-cli.sh; a
# fast no-op when installed; it prints its version as `codex-cli VERSION`).
# Usage: tests/tools/install-codex-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=0.171.0
exec bash "$(dirname "$0")/npm-cli.sh" @openai/codex "$VERSION" .codex-cli codex "codex-cli %s"
