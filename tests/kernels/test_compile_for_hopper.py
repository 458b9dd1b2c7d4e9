"""The small-step linears' kernel compiles for a Hopper GPU (sm_90) here, with no GPU: every
config its autotuner may pick, each op folded in, both forms. The CPU tests run the
kernel in Triton's interpreter, which accepts code that the GPU compiler refuses (a
constexpr reassigned in a branch, a layout a reduction cannot take); this catches that
before a lent GPU machine's start-up does (where the engine would fall back to the
separate kernels). Triton's own compiler and ptxas, bundled with its wheel, run in a
child process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # another Triton's layout: nothing to check with
    print(json.dumps({"skip": str(e)}))
    sys.exit(0)
import compute_plane.kernels.fused_linear as fl

sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "h_ptr": "*bf16", "g_ptr": "*bf16",
       "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
       "K": "i32", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_w": "i32"}
names = list(sig)
# as the launcher specialises them: shapes and strides that divide by 16
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in ("M", "eps")}
done = []
for gemv in (True, False):
    for i, cfg in enumerate(fl._configs(gemv)):
        # every op with the first config, the norm after it (the longest code); the
        # matrix-vector form at 1, 2 and 4 rows by turns; the norm with a residual or not
        modes = (fl.PLAIN, fl.NORM, fl.SILU) if i == 0 else (fl.NORM,)
        for mode in modes:
            consts = dict(MODE=mode, HAS_RES=mode == fl.NORM and i % 2 == 0,
                          HAS_BIAS=mode == fl.PLAIN or i % 3 == 1, IEEE=False, DOT=not gemv,
                          BLOCK_M=(1, 2, 4)[i % 3] if gemv else 16, **cfg.kwargs)
            s = dict(sig) | {k: "constexpr" for k in consts}
            try:
                src = ASTSource(fl._gemv_kernel.fn, s, constexprs=consts, attrs=attrs)
            except TypeError as e:  # another Triton's ASTSource (3.2 took constants=)
                print(json.dumps({"skip": f"ASTSource: {e}"}))
                sys.exit(0)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            assert k.asm["cubin"], consts
            done.append(consts)
print(json.dumps({"compiled": len(done)}))
"""


def test_every_config_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(f"this Triton compiles no other target here: {report['skip']}")
    from compute_plane.kernels import fused_linear as fl

    assert report["compiled"] == len(fl._configs(True)) + len(fl._configs(False)) + 4
