"""Run THERE (check.sh's `cupy` stage): which CuPy and NVRTC this machine has and where
CuPy found NVRTC, then the compute plane's warm-up check of its CuPy KV-cache kernels
(compute_plane/kernels/cache_ops.py: every variant compiled, each kernel run once
against torch's indexing). Exits 1 where the check fails (its WARNING says why).

    python3 benchmarks/device/cupy_check.py
"""

from __future__ import annotations

import logging
import sys


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    import cupy
    import torch

    try:  # CuPy 14 looks NVRTC up with cuda-pathfinder; CuPy 13 on the loader's path only
        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = load_nvidia_dynamic_lib("nvrtc")
        where = f"{lib.abs_path} (found via {lib.found_via})"
    except ImportError:
        where = "the loader's path"
    except Exception as e:  # not found: the check below says so too
        where = f"nowhere ({type(e).__name__}: {e})"
    print(f"CuPy {cupy.__version__}, NVRTC from {where}")
    from compute_plane.kernels import cache_ops

    works = cache_ops.cupy_works(torch.device("cuda", torch.cuda.current_device()))
    print(f"cache_ops.cupy_works: {works}")
    return 0 if works else 1


if __name__ == "__main__":
    sys.exit(main())
