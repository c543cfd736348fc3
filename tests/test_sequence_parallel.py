"""Sequence parallelism with DTensor tp (runtime/tensor_parallel.py): the norms on sequence shards,
sequence-sharded block inputs and outputs, the vocabulary-parallel head under loss_parallel; it
trains what one process trains and holds less activation memory per tp rank.

One launch of two gloo workers runs the stage-level cases (GPT-2 and Llama, vocabulary sharded
or whole, op-level selective recompute on top); a pp 2 x tp 2 plan trains through the pipeline
engine with sequence-sharded stage boundaries and is compared with one process (those runs and an
FSDP2 x tp 2 one share one launch with tests/test_tp.py's: tests/_tp_runs.py).
"""
from typing import Any, Dict, List

import pytest

from _plan_options import train_with_options
from _tp_runs import fsdp2_by_tp2_sp_selective_run, one_process_losses, pp2_tp2_run

STEPS = 3
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=2", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=2", "train.lr=3e-3"]
BATCH, SEQ = (2, 64)


def _stage(overrides: List[str]):
    from hrlplan.compose import compose
    from hrlplan.models.hf import HFStage
    from hrlplan.runtime.trainer import build_full_model

    cfg = compose(overrides)
    model = build_full_model(cfg["arch"], int(cfg["train"]["seed"]))
    return HFStage(model, 0, model.config.num_hidden_layers, first=True, last=True), cfg["train"]


def _train(part, train, loss_fn, context) -> Dict[str, Any]:
    """STEPS AdamW steps on fixed batches; the losses and the first step's measured memory."""
    import torch

    from hrlplan.runtime.memory import LiveStorageTracker
    from hrlplan.runtime.parallel import clip_grad_norm
    from hrlplan.runtime.trainer import make_optimizer

    opt = make_optimizer(part, train)
    params = [p for p in part.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    losses, memory = [], None
    for step in range(STEPS):
        x, y = torch.randint(0, 128, (BATCH, SEQ), generator=gen), torch.randint(0, 128, (BATCH, SEQ), generator=gen)
        opt.zero_grad(set_to_none=True)
        tracker = LiveStorageTracker("cpu", lambda: ([part], [opt]))
        tracker.track_tensors([*part.parameters(), *part.buffers()])
        with tracker if step == 0 else context():   # a tracked step runs the same as the others
            with context() if step == 0 else _nothing():
                loss = loss_fn(part(x), y)
                loss.backward()
        if step == 0:
            memory = tracker.result()
        clip_grad_norm(params, 1.0, None, [])
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "memory": memory}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _layout(part) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    block = next(iter(getattr(part.base, part.blocks_attr).values()))
    norm = block.ln_1 if part.model_type == "gpt2" else block.input_layernorm
    final = part.base.ln_f if part.model_type == "gpt2" else part.base.norm
    return {"norm": [repr(p) for p in getattr(norm.weight, "placements", ())],
            "final_norm": [repr(p) for p in getattr(final.weight, "placements", ())],
            "head_dtensor": isinstance(part.lm_head.weight, DTensor), "shards": part.sequence_shards}


def _vocab_layout(part) -> Dict[str, Any]:
    emb = part.base.wte if part.model_type == "gpt2" else part.base.embed_tokens
    return {"embedding": [repr(p) for p in getattr(emb.weight, "placements", ())],
            "embedding_rows": tuple(getattr(emb.weight, "_local_tensor", emb.weight).shape),
            "embedding_grad": [repr(p) for p in getattr(emb.weight.grad, "placements", ())],
            "head": [repr(p) for p in getattr(part.lm_head.weight, "placements", ())],
            "tied": part.lm_head.weight is emb.weight, "loss_mesh": part.loss_mesh is not None}


def _vocab_fallbacks(mesh) -> Dict[str, Any]:
    """An odd vocabulary keeps the embedding and head whole (said once per process), as the switch does."""
    import logging

    import torch.distributed as dist

    from hrlplan.runtime.tensor_parallel import parallelize_stage

    said: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hrlplan.runtime.tensor_parallel").addHandler(handler)
    for _ in range(2):
        odd, _ = _stage([*GPT2, "arch.vocab_size=127"])
        parallelize_stage(odd, mesh)
    off, _ = _stage(GPT2)
    parallelize_stage(off, mesh, vocab_parallel=False)
    return {"odd": {**_vocab_layout(odd), "said": said if dist.get_rank() == 0 else None},
            "off": _vocab_layout(off)}


def _block_output_shape(part) -> List[int]:
    import torch

    shapes = []
    block = next(iter(getattr(part.base, part.blocks_attr).values()))
    hook = block.register_forward_hook(lambda m, a, out: shapes.append(list((out[0] if isinstance(out, tuple)
                                                                              else out).shape)))
    with torch.no_grad():
        part(torch.zeros(BATCH, SEQ, dtype=torch.long))
    hook.remove()
    return shapes[0]


def _worker() -> Dict[str, Any]:
    from contextlib import nullcontext

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hrlplan.models.hf import causal_lm_loss
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.recompute import apply_recompute
    from hrlplan.runtime.tensor_parallel import loss_context, parallelize_stage, stage_loss

    init_distributed("cpu", {"collective_timeout_min": 5})
    try:
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("tp",))
        out: Dict[str, Any] = {}
        for name, overrides in (("gpt2", GPT2), ("llama", LLAMA)):
            whole, train = _stage(overrides)
            out[name] = {"whole": _train(whole, train, causal_lm_loss, nullcontext)}
            cases = {"tp": dict(sequence_parallel=False), "sp": dict(sequence_parallel=True),
                     "sp_whole_vocab": dict(sequence_parallel=True, vocab_parallel=False),
                     "sp_selective": dict(sequence_parallel=True, recompute="selective")}
            for case, options in cases.items():
                part, _ = _stage(overrides)
                recompute = options.pop("recompute", "none")
                parallelize_stage(part, mesh, **options)
                apply_recompute(part, recompute)
                out[name][case] = {**_train(part, train, stage_loss([part]), lambda: loss_context([part])),
                                   **_layout(part), "block_output": _block_output_shape(part),
                                   "vocab": _vocab_layout(part)}
        return {**out, **_vocab_fallbacks(mesh)}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def stage_cases(tmp_path_factory):
    """One launch of two gloo workers for every stage-level case (sequence and vocabulary parallel)."""
    from hrlplan.launch.local import launch_workers

    return launch_workers(_worker, (), 2, name="sequence-parallel", log_dir=str(tmp_path_factory.mktemp("sp")))


@pytest.mark.slow
def test_sharded_embedding_and_head_train_as_the_whole_stage(stage_cases):
    """A vocabulary-parallel embedding and head (tp=2, DTensor) train what the whole stage trains;
    an odd vocabulary, or vocab_parallel=false, keeps them whole."""
    out = stage_cases[0]
    for name in ("gpt2", "llama"):
        case = out[name]["tp"]["vocab"]
        assert out[name]["tp"]["losses"] == pytest.approx(out[name]["whole"]["losses"], abs=1e-5), name
        assert case["embedding"] == case["head"] == ["Shard(dim=0)"], name
        assert case["embedding_rows"][0] == 64, name   # 128 / tp
        assert case["embedding_grad"] == ["Shard(dim=0)"], name   # sliced as the weight: the tie sync needs it
        assert case["loss_mesh"], name
    assert out["gpt2"]["tp"]["vocab"]["tied"] and not out["llama"]["tp"]["vocab"]["tied"]
    odd = out["odd"]
    assert odd["embedding"] == [] and odd["head"] == [] and odd["tied"] and not odd["loss_mesh"]
    assert len(odd["said"]) == 1 and "127 is not divisible by tp=2" in odd["said"][0]
    assert out["off"]["embedding"] == [] and out["off"]["tied"] and not out["off"]["loss_mesh"]


@pytest.mark.slow
def test_sequence_parallel_stage_trains_as_the_whole_stage_with_less_activation_memory(stage_cases):
    results = stage_cases
    for name in ("gpt2", "llama"):
        for rank in (0, 1):
            case = results[rank][name]
            for variant in ("tp", "sp", "sp_whole_vocab", "sp_selective"):
                assert case[variant]["losses"] == pytest.approx(case["whole"]["losses"], abs=1e-5), (name, variant)
            sp, tp = case["sp"], case["tp"]
            print(f"{name} rank {rank} activations: whole {case['whole']['memory']['activations']}, "
                  f"tp {tp['memory']['activations']}, sp {sp['memory']['activations']}, "
                  f"sp+selective {case['sp_selective']['memory']['activations']}; peak: whole "
                  f"{case['whole']['memory']['peak']}, tp {tp['memory']['peak']}, sp {sp['memory']['peak']}")
            assert sp["norm"] == sp["final_norm"] == ["Replicate()"], name   # SequenceParallel's norms
            assert tp["norm"] == [] and tp["shards"] == 1
            assert sp["shards"] == 2 and sp["head_dtensor"] and not case["sp_whole_vocab"]["head_dtensor"]
            assert sp["block_output"] == [BATCH, SEQ // 2, 64] and tp["block_output"] == [BATCH, SEQ, 64], name
            # the residual stream and the norms' inputs are halved: less held for backward per tp rank
            assert sp["memory"]["activations"] < 0.9 * tp["memory"]["activations"], (name, sp["memory"], tp["memory"])
            assert case["sp_selective"]["memory"]["activations"] < sp["memory"]["activations"], name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pp2_tp2_sequence_parallel_matches_one_process(arch):
    """Stages hand each other the sequence-sharded activation (b, s/tp, h), tp rank to tp rank; the
    last stage gathers it once into the vocabulary-parallel head. Per-rank activation memory drops
    (against the same plan without sequence parallelism, a run tests/test_tp.py shares)."""
    sp, tp = pp2_tp2_run(arch, True), pp2_tp2_run(arch, False)
    assert sp["losses"] == pytest.approx(one_process_losses(arch), abs=1e-5)
    assert tp["losses"] == pytest.approx(one_process_losses(arch), abs=1e-5)
    for rank, (on, off) in enumerate(zip(sp["memory"], tp["memory"])):
        print(f"{arch} rank {rank}: activations {off['activations']} -> {on['activations']} bytes, "
              f"peak {off['peak']} -> {on['peak']}")
        assert on["activations"] < off["activations"], (rank, on, off)


@pytest.mark.slow
def test_fsdp2_by_tp2_with_sequence_parallel_op_sac_and_resharding_matches_one_process():
    """The layout torch-native trainers run at scale, on four gloo ranks: FSDP2 (resharded after
    forward) over tp 2 with sequence parallelism and op-level selective recomputation."""
    run = fsdp2_by_tp2_sp_selective_run()
    assert run["losses"] == pytest.approx(one_process_losses("fsdp2-tp2"), abs=1e-5)


@pytest.mark.slow
def test_sequence_parallel_run_resumes_on_its_loss_curve(tmp_path):
    """The norms' Replicate DTensors go through torch.distributed.checkpoint like the sharded
    weights: stopped after 2 steps and resumed, the run repeats the uninterrupted one's losses."""
    from hrlplan.plan import homogeneous_plan

    from _one_launch_runs import train_in_one_launch

    plan = homogeneous_plan("llama-tiny", 2, [(0, 2)], dp=1, tp=2, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b", sequence_parallel=True)
    saving = ["train.checkpoint_interval=2"]
    # the uninterrupted run and the stopped one share a launch; the resume is a launch of its own
    runs = train_in_one_launch({"straight": (plan, LLAMA, 4),
                                "run": (plan, [*LLAMA, *saving, "train.stop_after=2"], 4)}, tmp_path)
    straight, first = runs["straight"]["losses"], runs["run"]["losses"]
    resumed = train_with_options(plan, LLAMA, tmp_path / "run", 4, stage_options={"sequence_parallel": True},
                                 extra=[*saving, "train.resume=auto"])["losses"]
    assert first + resumed == pytest.approx(straight, abs=1e-6)
