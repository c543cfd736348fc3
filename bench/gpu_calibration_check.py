"""Why does calibration overstate the step on a GPU? (run 2 on an H200: the record predicted the
one-process step at 45.7 ms, it ran in 24.3 ms, 1.88x, so the calibration is never cached there.)
Prints calibration's per-block timings for gpt2 beside 12 blocks chained and the one-process step.

    python bench/gpu_calibration_check.py        # one GPU; on CPU it runs the same on the CPU
"""
import statistics, time, torch
from hrlplan.compose import compose, to_plain
from hrlplan.runtime.calibrate.compute import measure_block, measure_step
from hrlplan.runtime.calibrate.blocks import block_stage
from hrlplan.measure import now
cfg = compose(["arch=gpt2", "logger.mode=disabled"])
arch, seq = cfg["arch"], int(cfg["data"]["seq_len"])
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("seq", seq, "global batch", cfg["train"]["global_batch_size"], "dtype", cfg["train"]["dtype"])
with torch.autocast(dev.type, dtype=torch.bfloat16):
    for r in measure_block(arch, seq, [1, 2, 8], dev):
        print("measure_block", r["tokens"], "fwd ms %.3f bwd ms %.3f" % (r["fwd_s"] * 1e3, r["bwd_s"] * 1e3), [round(s * 1e3, 3) for s in r["samples_s"]])
    block, hidden = block_stage(arch, dev, n_blocks=12)
    x = torch.randn(8, seq, hidden, device=dev, requires_grad=True)
    for _ in range(3):
        y = block(x); y.backward(torch.ones_like(y))
    ts = []
    for _ in range(5):
        t0 = now(dev); y = block(x); y.backward(torch.ones_like(y)); ts.append(now(dev) - t0)
    print("12 blocks chained fwd+bwd ms", round(statistics.median(ts) * 1e3, 3))
from hrlplan.config import Config
print("measure_step", measure_step(cfg, dev))
