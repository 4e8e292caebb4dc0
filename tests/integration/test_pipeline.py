"""Pipelined training on real gloo ranks gives the unsplit model's loss and gradients.

The test starts two worker processes (this file run as a script) on 127.0.0.1 with a port
picked free here; each worker builds the model on the meta device, prepares its stage for
several runtimes and schedules, runs one step and compares loss and gradients with the
unsplit model (built in the same process from the same seeds) using the same micro-batches
and gradient accumulation. Results come back as JSON files; the workers' process groups are
killed in teardown whatever happens.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)



def _run_workers(tmp_path: Path, world: int, scenario: str, timeout: float = 180) -> list[dict]:
    """This file's ranks, owned (tests/rank_scripts.py)."""
    from rank_scripts import run_ranks
    return run_ranks(__file__, tmp_path, world, scenario, timeout)


def test_pipelined_step_matches_unsplit_model(tmp_path):
    results = _run_workers(tmp_path, 2, "equivalence")
    cases = {}
    for rank_result in results:
        for case in rank_result["cases"]:
            cases.setdefault(case["name"], []).append(case)
    expected = {"mlp-lean-gpipe", "mlp-lean-1f1b", "mlp-lean-gloo-1f1b", "mlp-torch-gpipe",
                "mlp-torch-1f1b",
                "mlp-torch-interleaved_1f1b", "lm-lean-1f1b-auto", "lm-torch-1f1b-auto",
                "mlp5-lean-1f1b-auto", "charlm-lean-gpipe"}
    assert set(cases) == expected
    for name, per_rank in cases.items():
        assert len(per_rank) == 2, name
        for case in per_rank:
            assert case["grad_max_err"] < 1e-5, (name, case)
            assert case["num_params"] > 0, (name, case)  # every rank owns some blocks
            assert case["materialised_only_own"], name  # the rest stays on the meta device
        losses = [c["loss"] for c in per_rank if c["loss"] is not None]
        assert len(losses) == 1, name  # only the last stage reports a loss
        assert losses[0] == pytest.approx(per_rank[0]["reference_loss"], rel=1e-5), name
        # the lean runtime's neighbours on this host talk through shared memory by default
        expected_shm = name.startswith(("mlp-lean", "mlp5-lean", "lm-lean", "charlm-lean")) \
            and "gloo" not in name
        assert [c["shared_memory"] for c in per_rank] == [expected_shm] * 2, name
        # the lean runtime splits the last backward on every stage but the first
        if "lean" in name:
            assert [c["split_last_backward"] for c in per_rank] == [False, True], name
        owned = sorted(b for c in per_rank for b in c["blocks"])
        assert owned == list(range(per_rank[0]["num_blocks"])), name  # each block on one rank
    # The automatic plan is the same on both ranks and reported as a dict.
    auto = cases["lm-lean-1f1b-auto"]
    assert auto[0]["plan"] == auto[1]["plan"]
    assert len(auto[0]["plan"]["stages"]) == 2
    # a close call between two cuts was measured, and the plan says which it kept
    refined = cases["mlp5-lean-1f1b-auto"][0]["plan"]
    # Which neighbours fall within the tolerance depends on the profile's timings (noisy on a
    # shared machine: [2]|[3] one run, [3]|[4] another), and so is which of them times fastest
    # (CI once kept [4]); what must hold is that at least two cuts were timed, and that the
    # plan kept the one measured fastest.
    notes = [n for n in refined["notes"] if "measured as whole stages" in n]
    assert notes, refined["notes"]
    timed = {int(cut): float(ms) for cut, ms in re.findall(r"\[(\d+)\] ([\d.]+) ms", notes[0])}
    assert len(timed) >= 2, notes
    kept = refined["stages"][1]["blocks"][0]
    assert f"chose [{kept}]" in notes[0] and timed[kept] == min(timed.values()), notes
    errors = results[0]["errors"]
    assert errors["stages"].startswith("InvalidSpec") and "stages=3" in errors["stages"] \
        and "has 2" in errors["stages"]
    assert errors["sample"].startswith("InvalidSpec") and "sample=" in errors["sample"]
    # Data parallel over stage replicas: each rank is replica r of a one-stage pipeline.
    replicas = [r["replicas"] for r in results]
    assert [r["replica"] for r in replicas] == [0, 1]
    for r in replicas:
        assert r["stages"] == 1 and r["blocks"] == list(range(6))
        assert r["grad_max_err"] < 1e-5
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
    # Checkpoint: stage state dicts stitch into the unsplit model's and reload.
    for case in results[0]["cases"]:
        if case["name"] == "mlp-lean-1f1b":
            assert case["checkpoint_roundtrip"] is True


@pytest.mark.slow
def test_lean_pipeline_matches_torch_runtime_gradients(tmp_path):
    """Also implied by the test above (both runtimes equal the unsplit model); kept explicit."""
    results = _run_workers(tmp_path, 2, "lean_vs_torch")
    for r in results:
        assert r["max_diff_lean_vs_torch"] < 1e-6


@pytest.mark.slow
def test_two_stages_times_two_replicas(tmp_path):
    """4 ranks: 2 replicas of a 2-stage pipeline, each replica on half the batch."""
    results = _run_workers(tmp_path, 4, "replicated_stages")
    for r in results:
        assert r["grad_max_err"] < 1e-5, r
    assert sorted((r["replica"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0),
                                                                  (1, 1)]
    last = [r for r in results if r["loss"] is not None]
    assert len(last) == 2
    assert sum(r["loss"] for r in last) / 2 == pytest.approx(last[0]["reference_loss"], rel=1e-5)


# ---------------------------------------------------------------- the worker side


def _worker(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    import copy

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for rank_scripts
    from rank_scripts import unsplit_reference

    from torchrelay.spec import PipelineStrategy
    from torchrelay.train.pipeline import build_on_meta, merge_stage_state_dicts, prepare
    from torchrelay.train.pipeline.meta import is_on_meta
    from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss, mse_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)

    def run_case(name, make_blocks, data, loss_fn, schedule, runtime, plan, seed=3,
                 microbatches=4, transport="auto", refine=0.06):
        inputs, targets, sample, sample_target = data
        meta = build_on_meta(make_blocks)
        strategy = PipelineStrategy(kind="pipeline", microbatches=microbatches,
                                    schedule=schedule)
        given = copy.deepcopy(meta)
        pipe = prepare(given, loss_fn, strategy, sample=sample, sample_target=sample_target,
                       plan=plan, runtime=runtime, seed=seed, transport=transport, refine=refine)
        others_on_meta = all(is_on_meta(b) for i, b in enumerate(given) if i not in pipe.blocks)
        own_materialised = not any(is_on_meta(b) for b in pipe.blocks.values())
        full, ref_loss = unsplit_reference(meta, seed, inputs, targets, loss_fn, microbatches)
        err = 0.0
        num_params = 0
        # Step three times: the first step of a shape learns it (over gloo), the next ones run
        # on cached buffers (shared-memory slots on one host), reused from step to step.
        for _ in range(3):
            pipe.module.zero_grad(set_to_none=True)
            loss = pipe.step(inputs if pipe.is_first else None,
                             targets if pipe.is_last else None)
            num_params = 0
            for i, block in pipe.blocks.items():
                for p, q in zip(block.parameters(), full[i].parameters()):
                    err = max(err, (p.grad - q.grad).abs().max().item())
                    num_params += p.numel()
        case = {"name": name, "loss": None if loss is None else loss.item(),
                "reference_loss": ref_loss, "grad_max_err": err, "num_params": num_params,
                "blocks": sorted(pipe.blocks), "num_blocks": len(meta),
                "plan": pipe.plan.to_dict(),
                "materialised_only_own": others_on_meta and own_materialised,
                "shared_memory": any(getattr(pipe.runner, side, None) is not None
                                     for side in ("prev_channel", "next_channel")),
                # the lean runtime's trace: did this stage split its last backward?
                "split_last_backward": any(kind == "W" for kind, _, _ in
                                           getattr(pipe.runner, "last_trace", []))}
        return case, pipe, full

    torch.manual_seed(0)
    mlp_data = (torch.randn(16, 32), torch.randn(16, 32), torch.randn(4, 32), torch.randn(4, 32))
    vocab, context = 512, 16
    tokens = torch.randint(0, vocab, (8, context + 1))
    lm_data = (tokens[:, :-1], tokens[:, 1:], tokens[:2, :-1], tokens[:2, 1:])

    def mlp():
        return balanced_mlp(32, 6)

    def lm():
        return char_transformer(vocab=vocab, dim=32, depth=3, heads=2, context=context)

    result: dict = {"cases": []}
    if scenario == "equivalence":
        for runtime, schedule, plan in [("lean", "gpipe", [0, 2]), ("lean", "1f1b", [0, 4]),
                                        ("lean-gloo", "1f1b", [0, 3]),
                                        ("torch", "gpipe", [0, 3]), ("torch", "1f1b", [0, 3]),
                                        ("torch", "interleaved_1f1b", [0, 1, 3, 5])]:
            case, pipe, full = run_case(
                f"mlp-{runtime}-{schedule}", mlp, mlp_data, mse_loss, schedule,
                runtime.split("-")[0], plan,
                transport="gloo" if runtime.endswith("gloo") else "auto")
            if runtime == "lean" and schedule == "1f1b":
                gathered = [None] * world
                dist.all_gather_object(gathered, pipe.state_dict())
                merged = merge_stage_state_dicts(gathered)
                whole = torch.nn.Sequential(*full)
                expected = {f"blocks.{k}": v for k, v in whole.state_dict().items()}
                same = merged.keys() == expected.keys() and all(
                    torch.equal(merged[k], expected[k]) for k in expected)
                for block in pipe.blocks.values():  # scramble, then restore from the merge
                    for p in block.parameters():
                        p.data.zero_()
                pipe.load_state_dict(merged)
                restored = all(torch.equal(v, merged[k]) for k, v in pipe.state_dict().items())
                case["checkpoint_roundtrip"] = bool(same and restored)
            result["cases"].append(case)
        for runtime in ("lean", "torch"):
            case, _, _ = run_case(f"lm-{runtime}-1f1b-auto", lm, lm_data, lm_loss, "1f1b",
                                  runtime, None)
            result["cases"].append(case)
        # 5 equal blocks: cuts [0, 2] and [0, 3] are predicted within a few percent (tiny
        # blocks time noisily, hence the wide tolerance), so the plan is settled by timing
        # both as whole stages (a note in the plan says so)
        case, _, _ = run_case("mlp5-lean-1f1b-auto", lambda: balanced_mlp(32, 5), mlp_data,
                              mse_loss, "1f1b", "lean", None, refine=0.5)
        result["cases"].append(case)
        # the example char LM (examples/charlm/model.py), whole model given as nn.Sequential
        from examples.charlm.model import CharLM, CharLMConfig
        from examples.charlm.model import lm_loss as charlm_loss
        config = CharLMConfig(vocab_size=vocab, context=context, d_model=32, n_heads=2,
                              n_layers=2)
        case, _, _ = run_case("charlm-lean-gpipe", lambda: list(CharLM(config)), lm_data,
                              charlm_loss, "gpipe", "lean", [0, 2])
        result["cases"].append(case)
        errors = {}
        for label, kwargs in [("stages", {"strategy": PipelineStrategy(kind="pipeline",
                                                                       stages=3)}),
                              ("sample", {"strategy": PipelineStrategy(kind="pipeline")})]:
            try:
                prepare(build_on_meta(mlp), mse_loss, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the test checks its type and text
                errors[label] = f"{type(exc).__name__}: {exc}"
        result["errors"] = errors
        # replicas=2 on 2 ranks: one stage per replica, each replica on half the batch; the
        # averaged gradients must equal the unsplit model's on the whole batch.
        meta = build_on_meta(mlp)
        strategy = PipelineStrategy(kind="pipeline", microbatches=2, replicas=2)
        pipe = prepare(copy.deepcopy(meta), mse_loss, strategy, plan=[0], runtime="lean", seed=5)
        inputs, targets = mlp_data[0], mlp_data[1]
        half = inputs.shape[0] // 2
        mine = slice(rank * half, (rank + 1) * half)
        loss = pipe.step(inputs[mine], targets[mine])
        full, ref_loss = unsplit_reference(meta, 5, inputs, targets, mse_loss, 4)
        err = max((p.grad - q.grad).abs().max().item()
                  for i, block in pipe.blocks.items()
                  for p, q in zip(block.parameters(), full[i].parameters()))
        dist.all_reduce(loss)
        result["replicas"] = {"stages": pipe.num_stages, "replica": pipe.replica,
                              "grad_max_err": err, "loss": loss.item() / 2,
                              "reference_loss": ref_loss, "blocks": sorted(pipe.blocks)}
    elif scenario == "lean_vs_torch":
        grads = {}
        for runtime in ("lean", "torch"):
            _, pipe, _ = run_case(runtime, mlp, mlp_data, mse_loss, "1f1b", runtime, [0, 3],
                                  microbatches=8)
            grads[runtime] = [p.grad.clone() for p in pipe.parameters()]
        result["max_diff_lean_vs_torch"] = max(
            (a - b).abs().max().item() for a, b in zip(grads["lean"], grads["torch"]))
    elif scenario == "replicated_stages":
        meta = build_on_meta(mlp)
        strategy = PipelineStrategy(kind="pipeline", microbatches=2, replicas=2)
        pipe = prepare(copy.deepcopy(meta), mse_loss, strategy, plan=[0, 2], runtime="lean",
                       seed=5)
        inputs, targets = mlp_data[0], mlp_data[1]
        half = inputs.shape[0] // 2
        mine = slice(pipe.replica * half, (pipe.replica + 1) * half)
        loss = pipe.step(inputs[mine], targets[mine])
        full, ref_loss = unsplit_reference(meta, 5, inputs, targets, mse_loss, 4)
        result = {"replica": pipe.replica, "stage": pipe.stage, "reference_loss": ref_loss,
                  "loss": None if loss is None else loss.item(),
                  "grad_max_err": max((p.grad - q.grad).abs().max().item()
                                      for i, block in pipe.blocks.items()
                                      for p, q in zip(block.parameters(),
                                                      full[i].parameters()))}
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
