"""A ``--tp-size 2`` server: sessions and streaming sessions, then a rank that dies.

The session tests are those of ``tests/sessions`` (each turn compared with a plain request on
the ids the session should have assembled), run here against two ranks: session state, timeouts
(decided by rank 0's clock alone) and streaming-session slots must stay identical on both. The
last test kills rank 1: the server must end by itself, cleanly, without orphans.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import start_server
from tests.sessions.conftest import api, rng  # noqa: F401 - the session tests' fixtures
from tests.sessions.test_sessions_http import (  # noqa: F401 - run here on two ranks
    test_append_with_rid_continues_from_parent_prompt_and_output_dropping_a_leading_bos,
    test_idle_session_is_closed_after_its_timeout,
    test_replace_aborts_a_running_descendant,
    test_two_children_of_one_rid_branch_from_the_same_context,
)
from tests.sessions.test_streaming_sessions_http import (  # noqa: F401
    test_abort_during_a_later_turn_rolls_back_to_the_last_finished_turn,
    test_turns_continue_linearly_reusing_all_but_the_last_token,
)

EXIT_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, "--tp-size", "2", "--enable-streaming-session")
    yield srv
    if srv.proc.poll() is None:
        srv.check_clean_stop()


def test_zz_a_rank_that_dies_ends_the_server_cleanly(server):
    """Runs last in this module (it ends the module's server)."""
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        processes = http.get("/get_server_info").json()["processes"]
    assert set(processes) == {"scheduler", "scheduler rank1", "detokenizer"}
    children = server.children()
    psutil.Process(processes["scheduler rank1"]).kill()
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, "the server outlived its dead rank"
        time.sleep(0.1)
    assert server.proc.returncode == 1, server.stderr_tail()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans left behind: {alive}"
    assert "exited unexpectedly" in server.stderr_tail(200)
