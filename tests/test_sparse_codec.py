"""The sparse sync's codec (federation/sparse.py): the top k of every chunk against a sort, the
values within half a level, the payload's size against costs.py's closed form, error feedback that
keeps what was sent on track, and a mean over 3 ranks that every rank ends with bit for bit and
that equals the mean of the encodings computed apart."""

import pytest
import torch

from fl_megatron.costs import SPARSE_CHUNK, sparse_payload_bytes, sparse_picks
from fl_megatron.federation.sparse import SparseCodec, sparse_mean_
from fl_megatron.local_ranks import run_ranks

pytestmark = pytest.mark.timeout(300)
DTYPES = ("int2", "int4", "int8", "bf16")


def _region(seed: int, chunks: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(chunks * SPARSE_CHUNK, generator=g) * torch.logspace(-4, 1, chunks).repeat_interleave(
        SPARSE_CHUNK)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 64])
def test_the_top_k_of_every_chunk_travel_within_half_a_level(dtype, k):
    codec = SparseCodec(k / SPARSE_CHUNK, dtype)
    x = _region(k)
    payload, indices, decoded = codec.encode(x)
    chunks = x.view(-1, SPARSE_CHUNK)
    expected = chunks.abs().sort(dim=1, descending=True).indices[:, :k]  # no ties in random data
    assert codec.k == k and all(set(a.tolist()) == set(b.tolist()) for a, b in zip(indices, expected))
    values = chunks.gather(1, indices)
    if dtype == "bf16":
        assert torch.equal(decoded, values.bfloat16().float())
    else:
        bits = int(dtype[3:])
        step = values.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 0.5)  # the levels' spacing
        assert torch.all((decoded - values).abs() <= step / 2 * (1 + 1e-5))
        assert torch.allclose(decoded.abs().amax(dim=1), values.abs().amax(dim=1))  # the largest: the outer level
    out = torch.zeros_like(x)
    codec.add_decoded_(payload, out)  # what travels is what the sender counts as sent
    assert torch.equal(out.view(-1, SPARSE_CHUNK), torch.zeros_like(chunks).scatter_(1, indices, decoded))


def test_the_payload_is_the_closed_form_and_50x_smaller_than_fp32_at_the_papers_density():
    # 64 of 4,096 at 2 bits: 3 chunks carry 3 x 4 bytes of scales, 192 codes in 48 bytes, 192 indices in 288
    assert sparse_picks(0.0156) == 64
    assert sparse_payload_bytes(3 * SPARSE_CHUNK, 0.0156, "int2") == 12 + 48 + 288
    for dtype in DTYPES:
        for k in (1, 3, 64):
            payload = SparseCodec(k / SPARSE_CHUNK, dtype).encode(_region(0, 2))[0]
            assert payload.numel() == sparse_payload_bytes(2 * SPARSE_CHUNK, k / SPARSE_CHUNK, dtype)
            assert payload.numel() % 4 == 0
    assert 4 * 3 * SPARSE_CHUNK / (12 + 48 + 288) >= 50
    with pytest.raises(ValueError, match="topk-density"):
        sparse_picks(0.0)


def test_error_feedback_keeps_the_sum_of_what_was_sent_on_track(world):
    """With decay 1, after T syncs (one rank) the sum of what was sent equals the sum of the inputs
    less the last residual, which stays bounded by a chunk's largest input; a steady drift the
    top k would never pick alone gets sent."""
    g = torch.Generator().manual_seed(2)
    n, rounds = 2 * SPARSE_CHUNK, 200
    residual, sent, true_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(rounds):
        delta = torch.randn(n, generator=g) * 1e-3 + 2e-4
        true_sum += delta
        x = delta.clone()
        sparse_mean_(x, world, 64 / SPARSE_CHUNK, "int2", residual)
        sent += x
    assert torch.allclose(sent + residual, true_sum, atol=1e-5)
    assert residual.abs().max() < 0.2 * true_sum.abs().max()  # a bounded lag, not the whole drift
    assert (sent > 0).float().mean() > 0.95  # nearly every element was sent at some point


def _mean_job(rank, world):
    """int2 with every rank sending; int8 with rank 2 left out and 2 contributing."""
    import torch.distributed as dist

    out = {}
    for dtype in ("int2", "int8"):
        x, residual = _region(10 + rank), _region(20 + rank) * 1e-2
        before = residual.clone()
        left_out = dtype == "int8" and rank == 2
        mine = x.clone()
        nbytes = sparse_mean_(mine, dist.group.WORLD, 64 / SPARSE_CHUNK, dtype, residual, decay=0.95,
                              include=not left_out, contributors=2 if dtype == "int8" else None)
        # numpy arrays travel by value through the job's queue (tensors would by shared memory)
        out[dtype] = {"mean": mine.numpy(), "residual": residual.numpy(), "before": before.numpy(), "x": x.numpy(),
                      "bytes": nbytes}
    return out


def test_the_mean_is_the_same_on_every_rank_and_equals_the_encodings_averaged_apart():
    jobs = run_ranks(3, _mean_job, timeout=120)
    for dtype, senders in (("int2", [0, 1, 2]), ("int8", [0, 1])):
        out = [{k: torch.from_numpy(v) if k != "bytes" else v for k, v in job[dtype].items()} for job in jobs]
        codec = SparseCodec(64 / SPARSE_CHUNK, dtype)
        expected = torch.zeros_like(out[0]["x"])
        for r in senders:  # what each sender encodes: its decayed residual plus its region
            carried = 0.95 * out[r]["before"] + out[r]["x"]
            _, indices, decoded = codec.encode(carried)
            sent = torch.zeros_like(carried).view(-1, SPARSE_CHUNK).scatter_(1, indices, decoded).view(-1)
            expected += sent
            assert torch.allclose(out[r]["residual"] + sent, carried, atol=1e-6)  # nothing lost, nothing twice
        expected /= len(senders)
        assert all(torch.equal(o["mean"], out[0]["mean"]) for o in out)
        assert torch.allclose(out[0]["mean"], expected, rtol=1e-6, atol=1e-9)
        if dtype == "int8":  # a left-out rank keeps no residual
            assert torch.equal(out[2]["residual"], torch.zeros_like(out[2]["residual"]))
        payload = sparse_payload_bytes(out[0]["x"].numel(), 64 / SPARSE_CHUNK, dtype)
        assert all(o["bytes"] == payload for o in out)
