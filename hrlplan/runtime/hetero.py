"""Heterogeneous pipelines: replicas with different stage templates, micro-batch counts, batch
shares and per-stage tensor-parallel degrees, on plain torch.distributed point-to-point calls.

Why not torch.distributed.pipelining here: its PipelineStage ties a stage to one rank of one p2p
group, so (a) a stage of tp 2 feeding a stage of tp 1 cannot be expressed (the tp-1 rank would have
to sit in two groups and run twice), and (b) its DDP/FSDP integrations assume identical replicas.
This executor is the smallest piece that covers both: GPipe or 1F1B order per pipeline, a fixed
activation shape, and each step's receives posted together with the previous step's sends in one
dist.batch_isend_irecv (as torch's schedules do; see p2p_program). Separate isend and recv calls
form a cycle under 1F1B (stage 0 sends act1 before receiving grad0, stage 1 sends grad0 before
receiving act1): NCCL runs a pair's p2p in order on one stream, so above its buffer size both wait
forever.

Resharding at a stage boundary: every rank of a tensor-parallel stage holds the full activation
(tensor_parallel.py keeps block inputs/outputs replicated), so rank j of the receiving stage takes
it from rank j mod tp_sender of the sending stage, and gradients go back the same way. A replica
whose stages all run sequence parallelism at one tp (plan/checks.py) passes the sequence shard
(b, s/tp, h) instead, rank j to rank j of the next stage -- the same mapping, since the tps are
equal -- as the torch pipelining engine does. Its norms' weights are Replicate DTensors whose
gradients SequenceParallel leaves Partial (a sum over the rank's positions); they are all-reduced over
the tp ranks at the step's last accumulation (tensor_parallel.replicate_partial_grads), so the reduce
across replicas treats them as any replicated parameter, and replicas with and without it, at any
tp, synchronise as before.

Gradients: replicas differ, so there is no DDP/FSDP. Each parameter unit (embedding, block i,
final norm + head) is all-reduced over the ranks holding it, every contribution weighted by its
pipeline's share of the global batch, so the update equals one process on the global batch:
bucketed, in the training dtype where safe, and started during the last micro-batch's backward
(hetero_sync.py says exactly how). GPT-2 replicas may hold a block at different tp degrees.
The optimizer: sharded over each bucket's ranks (hetero_zero.py: each steps its slice, then the
slices are all-gathered) where the plan says so (plan.meta replica_optimizer: sharded; cost/
replica_sync.replica_optimizer) and the trainer asks the engine for it (make_optimizer); else each
rank steps its whole stage.

Packed documents (data.packing=document|balanced): a replica's rows hold its share of the step's
documents (data/packed_stream.py lays them out over the replicas), every rank of the pipeline reads
the positions and document ids of its micro-batch from its own rows, and the stages send only the
activations. A replica may take its own sequence length (its plan's seq_len, up to data.seq_len):
its rows are filled only that far and cut to it here, so its activations are that long. The packed loss is weighted by the step's useful tokens over all replicas and its rows,
so the batch-share weights above make the update the step's mean loss per token (token-weighted
across replicas, models/documents.packed_micro_batch_loss).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.device_mesh import DeviceMesh

from hrlplan import schedules
from hrlplan.config import TrainConfig, section
from hrlplan.families import GENERIC_HF, family_for
from hrlplan.models.documents import is_packed_inputs, split_packed_inputs, trim_packed
from hrlplan.models.hf import build_stage_modules, hf_layout, materialize
from hrlplan.plan import Plan
from hrlplan import devices
from hrlplan.cost.replica_sync import SHARDED, replica_optimizer, unit_holders, unit_order
from hrlplan.runtime.hetero_sync import GradientReducer, gpt2_layout, reduce_dtype
from hrlplan.runtime.hetero_zero import ShardedReplicaOptimizer
from hrlplan.runtime.recompute import apply_recompute
from hrlplan.runtime.tensor_parallel import loss_context, parallelize_stage, replicate_partial_grads, stage_loss
from hrlplan.runtime.timing import StepRecorder
from hrlplan.schedules import Order

Holder = Tuple[int, int]   # (pipeline, stage)


def schedule_ops(schedule: str, n_stages: int, stage: int, m: int) -> List[Tuple[str, int]]:
    """A stage's order of forwards and backwards: the registry's fill-drain order (GPipe: all F, then
    all B) or 1F1B (the heterogeneous schedules; plan checks refuse the others)."""
    if schedules.get(schedule).order is Order.FILL_DRAIN:
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(n_stages - stage - 1, m)
    ops = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", j) for j in range(m - warm, m)]



def per_degree_layout(full_model) -> bool:
    """The family stores a block under tp in a layout of that degree (GPT-2's fused c_attn)."""
    return family_for(GENERIC_HF.arch_family, full_model.config.model_type).tp_layout_per_degree

class P2P(NamedTuple):
    """One point-to-point message: send or recv, the peer rank, "act" or "grad", the micro-batch."""
    op: str
    peer: int
    what: str
    microbatch: int


class Step(NamedTuple):
    """Post `batch` together (one batch_isend_irecv), wait for it, then compute `kind` of `microbatch`
    (kind None: the trailing batch of the last sends)."""
    batch: Tuple[P2P, ...]
    kind: Optional[str]
    microbatch: int


def p2p_program(ops: Sequence[Tuple[str, int]], recv_fwd_from: Optional[int], send_fwd_to: Sequence[int],
                recv_bwd_from: Optional[int], send_bwd_to: Sequence[int]) -> List[Step]:
    """A stage's steps: each op's receives batched with the sends the op before it produced, so a
    neighbour's send and receive are posted together and no pair waits on a send ordered behind
    its own receive. Pure, so tests replay every rank's program under rendezvous semantics."""
    steps: List[Step] = []
    pending: List[P2P] = []
    for kind, j in ops:
        if kind == "F":
            recvs = [P2P("recv", recv_fwd_from, "act", j)] if recv_fwd_from is not None else []
            sends = [P2P("send", r, "act", j) for r in send_fwd_to]
        else:
            recvs = [P2P("recv", recv_bwd_from, "grad", j)] if recv_bwd_from is not None else []
            sends = [P2P("send", r, "grad", j) for r in send_bwd_to]
        steps.append(Step(tuple(pending + recvs), kind, j))
        pending = sends
    if pending:
        steps.append(Step(tuple(pending), None, -1))
    return steps


def stage_links(stages: Sequence, s: int, t: int) -> Tuple[Optional[int], List[int], Optional[int], List[int]]:
    """Tensor-parallel rank t of stage s: (recv_fwd_from, send_fwd_to, recv_bwd_from, send_bwd_to).
    Receiving rank j takes from rank j mod tp_sender (see the module docstring)."""
    prev = stages[s - 1] if s > 0 else None
    nxt = stages[s + 1] if s < len(stages) - 1 else None
    tp = stages[s].tp
    return (prev.ranks[t % prev.tp] if prev else None,
            [r for j, r in enumerate(nxt.ranks) if j % tp == t] if nxt else [],
            nxt.ranks[t % nxt.tp] if nxt else None,
            [r for i, r in enumerate(prev.ranks) if i % tp == t] if prev else [])


def embedding_units(full_model) -> Tuple[List[str], Optional[str]]:
    """The embedding parameters' full names (each its own unit: only the tied one has a second
    holder) and the name of the one the output head shares, if any."""
    layout = hf_layout(full_model)
    names, tied = [], None
    head = full_model.get_output_embeddings()
    for child in layout.embed_names:
        for pname, param in getattr(layout.base, child).named_parameters():
            name = f"{layout.prefix}.{child}.{pname}"
            names.append(name)
            if head is not None and param is head.weight:
                tied = name
    return names, tied


class HeteroPipelineEngine:
    """This rank's stage of its pipeline (none on an unused rank) and one training step."""

    def __init__(self, plan: Plan, train: TrainConfig, device: torch.device, full_model, recorder: StepRecorder):
        train = section(TrainConfig, train)
        self.plan, self.device, self.recorder = plan, device, recorder
        self.rank = dist.get_rank()
        self.pipes = plan.as_pipelines()
        self.me: Optional[Holder] = None
        self.tp_index = 0
        offsets, gid = [], 0
        for p, pipe in enumerate(self.pipes):
            offsets.append(gid)
            gid += len(pipe.stages)
            for s, st in enumerate(pipe.stages):
                if self.rank in st.ranks:
                    self.me, self.tp_index = (p, s), st.ranks.index(self.rank)
        embed_units, self.tied_unit = embedding_units(full_model)
        holders = unit_holders(self.pipes, plan.n_layer, embed_units, self.tied_unit)
        # tensor_parallel.py stores GPT-2 under tp in a tp-specific layout, and one holder writes each
        # parameter to a checkpoint: replicas at other tp degrees could not load it back
        self.resume_refusal = ""
        if per_degree_layout(full_model) and any(
                len({self.pipes[p].stages[s].tp for p, s in hs}) > 1 for u, hs in holders.items() if u.startswith("block")):
            self.resume_refusal = ("this plan's GPT-2 replicas hold a block at different tp degrees, whose "
                                   "checkpoints do not load back yet")
        tp_mesh = self._tp_meshes()
        self.sharded = replica_optimizer(plan) == SHARDED
        self.sharded_optimizer: Optional[ShardedReplicaOptimizer] = None
        self.reducer = GradientReducer(plan, self.pipes, holders, self.rank, unit_order(plan.n_layer, embed_units),
                                       reduce_dtype(train.dtype), sharded=self.sharded)
        self.reducer.sharded = False   # on once make_optimizer() hands out the sharded optimizer
        self.parts: Dict[int, nn.Module] = {}
        self.not_written: set = set()   # parameter names another holder writes to a checkpoint
        self.hidden = int(full_model.config.hidden_size)
        self.seq = None
        self.sequence_shards = 1
        if self.me is None:
            return
        p, s = self.me
        self.pipe = self.pipes[p]
        self.stage = self.pipe.stages[s]
        self.gid = offsets[p] + s
        part = build_stage_modules(full_model, [tuple(x.layers) for x in self.pipe.stages])[s]
        materialize(full_model, part.modules(), int(train.seed))
        part = part.to(device)
        if train.dtype == "bfloat16":   # weights, gradients (reduced in fp32) and messages stay fp32
            part.autocast_dtype = torch.bfloat16
        # sequence parallelism: the whole replica or none of it, at one tp (plan/checks.py)
        self.sequence_shards = self.stage.tp if self.stage.sequence_parallel and self.stage.tp > 1 else 1
        if self.stage.tp > 1:
            parallelize_stage(part, tp_mesh, vocab_parallel=bool(train.vocab_parallel),
                              sequence_parallel=self.sequence_shards > 1)
            if self.sequence_shards > 1:   # the norms' Partial gradients summed before the reducer reads them
                replicate_partial_grads(part, self.pipe.num_microbatches)
        apply_recompute(part, self.stage.recompute)   # after tp, as the torch engine does
        self.parts[self.gid] = part
        self.loss_fn = stage_loss([part])
        self.first, self.last = s == 0, s == len(self.pipe.stages) - 1
        self.units = _param_units(part, embed_units, self.tied_unit)
        self.not_written = {n for name, (unit, canonical) in self.units.items() if self.reducer.canonical(unit) != self.me
                            for n in (name.replace(_CHECKPOINT_PREFIX, ""), canonical)}
        (self.recv_fwd_from, self.send_fwd_to, self.recv_bwd_from,
         self.send_bwd_to) = stage_links(self.pipe.stages, s, self.tp_index)
        self.loss_reporter = self.last and self.tp_index == 0
        gpt2 = per_degree_layout(full_model)
        self.reducer.attach(self._unit_params(), self.me, self.tp_index, self.stage.tp, self.pipe.num_microbatches,
                            lambda name: gpt2_layout(name, self.stage.tp, self.hidden) if gpt2 else None)

    def make_optimizer(self, train) -> Optional[torch.optim.Optimizer]:
        """This rank's optimizer where the plan shards it across replicas (hetero_zero.py), else None
        (the trainer's own AdamW steps the whole stage). Every rank of the job calls it or none does:
        it switches the reduce to the sharded one."""
        if not self.sharded or self.me is None:
            return None
        t = section(TrainConfig, train)
        self.reducer.sharded = True
        params = [p for _, _, p in self._unit_params() if p.requires_grad]
        self.sharded_optimizer = ShardedReplicaOptimizer(
            params, self.reducer, {"lr": float(t.lr), "betas": (float(t.beta1), float(t.beta2)),
                                   "weight_decay": float(t.weight_decay)},
            devices.optimizer_impl(self.device, dtensor=False))
        wait = self.sharded_optimizer.wait_for
        for module in self.parts[self.gid].modules():   # each weight's gather waited for at its first use
            own = list(module.parameters(recurse=False))
            if any(id(p) in self.sharded_optimizer.bucket_of for p in own):
                module.register_forward_pre_hook(lambda _m, _args, own=own: wait(own))
        return self.sharded_optimizer

    def checkpoint_writes(self, name: str) -> bool:
        """Whether this rank writes parameter `name` (and its optimizer state) to a checkpoint. Replicas
        may hold one parameter at different tp -- a full tensor here, two shards there -- and
        torch.distributed.checkpoint refuses overlapping chunks of one key; so only the parameter's
        canonical holder (the gradient norm's) writes it, and every holder loads it back resharded to
        its own tp."""
        return name not in self.not_written

    def _tp_meshes(self):
        mine = None
        for pipe in self.pipes:
            for st in pipe.stages:
                if st.tp > 1:  # new_group is collective over the world, in this order on every rank
                    group = dist.new_group(list(st.ranks))
                    if self.rank in st.ranks:
                        mine = DeviceMesh.from_group(group, self.device.type, mesh_dim_names=("tp",))
        return mine

    def local_rows(self) -> slice:
        if self.me is None:
            return slice(0, 0)
        start = sum(q.batch_size for q in self.pipes[:self.me[0]])
        return slice(start, start + self.pipe.batch_size)

    def program(self) -> List[Step]:
        ops = schedule_ops(self.plan.schedule, len(self.pipe.stages), self.me[1], self.pipe.num_microbatches)
        return p2p_program(ops, self.recv_fwd_from, self.send_fwd_to, self.recv_bwd_from, self.send_bwd_to)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._pipeline(inputs, targets, self.program())

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss share of a forward-only pass (no gradients, no synchronisation)."""
        if self.me is None:
            return torch.zeros(1, device=self.device)
        ops = [("F", j) for j in range(self.pipe.num_microbatches)]
        with torch.no_grad():
            return self._pipeline(inputs, targets, p2p_program(ops, self.recv_fwd_from, self.send_fwd_to, None, []))

    def _pipeline(self, inputs: torch.Tensor, targets: torch.Tensor, program: List[Step]) -> torch.Tensor:
        loss_share = torch.zeros(1, device=self.device)
        if self.me is None:
            return loss_share
        budget = getattr(self.pipe, "seq_len", None)   # a replica's own sequence length (plan field to come)
        if budget is not None and is_packed_inputs(inputs):   # concat: refused (data/packing_options.py)
            inputs, targets = trim_packed(inputs, targets, int(budget))
        part = self.parts[self.gid]
        losses: List[torch.Tensor] = []
        with loss_context([part]):   # a vocabulary-parallel head's loss, forward and backward
            self._run_program(program, inputs, targets, losses)
        if self.loss_reporter:
            loss_share[0] = torch.stack(losses).float().mean() * self.reducer.weights[self.me[0]]
        return loss_share

    def _run_program(self, program: List[Step], inputs: torch.Tensor, targets: torch.Tensor,
                     losses: List[torch.Tensor]) -> None:
        part, m = self.parts[self.gid], self.pipe.num_microbatches
        mbs = self.pipe.microbatch_size
        # every rank of the pipeline holds its rows: packed documents' positions and ids are read here,
        # not sent beside the activations
        packed = is_packed_inputs(inputs)
        seq = inputs.shape[-1]
        if seq % self.sequence_shards:
            raise ValueError(f"sequence parallelism over tp={self.sequence_shards} needs a sequence length divisible "
                             f"by it, got {seq}: set data.seq_len (or the replica's seq_len) to a multiple of it")
        shape = (mbs, seq // self.sequence_shards, self.hidden)   # under sequence parallelism: this rank's shard
        outbox: Dict[Tuple[str, int], torch.Tensor] = {}   # what this rank's sends carry
        inbox: Dict[Tuple[str, int], torch.Tensor] = {}
        stash: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for step in program:
            self._exchange(step.batch, shape, outbox, inbox)
            kind, j = step.kind, step.microbatch
            rows = slice(j * mbs, (j + 1) * mbs)
            if kind == "F":
                x = inputs[rows] if self.first else inbox.pop(("act", j)).requires_grad_(True)
                with self.recorder.op(self.gid, j, "F"):
                    out = part(x, split_packed_inputs(inputs[rows])[1]) if packed and not self.first else part(x)
                    if packed and not self.last:
                        out = out[0]   # (activations, side): the next stage reads the side from its own rows
                    if self.last:   # 1/m: the pipeline's loss is the mean over its micro-batches
                        out = self.loss_fn(out, targets[rows]) / m
                if self.last:
                    losses.append(out.detach() * m)
                else:
                    outbox[("act", j)] = out.detach().float()
                stash[j] = (x, out)
            elif kind == "B":
                x, out = stash.pop(j)
                if self.last:
                    with self.recorder.op(self.gid, j, "B"):
                        out.backward()
                else:
                    grad = inbox.pop(("grad", j))
                    with self.recorder.op(self.gid, j, "B"):
                        torch.autograd.backward(out, grad.to(out.dtype))
                if not self.first:
                    outbox[("grad", j)] = x.grad

    def _exchange(self, batch: Sequence[P2P], shape, outbox: Dict, inbox: Dict) -> None:
        """One batch_isend_irecv of a step's messages, waited for before the step computes."""
        if not batch:
            return
        p2p_ops = []
        for msg in batch:
            key = (msg.what, msg.microbatch)
            if msg.op == "send":
                p2p_ops.append(dist.P2POp(dist.isend, outbox[key], msg.peer))
            else:
                inbox[key] = torch.empty(shape, device=self.device)
                p2p_ops.append(dist.P2POp(dist.irecv, inbox[key], msg.peer))
        for work in dist.batch_isend_irecv(p2p_ops):
            work.wait()
        for msg in batch:   # every copy of a tensor is sent in one batch: done with it now
            if msg.op == "send":
                outbox.pop((msg.what, msg.microbatch), None)

    def sync_and_clip(self, max_norm: float) -> torch.Tensor:
        params = self._unit_params()
        if self.me is not None:
            self.reducer.finish()
        sq = torch.zeros(1, device=self.device)
        for unit, _, param in params:   # each parameter counted once: on its canonical holder
            if self.reducer.canonical(unit) != self.me or param.grad is None:
                continue
            g = param.grad
            sharded = hasattr(g, "to_local") and any(type(pl).__name__ == "Shard" for pl in g.placements)
            if sharded or self.tp_index == 0:
                local = g.to_local() if hasattr(g, "to_local") else g
                sq += local.detach().float().pow(2).sum()
        if self.sharded_optimizer is not None:   # the sharded buckets' gradients: each member's slice
            sq += self.sharded_optimizer.squared_norm(self.tp_index).to(sq.device)
        dist.all_reduce(sq)
        total = sq.sqrt()[0]
        if max_norm and max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            with torch.no_grad():
                for _, _, param in params:
                    if param.grad is not None:
                        g = param.grad
                        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
                if self.sharded_optimizer is not None:
                    self.sharded_optimizer.scale_gradients(coef)
        if self.sharded_optimizer is not None:
            self.sharded_optimizer.take_gradients()
        return total

    def _unit_params(self) -> List[Tuple[str, str, nn.Parameter]]:
        if self.me is None:
            return []
        seen, out = set(), []
        for name, param in self.parts[self.gid].named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            out.append((*self.units[name], param))
        return out


def _param_units(part: nn.Module, embed_units: List[str], tied_unit: Optional[str]) -> Dict[str, Tuple[str, str]]:
    """Parameter name -> (unit, canonical name); a tied head's weight is the embedding's."""
    units: Dict[str, Tuple[str, str]] = {}
    blocks = f"{part.prefix}.{part.blocks_attr}."
    for name, _ in part.named_parameters(remove_duplicate=False):
        if name.startswith(blocks):   # a recomputed block's names lose the wrapper's prefix: replicas may differ
            units[name] = ("block" + name[len(blocks):].split(".")[0], name.replace(_CHECKPOINT_PREFIX, ""))
        elif name in embed_units:
            units[name] = (name, name)
        elif name == "lm_head.weight" and tied_unit is not None:
            units[name] = (tied_unit, tied_unit)
        else:
            units[name] = ("final", name)
    return units
