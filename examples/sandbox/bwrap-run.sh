#!/bin/sh
# Run CMD in a bubblewrap sandbox shaped like the Docker image in this directory: a read-only
# system, no network, its own PID namespace, a private /tmp, and nothing of the host's files
# but the relay socket, at /oubliette/relay.sock.
#
#   OUBLIETTE_INSTANCE=box1 OUBLIETTE_TOKEN=… bwrap-run.sh HOST_RELAY_SOCKET [--uid UID] [--ro PATH]... -- CMD [ARGS...]
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
# --uid UID (as root) runs CMD as that user, as the Docker image's agent runs as uid 10001: user
# and group UID, and of the host's groups only the relay socket's, which the server gives it with
# `oubliette-server --relay-group GROUP` (mode 0660; docs/SECURITY.md, "The relay socket"), and
# no capabilities. bwrap itself stays root, for its mounts; setpriv drops to UID in the sandbox.
# tests/e2e/test_sandbox_bwrap.py runs the guest runtime through this script.
# As root, bwrap needs no setuid bit and no user namespace; these flags work on Debian 12.
set -eu
if [ $# -lt 3 ]; then
    echo "usage: bwrap-run.sh HOST_RELAY_SOCKET [--uid UID] [--ro PATH]... -- CMD [ARGS...]" >&2
    exit 2
fi
sock=$1
shift
extra=""
uid=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    if [ "$1" = "--ro" ] && [ $# -ge 2 ]; then
        extra="$extra $2"
    elif [ "$1" = "--uid" ] && [ $# -ge 2 ]; then
        uid=$2
    else
        echo "bwrap-run.sh: expected --uid UID, --ro PATH or --, got $1" >&2
        exit 2
    fi
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
as_user=""
caps=""
if [ -n "$uid" ]; then
    case $uid in
        *[!0-9]*|'') echo "bwrap-run.sh: --uid takes a number, not $uid" >&2; exit 2 ;;
    esac
    if [ "$(id -u)" != 0 ]; then
        echo "bwrap-run.sh: --uid needs root (bwrap makes the sandbox as root, then drops to the user)" >&2
        exit 2
    fi
    group=$(stat -c %g "$sock")
    if [ "$group" = 0 ]; then
        echo "bwrap-run.sh: the relay socket's group is root's: start oubliette-server with --relay-group GROUP so that uid $uid may use it" >&2
        exit 2
    fi
    caps="--cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_SETPCAP"
    as_user="setpriv --reuid $uid --regid $uid --groups $group --inh-caps=-all --bounding-set=-all --"
fi
ro=""
parents=""
for path in $extra; do
    ro="$ro --ro-bind $path $path"
    parent=$(dirname "$path")
    while [ "$parent" != / ] && [ "$parent" != /tmp ]; do
        parents="$parents $parent"
        parent=$(dirname "$parent")
    done
done
# bwrap makes a bound path's missing parents 0700: a --uid user could not reach the path.
dirs=""
for parent in $(printf '%s\n' $parents | sort -u); do
    dirs="$dirs --perms 0755 --dir $parent"
done
# $dirs, $ro, $caps and $as_user are split on spaces on purpose: the paths must not contain any. $ro
# comes after the private /tmp, so a checkout or venv that lives under /tmp is bound on top of it,
# not hidden by it; /tmp is 1777 as usual, so that a --uid user may write there.
# bwrap runs as this shell's child, not in its place (no exec): --die-with-parent kills the sandbox
# when the *thread* that started bwrap ends, and a launcher may start it from a worker thread that
# ends long before the sandbox should (trio's open_process does). This shell lives as long as bwrap.
# shellcheck disable=SC2086
bwrap \
    --ro-bind /usr /usr --ro-bind-try /lib /lib --ro-bind-try /lib64 /lib64 \
    --ro-bind-try /bin /bin --ro-bind-try /sbin /sbin --ro-bind /etc /etc \
    --proc /proc --dev /dev --perms 1777 --tmpfs /tmp \
    $dirs $ro \
    --tmpfs /oubliette --bind "$sock" /oubliette/relay.sock --remount-ro /oubliette \
    --unshare-net --unshare-pid --unshare-ipc --unshare-uts \
    --die-with-parent --new-session --chdir /tmp $caps \
    --clearenv --setenv PATH "$sandbox_path" --setenv HOME /tmp \
    --setenv OUBLIETTE_RELAY unix:/oubliette/relay.sock \
    --setenv OUBLIETTE_INSTANCE "${OUBLIETTE_INSTANCE:?set OUBLIETTE_INSTANCE}" \
    --setenv OUBLIETTE_TOKEN "${OUBLIETTE_TOKEN:?set OUBLIETTE_TOKEN}" \
    -- $as_user "$@"
exit $?
