"""Messages that must not mislead: the wrong-token hint names the command that prints the right token.

A server on a PostgreSQL store accepts the deployment's tokens (derived from the store's secret),
so `oubliette-server token box1` without `--store` prints a token it refuses: the refusal says
to add `--store`. The real programs, as a person runs them.
"""

from __future__ import annotations

import json

from harness import Deployment, env_without_oubliette
from program_runs import READY, assert_one_line, program, run


async def _refusal(deployment: Deployment) -> list[str]:
    env = {**env_without_oubliette(), "OUBLIETTE_RELAY": deployment.relay, "OUBLIETTE_INSTANCE": "box1",
           "OUBLIETTE_TOKEN": "0" * 64}
    status, out, err = await run(["oubliette_client", "tools", "list"], env)
    assert (status, out) == (1, ""), (status, out, err)
    return err


async def test_with_a_postgresql_store_the_token_hint_names_store(pg_url: str) -> None:
    deployment = Deployment(store=pg_url)
    args = ["oubliette_server", "--no-stdio", "--data-dir", str(deployment.data_dir), "--relay", deployment.relay,
            "--store", pg_url]
    async with program(args, env_without_oubliette()) as (_, stderr):
        await stderr.wait_for(READY)
        err = await _refusal(deployment)
    assert_one_line(err, "wrong token for instance 'box1'", "`oubliette-server token box1 --store URL` prints it, "
                    "URL being the server's --store")
    assert pg_url not in err[0] and "db" not in err[0].split("--store")[-1], "the store's address stays on the host"
    assert err[0].count("oubliette-server token") == 1, err[0]


async def test_with_sqlite_the_token_hint_names_the_data_dir_and_tools_list_is_one_line(deployment: Deployment) -> None:
    args = ["oubliette_server", "--no-stdio", "--data-dir", str(deployment.data_dir), "--relay", deployment.relay]
    async with program(args, env_without_oubliette()) as (_, stderr):
        await stderr.wait_for(READY)
        err = await _refusal(deployment)
        env = {**env_without_oubliette(), **deployment.client_env("box1")}
        status, out, _ = await run(["oubliette_client", "tools", "list"], env)
    assert_one_line(err, "`oubliette-server token box1` prints it, with the server's --data-dir if it has one")
    assert err[0].count("oubliette-server token") == 1, err[0]
    # the README shows this answer as one line
    assert (status, out) == (0, json.dumps({"type": "result", "tools": []}) + "\n")
