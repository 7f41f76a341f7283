"""Token exactness of gateway sessions: the record holds exactly the engine's tokens, log-probs and
versions; observation tokens carry mask 0; a multi-turn session is one sequence; a history rewrite
forks (counted) and is never re-tokenized into the old record; a weight sync mid-call parks the
generation in place and the call completes with tokens of two policy versions."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.fake import fake_logprob
from streamrl.rollout.types import TrajectoryStatus
from tests.rollout.gateway.conftest import CALC_TOOL
from tests.rollout.test_agent_loop import ANSWER, CALL

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "What is 12 times 7?"}]
LONG = (
    "Let me work this out. Twelve times seven: twelve times five is sixty, twelve times two is twenty-four, "
    "so the total is eighty-four. The answer is \\boxed{84}."
)


def sampled_runs(data) -> list[list[int]]:
    """The record's runs of sampled tokens (mask 1), in order."""
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(data.response_ids, data.response_mask)):
        if m:
            if i == 0 or not data.response_mask[i - 1]:
                runs.append([])
            runs[-1].append(t)
    return runs


async def test_record_is_the_engines_tokens_logprobs_and_versions(make_gateway, tiny_tokenizer):
    gw = await make_gateway([CALL, ANSWER], policy_version=5)
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL])
    msg = first.choices[0].message
    tool = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "84"}
    await client.chat.completions.create(
        model="p", messages=[*USER, msg.model_dump(exclude_none=True), tool], tools=[CALC_TOOL]
    )
    gw.session.finish()
    data = gw.data
    eos = tiny_tokenizer.eos_token_id
    turns = [tiny_tokenizer.encode(t, add_special_tokens=False) + [eos] for t in (CALL, ANSWER)]
    assert data.prompt_ids == gw.ctx.encoder.encode_prompt(USER, [CALC_TOOL])
    assert sampled_runs(data) == turns  # one sequence: turn, observation, turn
    # Each sampled token's log-prob is the engine's for that absolute position; observations are 0 / -1.
    for i, (t, m, lp, v) in enumerate(
        zip(data.response_ids, data.response_mask, data.behavior_logprobs, data.policy_versions)
    ):
        if m:
            assert (lp, v) == (fake_logprob(len(data.prompt_ids) + i, t), 5)
        else:
            assert (lp, v) == (0.0, -1)
    obs = [t for t, m in zip(data.response_ids, data.response_mask) if not m]
    assert obs == gw.ctx.encoder.encode_new_messages([tool])
    # The engine saw exactly the record as its prompts.
    prompts = [p for _, p in gw.engine.requests_seen]
    assert prompts[1] == data.prompt_ids + data.response_ids[: len(turns[0]) + len(obs)]
    traj = data.to_trajectory(TrajectoryStatus.FINISHED)
    traj.validate(max_model_len=gw.ctx.cfg.prompt_length + gw.ctx.cfg.response_length)
    assert gw.session.state.num_forks == 0 and gw.session.state.num_calls == 2
    assert traj.num_tool_calls == 1  # the model's call, on the record (the program ran it)


async def test_a_fork_counts_only_the_tool_calls_of_the_new_record(make_gateway):
    gw = await make_gateway([CALL, ANSWER])
    client = gw.openai()
    await client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL])
    # The agent drops its call from the history and asks again: a new record (the fork) begins.
    edited = [*USER, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model="p", messages=edited, tools=[CALC_TOOL])
    assert gw.session.state.num_forks == 1
    gw.session.finish()
    assert gw.data.num_tool_calls == 0  # the call is in the first record, which is not trained


async def test_a_history_rewrite_forks_and_is_counted(make_gateway, tiny_tokenizer):
    gw = await make_gateway(["The answer is 84.", "The answer is 85."])
    client = gw.openai()
    a = await client.chat.completions.create(model="p", messages=USER)
    old_prompt, old_response = list(gw.data.prompt_ids), None
    # The agent edits its own earlier answer before going on: that is not what the policy sampled.
    edited = [*USER, {"role": "assistant", "content": "It is 84."}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="p", messages=edited)
    state = gw.session.state
    assert state.num_forks == 1
    (segment,) = state.segments
    old_response = tiny_tokenizer.encode(a.choices[0].message.content, add_special_tokens=False)
    # Only its size is kept: the budget counts it, training takes the last record.
    assert segment.num_prompt_tokens == len(old_prompt) and segment.num_messages == 2
    assert segment.num_response_tokens == segment.num_sampled_tokens == len(old_response) + 1  # + eos
    # The new segment starts from this call's own rendering: no observation tokens, nothing re-tokenized.
    assert gw.data.prompt_ids == gw.ctx.encoder.encode_prompt(edited, None)
    gw.session.finish()
    assert 0 not in gw.data.response_mask


async def test_renamed_tool_call_ids_extend_by_token_prefix_not_fork(make_gateway):
    gw = await make_gateway([CALL, ANSWER])
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL])
    msg = first.choices[0].message.model_dump(exclude_none=True)
    msg["tool_calls"][0]["id"] = "my_own_id"  # some frameworks re-number calls; the template never shows ids
    tool = {"role": "tool", "tool_call_id": "my_own_id", "content": "84"}
    await client.chat.completions.create(model="p", messages=[*USER, msg, tool], tools=[CALC_TOOL])
    assert gw.session.state.num_forks == 0
    assert 0 in gw.data.response_mask  # the tool response joined the one record as observation tokens


async def test_a_weight_sync_mid_call_parks_in_place_and_the_call_completes(make_gateway, tiny_tokenizer):
    gw = await make_gateway([LONG], token_delay_s=0.01, policy_version=0)
    ctx, engine = gw.ctx, gw.engine
    call = asyncio.create_task(gw.openai().chat.completions.create(model="p", messages=USER))
    for _ in range(2000):
        if ctx.num_in_engine:
            break
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.1)  # some tokens of the answer are out
    ctx.cancel.set()  # the worker's pause: generations abort and park
    for _ in range(2000):
        if not ctx.num_in_engine:
            break
        await asyncio.sleep(0.002)
    assert ctx.num_in_engine == 0
    await engine.pause()
    await engine.set_policy_version(1)  # the weights change while the call waits
    await asyncio.sleep(0.1)
    assert not call.done() and ctx.num_in_engine == 0  # parked: nothing was sent meanwhile
    await engine.resume()
    ctx.cancel.clear()
    out = await call
    assert out.choices[0].message.content == LONG and out.choices[0].finish_reason == "stop"
    gw.session.finish()
    data = gw.data
    target = tiny_tokenizer.encode(LONG, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    assert data.response_ids == target  # token for token what one uninterrupted sample would be
    versions = data.policy_versions
    k = versions.index(1)
    assert 0 < k < len(versions) and versions == [0] * k + [1] * (len(versions) - k)
    assert data.behavior_logprobs == [fake_logprob(len(data.prompt_ids) + i, t) for i, t in enumerate(target)]
    assert gw.session.state.num_interrupts == 1 and len(engine.requests_seen) == 2
    assert engine.requests_seen[1][1] == data.prompt_ids + target[:k]  # resumed from prompt + tokens so far


async def test_a_non_canonical_sample_is_kept_and_the_next_turn_extends_it(make_gateway, tiny_tokenizer):
    """The engine may sample a tokenization the tokenizer would never produce; re-encoding the history
    would change it. The session matches the conversation by messages, keeps the engine's ids, and
    templates only the new user turn."""
    tok = tiny_tokenizer
    text = "The answer is 84."
    odd = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    assert odd[:-1] != tok.encode(text, add_special_tokens=False)  # really not what re-encoding gives
    again = tok.encode("Yes.", add_special_tokens=False) + [tok.eos_token_id]
    gw = await make_gateway(script=[odd, again])
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER)
    assert first.choices[0].message.content == text
    follow = [*USER, {"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="p", messages=follow)
    gw.session.finish()
    assert gw.session.state.num_forks == 0
    assert sampled_runs(gw.data) == [odd, again]
    obs = gw.ctx.encoder.encode_new_messages([{"role": "user", "content": "Sure?"}])
    assert gw.data.response_ids == odd + obs + again
