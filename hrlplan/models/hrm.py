"""Hierarchical Reasoning Model with adaptive computation time (HRM ACT v1), arch=hrm.

A slow high-level module (H) and a fast low-level module (L) refine two recurrent states: per
ACT step, L runs L_cycles times per H update and H runs H_cycles times. Only the last L and the
last H pass carry gradients (HRM's one-step gradient), so memory does not grow with the cycles.
A Q-head on the first position decides to halt or continue; halted sequences are replaced by new
puzzles from the next batch while the others keep their carry, as in HRM's training loop.

Module and buffer names follow HRM (model.inner.H_level.layers.0.self_attn.qkv_proj.weight,
model.inner.puzzle_emb.weights, ...), so HRM state dicts load here. The memory guide at the end
(recommend_hrm_size / check_hrm_fits) implements the HRM guide's table.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hrlplan.config import HRMArchConfig
from hrlplan.devices import compile_disabled
from hrlplan.model_record import ModelMeta
from hrlplan.models import hrm_layers, sparse_embedding
from hrlplan.models.hrm_layers import (CastedEmbedding, CastedLinear, ReasoningModule, RotaryEmbedding,
                                       swiglu_intermediate_size, trunc_normal_init_)
from hrlplan.models.sparse_embedding import CastedSparseEmbedding

IGNORE_LABEL_ID = -100
SUDOKU_SEQ_LEN, SUDOKU_VOCAB = 81, 11


@dataclass
class HRMConfig(HRMArchConfig):
    """The arch keys (HRMArchConfig, what users override as arch.*) plus the data's dimensions."""
    seq_len: int = SUDOKU_SEQ_LEN
    vocab_size: int = SUDOKU_VOCAB
    num_puzzle_identifiers: int = 1

    @classmethod
    def from_arch(cls, arch: Dict[str, Any], **data_dims: Any) -> "HRMConfig":
        """cfg.arch (unknown keys such as name/family ignored) plus the data's seq_len/vocab/ids."""
        arch = dict(arch)
        # HRM nests the loss under arch.loss (arch.loss.loss_type=softmax_cross_entropy); it wins.
        loss = arch.get("loss")
        if isinstance(loss, dict) and loss.get("loss_type"):
            arch["loss_type"] = loss["loss_type"]
        arch["forward_dtype"] = resolve_forward_dtype(arch.get("forward_dtype"))
        types = {f.name: type(f.default) for f in fields(cls)}
        values = {k: _resolve(arch, v) for k, v in arch.items() if k in types and v is not None}
        values.update({k: v for k, v in data_dims.items() if v is not None})
        # YAML read without Hydra may give "4" or 4 for a float field: cast to the schema's type.
        return cls(**{k: types[k](v) if types[k] in (int, float) else v for k, v in values.items()})

    @property
    def puzzle_emb_len(self) -> int:
        return -(self.puzzle_emb_ndim // -self.hidden_size) if self.puzzle_emb_ndim > 0 else 0

    @property
    def positions(self) -> int:
        return self.seq_len + self.puzzle_emb_len


def resolve_forward_dtype(setting: Optional[str], device_type: Optional[str] = None) -> str:
    """arch.forward_dtype: auto = HRM's bfloat16 on a GPU, float32 on the CPU (where bfloat16
    matmuls are slow); an explicit dtype name is kept."""
    setting = str(setting or "auto")
    if setting != "auto":
        if not isinstance(getattr(torch, setting, None), torch.dtype):
            raise ValueError(f"arch.forward_dtype={setting!r}: use auto, bfloat16, float16 or float32")
        return setting
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if device_type == "cuda" else "float32"


def _resolve(arch: Dict[str, Any], value: Any) -> Any:
    """Follow a `${.hidden_size}`-style reference (conf/arch/hrm.yaml read without Hydra)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{\.?(\w+)\}", value.strip())
        if m and m.group(1) in arch:
            return _resolve(arch, arch[m.group(1)])
    return value


@dataclass
class InnerCarry:
    z_H: torch.Tensor
    z_L: torch.Tensor


@dataclass
class ACTCarry:
    inner_carry: InnerCarry
    steps: torch.Tensor        # ACT steps taken by each sequence so far
    halted: torch.Tensor       # sequences to replace with new data at the next call
    current_data: Dict[str, torch.Tensor]


class HRMInner(nn.Module):
    def __init__(self, config: HRMConfig):
        super().__init__()
        self.config = config
        self.forward_dtype = getattr(torch, config.forward_dtype)
        hidden = config.hidden_size
        self.embed_scale = math.sqrt(hidden)
        init_std = 1.0 / self.embed_scale
        self.embed_tokens = CastedEmbedding(config.vocab_size, hidden, init_std, self.forward_dtype)
        self.lm_head = CastedLinear(hidden, config.vocab_size, bias=False)
        self.q_head = CastedLinear(hidden, 2, bias=True)
        self.puzzle_emb_len = config.puzzle_emb_len
        if config.puzzle_emb_ndim > 0:
            # Zero init: a fresh puzzle starts with no identity signal.
            self.puzzle_emb = CastedSparseEmbedding(config.num_puzzle_identifiers, config.puzzle_emb_ndim,
                                                    init_std=0.0, cast_to=self.forward_dtype)
        if config.pos_encodings == "rope":
            self.rotary_emb = RotaryEmbedding(hidden // config.num_heads, config.positions, config.rope_theta)
        elif config.pos_encodings == "learned":
            self.embed_pos = CastedEmbedding(config.positions, hidden, init_std, self.forward_dtype)
        else:
            raise ValueError(f"arch.pos_encodings={config.pos_encodings!r}: expected rope or learned")
        level = dict(hidden_size=hidden, num_heads=config.num_heads, expansion=config.expansion, eps=config.rms_norm_eps)
        self.H_level = ReasoningModule(config.H_layers, **level)
        self.L_level = ReasoningModule(config.L_layers, **level)
        self.register_buffer("H_init", trunc_normal_init_(torch.empty(hidden, dtype=self.forward_dtype), std=1.0))
        self.register_buffer("L_init", trunc_normal_init_(torch.empty(hidden, dtype=self.forward_dtype), std=1.0))
        if self.q_head.weight.device.type != "meta":
            with torch.no_grad():
                # Q starts near "continue" (sigmoid(-5) ~ 0.007) so early training is not cut short.
                self.q_head.weight.zero_()
                self.q_head.bias.fill_(-5.0)

    def input_embeddings(self, inputs: torch.Tensor, puzzle_identifiers: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens(inputs.long())
        if self.config.puzzle_emb_ndim > 0:
            puzzle = self.puzzle_emb(puzzle_identifiers)
            pad = self.puzzle_emb_len * self.config.hidden_size - puzzle.shape[-1]
            if pad > 0:
                puzzle = F.pad(puzzle, (0, pad))
            embedding = torch.cat((puzzle.view(-1, self.puzzle_emb_len, self.config.hidden_size), embedding), dim=-2)
        if self.config.pos_encodings == "learned":
            # 1/sqrt(2) keeps the sum of two unit-variance embeddings at unit variance.
            embedding = 0.707106781 * (embedding + self.embed_pos.embedding_weight.to(self.forward_dtype))
        return self.embed_scale * embedding

    def empty_carry(self, batch_size: int, device: torch.device) -> InnerCarry:
        shape = (batch_size, self.config.positions, self.config.hidden_size)
        return InnerCarry(torch.zeros(shape, dtype=self.forward_dtype, device=device),
                          torch.zeros(shape, dtype=self.forward_dtype, device=device))

    def reset_carry(self, reset: torch.Tensor, carry: InnerCarry) -> InnerCarry:
        flag = reset.view(-1, 1, 1)
        return InnerCarry(torch.where(flag, self.H_init, carry.z_H), torch.where(flag, self.L_init, carry.z_L))

    def forward(self, carry: InnerCarry, batch: Dict[str, torch.Tensor]):
        cos_sin = self.rotary_emb() if self.config.pos_encodings == "rope" else None
        injection = self.input_embeddings(batch["inputs"], batch["puzzle_identifiers"])
        H_cycles, L_cycles = self.config.H_cycles, self.config.L_cycles
        z_H, z_L = carry.z_H, carry.z_L
        with torch.no_grad():
            for h in range(H_cycles):
                for l in range(L_cycles):
                    if not (h == H_cycles - 1 and l == L_cycles - 1):
                        z_L = self.L_level(z_L, z_H + injection, cos_sin)
                if h != H_cycles - 1:
                    z_H = self.H_level(z_H, z_L, cos_sin)
        # One-step gradient: only the final L and H updates are differentiated.
        z_L = self.L_level(z_L, z_H + injection, cos_sin)
        z_H = self.H_level(z_H, z_L, cos_sin)
        logits = self.lm_head(z_H)[:, self.puzzle_emb_len:]
        q_logits = self.q_head(z_H[:, 0]).to(torch.float32)
        return InnerCarry(z_H.detach(), z_L.detach()), logits, (q_logits[..., 0], q_logits[..., 1])


class HRMACT(nn.Module):
    """ACT wrapper: per call, one reasoning segment for every sequence of the carry."""

    def __init__(self, config: HRMConfig):
        super().__init__()
        self.config = config
        self.inner = HRMInner(config)

    @property
    def puzzle_emb(self) -> Optional[CastedSparseEmbedding]:
        return getattr(self.inner, "puzzle_emb", None)

    def initial_carry(self, batch: Dict[str, torch.Tensor]) -> ACTCarry:
        size, device = batch["inputs"].shape[0], batch["inputs"].device
        return ACTCarry(self.inner.empty_carry(size, device),
                        steps=torch.zeros(size, dtype=torch.int32, device=device),
                        halted=torch.ones(size, dtype=torch.bool, device=device),   # all take new data first
                        current_data={k: torch.zeros_like(v) for k, v in batch.items()})

    def forward(self, carry: ACTCarry, batch: Dict[str, torch.Tensor]):
        inner_carry = self.inner.reset_carry(carry.halted, carry.inner_carry)
        steps = torch.where(carry.halted, 0, carry.steps)
        data = {k: torch.where(carry.halted.view((-1,) + (1,) * (batch[k].ndim - 1)), batch[k], v)
                for k, v in carry.current_data.items()}
        inner_carry, logits, (q_halt, q_continue) = self.inner(inner_carry, data)
        outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}
        with torch.no_grad():
            steps = steps + 1
            is_last = steps >= self.config.halt_max_steps
            halted = is_last
            # Evaluation always runs halt_max_steps, so every sequence in a batch halts together.
            if self.training and self.config.halt_max_steps > 1:
                halted = halted | (q_halt > q_continue)
                explore = torch.rand_like(q_halt) < self.config.halt_exploration_prob
                min_steps = explore * torch.randint_like(steps, low=2, high=self.config.halt_max_steps + 1)
                halted = halted & (steps >= min_steps)
                # Bootstrapped Q target from the next segment (no replay buffer: the batch is many
                # parallel environments, as in PQN).
                next_halt, next_continue = self.inner(inner_carry, data)[-1]
                outputs["target_q_continue"] = torch.sigmoid(
                    torch.where(is_last, next_halt, torch.maximum(next_halt, next_continue)))
        return ACTCarry(inner_carry, steps, halted, data), outputs


# ---------------------------------------------------------------- losses
def _stablemax_s(x: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    return torch.where(x < 0, 1 / (1 - x + eps), x + 1)


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_LABEL_ID) -> torch.Tensor:
    """Per-token loss with stablemax (s(x) = x+1 or 1/(1-x)) instead of exp: no overflow, which
    matters when logits keep growing over many recurrent steps. float64 except on MPS."""
    dtype = torch.float32 if logits.device.type == "mps" else torch.float64
    s = _stablemax_s(logits.to(dtype))
    logprobs = torch.log(s / s.sum(dim=-1, keepdim=True))
    valid = labels != ignore_index
    picked = torch.gather(logprobs, -1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_LABEL_ID) -> torch.Tensor:
    flat = F.cross_entropy(logits.to(torch.float32).reshape(-1, logits.shape[-1]), labels.long().reshape(-1),
                           ignore_index=ignore_index, reduction="none")
    return flat.view(labels.shape)


LOSSES = {"stablemax_cross_entropy": stablemax_cross_entropy, "softmax_cross_entropy": softmax_cross_entropy}


class ACTLossHead(nn.Module):
    """HRM's training objective: LM loss + 0.5 * (Q-halt BCE vs exact correctness + Q-continue
    BCE vs the bootstrapped target). Losses are sums over sequences; metrics count halted ones."""

    def __init__(self, model: HRMACT, loss_type: str = "stablemax_cross_entropy"):
        super().__init__()
        if loss_type not in LOSSES:
            raise ValueError(f"arch.loss.loss_type={loss_type!r}: expected one of {sorted(LOSSES)}")
        self.model = model
        self.loss_fn = LOSSES[loss_type]

    def initial_carry(self, batch: Dict[str, torch.Tensor]) -> ACTCarry:
        return self.model.initial_carry(batch)

    def forward(self, carry: ACTCarry, batch: Dict[str, torch.Tensor], return_keys: Sequence[str] = ()):
        carry, outputs = self.model(carry, batch)
        labels = carry.current_data["labels"]
        with torch.no_grad():
            mask = labels != IGNORE_LABEL_ID
            counts = mask.sum(-1)
            divisor = counts.clamp_min(1).unsqueeze(-1)
            correct = mask & (outputs["logits"].argmax(-1) == labels)
            seq_correct = correct.sum(-1) == counts
            valid = carry.halted & (counts > 0)
            metrics = {
                "count": valid.sum(),
                "accuracy": torch.where(valid, (correct.float() / divisor).sum(-1), 0).sum(),
                "exact_accuracy": (valid & seq_correct).sum(),
                "q_halt_accuracy": (valid & ((outputs["q_halt_logits"] >= 0) == seq_correct)).sum(),
                "steps": torch.where(valid, carry.steps, 0).sum(),
            }
        lm_loss = (self.loss_fn(outputs["logits"], labels) / divisor).sum()
        # A row without labels (batch padding) would teach the Q head that an empty puzzle is
        # solved; HRM never trains on one. Dropping it (not weighting by 0) keeps full batches' sums
        # bit-identical to HRM's.
        labelled = counts > 0
        q_halt_loss = torch.where(labelled, F.binary_cross_entropy_with_logits(
            outputs["q_halt_logits"], seq_correct.to(outputs["q_halt_logits"].dtype), reduction="none"), 0).sum()
        loss = lm_loss + 0.5 * q_halt_loss
        metrics.update(lm_loss=lm_loss.detach(), q_halt_loss=q_halt_loss.detach())
        if "target_q_continue" in outputs:
            q_continue_loss = torch.where(labelled, F.binary_cross_entropy_with_logits(
                outputs["q_continue_logits"], outputs["target_q_continue"], reduction="none"), 0).sum()
            loss = loss + 0.5 * q_continue_loss
            metrics["q_continue_loss"] = q_continue_loss.detach()
        metrics = {k: v.detach().to(torch.float32) for k, v in metrics.items()}
        detached = {k: outputs[k].detach() for k in return_keys if k in outputs}
        return carry, loss, metrics, detached, carry.halted.all()


def build_hrm(arch: Dict[str, Any], seq_len: int = SUDOKU_SEQ_LEN, vocab_size: int = SUDOKU_VOCAB,
              num_puzzle_identifiers: int = 1) -> ACTLossHead:
    """The trainable module (ACT loss head around the model), on torch's current default device."""
    config = HRMConfig.from_arch(arch, seq_len=seq_len, vocab_size=vocab_size, num_puzzle_identifiers=num_puzzle_identifiers)
    return ACTLossHead(HRMACT(config), loss_type=config.loss_type)


def compile_enabled(device: torch.device) -> bool:
    """HRM's rule: compile only on CUDA and only when DISABLE_COMPILE is not set (hrlplan.devices reads it)."""
    return device.type == "cuda" and not compile_disabled()


def maybe_compile(model: ACTLossHead, device: torch.device) -> bool:
    if not compile_enabled(device):
        return False
    # In-place Module.compile keeps state-dict keys free of an _orig_mod. prefix.
    model.model.inner.compile(dynamic=False)
    return True


def source_files() -> Tuple[str, ...]:
    """Model source copied next to each checkpoint (as HRM does with hrm_act_v1.py)."""
    return (__file__, hrm_layers.__file__, sparse_embedding.__file__)



# ---------------------------------------------------------------- introspection (for the planner)
def _dtype_bytes(name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, name), device="meta").element_size()


def introspect_hrm(arch: Dict[str, Any], seq_len: Optional[int] = None):
    """ModelMeta for an HRM arch, built on the meta device (no weights materialised).

    Tokens are the positions the blocks see (seq_len + puzzle_emb_len). Blocks are listed L then
    H (execution order in a cycle). block_repeats = H_cycles * L_cycles, the L-level runs per ACT
    step; H blocks run L_cycles times less often, so their per-token FLOPs are divided by
    L_cycles: block_repeats * sum(block FLOPs) is then exactly one ACT step's forward.
    Activation bytes are per block for the one pass whose activations backward keeps (one-step
    gradient), as measured with autograd's saved-tensor hooks (tests/test_memory_guide.py): SDPA's
    fused kernels (CPU and GPU) keep their output and a log-sum-exp per head, never the scores.
    extra['train_flops_per_token'] counts a training step exactly: two forwards (the ACT target-Q
    pass repeats the inner model) and a backward through one cycle only."""
    config = HRMConfig.from_arch(arch, seq_len=seq_len)
    with torch.device("meta"):
        model = build_hrm(arch, seq_len=config.seq_len, vocab_size=config.vocab_size,
                          num_puzzle_identifiers=config.num_puzzle_identifiers)
    inner = model.model.inner
    hidden, heads, vocab, S = config.hidden_size, config.num_heads, config.vocab_size, config.positions
    inter = swiglu_intermediate_size(hidden, config.expansion)
    act_bytes = _dtype_bytes(config.forward_dtype)

    blocks = [("model.inner.L_level.layers", i, b) for i, b in enumerate(inner.L_level.layers)]
    blocks += [("model.inner.H_level.layers", i, b) for i, b in enumerate(inner.H_level.layers)]
    runs = [config.H_cycles * config.L_cycles] * config.L_layers + [config.H_cycles] * config.H_layers
    repeats = max(1, config.H_cycles * config.L_cycles)
    matmul = [sum(m.weight.numel() for m in b.modules() if isinstance(m, CastedLinear)) for _, _, b in blocks]
    single_pass = [2.0 * mm + 4.0 * S * hidden for mm in matmul]      # weights + QK^T and AV
    # Per token per block kept for backward: the qkv projection's input and output, rotated q/k,
    # SDPA's output (+ a float32 log-sum-exp per head), o_proj's input, the two norms' inputs, the
    # MLP's input, gate/up, silu and product: 10h + 4I elements (measured, see the docstring).
    block_act = float((10 * hidden + 4 * inter) * act_bytes + 4 * heads)

    puzzle_table = inner.puzzle_emb.weights.numel() if config.puzzle_emb_ndim > 0 else 0
    embedding = sum(p.numel() for n, p in inner.named_parameters() if n.startswith(("embed_tokens", "embed_pos")))
    embedding += puzzle_table
    head = sum(p.numel() for p in inner.lm_head.parameters()) + sum(p.numel() for p in inner.q_head.parameters())
    head_matmul = inner.lm_head.weight.numel() + inner.q_head.weight.numel()
    head_flops = 2.0 * inner.lm_head.weight.numel() + 2.0 * inner.q_head.weight.numel() / S
    forward = sum(f * r for f, r in zip(single_pass, runs)) + head_flops
    one_cycle = sum(single_pass) + head_flops
    passes = 2 if config.halt_max_steps > 1 else 1
    return ModelMeta(
        name=str(arch.get("name", "hrm")), family="hrm", model_type=str(arch.get("model_type", "hrm_act_v1")),
        n_layer=len(blocks), hidden_size=hidden, num_heads=heads, seq_len=S, vocab_size=vocab,
        total_params=sum(p.numel() for p in model.parameters()) + puzzle_table,
        embedding_params=embedding, head_params=head,
        block_params=[sum(p.numel() for p in b.parameters()) for _, _, b in blocks],
        block_matmul_params=matmul, head_matmul_params=head_matmul,
        block_flops_fwd_per_token=[f * r / repeats for f, r in zip(single_pass, runs)],
        head_flops_fwd_per_token=head_flops,
        block_activation_bytes_per_token=[block_act] * len(blocks),
        # z_H, z_L carry and the input injection, lm_head input and logits, float64 stablemax terms
        head_activation_bytes_per_token=float((4 * hidden + vocab) * act_bytes + 3 * vocab * 8),
        tied_embeddings=False,
        first_stage_modules=["model.inner.embed_tokens"] + (["model.inner.puzzle_emb"] if puzzle_table else []),
        last_stage_modules=["model.inner.lm_head", "model.inner.q_head"],
        block_modules=[f"{prefix}.{i}" for prefix, i, _ in blocks],
        block_repeats=repeats,
        extra={"H_cycles": config.H_cycles, "L_cycles": config.L_cycles, "block_runs_per_forward": runs,
               "data_seq_len": config.seq_len, "puzzle_emb_len": config.puzzle_emb_len,
               "puzzle_emb_params": puzzle_table, "one_step_gradient": True,
               "forward_passes_per_train_step": passes, "halt_max_steps": config.halt_max_steps,
               "train_flops_per_token": passes * forward + 2.0 * one_cycle,
               "forward_dtype": config.forward_dtype},
    )


# ---------------------------------------------------------------- memory guide (HRM guide's table)
GiB = 1024 ** 3
CUDA_CONTEXT_BYTES = 600 * 1024 ** 2     # CUDA context + cuBLAS workspace, before any tensor
ALLOCATOR_SLACK = 1.2                    # caching-allocator fragmentation
MEMORY_TIERS = (  # (below this many GiB, settings) -- the guide's "Memory Guidelines" table
    (2, dict(hidden_size=16, global_batch_size=2, H_layers=1, L_layers=1, num_heads=1, expansion=2)),
    (5, dict(hidden_size=32, global_batch_size=4, H_layers=1, L_layers=1, num_heads=1, expansion=2)),
    (10, dict(hidden_size=64, global_batch_size=8, H_layers=2, L_layers=2, num_heads=2, expansion=2)),
)
FULL_SIZE_BATCHES = (768, 512, 384, 256, 128, 64, 32, 16, 8)   # 768: HRM's cfg_pretrain default


def estimate_hrm_memory(arch: Dict[str, Any], global_batch_size: int, world_size: int = 1,
                        seq_len: Optional[int] = None, dp_mode: str = "fsdp", cuda: bool = True) -> Dict[str, float]:
    """Peak bytes per device while training, by kind, and `tensors` (what torch allocates: compare it
    with torch.cuda.max_memory_allocated, or runtime.memory's live tensors on the CPU).

    The peak is the larger of the forward's end -- weights, AdamATan2's two fp32 moments, the gradient
    cycle's kept activations and the no-grad target-Q forward's working set (one block's worth);
    zero_grad(set_to_none) freed the gradients -- and the optimizer step (weights, moments,
    gradients). FSDP (one unit for the whole model) shards weights, gradients and moments over the
    ranks and keeps one unsharded copy of the weights through forward and backward; the puzzle
    table is a buffer, whole on every rank, without gradients or moments. `total` adds the
    allocator's slack (ALLOCATOR_SLACK) and, on CUDA, the context (CUDA_CONTEXT_BYTES)."""
    meta = introspect_hrm(arch, seq_len)
    puzzle = meta.extra["puzzle_emb_params"]
    dense = meta.total_params - puzzle
    shards = max(1, world_size) if dp_mode == "fsdp" else 1
    unsharded = 4.0 * dense if shards > 1 else 0.0
    weights = 4.0 * puzzle + 4.0 * dense / shards + unsharded
    moments = 8.0 * dense / shards
    grads = 4.0 * dense / shards + unsharded
    tokens = -(-int(global_batch_size) // max(1, world_size)) * meta.seq_len
    kept = tokens * (sum(meta.block_activation_bytes_per_token) + meta.head_activation_bytes_per_token)
    transient = tokens * max(meta.block_activation_bytes_per_token)
    tensors = weights + moments + max(kept + transient, grads)
    context = float(CUDA_CONTEXT_BYTES) if cuda else 0.0
    return {"weights": weights, "gradients": grads, "optimizer": moments, "activations": kept + transient,
            "states": weights + moments + grads, "tensors": tensors, "context": context,
            "total": ALLOCATOR_SLACK * tensors + context}


def recommend_hrm_size(device_memory_bytes: float) -> Dict[str, Any]:
    """The guide's recommended arch.* keys and global_batch_size for a device's memory.

    Above 10 GiB: HRM's default architecture, with HRM's global batch of 768 when the estimate
    says it fits, else the largest batch from FULL_SIZE_BATCHES that does."""
    gib = device_memory_bytes / GiB
    for limit, settings in MEMORY_TIERS:
        if gib < limit:
            lower = {2: 0, 5: 2, 10: 5}[limit]
            out = dict(settings, puzzle_emb_ndim=settings["hidden_size"], tier=f"{lower}-{limit}GB" if lower else "< 2GB")
            return out
    defaults = HRMArchConfig()
    arch = dict(hidden_size=defaults.hidden_size, H_layers=defaults.H_layers, L_layers=defaults.L_layers,
                num_heads=defaults.num_heads, expansion=defaults.expansion, puzzle_emb_ndim=defaults.hidden_size)
    batch = next((b for b in FULL_SIZE_BATCHES if estimate_hrm_memory(arch, b)["total"] <= device_memory_bytes),
                 FULL_SIZE_BATCHES[-1])
    return dict(arch, global_batch_size=batch, tier="> 10GB")


def check_hrm_fits(arch: Dict[str, Any], global_batch_size: int, device_memory_bytes: float,
                   world_size: int = 1, seq_len: Optional[int] = None) -> Optional[str]:
    """A warning (printed before launch) when the size likely runs out of memory; None if it fits."""
    est = estimate_hrm_memory(arch, global_batch_size, world_size, seq_len)
    if est["total"] <= device_memory_bytes:
        return None
    rec = recommend_hrm_size(device_memory_bytes)
    config = HRMConfig.from_arch(arch)
    keys = " ".join(f"arch.{k}={rec[k]}" for k in ("hidden_size", "H_layers", "L_layers", "num_heads", "expansion"))
    return (f"HRM hidden_size={config.hidden_size} H_layers={config.H_layers} L_layers={config.L_layers} with "
            f"global_batch_size={global_batch_size} over {world_size} device(s) needs about {est['total'] / GiB:.1f} GiB "
            f"per device (weights+optimizer {est['states'] / GiB:.2f} GiB, activations {est['activations'] / GiB:.2f} GiB) "
            f"but has {device_memory_bytes / GiB:.1f} GiB: expect CUDA out of memory. The memory guide suggests "
            f"{keys} global_batch_size={rec['global_batch_size']} for this device ({rec['tier']}).")
