"""Sparse puzzle embeddings: only the rows a batch touched change."""
import pytest
import torch

from hrlplan.models.sparse_embedding import CastedSparseEmbedding, SparseEmbeddingSignSGD


def _table(rows=10, dim=4):
    emb = CastedSparseEmbedding(rows, dim, init_std=0.0)
    with torch.no_grad():
        emb.weights.copy_(torch.arange(rows * dim, dtype=torch.float32).view(rows, dim) / 10)
    return emb.train()


def test_only_touched_rows_are_updated():
    emb = _table()
    before = emb.weights.clone()
    opt = SparseEmbeddingSignSGD([emb], lr=0.1, weight_decay=0.5, world_size=1)
    ids = torch.tensor([2, 7, 2])
    out = emb(ids)
    (out * torch.tensor([1.0, -1.0, 2.0, 0.0])).sum().backward()
    opt.step()
    opt.zero_grad()
    changed = (emb.weights != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2, 7]
    # decoupled decay then sign step; row 2 appears twice and its gradients are summed
    expected = before[2] * (1 - 0.1 * 0.5) - 0.1 * torch.sign(torch.tensor([2.0, -2.0, 4.0, 0.0]))
    assert torch.allclose(emb.weights[2], expected)
    assert emb.local_weights is None


def test_no_grad_and_eval_forwards_do_not_replace_the_rows_with_gradient():
    emb = _table()
    emb(torch.tensor([1]))
    kept = emb.local_weights
    with torch.no_grad():
        emb(torch.tensor([5]))
    emb.eval()
    emb(torch.tensor([6]))
    assert emb.local_weights is kept and emb.local_ids.tolist() == [1]


def test_step_without_a_forward_changes_nothing():
    emb = _table()
    before = emb.weights.clone()
    SparseEmbeddingSignSGD([emb], lr=1.0, weight_decay=1.0, world_size=1).step()
    assert torch.equal(emb.weights, before)


def _two_rank_worker(rank, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        emb = CastedSparseEmbedding(8, 2).train()
        opt = SparseEmbeddingSignSGD([emb], lr=1.0, weight_decay=0.0)
        # The ranks touch different numbers of rows and share row 2.
        ids = torch.tensor([1, 2]) if rank == 0 else torch.tensor([2, 5, 5])
        grad = torch.tensor([[1.0, 1.0], [1.0, -3.0]]) if rank == 0 else torch.tensor([[-2.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
        (emb(ids) * grad).sum().backward()
        opt.step()
        torch.save(emb.weights, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rows_are_all_reduced_across_ranks(tmp_path, free_port):
    import torch.multiprocessing as mp

    mp.start_processes(_two_rank_worker, args=(free_port, str(tmp_path)), nprocs=2, start_method="fork")
    tables = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert torch.equal(tables[0], tables[1])
    expected = torch.zeros(8, 2)
    expected[1] = -1.0             # sign(+1, +1)
    expected[2] = torch.tensor([1.0, 1.0])   # sign of the sum (1-2, -3+1) = (-, -)
    expected[5] = -1.0
    assert torch.equal(tables[0], expected)
