"""How much of the GPU a matrix product of a given shape can keep busy: tile and wave quantization.

NVIDIA's "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance/
dl-performance-matrix-multiplication, sections "Typical Tile Dimensions in cuBLAS" and "Dimension Quantization
Effects") describes how cuBLAS runs C = A B: the m x n output is cut into tiles, one thread block each, and the
blocks run on the streaming multiprocessors in waves of one tile per SM. So a product does the work of

    waves x SMs x tile area,  waves = ceil(tiles / SMs),  tiles = batch x ceil(m / tile_m) x ceil(n / tile_n)

while only batch x m x n of it is its output: the rest is a partial last tile (tile quantization) or SMs idle in
the last wave (wave quantization). bert-large's (512 x 1024) products at batch 1 make 32 tiles of 128 x 128 on
a V100's 80 SMs: 40% of one wave busy. cuBLAS picks, per shape, among the tile sizes of the guide's table
(`TILES`); the model takes the one that reaches the most of the peak (below).

A fused attention kernel (FlashAttention and the memory-efficient kernel) gives each thread block a tile of
query rows (`ATTENTION_ROWS`) against every key, over batch x heads; the key dimension is not tiled.

A smaller tile reaches less of the tensor cores' peak: the guide says larger tiles have more data reuse, so use less
bandwidth and are more efficient. Each step along the sum loads tile_m + tile_n values for tile_m x tile_n
multiply-adds, so the model runs a tensor-core tile at its reuse tile_m tile_n / (tile_m + tile_n) over 128 x 128's
(64), at most 1 (`tile_efficiency`): 64 x 64 at 0.5, 128 x 64 at 0.67. The one published measurement of a small-tile
kernel (pytorch/pytorch#181718: cuBLAS's 64 x 64 bf16 kernel on an RTX 4090) ran at 0.58-0.64 of what its waves allow.
CUDA-core (fp32) products load far less per second than tensor cores consume, so their tiles all run alike
(tests/test_gemm_published.py: cuBLAS's fp32 products on an A100 keep even more of the GPU busy than this model says).

What is not modelled: split-K (several blocks sharing one output tile's sum), which cuBLAS uses for a small output
with a long sum; several blocks on one SM; the alignment of a dimension that is no multiple of 16 bytes (a vocabulary
of 50257, an intermediate size of 10922), which runs slower kernels; a short sum, whose blocks spend their time
starting and storing rather than multiplying. The tensor-core and fp32 efficiencies of the time model are fitted to
what a busy GPU reaches with large tiles (`calibration.fit`).
"""

from __future__ import annotations

from math import ceil

TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64),
                                      (64, 128), (64, 64))
"""The output tile sizes of cuBLAS's GEMM kernels, the guide's table "typical tile dimensions in cuBLAS"."""
ATTENTION_ROWS: tuple[int, ...] = (128, 64)
"""Query rows per thread block of the fused attention kernels: FlashAttention-2's forward takes 128 for the common
head dimensions and 64 for others (`kBlockM` in its flash_fwd_launch_template.h), the memory-efficient kernel 64."""


def tile_efficiency(tile_m: int, tile_n: int) -> float:
    """The share of the tensor cores' peak a tile reaches: its reuse over 128 x 128's, at most 1."""
    return min(1.0, tile_m * tile_n / (tile_m + tile_n) / 64)


def busy_fraction(gemm: tuple[int, int, int, int], sm_count: int, *, tensor_cores: bool = True,
                  attention: bool = False) -> float:
    """The share of the GPU's peak a product of shape `gemm` = (batch, m, n, k) can reach: its output over the work of
    its waves of tiles, each tensor-core tile at its `tile_efficiency`, with the tile that reaches the most (1.0
    where there is no shape or no SM count to tile by)."""
    batch, m, n, _ = gemm
    if batch <= 0 or m <= 0 or n <= 0 or sm_count <= 0:
        return 1.0
    best = 0.0
    for tile_m, tile_n in ((rows, n) for rows in ATTENTION_ROWS) if attention else TILES:
        blocks = batch * ceil(m / tile_m) * ceil(n / tile_n)
        waves = ceil(blocks / sm_count)
        busy = batch * m * n / (waves * sm_count * tile_m * tile_n)
        best = max(best, busy * tile_efficiency(tile_m, tile_n) if tensor_cores and not attention else busy)
    return best
