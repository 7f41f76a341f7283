"""The `server_orphan` chaos family on real engine processes (`bench/chaos_server_orphan.py`): a
`server_command` engine SIGKILLed and restarted on its port while its draining server still answers,
then an orphan server answering for good. The restarted engine must wait for the port and drive only
its own server; the engine started beside the orphan must refuse it and send it nothing. The same
case with the engine's guards turned off (the code as the finding saw it) must count the adoption,
so a pass means something. `python -m bench.chaos --families server_orphan` records it."""

from __future__ import annotations

import json

import pytest

from bench import chaos_families
from bench.chaos_server_orphan import run_server_orphan

pytestmark = pytest.mark.timeout(120)


def test_a_restarted_server_engine_never_drives_a_server_it_did_not_start(tmp_path):
    result = run_server_orphan(0, tmp_path, port_free_wait_s=2.0)
    assert result["completed"] and not result["hangs"], result
    assert result["faults_injected"] == 3  # engine A; B's supervisor, then B
    # 1. B started while A's server still answered, waited for it to go, and then ran on its own server
    assert result["killed_engine_server_answered_at_restart"]
    assert result["killed_engine_server_gone_after_s"] is not None
    assert result["restarted_engine"] == {"num_tokens": 4, "error": None}
    assert result["requests_by_server"] == {"engine_a": 4, "engine_b": 4}  # health, tokens, weights, cache
    # 2. the orphan answered before and after C, C refused it with the reason, and nothing reached it
    assert result["orphan_answers"] and result["orphan_answers_after_refusal"]
    assert "already answers before its server_command started" in result["refusal"]
    assert result["refused_clearly"] == 1 and result["orphans_adopted"] == 0
    assert result["servers_started_by_refused_engine"] == 0
    assert result["requests_to_foreign_servers"] == 0
    assert result["generations_to_foreign_servers"] == result["weight_calls_to_foreign_servers"] == 0


def test_the_case_counts_an_engine_that_adopts_what_answers(tmp_path):
    """Without the port-free wait and the owner check, the restarted engine takes the killed engine's
    draining server as its own: its tokens and its weights go there, and the case says so."""
    result = run_server_orphan(0, tmp_path, port_free_wait_s=2.0, unguarded=True)
    assert result["completed"], result
    assert result["requests_to_foreign_servers"] > 0
    assert result["generations_to_foreign_servers"] >= 1 and result["weight_calls_to_foreign_servers"] >= 1


def test_by_kind_sums_the_server_orphan_cases_and_the_tokens_lost_per_crash():
    case = {
        "name": "server_orphan",
        "completed": True,
        "faults_injected": 3,
        "orphans_adopted": 0,
        "requests_to_foreign_servers": 0,
        "refused_clearly": 1,
    }
    data = {"fault_families": [{"results": [case]}, {"results": [{**case, "requests_to_foreign_servers": 2}]}]}

    def progress(lost: float) -> dict:
        summary = {"tokens_lost_mean": lost, "tokens_lost_per_trajectory": 166.8, "lost_share": 0.319}
        return {"summary": {"off": {**summary, "sampled_tokens_per_s": 130.5}}}

    kinds = chaos_families.by_kind(data, None, {}, {"worker": progress(2668.5), "engine": progress(512.0)})
    assert kinds["server_orphan"] == {
        "cases": 2,
        "completed": 2,
        "kills": 6,
        "orphans_adopted": 0,
        "requests_to_foreign_servers": 2,
        "refused_clearly": 2,
    }
    assert kinds["losses_and_violations"]["requests_to_foreign_servers"] == 2  # a violation anywhere shows
    assert kinds["tokens_lost_per_crash"]["worker"]["off"]["tokens_lost"] == 2668.5
    assert kinds["tokens_lost_per_crash"]["engine"]["off"]["tokens_lost"] == 512.0
    assert chaos_families.by_kind({}, None, {})["tokens_lost_per_crash"] == {}
    json.dumps(kinds)
