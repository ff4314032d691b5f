"""Routing metadata against plain Python bookkeeping."""
import pytest
import torch

from moe_inductor.ops import route
from moe_inductor.ops.reference import capacity_keep_mask


@pytest.mark.parametrize("T,E,k", [(0, 4, 2), (1, 3, 1), (50, 7, 2), (16, 4, 4)], ids=["T0", "T1", "E7", "k-eq-E"])
def test_order_is_stable_and_offsets_count(T, E, k):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    order, sorted_expert, offsets = route(ids, E)
    flat = ids.reshape(-1).tolist()
    expected = sorted(range(T * k), key=lambda a: (flat[a], a))
    assert order.tolist() == expected
    assert sorted_expert.tolist() == [flat[a] for a in expected]
    counts = [flat.count(e) for e in range(E)]
    assert offsets.tolist() == [sum(counts[:e]) for e in range(E + 1)]
    assert order.dtype == offsets.dtype == torch.int32


@pytest.mark.parametrize("k,capacity", [(1, 1), (2, 2), (2, 5)])
def test_capacity_keeps_choice_major_priority(k, capacity):
    E, T = 3, 12
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    order, sorted_expert, offsets = route(ids, E, capacity)
    keep = capacity_keep_mask(ids, E, capacity).reshape(-1)
    kept = set(order[: offsets[-1]].tolist())
    assert kept == set(torch.nonzero(keep).flatten().tolist())
    assert (sorted_expert[offsets[-1]:] == E).all()
    assert all(b - a <= capacity for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()))


def test_out_of_range_ids_are_dropped_not_read():
    ids = torch.tensor([[0, 9], [-1, 1]])
    order, sorted_expert, offsets = route(ids, 2)
    assert offsets.tolist() == [0, 1, 2]
    assert sorted_expert.tolist()[2:] == [2, 2]


@pytest.mark.parametrize(
    "T,E,k,capacity",
    [(0, 4, 2, None), (1, 3, 1, None), (37, 7, 2, None), (37, 7, 2, 5), (9, 4, 4, 2)],
    ids=["T0", "T1", "E7-several-chunks", "capacity", "k-eq-E-capacity"],
)
@pytest.mark.parametrize("chunked", [None, True], ids=["chosen", "count-then-place"])
def test_triton_routing_equals_reference(T, E, k, capacity, chunked, monkeypatch):
    """Both launch paths; count-then-place is what a dynamic graph runs at every row count, one chunk included."""
    from moe_inductor import config
    from moe_inductor.ops.routing import route_metadata, route_reference

    monkeypatch.setattr(config, "triton_on_cpu", True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    if T > 3:
        ids[3, 0] = E + 2  # an out-of-range id goes to the very end
    ids = ids.to(device)
    for got, want in zip(route_metadata(ids, E, capacity, chunked), route_reference(ids, E, capacity)):
        assert got.tolist() == want.tolist()
