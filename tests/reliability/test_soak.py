"""The soak (``make soak``: 15 minutes) as a 20-second smoke run on the tiny checkpoint: every
kind of traffic is sent, every step's leak check passes, nothing fails."""

from __future__ import annotations

from tests.reliability.soak import run

KINDS = {"generate", "chat_stream", "dropped_stream", "aborted", "session"}


def test_a_short_soak_has_no_failure_and_no_leak(llama_path):
    summary = run(llama_path, duration=20)
    print(summary)
    assert summary["failures"] == {}, summary["failure_samples"]
    assert set(summary["requests"]) == KINDS and min(summary["requests"].values()) >= 2
    assert summary["steps"] >= 1 and summary["leak_checks_passed"] == summary["steps"]
    assert summary["rss_growth_mib"] is not None
