"""Random planning instances for training and evaluating the generalist policy.

An instance is (model meta, cluster, train settings). Models are GPT-2-like (4h MLP, tied
embeddings) or Llama-like (gated MLP, untied head) transformers of random depth, width, sequence
length and vocabulary; their meta is computed analytically with the same formulas as
hrlplan.model_meta's introspection (no model is built). Clusters are 1 to 3 random GPU types --
made-up names, random peak FLOP/s, memory and link bandwidths -- in whole nodes of 4 or 8.

The benchmark's instances (shipped arch shapes on conf/cluster presets) are never generated:
`is_benchmark_like` rejects any instance whose model shape or whose device types match one of
them, so zero-shot results on generated instances are on unseen instances.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np

from hrlplan import schedules
from hrlplan.cluster import spec_from_preset
from hrlplan.model_meta import ModelMeta

# Shapes of the shipped archs (hidden, layers) and the preset device names: generated instances avoid them.
BENCH_SHAPES = {(768, 12), (1024, 24), (1600, 48), (4096, 32), (8192, 80), (128, 2), (256, 4)}
BENCH_DEVICE_WORDS = ("A100", "V100", "H100", "H800", "H20")
# Every registry schedule at the stages per rank a search gives it (looped multi-stage ones 2), the
# default twice (it is what most runs use).
SCHEDULES = ((schedules.DEFAULT, 1),) + tuple((name, spec.stages_per_rank_for(2 if spec.multi_stage else 1))
                                              for name, spec in schedules.SCHEDULES.items())


@dataclass
class Instance:
    meta: ModelMeta
    cluster: Any
    train: Dict[str, Any]
    label: str


def transformer_meta(name: str, n_layer: int, hidden: int, heads: int, seq: int, vocab: int, gated: bool,
                     intermediate: int | None = None) -> ModelMeta:
    """Analytic meta of a decoder-only transformer (GPT-2 style when not gated, Llama style when gated)."""
    inter = intermediate or (int(8 * hidden / 3 / 256 + 1) * 256 if gated else 4 * hidden)
    if gated:  # q,k,v,o + gate, up, down; two RMSNorms without bias
        matmul = 4 * hidden * hidden + 3 * hidden * inter
        block = matmul + 2 * hidden
        embedding = vocab * hidden
        head = hidden + vocab * hidden          # final norm + untied lm_head
        tied = False
    else:  # c_attn, c_proj, c_fc, c_proj with biases, two LayerNorms
        matmul = 4 * hidden * hidden + 2 * hidden * inter
        block = matmul + 4 * hidden + hidden + inter + hidden + 4 * hidden
        embedding = vocab * hidden + seq * hidden
        head = 2 * hidden                      # final LayerNorm; lm_head tied to the embedding
        tied = True
    flops = 2.0 * matmul + 4.0 * seq * hidden
    act = float(11 * hidden + 5 * heads * seq + 4 * hidden + 3 * hidden + (6 if gated else 4) * inter)
    total = n_layer * block + embedding + head
    return ModelMeta(
        name=name, family="hf", model_type="llama" if gated else "gpt2", n_layer=n_layer, hidden_size=hidden,
        num_heads=heads, seq_len=seq, vocab_size=vocab, total_params=total, embedding_params=embedding,
        head_params=head, block_params=[block] * n_layer, block_matmul_params=[matmul] * n_layer,
        head_matmul_params=vocab * hidden, block_flops_fwd_per_token=[flops] * n_layer,
        head_flops_fwd_per_token=2.0 * vocab * hidden, block_activation_bytes_per_token=[act] * n_layer,
        head_activation_bytes_per_token=float(2 * hidden + 4 * vocab), tied_embeddings=tied,
        first_stage_modules=["embed"], last_stage_modules=["norm", "lm_head"],
        block_modules=[f"layers.{i}" for i in range(n_layer)])


def random_meta(rng: np.random.Generator, index: int) -> ModelMeta:
    while True:
        heads = int(rng.choice([8, 12, 16, 20, 24, 32, 40, 48, 64]))
        head_dim = int(rng.choice([64, 80, 96, 128]))
        hidden = heads * head_dim
        n_layer = int(rng.integers(8, 65))
        if (hidden, n_layer) not in BENCH_SHAPES:
            break
    gated = bool(rng.random() < 0.5)
    seq = int(rng.choice([512, 1024, 2048, 4096]))
    vocab = int(rng.choice([32000, 32768, 50257, 65536, 100352]))
    return transformer_meta(f"gen{index}-{'llama' if gated else 'gpt'}-{n_layer}x{hidden}", n_layer, hidden, heads,
                            seq, vocab, gated)


def random_cluster(rng: np.random.Generator, index: int, max_gpus: int = 128, types: int | None = None):
    n_types = types or int(rng.choice([1, 2, 2, 3]))
    per_node = int(rng.choice([4, 8, 8]))
    max_nodes = max(max_gpus // per_node, n_types)
    groups = []
    budget = int(rng.integers(n_types, max_nodes + 1))
    for t in range(n_types):
        left = budget - sum(g["count"] for g in groups) - (n_types - t - 1)
        count = left if t == n_types - 1 else int(rng.integers(1, max(2, left // 2 + 1)))
        tflops = float(np.exp(rng.uniform(np.log(60), np.log(1200))))
        groups.append(dict(count=max(count, 1), device=f"gpu{index}-{t}", devices_per_node=per_node,
                           memory_gb=float(rng.choice([16, 24, 32, 40, 48, 64, 80, 96, 141])),
                           tflops=round(tflops, 1), intra_node_GBps=float(rng.choice([64, 150, 300, 450, 900]))))
    cfg = dict(name=f"gen{index}", node_groups=groups, inter_node_GBps=float(rng.choice([6.25, 12.5, 25, 50, 100])),
               intra_node_latency_us=2.0, inter_node_latency_us=float(rng.choice([3.0, 5.0, 10.0])))
    return spec_from_preset(cfg), cfg


def random_train(rng: np.random.Generator, world: int) -> Dict[str, Any]:
    schedule, v = SCHEDULES[int(rng.integers(len(SCHEDULES)))]
    gbs = int(rng.choice([32, 64, 96, 128, 192, 256, 384, 512]))
    return dict(global_batch_size=gbs, schedule=schedule, stages_per_rank=v, microbatches="auto",
                dtype="bfloat16", dp_mode="fsdp")


def is_benchmark_like(meta: ModelMeta, cluster) -> bool:
    if (meta.hidden_size, meta.n_layer) in BENCH_SHAPES:
        return True
    return any(w in d.name for d in cluster.devices for w in BENCH_DEVICE_WORDS)


def random_instance(seed: int, max_gpus: int = 128, types: int | None = None) -> Instance:
    rng = np.random.default_rng(seed)
    meta = random_meta(rng, seed)
    cluster, _ = random_cluster(rng, seed, max_gpus, types)
    train = random_train(rng, cluster.world_size)
    assert not is_benchmark_like(meta, cluster)
    label = (f"{meta.name} on {cluster.world_size}x[{','.join(sorted(cluster.device_types()))}] "
             f"gbs={train['global_batch_size']} {train['schedule']}")
    return Instance(meta, cluster, train, label)


def instances(seeds: List[int], **kw) -> List[Instance]:
    return [random_instance(s, **kw) for s in seeds]


# Disjoint seed ranges: training draws from TRAIN_SEEDS, held-out evaluation (tests, bench) from HELD_OUT_SEEDS.
TRAIN_SEEDS = range(1_000, 100_000)
HELD_OUT_SEEDS = range(900_000, 900_100)


def split_of(seed: int) -> str:
    return "train" if seed in TRAIN_SEEDS else ("held-out" if seed in HELD_OUT_SEEDS else "other")

