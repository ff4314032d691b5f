"""A region must read the values its proof reasoned about.

A proof reads the graph's dataflow: ``mask = one_hot(ids, E).permute(2, 1, 0)``, then ``torch.where(mask[e])`` in
every body, is expert e's rows of ``ids``. An in-place write does not show in that dataflow when the user's code keeps
the old name: after ``mask[e + 1].zero_()`` the next body's ``mask[e + 1]`` reads the same node, whose memory now
holds other values, and the op, which recomputes the rows from ``ids``, would give another result than the user's
loop. ``inputs_unchanged`` guards the region's inputs; this guards what the region derives from them.

A write counts where a node the region derives from its inputs (an ancestor of its result that descends from an
input) is changed in place, through any view, and the region reads that node, or a view of it, both before and
after the write: its reads saw two values where the dataflow shows one. The region's own writes into its
accumulator (``Match.writes``) are its proof's business.

A write before every read counts too (``unseen_write``), wherever the written tensor is an op's result: after
``h = F.silu(g); h.mul_(2)`` every read of ``h`` sees the doubled values while the dataflow shows silu's. The driver
leaves to the proofs only the writes into a tensor made fresh (``zeros_like`` then ``scatter_``: the proofs that
accept one read it), whose dataflow shows no values at all. A write whose node is rebound (``weights /= s`` makes a
new node that later reads use) is not read stale, and does not count: a read through the write's result (which
aliases the written tensor, ``aliases.alias_source``) sees the written value in the dataflow too.

Before the passes match, the writes that are provably the same program as an out-of-place op (arithmetic on a
tensor the graph has just made, with no view or alias of it and no backward through it) are respelled as that op
(``private_writes.py``), so their values show in the dataflow; every write these checks meet is one that could not
be: into a view, an input, a tensor with another name, or one a backward runs through.
"""
from __future__ import annotations

from typing import Iterable, Optional

from torch.fx import Node

from .aliases import alias_mutations, base_of, is_view_of, view_family
from .fx_utils import made_fresh, reach

STALE = "a tensor the region computes from its inputs is changed in place between its reads"


def stale_read(inputs: Iterable[Node], ends: Iterable[Node], own_writes: Iterable[Node]) -> Optional[str]:
    """The reason the region reads a tensor it derived after an in-place write to it, or None.

    ``inputs`` are the region's inputs (the op's), ``ends`` its result and its writes, ``own_writes`` the writes
    the proof accounted for."""
    ends = [e for e in ends if isinstance(e, Node)]
    if not ends:
        return None
    graph = ends[0].graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    own = set(own_writes)
    derived = reach(ends, lambda n: n.all_input_nodes) & reach(inputs, lambda n: n.users)
    for node in sorted(derived, key=position.__getitem__):
        writes = [w for w in alias_mutations(node) if w not in own]
        if not writes:
            continue
        reads = sorted(((u, a) for a in view_family(node) for u in a.users if u in derived and u not in own
                        and u not in writes), key=lambda read: position[read[0]])
        for w in writes:  # read on both sides of the write: the reads saw two values, the proof one
            before = [r for r, _ in reads if position[r] < position[w]]
            # a read through the write's own result (or a view of it) sees the written value in the dataflow too
            after = [r for r, a in reads if position[r] > position[w] and not is_view_of(a, w)]
            if before and after:
                return f"{STALE} ({node.name}: read by {before[0].name}, written by {w.name}, read by {after[0].name})"
    return None


#: what ``unseen_write`` says
UNSEEN = "a tensor the region computes from its inputs is changed in place before the region reads it"


def unseen_write(inputs: Iterable[Node], ends: Iterable[Node], own_writes: Iterable[Node],
                 fresh_left: bool = False) -> Optional[str]:
    """The reason the region reads a tensor it derived after an in-place write that its dataflow does not show, or
    None: ``out.mul_(2)`` then ``out * w`` reads the ``out`` node, which a proof reads as the op that made it.

    Stricter than ``stale_read``, which lets a write before every read stand (the proofs that read a ``zeros`` then
    ``scatter_`` table check that write themselves). A proof whose reading goes through no write but ``own_writes``
    (the ones it proved) calls this. A read through the write's own result (``out = out.mul_(2)``, ``out *= 2``
    rebinding the name) sees the written value in the dataflow, and does not count. ``fresh_left``: writes into a
    tensor made fresh (``fx_utils.made_fresh``: a ``zeros`` then ``scatter_`` table, an ``empty`` filled by
    ``copy_``) are left to ``stale_read`` and to the proofs that read such tensors, as the driver does for every
    form; the dataflow shows nothing of a fresh tensor's values but how it was made, so no proof reads it as an op's
    result."""
    ends = [e for e in ends if isinstance(e, Node)]
    if not ends:
        return None
    position = {n: i for i, n in enumerate(ends[0].graph.nodes)}
    own = set(own_writes)
    derived = reach(ends, lambda n: n.all_input_nodes) & reach(inputs, lambda n: n.users)
    for node in sorted(derived, key=position.__getitem__):
        if fresh_left and made_fresh(base_of(node)):
            continue
        for w in (w for w in alias_mutations(node) if w not in own):
            for a in view_family(node):
                read = next((u for u in a.users if u in derived and u not in own and u is not w
                             and position[u] > position[w] and not is_view_of(a, w)), None)
                if read is not None:
                    return f"{UNSEEN} ({node.name}: written by {w.name}, read by {read.name})"
    return None
