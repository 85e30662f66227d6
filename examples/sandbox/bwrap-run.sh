#!/bin/sh
# Run CMD in a bubblewrap sandbox shaped like the Docker image in this directory: a read-only
# system, no network, its own PID namespace, a private /tmp, and nothing of the host's files
# but the relay socket, at /oubliette/relay.sock.
#
#   OUBLIETTE_INSTANCE=box1 OUBLIETTE_TOKEN=… bwrap-run.sh HOST_RELAY_SOCKET [--ro PATH]... -- CMD [ARGS...]
#
# e.g. in the checkout, after the README's command 1:
#   OUBLIETTE_INSTANCE=box1 OUBLIETTE_TOKEN=$(.venv/bin/oubliette-server token box1) \
#     examples/sandbox/bwrap-run.sh ~/.local/share/oubliette/relay.sock -- .venv/bin/oubliette-client tools list
#
# When CMD is a program of a virtualenv (a path, or a name found on PATH), that venv is bound
# read-only, with what it needs from the host: the Python it was made from (symlinks resolved,
# sys.base_prefix) and, for an editable install, the source checkout; its bin/ comes first on
# the sandbox's PATH, so the agent command of `oubliette-client run -- …` finds its programs by
# name. --ro PATH binds one more host path read-only at the same place. The environment is
# cleared: CMD sees PATH, HOME=/tmp, OUBLIETTE_RELAY=unix:/oubliette/relay.sock,
# OUBLIETTE_INSTANCE and OUBLIETTE_TOKEN.
# tests/test_sandbox_bwrap.py runs the guest runtime through this script.
# As root, bwrap needs no setuid bit and no user namespace; these flags work on Debian 12.
set -eu
if [ $# -lt 3 ]; then
    echo "usage: bwrap-run.sh HOST_RELAY_SOCKET [--ro PATH]... -- CMD [ARGS...]" >&2
    exit 2
fi
sock=$1
shift
extra=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    if [ "$1" != "--ro" ] || [ $# -lt 2 ]; then
        echo "bwrap-run.sh: expected --ro PATH or --, got $1" >&2
        exit 2
    fi
    extra="$extra $2"
    shift 2
done
[ $# -gt 0 ] && shift  # the --
if [ $# -eq 0 ]; then
    echo "bwrap-run.sh: give the command to run after --" >&2
    exit 2
fi
# CMD by its absolute path: the sandbox starts in /tmp, and has not the host's PATH.
cmd=$1
case $cmd in
    */*) ;;
    *) cmd=$(command -v "$cmd") || { echo "bwrap-run.sh: $1: command not found" >&2; exit 127; } ;;
esac
cmd="$(cd "$(dirname "$cmd")" && pwd)/$(basename "$cmd")"
shift
set -- "$cmd" "$@"
sandbox_path=${SANDBOX_PATH:-/usr/local/bin:/usr/bin:/bin}
venv=$(dirname "$(dirname "$cmd")")
if [ -f "$venv/pyvenv.cfg" ] && [ -x "$venv/bin/python" ]; then
    # The venv as CMD names it and as it really is, the Python it was made from, and the checkout
    # of an editable install: what its interpreter needs to start and import the programs.
    needs=$("$venv/bin/python" -c '
import os, sys
paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
try:
    import oubliette_client
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(oubliette_client.__file__))))
except ImportError:
    pass
print(" ".join(sorted({os.path.realpath(p) for p in paths})))
') || { echo "bwrap-run.sh: the Python of $venv does not start" >&2; exit 1; }
    for path in "$venv" $needs; do
        case $path in /usr|/usr/*) ;; *) extra="$extra $path" ;; esac
    done
    sandbox_path="$venv/bin:$sandbox_path"
fi
ro=""
for path in $extra; do
    ro="$ro --ro-bind $path $path"
done
# $ro is split on spaces on purpose: the paths must not contain any. It comes after the private
# /tmp, so a checkout or venv that lives under /tmp is bound on top of it, not hidden by it.
# bwrap runs as this shell's child, not in its place (no exec): --die-with-parent kills the sandbox
# when the *thread* that started bwrap ends, and a launcher may start it from a worker thread that
# ends long before the sandbox should (trio's open_process does). This shell lives as long as bwrap.
# shellcheck disable=SC2086
bwrap \
    --ro-bind /usr /usr --ro-bind-try /lib /lib --ro-bind-try /lib64 /lib64 \
    --ro-bind-try /bin /bin --ro-bind-try /sbin /sbin --ro-bind /etc /etc \
    --proc /proc --dev /dev --tmpfs /tmp \
    $ro \
    --tmpfs /oubliette --bind "$sock" /oubliette/relay.sock --remount-ro /oubliette \
    --unshare-net --unshare-pid --unshare-ipc --unshare-uts \
    --die-with-parent --new-session --chdir /tmp \
    --clearenv --setenv PATH "$sandbox_path" --setenv HOME /tmp \
    --setenv OUBLIETTE_RELAY unix:/oubliette/relay.sock \
    --setenv OUBLIETTE_INSTANCE "${OUBLIETTE_INSTANCE:?set OUBLIETTE_INSTANCE}" \
    --setenv OUBLIETTE_TOKEN "${OUBLIETTE_TOKEN:?set OUBLIETTE_TOKEN}" \
    -- "$@"
exit $?
