"""FSDP2's reshard_after_forward as the runtime applies it (runtime/parallel.py, torch_engine.py):
torchtitan's default -- resharded without pipelining, kept gathered under it --, the same losses
either way, and fewer unsharded weights alive at the peak when resharding."""
import pytest

from _memory_runs import train_in_few_launches
from _plan_options import reference_losses

STEPS = 3
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=6", "train.lr=3e-3", "train.global_batch_size=8", "train.dp_mode=fsdp"]


def _plan(spans, dp, microbatches):
    from hrlplan.plan import homogeneous_plan

    return homogeneous_plan("gpt2-tiny", 6, spans, dp=dp, tp=1, microbatch_size=8 // dp // microbatches,
                            num_microbatches=microbatches, schedule="1f1b")


def test_default_reshards_without_pipelining_only():
    alone, piped = _plan([(0, 6)], 2, 1), _plan([(0, 3), (3, 6)], 2, 2)
    assert alone.reshard_after_forward is None and piped.reshard_after_forward is None   # the field's default
    assert alone.resolved_reshard_after_forward() and not piped.resolved_reshard_after_forward()
    piped.reshard_after_forward = True
    assert piped.resolved_reshard_after_forward()


@pytest.mark.slow
def test_fsdp2_reshard_after_forward_trains_the_same_and_frees_the_gathered_weights(tmp_path):
    plan = _plan([(0, 6)], 2, 1)
    runs = train_in_few_launches({flag: (plan, GPT2, STEPS, None, {"reshard_after_forward": flag})
                                  for flag in (True, False)}, tmp_path)   # one launch, a trainer per flag
    reference = reference_losses(GPT2, STEPS)
    for flag, run in runs.items():
        assert run["losses"] == pytest.approx(reference, abs=1e-5), flag
    for rank in (0, 1):
        on, off = runs[True]["memory"][rank], runs[False]["memory"][rank]
        print(f"rank {rank}: weights at the peak {off['weights']} -> {on['weights']} bytes, peak {off['peak']} -> "
              f"{on['peak']}; step {runs[False]['step_time_s']:.3f} s -> {runs[True]['step_time_s']:.3f} s")
        assert on["weights"] < off["weights"] and on["peak"] < off["peak"], rank
