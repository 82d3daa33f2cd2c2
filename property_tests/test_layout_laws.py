"""A tensor cut by a layout is put back whole: slices (tensor parallelism) and chunks (sharding), in either composition.

A 2-D state holds, on the rank at place ``t`` of its block and shard ``s``,
``chunk(local_slice(whole, ...), shards(s))``. The checkpoint, the export and
``fl.unshard`` put the whole back from every rank's part (the chunks' rows
joined and their padding cut, then the slices joined), and ``whole_shape`` is
the shape they announce before any byte arrives. The laws: the parts put back
are the whole, bit for bit, and the shape announced from any rank's part is
the whole's.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from fnloop._core.shards import Shards, chunk
from fnloop._core.tensor_parallel import TensorParallel, joined, local_slice, whole_shape


@st.composite
def layouts(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int, int]:
    """A whole tensor and how it is cut: the dimension split, the parts fused in it, the degree, the shards."""
    degree = draw(st.sampled_from([1, 2, 4]))
    parts = draw(st.sampled_from([1, 3]))
    dim = draw(st.sampled_from([0, 1]))
    shards = draw(st.integers(1, 3))
    split = parts * degree * draw(st.integers(1, 3))
    other = draw(st.integers(1, 7))
    shape = (split, other) if dim == 0 else (other, split)
    whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    return whole, dim, parts, degree, shards


@given(layouts())
def test_every_ranks_chunk_of_its_slice_puts_back_the_whole(layout) -> None:
    whole, dim, parts, degree, world = layout
    tensor = TensorParallel(degree, 0, (), (), (("w", dim, parts),))
    slices = []
    for place in range(degree):
        mine = local_slice(whole, dim, parts, degree, place)
        shards = [Shards("full", world, s, {"w": mine.shape[0]}) for s in range(world)]
        chunks = [chunk(mine, shard, "w") for shard in shards]
        for shard, part in zip(shards, chunks):  # announced from any rank's part: the whole's shape
            assert whole_shape(part, tensor, shard, "w", "w") == whole.shape
        slices.append(torch.cat(chunks)[: mine.shape[0]])  # the padding rows cut
        assert torch.equal(slices[-1], mine)
    assert torch.equal(joined(slices, dim, parts), whole)
