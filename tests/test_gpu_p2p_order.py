"""The heterogeneous executor's point-to-point order cannot deadlock under NCCL.

Every rank's executor is run for real (a tiny stage per rank, torch.distributed's batch_isend_irecv
replaced by a recorder), for GPipe and 1F1B at pp 2-4 with equal and unequal tp, and the recorded
batches are replayed under NCCL's rendezvous semantics: a send completes only once its peer has
posted the matching receive, each ordered pair's messages match first-in first-out, and the ops of
one batch count as posted together. The old order (isend, then a blocking recv, each on its own)
deadlocks in the same replay: the replay would catch a regression.
"""
from types import SimpleNamespace
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hrlplan.runtime import hetero
from hrlplan.runtime.timing import StepRecorder

VOCAB, HIDDEN, SEQ = 11, 4, 3


def replay(programs: Dict[int, List[List[Tuple[str, int, tuple]]]]) -> List[int]:
    """Rendezvous replay. programs: rank -> batches of (op, peer, label). Returns the ranks stuck
    (empty: every program ran to its end). Also asserts that matched messages carry equal labels."""
    pos = {r: 0 for r in programs}
    posted: Dict[Tuple[int, int, str], List[tuple]] = {}   # (src, dst, op) -> labels in posting order
    seq: Dict[int, List[int]] = {}                          # rank -> indices of its current batch's ops

    def post(rank: int) -> None:
        idx = []
        for op, peer, label in programs[rank][pos[rank]]:
            key = (rank, peer, op) if op == "send" else (peer, rank, op)
            posted.setdefault(key, []).append(label)
            idx.append(len(posted[key]) - 1)
        seq[rank] = idx

    for r in programs:
        if programs[r]:
            post(r)
    progress = True
    while progress:
        progress = False
        for r in programs:
            if pos[r] >= len(programs[r]):
                continue
            done = True
            for (op, peer, label), k in zip(programs[r][pos[r]], seq[r]):
                other = (r, peer, "recv") if op == "send" else (peer, r, "send")
                matched = posted.get(other, [])
                if len(matched) <= k:
                    done = False
                    break
                assert matched[k] == label, f"rank {r}: {op} {label} matched {matched[k]} (FIFO order differs)"
            if done:
                pos[r] += 1
                progress = True
                if pos[r] < len(programs[r]):
                    post(r)
    return [r for r in programs if pos[r] < len(programs[r])]


class _Part(nn.Module):
    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.first = nn.Embedding(VOCAB, HIDDEN) if first else None
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.last = nn.Linear(HIDDEN, VOCAB) if last else None

    def forward(self, x):
        x = self.first(x) if self.first is not None else x
        x = self.mid(x)
        return self.last(x) if self.last is not None else x


def _pipe(tps: Sequence[int], m: int):
    stages, rank = [], 0
    for tp in tps:
        stages.append(SimpleNamespace(tp=tp, ranks=list(range(rank, rank + tp))))
        rank += tp
    return SimpleNamespace(stages=stages, num_microbatches=m, microbatch_size=1, batch_size=m)


def _engine(pipe, schedule: str, s: int, t: int):
    """A HeteroPipelineEngine on one rank of `pipe` without a process group: the executor itself."""
    eng = object.__new__(hetero.HeteroPipelineEngine)
    n = len(pipe.stages)
    eng.plan = SimpleNamespace(schedule=schedule)
    eng.pipe, eng.me, eng.gid, eng.tp_index = pipe, (0, s), s, t
    eng.stage, eng.first, eng.last = pipe.stages[s], s == 0, s == n - 1
    eng.device, eng.hidden = torch.device("cpu"), HIDDEN
    eng.sequence_shards = 1   # no sequence parallelism in these stages
    eng.recorder = StepRecorder(eng.device)
    eng.parts = {s: _Part(eng.first, eng.last)}
    eng.recv_fwd_from, eng.send_fwd_to, eng.recv_bwd_from, eng.send_bwd_to = hetero.stage_links(pipe.stages, s, t)
    eng.loss_reporter = eng.last and t == 0
    eng.reducer = SimpleNamespace(weights=[1.0])
    eng.loss_fn = hetero.stage_loss([eng.parts[s]])   # the executor computes the loss on the last stage
    return eng


def record_programs(tps: Sequence[int], schedule: str, m: int, monkeypatch) -> Dict[int, list]:
    """Run every rank's real executor for one step; return the p2p batches it issued, labelled."""
    pipe = _pipe(tps, m)
    issued: List[list] = []

    class Op:
        def __init__(self, fn, tensor, peer):
            self.fn, self.tensor, self.peer = fn, tensor, peer

    def batch_isend_irecv(ops):
        issued.append([("send" if o.fn is dist.isend else "recv", o.peer) for o in ops])
        for o in ops:
            if o.fn is dist.irecv:
                o.tensor.fill_(0.01)
        return [SimpleNamespace(wait=lambda: None) for _ in ops]

    monkeypatch.setattr(dist, "P2POp", Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    programs = {}
    inputs = torch.randint(0, VOCAB, (m, SEQ))
    for s, st in enumerate(pipe.stages):
        for t, rank in enumerate(st.ranks):
            eng = _engine(pipe, schedule, s, t)
            issued.clear()
            eng.forward_backward(inputs, inputs)
            program = [step.batch for step in eng.program() if step.batch]
            # what the executor issued is its program, batch for batch
            assert issued == [[(msg.op, msg.peer) for msg in b] for b in program]
            programs[rank] = [[(msg.op, msg.peer, (msg.what, msg.microbatch)) for msg in b] for b in program]
    return programs


CASES = [(1, 1), (1, 1, 1), (1, 1, 1, 1), (2, 1), (1, 2), (2, 1, 2), (1, 2, 1, 1), (2, 2, 1)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tps", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_recorded_p2p_sequences_never_deadlock(tps, schedule, monkeypatch):
    for m in (1, 2, 3, len(tps) + 2):
        programs = record_programs(tps, schedule, m, monkeypatch)
        assert replay(programs) == [], f"pp={len(tps)} tp={tps} {schedule} m={m} deadlocks"


def legacy_program(tps: Sequence[int], schedule: str, m: int) -> Dict[int, list]:
    """The executor's old order: each isend and each blocking recv on its own, in schedule order
    (NCCL runs a pair's p2p in order on one stream: a single-op batch each)."""
    pipe = _pipe(tps, m)
    out = {}
    for s, st in enumerate(pipe.stages):
        for t, rank in enumerate(st.ranks):
            rf, sf, rb, sb = hetero.stage_links(pipe.stages, s, t)
            ops = []
            for kind, j in hetero.schedule_ops(schedule, len(tps), s, m):
                if kind == "F":
                    ops += ([[("recv", rf, ("act", j))]] if rf is not None else []) + [[("send", r, ("act", j))] for r in sf]
                else:
                    ops += ([[("recv", rb, ("grad", j))]] if rb is not None else []) + [[("send", r, ("grad", j))] for r in sb]
            out[rank] = ops
    return out


def test_replay_catches_the_old_order_deadlock():
    assert replay(legacy_program((1, 1), "1f1b", 2)) == [0, 1]
    assert replay(legacy_program((1, 1), "gpipe", 2)) == []   # GPipe's old order was safe


def test_p2p_program_batches_sends_with_the_next_receive():
    steps = hetero.p2p_program(hetero.schedule_ops("1f1b", 2, 0, 2), None, [1], 1, [])
    assert [(s.kind, s.microbatch, [(b.op, b.what, b.microbatch) for b in s.batch]) for s in steps] == [
        ("F", 0, []), ("F", 1, [("send", "act", 0)]), ("B", 0, [("send", "act", 1), ("recv", "grad", 0)]),
        ("B", 1, [("recv", "grad", 1)])]
