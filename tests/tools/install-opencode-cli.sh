#!/usr/bin/env bash
# Install the real OpenCode CLI that tests/e2e/test_opencode.py drives, into .opencode-cli/ of the
# checkout (git-ignored): `opencode-ai@VERSION` from the npm registry, reachable as
# .opencode-cli/opencode (tests/tools/npm-cli.sh; a fast no-op when installed). npm picks the
# native binary for this platform from the package's optional dependencies.
# Usage: tests/tools/install-opencode-cli.sh   (README command 2 and .ci/run call it)
set -euo pipefail
VERSION=1.18.33
exec bash "$(dirname "$0")/npm-cli.sh" opencode-ai "$VERSION" .opencode-cli opencode
