"""Independent references for the kernel tests: a paged cache filled by plain loops, and
attention computed per query token in float64 by the textbook formula."""

from __future__ import annotations

import random

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# fp32 and fp16 run wherever the tests run (interpreter or GPU); bf16 only on a GPU
# (the interpreter computes bf16 wrongly).
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=ON_GPU),
]
TOL = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class PagedCache:
    """A cache of `num_blocks` blocks; each sequence gets blocks from a shuffled pool."""

    def __init__(
        self, num_blocks: int, block_size: int, kvh: int, d: int, dtype: torch.dtype, seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, kvh, d)
        self.k = torch.randn(shape, generator=g).to(DEVICE, dtype)
        self.v = torch.randn(shape, generator=g).to(DEVICE, dtype)
        self.block_size = block_size
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)

    def tables(self, seq_lens: list[int]) -> torch.Tensor:
        """A 0-padded int32 block table with enough blocks for each length."""
        need = [-(-n // self.block_size) for n in seq_lens]
        table = torch.zeros((len(seq_lens), max(need) + 1), dtype=torch.int32)
        for i, n in enumerate(need):
            for j in range(n):
                table[i, j] = self.free.pop()
        return table.to(DEVICE)

    def context(self, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, KVH, D] of a sequence's first n tokens, token by token."""
        bs = self.block_size
        ks = [self.k[int(table_row[t // bs]), t % bs] for t in range(n)]
        vs = [self.v[int(table_row[t // bs]), t % bs] for t in range(n)]
        return torch.stack(ks).double(), torch.stack(vs).double()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token [H, D] over keys/values [n, KVH, D]: softmax(q·k·scale)·v in float64."""
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
