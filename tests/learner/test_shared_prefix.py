"""`learner.shared_prefix`: a GRPO group's prompt forwarded once gives the dense step's losses and
gradients, parameter by parameter, through micro-batching, gradient checkpointing, every correction,
PPO's value head and multi-turn masks; groups whose prompts differ stay dense.

Tolerance: gradients are compared per parameter as ‖g_shared − g_dense‖ ≤ 1e-4·‖g_dense‖ + 1e-8
(fp32; what differs is only the summation order of the prompt's gradient and the attention kernel's
masked-versus-causal path, measured at ≤ 2.3e-6 relative on the tiny model, ≤ 1.2e-5 per parameter and
3.6e-6 over the whole gradient on SmolLM2).
"""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from streamrl.learner.shared_prefix import PackedLayout, Segment, plan_micro_batches, plan_segments
from streamrl.learner.types import TrainBatch
from tests.learner.helpers import padded_batch

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-4, 1e-8


def _cfg(model: str = "tiny", **kw) -> LearnerConfig:
    base = dict(model=model, device="cpu", lr=1e-4, micro_batch_tokens=4096, seed=3, logits_chunk_tokens=16)
    base.update(kw)
    return LearnerConfig(**base)


def group_batch(
    vocab: int,
    *,
    prompt_len: int = 12,
    response_lens: tuple[int, ...] = (9, 14, 6, 11),
    num_groups: int = 2,
    differing_group: bool = True,
    seed: int = 0,
    versions: tuple[int, ...] = (0, 1, 2),
):
    """`num_groups` groups of len(response_lens) rows sharing their group's prompt, whose responses have
    observation tokens (loss mask 0) inside them as a multi-turn row does; with `differing_group` one
    more group whose rows' prompts differ (it must train dense) and a lone row."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    seqs, group_index, rewards, pv = [], [], [], []

    def row(prompt: list[int], n: int, group: int) -> None:
        mask = [1] * n
        if n > 6:  # an observation inside the response: tokens 3..5 carry no loss
            mask[3:5] = [0, 0]
        seqs.append((prompt, ids(n), mask))
        group_index.append(group)
        rewards.append(float(torch.rand(1, generator=g)))
        pv.append(versions[len(pv) % len(versions)])

    for group in range(num_groups):
        prompt = ids(prompt_len + group)
        for n in response_lens:
            row(prompt, n, group)
    if differing_group:
        for b, n in enumerate(response_lens[:3]):
            row(ids(prompt_len - 2 + b), n, num_groups)  # same group, different prompts
        row(ids(prompt_len), 7, num_groups + 1)  # a group of one
    behav = [[-2.0] * len(r) for _, r, _ in seqs]
    return padded_batch(seqs, rewards=rewards, group_index=group_index, behavior_logprobs=behav, policy_versions=pv)


def _near_policy(engine: TrainingEngine, batch, seed: int = 0):
    """Behaviour log-probs = the current policy's ± 0.2, so corrections weigh and clip few tokens."""
    logp = engine.compute_logprobs(batch).numpy()
    noise = torch.empty(logp.shape).uniform_(-0.2, 0.2, generator=torch.Generator().manual_seed(seed)).numpy()
    batch.behavior_logprobs = ((logp + noise) * (batch.loss_mask != 0)).astype("float32")
    return batch


def _capture_grads(engine: TrainingEngine) -> list[dict[str, torch.Tensor]]:
    """Every optimiser step's gradients, just before it is clipped and taken."""
    grads: list[dict[str, torch.Tensor]] = []
    step = engine._clip_and_step

    def capture(loss: float):
        grads.append({n: p.grad.detach().clone() for n, p in engine.policy.named_parameters() if p.grad is not None})
        return step(loss)

    engine._clip_and_step = capture  # type: ignore[method-assign]
    return grads


def _step_both(cfg_kw: dict, batch_kw: dict | None = None, model: str = "tiny", policy_version: int = 2):
    """One step of a dense and a shared-prefix engine on the same batch: (metrics, grads) of each."""
    dense = TrainingEngine(_cfg(model, shared_prefix=False, **cfg_kw))
    shared = TrainingEngine(_cfg(model, shared_prefix=True, **cfg_kw))
    batch = _near_policy(dense, group_batch(dense.policy.lm.config.vocab_size, **(batch_kw or {})))
    tb = shared.to_train_batch(batch)
    assert any(p.is_shared for p in shared.train_micro_batches(tb, torch.arange(tb.batch_size)))
    out = []
    for engine in (dense, shared):
        engine.policy_version = policy_version
        grads = _capture_grads(engine)
        out.append((engine.train_step(batch), grads))
    return out


def _assert_same_grads(dense: list[dict], shared: list[dict]) -> float:
    """Per-parameter check; returns the largest relative L2 gap."""
    assert len(dense) == len(shared) and dense
    worst = 0.0
    for gd, gs in zip(dense, shared):
        assert gd.keys() == gs.keys()
        for name in gd:
            gap, norm = (gs[name] - gd[name]).norm().item(), gd[name].norm().item()
            assert gap <= RTOL * norm + ATOL, f"{name}: |Δg| {gap:.3g} against |g| {norm:.3g}"
            worst = max(worst, gap / norm if norm > 0 else 0.0)
        assert sum(gd[n].norm() ** 2 for n in gd) > 0  # the step has a gradient to compare
    return worst


def _assert_same_losses(md: dict, ms: dict) -> None:
    for key in ("learner/loss", "learner/pg_loss", "learner/entropy", "is/ratio_mean", "is/clip_frac"):
        assert ms[key] == pytest.approx(md[key], rel=1e-5, abs=1e-7), key


# ---- planning -------------------------------------------------------------------------------------


def _train_batch(**kw) -> TrainBatch:
    return TrainBatch.from_padded(group_batch(400, **kw))


def test_a_group_sharing_its_prompt_is_one_segment_and_differing_prompts_stay_rows():
    tb = _train_batch()  # rows 0-3 group 0, 4-7 group 1, 8-10 differing prompts, 11 alone
    segments = plan_segments(tb, list(range(tb.batch_size)), budget=4096)
    shared = [s for s in segments if s.is_shared]
    assert [sorted(s.rows) for s in shared] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [s.prefix_len for s in shared] == [12, 13]
    assert shared[0].num_tokens == 12 + 9 + 14 + 6 + 11
    assert sorted(r for s in segments if not s.is_shared for r in s.rows) == [8, 9, 10, 11]


def test_without_prompt_lens_the_prefix_ends_at_the_first_loss_token():
    tb = _train_batch(differing_group=False)
    tb.prompt_lens = None
    assert [s.prefix_len for s in plan_segments(tb, list(range(8)), budget=4096)] == [12, 13]


def test_a_group_over_the_budget_is_cut_into_chunks_each_repeating_the_prompt():
    tb = _train_batch(differing_group=False, num_groups=1)  # prompt 12, responses 9, 14, 6, 11
    segments = plan_segments(tb, list(range(4)), budget=12 + 14 + 11)
    assert [(s.rows, s.prefix_len, s.num_tokens) for s in segments] == [((1, 3), 12, 37), ((0, 2), 12, 27)]
    tight = plan_segments(tb, list(range(4)), budget=20)  # no two responses fit beside the prompt
    assert all(not s.is_shared for s in tight) and sorted(r for s in tight for r in s.rows) == [0, 1, 2, 3]


def test_micro_batches_cover_every_row_once_within_the_budget():
    tb = _train_batch()
    plans = plan_micro_batches(tb, torch.arange(tb.batch_size), budget=60)
    rows = sorted(r for p in plans for r in p.rows.tolist())
    assert rows == list(range(tb.batch_size))
    for p in plans:
        assert len(p.segments) * max(s.num_tokens for s in p.segments) <= 60 or len(p.segments) == 1
        assert sorted(r for s in p.segments for r in s.rows) == list(range(len(p.rows)))


def test_no_shared_prompt_gives_the_dense_packing():
    from streamrl.learner.model import pack_by_tokens

    tb = _train_batch(num_groups=0)
    plans = plan_micro_batches(tb, torch.arange(tb.batch_size), budget=20)
    assert not any(p.is_shared for p in plans)
    dense = pack_by_tokens(tb.seq_lens.tolist(), 20)
    assert [p.rows.tolist() for p in plans] == dense


def test_packed_mask_sees_the_prefix_and_its_own_branch_only():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    mb = TrainBatch(
        input_ids=ids,
        attention_mask=(ids != 0).long(),
        loss_mask=torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]], dtype=torch.float32),
        behavior_logprobs=torch.zeros(2, 5),
        policy_versions=torch.zeros(2, 5, dtype=torch.long),
        seq_lens=torch.tensor([4, 3]),
        rewards=torch.zeros(2),
        group_index=torch.zeros(2, dtype=torch.long),
        prompt_lens=torch.tensor([2, 2]),
    )
    layout = PackedLayout.build(mb, [Segment(rows=(0, 1), prefix_len=2, num_tokens=5)])
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    mask = layout.attention_mask("sdpa", torch.float32)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # row 1's token 9 sees the prompt, not row 0's 7 and 8
    ]
    # tokens 7, 8 (row 0) and 9 (row 1) are scored from the prompt's last state or their own branch
    assert list(zip(layout.out_row.tolist(), layout.out_col.tolist(), layout.source.tolist())) == [
        (0, 2, 1),
        (0, 3, 2),
        (1, 2, 1),
    ]
    eager = layout.attention_mask("eager", torch.float32)[0, 0]
    assert ((eager == 0) == torch.tensor(mask, dtype=torch.bool)).all()


# ---- the step: losses and gradients against dense ---------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled", "masked", "m2po"])
def test_every_correction_gives_the_dense_gradients(mode):
    (md, gd), (ms, gs) = _step_both(dict(correction={"mode": mode}, clip_low=0.1, clip_high=0.1))
    _assert_same_losses(md, ms)
    _assert_same_grads(gd, gs)


@pytest.mark.parametrize(
    "cfg_kw",
    [
        dict(gradient_checkpointing=True),
        dict(gradient_checkpointing=True, micro_batch_tokens=40),  # groups cut into chunks
        dict(micro_batch_tokens=60, num_minibatches=2, ppo_epochs=2, correction={"prox": "loglinear"}),
        dict(num_minibatches=2, correction={"mode": "decoupled", "prox": "recompute"}),
        dict(algo="ppo", gradient_checkpointing=True, micro_batch_tokens=48),
        dict(entropy_coef=0.01, temperature=0.7, logits_chunk_tokens=0),
        dict(use_reference=True, kl_coef=0.1, loss_agg_mode="seq-mean-token-mean"),
        dict(dr_grpo=True, correction={"ratio_level": "geometric", "level": "sequence"}),
    ],
    ids=[
        "checkpointing",
        "chunked-groups",
        "epochs-loglinear",
        "minibatch-recompute",
        "ppo",
        "entropy",
        "kl",
        "drgrpo",
    ],
)
def test_the_step_composes_with_the_learner_options(cfg_kw):
    (md, gd), (ms, gs) = _step_both(dict(shuffle_minibatches=False, **cfg_kw))
    _assert_same_losses(md, ms)
    if "value_loss" in " ".join(md):
        assert ms["learner/value_loss"] == pytest.approx(md["learner/value_loss"], rel=1e-5, abs=1e-8)
    _assert_same_grads(gd, gs)


def test_packed_forward_scores_every_loss_token_like_the_dense_forward():
    from streamrl.learner.shared_prefix import packed_forward

    engine = TrainingEngine(_cfg(algo="ppo"))
    tb = engine.to_train_batch(group_batch(engine.policy.lm.config.vocab_size))
    (plan,) = plan_micro_batches(tb, torch.arange(tb.batch_size), budget=4096)
    mb = tb.select(plan.rows)
    with torch.no_grad():
        dense = engine.forward(engine.policy, mb, with_entropy=True)
        packed = packed_forward(engine.policy, mb, plan.segments, with_entropy=True)
    scored = torch.ones_like(mb.loss_mask, dtype=torch.bool)
    for seg in plan.segments:  # every position after the shared prompt, up to the row's end
        for r in seg.rows:
            scored[r, : max(seg.prefix_len, 1)] = False
    scored &= mb.attention_mask.bool()
    for name in ("logp", "entropy", "values"):
        got, want = getattr(packed, name), getattr(dense, name)
        assert torch.allclose(got[scored], want[scored], atol=1e-5), name
        assert (got[~scored] == 0).all(), name


def test_a_vision_model_trains_dense():
    engine = TrainingEngine(_cfg("tiny-vlm"))
    assert engine.cfg.shared_prefix and not engine.shared_prefix


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_gradients_match_the_dense_step():
    """The real model (SmolLM2-135M, 30 layers), the default learner's settings (activation
    checkpointing, 128-token LM-head chunks, decoupled correction with log-linear π_prox), groups
    cut into micro-batches that each repeat the prompt."""
    cfg = dict(
        gradient_checkpointing=True,
        logits_chunk_tokens=128,
        micro_batch_tokens=72,  # one dense row per micro-batch; the group packs as two chunks
        correction={"mode": "decoupled", "prox": "loglinear"},
    )
    batch = dict(prompt_len=32, response_lens=(12, 18, 8, 15), num_groups=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the other xdist worker's engines, 2 threads run ~8x slower than 1
    try:
        (md, gd), (ms, gs) = _step_both(cfg, batch, model="smollm2")
    finally:
        torch.set_num_threads(threads)
    _assert_same_losses(md, ms)
    worst = _assert_same_grads(gd, gs)
    total = (
        sum((gs[0][n] - gd[0][n]).norm() ** 2 for n in gd[0]) ** 0.5 / sum(g.norm() ** 2 for g in gd[0].values()) ** 0.5
    )
    assert total < 1e-5, f"relative L2 gap of the whole gradient {total:.3g} (worst parameter {worst:.3g})"


def _fsdp_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One FSDP2 rank (gloo): a shared-prefix step on rows rank::world_size; rank 0 saves the full
    gradients and metrics to `out`."""
    import os

    import torch.distributed as dist

    from streamrl.learner.group import fsdp_shard
    from streamrl.learner.sharded import full_tensor

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        engine = TrainingEngine(_cfg(gradient_checkpointing=True, micro_batch_tokens=40), shard=fsdp_shard)
        engine.policy.fused_head = False
        batch = torch.load(out + ".batch", weights_only=False)
        engine.policy_version = 2
        grads: list[dict[str, torch.Tensor]] = []
        step = engine._clip_and_step

        def capture(loss: float):
            full = {n: full_tensor(p.grad).detach().clone() for n, p in engine.policy.named_parameters()}
            grads.append(full)
            return step(loss)

        engine._clip_and_step = capture  # type: ignore[method-assign]
        metrics = engine.train_step(batch)
        if rank == 0:
            torch.save((metrics, grads), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_ranks_pack_their_rows_of_a_group_like_one_process(tmp_path):
    """Two FSDP2 ranks each hold half of every group (rows rank::2), pack it around the shared prompt,
    and run the same number of micro-batch passes (dummy passes where one rank has fewer)."""
    import socket

    import torch.multiprocessing as mp

    single = TrainingEngine(_cfg(shared_prefix=False, gradient_checkpointing=True, micro_batch_tokens=40))
    batch = _near_policy(single, group_batch(single.policy.lm.config.vocab_size))
    out = str(tmp_path / "rank0.pt")
    torch.save(batch, out + ".batch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(2, port, out), nprocs=2, join=True)
    got_metrics, got = torch.load(out, weights_only=False)
    single.policy_version = 2
    want = _capture_grads(single)
    want_metrics = single.train_step(batch)
    _assert_same_losses(want_metrics, got_metrics)
    got = [{n.removeprefix("_checkpoint_wrapped_module."): g for n, g in step.items()} for step in got]
    _assert_same_grads(want, [{n: g[n] for n in want[0]} for g in got])
