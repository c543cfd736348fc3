#!/usr/bin/env bash
# train.float8 and train.compile on ONE GPU through pretrain.py: a bf16 baseline, float8, compile and
# both, each printing the measured step time and peak memory beside the prediction (plan_info.json).
#
#   bash bench/gpu_torch_native.sh [OUT_DIR]            # one H100/H200: four runs, each under `timeout 80`
#   SMOKE=1 bash bench/gpu_torch_native.sh /tmp/tn      # on a CPU: a tiny model, float8 refused in one line
#
# The model is Llama-shaped, 4 blocks of width 2048 (ffn 5632, 16 heads, a 128-token vocabulary so the
# head stays small): q, o, gate, up and down have both dims multiples of 16 and are past torchao's
# small-matmul rule (K <= 4096 and N <= 1024 skipped), so train.float8 swaps 5 linears a block
# (runtime/float8.py; the cost model prices the same linears: cost/memory.float8_swaps, and their
# casts: cost/float8_time.py). planner.calibrate=false: planned from the datasheet figures, no 30 s
# calibration per run. Needs no network, no wandb (logger.mode=disabled).
set -u
OUT=${1:-/tmp/gpu_torch_native}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

if [ "${SMOKE:-0}" = "1" ]; then
  MODEL=(arch=llama-tiny arch.num_hidden_layers=2 data.seq_len=64 train.global_batch_size=4 train.steps=4)
else
  MODEL=(arch=llama-tiny arch.hidden_size=2048 arch.intermediate_size=5632 arch.num_hidden_layers=4
         arch.num_attention_heads=16 arch.num_key_value_heads=16 arch.max_position_embeddings=1024
         data.seq_len=1024 train.global_batch_size=8 train.steps=12 train.dtype=bfloat16)
fi
COMMON=("${MODEL[@]}" train.measure_memory=true train.checkpoint_interval=0 logger.mode=disabled
        planner.calibrate=false)

summarise() {   # the prediction beside the measurement, from the run's plan_info.json
  python - "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
name, run = sys.argv[1], Path(sys.argv[2])
info_path = run / "plan_info.json"
if not info_path.exists():
    print(f"{name:>15}: no plan_info.json (see {run}.log)")
    sys.exit(0)
info = json.loads(info_path.read_text())
pred, meas, memory = info.get("predicted") or {}, info.get("measured") or {}, info.get("memory") or {}
row = (memory.get("per_rank") or [{}])[0]
opts = row.get("options") or {}


def size(x):
    if not isinstance(x, (int, float)):
        return "n/a"
    return f"{x / 2 ** 30:.2f} GiB" if x >= 2 ** 30 else f"{x / 2 ** 20:.1f} MiB"


def ms(x):
    return f"{x * 1e3:.1f} ms" if isinstance(x, (int, float)) else "n/a"


print(f"{name:>15}: step measured {ms(meas.get('step_time_s'))} predicted {ms(pred.get('step_time_s'))}"
      f" | peak measured {size(row.get('measured_bytes'))} predicted {size(row.get('predicted_bytes'))}"
      f" ({memory.get('measured_kind', '')}) | compile={opts.get('compile')} float8={opts.get('float8')}")
split = {k: v for k, v in (row.get("measured_split") or {}).items() if v}
if split:   # the live-tensor tracker's split at its own peak (eager runs): what the allocator's peak adds beyond
    print(f"{'':>15}  tracker's split {', '.join(f'{k} {size(v)}' for k, v in split.items())}"
          f" = {size(sum(split.values()))}; predicted split "
          + ", ".join(f"{k} {size(v)}" for k, v in (row.get("predicted_split") or {}).items()
                      if v and k not in ("total", "tensors")))
EOF
}

for name in bf16 float8 compile float8+compile; do
  extra=()
  case $name in
    float8) extra=(train.float8=true) ;;
    compile) extra=(train.compile=true) ;;
    float8+compile) extra=(train.float8=true train.compile=true) ;;
  esac
  start=$(date +%s)
  timeout 80 python pretrain.py "${COMMON[@]}" "${extra[@]}" run_dir="$OUT/$name" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - start )) s (log: $OUT/$name.log)"
  grep -E "hrlplan: error|peak memory|step time:|plan:" "$OUT/$name.log" | sed 's/^/   /'
  summarise "$name" "$OUT/$name"
done
