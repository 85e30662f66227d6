"""The deployment to copy in deploy/ (docs/DEPLOY.md) names only what the programs have.

Each file is read with a parser — configparser for the systemd unit, PyYAML for compose and
Kubernetes, its lines for haproxy.cfg and the Dockerfiles — and then:
- every server command line in it goes through oubliette-server's own parser and config, so an
  unknown flag or a bad value fails here;
- every HTTP path a probe, health check or balancer asks for is asked of a running server,
  which must answer 200;
- what one side names, the other has: the images and the Dockerfiles that build them, the files
  they copy and mount, ports, sockets, volumes, Secret keys, the directories systemd makes.
`systemd-analyze verify` checks the unit (it is installed where these tests run). The server's
side of the unit's `Type=notify` is tested here too: it tells systemd READY=1 and STOPPING=1.
"""

from __future__ import annotations

import configparser
import contextlib
import io
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import trio
import yaml

from harness import Deployment
from oubliette_server.program import cli
from oubliette_server.program.config import ServerConfig
from oubliette_server.program.runner import SHUTDOWN_DRAIN_SECONDS
from protocol import parse_relay_address

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "oubliette-server.service"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
HAPROXY = DEPLOY / "compose" / "haproxy.cfg"
KUBERNETES = DEPLOY / "kubernetes" / "oubliette.yaml"
DOCKERFILES = [DEPLOY / "Dockerfile", ROOT / "examples" / "sandbox" / "Dockerfile"]
PROGRAMS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


# -- reading the files -----------------------------------------------------------------------


def server_config(argv: list[str]) -> ServerConfig:
    """What `oubliette-server ARGV` would serve with, read by the server's own parser and config;
    a flag it does not have, or a value it refuses, fails the test with the server's own line."""
    command, rest = cli.split_subcommand(argv)
    assert command == "serve", argv
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = cli._serve_parser().parse_args(rest)
            return cli.build_config(args)
    except SystemExit:
        pytest.fail(f"oubliette-server refuses {shlex.join(argv)}: {errors.getvalue().strip()}")
    except ValueError as exc:
        pytest.fail(f"oubliette-server refuses {shlex.join(argv)}: {exc}")


def http_port(config: ServerConfig) -> int:
    """The port of the server's one TCP HTTP listener."""
    tcp = [bind for bind in config.http if not bind.startswith("unix:")]
    assert len(tcp) == 1, config.http
    return int(tcp[0].rpartition(":")[2])


def images() -> dict[str, Path]:
    """Each image the Dockerfiles build, by the tag their `docker build … -t TAG` line gives it."""
    built = {}
    for dockerfile in DOCKERFILES:
        tags = re.findall(r"docker build -f (\S+) -t (\S+) \.", dockerfile.read_text())
        assert tags and all(ROOT / path == dockerfile for path, _ in tags), dockerfile
        built.update({tag: dockerfile for _, tag in tags})
    return built


def entrypoint(dockerfile: Path) -> list[str]:
    """The image's ENTRYPOINT (exec form)."""
    found = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile.read_text(), re.M)
    assert found, dockerfile
    return json.loads(found.group(1))


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def unit_command() -> list[str]:
    """The unit's ExecStart, its continuation lines joined, split as systemd splits it."""
    return shlex.split(unit()["Service"]["ExecStart"].replace("\\\n", " "))


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def kubernetes() -> dict[tuple[str, str], dict[str, Any]]:
    """The manifests by (kind, name)."""
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d}


def haproxy_sections() -> dict[str, list[str]]:
    """haproxy.cfg's sections (`backend oubliette_http`) and their lines, comments left out."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in HAPROXY.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        if not line[0].isspace():
            current = sections.setdefault(line, [])
        else:
            current.append(line.strip())
    return sections


def server_template(section: list[str]) -> tuple[int, str, int, list[str]]:
    """A backend's `server-template NAME COUNT HOST:PORT OPTIONS…`: count, host, port, options."""
    [line] = [line for line in section if line.startswith("server-template ")]
    _, _, count, address, *options = line.split()
    host, _, port = address.rpartition(":")
    return int(count), host, int(port), options


def probe_paths() -> set[str]:
    """Every HTTP path the deploy files ask a server for."""
    paths = set()
    for document in kubernetes().values():
        for container in document.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            paths |= {container[probe]["httpGet"]["path"] for probe in container if probe.endswith("Probe")}
    for service in compose()["services"].values():
        paths |= set(re.findall(r"http://[^/'\"]+(/[\w/]*)", " ".join(service.get("healthcheck", {}).get("test", []))))
    paths |= set(re.findall(r"option httpchk GET (\S+)", HAPROXY.read_text()))
    return paths


# -- the checks ------------------------------------------------------------------------------


def test_the_checks_refuse_what_the_server_does_not_have() -> None:
    """The reader of a command line fails on a flag or a value the server does not take."""
    for wrong in (["oubliette-server", "--no-stdio", "--listen", "0.0.0.0:8765"],
                  ["oubliette-server", "--http", "8765"], ["oubliette-server", "--relay", "bogus:7000"]):
        with pytest.raises(pytest.fail.Exception, match="oubliette-server refuses"):
            server_config(wrong[1:])
    assert server_config(["--no-stdio", "--http", "127.0.0.1:8765"]).http == ["127.0.0.1:8765"]


async def test_every_endpoint_the_deploy_files_probe_answers_on_a_running_server(deployment: Deployment) -> None:
    paths = probe_paths()
    assert {"/livez", "/readyz"} <= paths, paths
    async with deployment.http_server() as server, server.rest(token=None) as rest:
        for path in sorted(paths):
            response = await rest.get(path)
            assert response.status_code == 200, (path, response.status_code, response.text)


def test_the_dockerfiles_copy_what_exists_and_run_the_programs() -> None:
    sources = [line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    assert sources and all((ROOT / source).exists() for source in sources), sources  # the build context
    for dockerfile in DOCKERFILES:
        for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile.read_text(), re.M):
            *sources, _ = line.split()
            missing = [s for s in sources if not (ROOT / s).exists()]
            assert not missing, f"{dockerfile.relative_to(ROOT)} copies what the repository does not have: {missing}"
        assert entrypoint(dockerfile)[0] in PROGRAMS, dockerfile
    assert entrypoint(DEPLOY / "Dockerfile") == ["oubliette-server"]
    server_config(json.loads(re.search(r"^CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)))  # type: ignore[union-attr]


# -- systemd ---------------------------------------------------------------------------------


def test_the_systemd_unit_runs_the_server_with_its_flags_and_the_directories_systemd_makes() -> None:
    service = unit()["Service"]
    argv = unit_command()
    assert PurePosixPath(argv[0]).name in PROGRAMS, argv[0]
    config = server_config(argv[1:])
    assert "--no-stdio" in argv  # a service has no caller on its stdin
    assert str(config.data_dir) == f"/var/lib/{service['StateDirectory']}"
    sockets = [PurePosixPath(parse_relay_address(config.relay_address).path or "")]
    sockets += [PurePosixPath(bind[len("unix:"):]) for bind in config.http if bind.startswith("unix:")]
    assert len(sockets) == 2 and all(s.parent == PurePosixPath("/run", service["RuntimeDirectory"]) for s in sockets), sockets
    assert http_port(config) > 0
    assert service["Type"] == "notify"  # the server sends READY=1: test_the_server_tells_systemd_…
    assert service["KillSignal"] in ("SIGTERM", "SIGINT")  # the signals it stops cleanly on
    assert int(service["TimeoutStopSec"]) > SHUTDOWN_DRAIN_SECONDS


def test_systemd_analyze_verifies_the_unit(short_tmp: Path) -> None:
    """`systemd-analyze verify` with the unit's program pointed at this checkout's (it must exist)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is not installed (apt-get install systemd)"
    program = unit_command()[0]
    installed = shutil.which(PurePosixPath(program).name, path=str(Path(cli.sys.executable).parent))
    assert installed, program
    copy = short_tmp / UNIT.name
    copy.write_text(UNIT.read_text().replace(program, installed))
    done = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    about_it = [line for line in (done.stdout + done.stderr).splitlines() if UNIT.name in line]
    assert done.returncode == 0 and not about_it, done.stdout + done.stderr


async def test_the_server_tells_systemd_when_it_is_ready_and_when_it_stops(deployment: Deployment, short_tmp: Path) -> None:
    """`Type=notify`: READY=1 once the listeners are bound (/readyz answers), STOPPING=1 on SIGTERM."""
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(str(short_tmp / "notify"))
        async with deployment.http_server(env={"NOTIFY_SOCKET": str(short_tmp / "notify")}) as server:
            with trio.fail_after(10):
                assert await notify.recv(4096) == b"READY=1"
            async with server.rest(token=None) as rest:
                assert (await rest.get("/readyz")).status_code == 200
            server.process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await notify.recv(4096) == b"STOPPING=1"
                assert await server.process.wait() == 0


# -- compose ---------------------------------------------------------------------------------


def test_compose_builds_servers_on_postgresql_behind_the_balancer() -> None:
    services = compose()["services"]
    built = images()
    for name, service in services.items():
        if "build" in service:
            context = (COMPOSE.parent / service["build"]["context"]).resolve()
            assert context == ROOT, name
            assert built[service["image"]] == ROOT / service["build"]["dockerfile"], name
    server = services["oubliette"]
    config = server_config(server["command"])
    assert entrypoint(built[server["image"]]) == ["oubliette-server"]
    assert config.store_url and config.store_url.startswith("postgresql://")
    assert "@postgres:" in config.store_url and "PGPASSWORD" in server["environment"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert server["stop_signal"] in ("SIGTERM", "SIGINT")
    assert f"127.0.0.1:{http_port(config)}/readyz" in " ".join(server["healthcheck"]["test"])
    relay = parse_relay_address(config.relay_address)
    assert relay.kind == "tcp"

    balancer = services["balancer"]
    mounted = [v.split(":")[0] for v in balancer["volumes"]]
    assert all((COMPOSE.parent / source).is_file() for source in mounted), mounted
    sections = haproxy_sections()
    for backend, port in (("backend oubliette_http", http_port(config)), ("backend oubliette_relay", relay.port)):
        count, host, target, options = server_template(sections[backend])
        assert (count, host, target) == (server["deploy"]["replicas"], "oubliette", port), backend
        if backend.endswith("relay"):
            assert options[options.index("port") + 1] == str(http_port(config))  # its probe asks the HTTP port
    frontends = {int(line.split(":")[-1]) for name, lines in sections.items() if name.startswith("frontend")
                 for line in lines if line.startswith("bind ")}
    published = {int(p.split(":")[-1]) for p in balancer["ports"]}
    assert frontends == published == {http_port(config), relay.port}
    assert f"balancer:{http_port(config)}" in config.allowed_hosts  # callers on the compose network

    sandbox = services["box1"]
    address = parse_relay_address(sandbox["environment"]["OUBLIETTE_RELAY"])
    assert (address.host, address.port) == ("balancer", relay.port)
    assert entrypoint(built[sandbox["image"]])[0] == "oubliette-client"


# -- Kubernetes ------------------------------------------------------------------------------


def test_kubernetes_probes_ports_secrets_and_the_shared_relay_socket_agree() -> None:
    manifests = kubernetes()
    built = images()
    secrets = {name: set(d["stringData"]) for (kind, name), d in manifests.items() if kind == "Secret"}
    deployment = manifests[("Deployment", "oubliette-server")]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    [server] = pod["containers"]
    assert "command" not in server and entrypoint(built[server["image"]]) == ["oubliette-server"]
    config = server_config(server["args"])
    assert config.store_url and config.store_url.startswith("postgresql://")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports["http"] == http_port(config)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert server[probe]["httpGet"]["port"] in ports, probe
    assert server["livenessProbe"]["httpGet"]["path"] == "/livez"  # never the store: no restarts in an outage
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_DRAIN_SECONDS

    service = manifests[("Service", "oubliette")]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])
    assert f"oubliette:{service['spec']['ports'][0]['port']}" in config.allowed_hosts

    sandbox = manifests[("Pod", "box1")]["spec"]
    assert entrypoint(built[sandbox["containers"][0]["image"]])[0] == "oubliette-client"
    for spec in (pod, sandbox):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert {m["name"] for m in container["volumeMounts"]} <= set(volumes), container["name"]
            assert container["image"] in built, container["name"]
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref["key"] in secrets[ref["name"]], variable

    # The relay socket: a file of the node's hostPath, mounted by the server and by the sandbox.
    def host_path_of(spec: dict[str, Any], container: dict[str, Any], path: PurePosixPath) -> PurePosixPath:
        volumes = {v["name"]: v for v in spec["volumes"]}
        for mount in container["volumeMounts"]:
            if path.is_relative_to(mount["mountPath"]):
                return PurePosixPath(volumes[mount["name"]]["hostPath"]["path"], path.relative_to(mount["mountPath"]))
        raise AssertionError(f"{path} is on no volume of {container['name']}")

    server_socket = PurePosixPath(parse_relay_address(config.relay_address).path or "")
    [agent] = sandbox["containers"]
    agent_relay = {v["name"]: v.get("value") for v in agent["env"]}["OUBLIETTE_RELAY"]
    agent_socket = PurePosixPath(parse_relay_address(agent_relay).path or "")
    assert host_path_of(pod, server, server_socket) == host_path_of(sandbox, agent, agent_socket)
    # The socket is 0600, its server's: the sandbox runs as the same uid, the one both images
    # make their user with, and the server's init container gives it the hostPath directory.
    uid = pod["securityContext"]["runAsUser"]
    assert sandbox["securityContext"]["runAsUser"] == uid
    assert {int(n) for d in DOCKERFILES for n in re.findall(r"--uid (\d+)", d.read_text())} == {uid}
    [chown] = pod["initContainers"]
    assert chown["command"] == ["chown", f"{uid}:{pod['securityContext']['runAsGroup']}", str(server_socket.parent)]
    [affinity] = sandbox["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert affinity["labelSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
