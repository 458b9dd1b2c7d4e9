"""The small-step linears' kernel compiles for a Hopper GPU (sm_90) here, with no GPU: every
config its autotuner may pick, each op folded in, both forms; so do decode and prefill
attention, their dots bf16 tensor-core products where they take the cache's values. The CPU tests run the
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
from typing import Any

import pytest

pytest.importorskip("triton")

# Triton's compiler for another target, and the linear kernel's signature as the launcher
# specialises it: the start of each linear script below.
_LINEAR = r"""
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
"""

_SCRIPT = r"""
done = []
for gemv in (True, False):
    for i, cfg in enumerate(fl._configs(gemv)):
        # every op with the first config, the norm after it (the longest code); the
        # matrix-vector form at 1, 2 and 4 rows by turns; the norm with a residual or not
        modes = (fl.PLAIN, fl.NORM, fl.SILU) if i == 0 else (fl.NORM,)
        for mode in modes:
            consts = dict(MODE=mode, HAS_RES=mode == fl.NORM and i % 2 == 0,
                          HAS_BIAS=mode == fl.PLAIN or i % 3 == 1, IEEE=False, DOT=not gemv,
                          BLOCK_M=(1, 2, 4)[i % 3] if gemv else 16, PDL=False, **cfg.kwargs)
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


def _compile(script: str) -> dict[str, Any]:
    """The script's report (its last line, JSON), run by Triton's own compiler in a child
    process without TRITON_INTERPRET; skips where this Triton cannot target sm_90 here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(f"this Triton compiles no other target here: {report['skip']}")
    return report


_PDL = r"""
found = {}
for pdl in (False, True):
    consts = dict(MODE=fl.NORM, HAS_RES=True, HAS_BIAS=False, IEEE=False, DOT=False,
                  BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, PRELOAD=True, PDL=pdl)
    src = ASTSource(fl._gemv_kernel.fn, dict(sig) | {k: "constexpr" for k in consts},
                    constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2, "launch_pdl": pdl})
    # each instruction's opcode (after a predicate such as `@%p1`)
    lines = [t[1] if t[0].startswith("@") and len(t) > 1 else t[0].rstrip(";")
             for t in (ln.split() for ln in k.asm["ptx"].splitlines()) if t]
    gdc = [i for i, op in enumerate(lines) if op.startswith("griddepcontrol")]
    loads = [i for i, op in enumerate(lines) if op.startswith(("ld.global", "cp.async"))]
    stores = [i for i, op in enumerate(lines) if op.startswith("st.global")]
    found[str(pdl)] = {"gdc": [lines[i] for i in gdc],
                       "loads_before": sum(i < gdc[0] for i in loads) if gdc else None,
                       "stores_before": sum(i < gdc[0] for i in stores) if gdc else None,
                       "loads": len(loads)}
print(json.dumps({"compiled": found}))
"""


def test_programmatic_dependent_launch_compiles_for_sm90() -> None:
    """With PDL the matrix-vector kernel waits for the kernel before it (griddepcontrol.wait)
    after loading its first weight tile and before any other load or store, then lets the
    next launch; without it, neither instruction is there."""
    compiled = _compile(_LINEAR + _PDL)["compiled"]
    assert compiled["False"]["gdc"] == [], compiled
    pdl = compiled["True"]
    assert pdl["gdc"][:2] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], pdl
    # the first tile's loads only (a [4, 1024] bf16 tile: a few vector loads a thread)
    assert 0 < pdl["loads_before"] < pdl["loads"] and pdl["stores_before"] == 0, pdl


def test_every_config_compiles_for_sm90() -> None:
    report = _compile(_LINEAR + _SCRIPT)
    from compute_plane.kernels import fused_linear as fl

    assert report["compiled"] == len(fl._configs(True)) + len(fl._configs(False)) + 4


_ATTENTION = r"""
import json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"skip": str(e)}))
    sys.exit(0)
from compute_plane.kernels import decode_attention as da, prefill_attention as pa

def build(fn, ptrs, ints, floats, consts, warps):
    sig = {**ptrs, **{n: "i32" for n in ints}, **{n: "fp32" for n in floats}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in floats
             and n != "window"}
    s = dict(sig) | {k: "constexpr" for k in consts}
    try:
        src = ASTSource(fn, s, constexprs=consts, attrs=attrs)
    except TypeError as e:
        print(json.dumps({"skip": f"ASTSource: {e}"}))
        sys.exit(0)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 2})
    # its tensor-core products: mma.sync.<shape>.<types>, or Hopper's warpgroup
    # wgmma.mma_async.<shape>.<types>
    ops = (line.split()[0] for line in k.asm["ptx"].splitlines() if line.strip())
    mma = [op for op in ops if op.startswith(("mma.", "wgmma.mma_async"))]
    return {"mma": len(mma), "bf16": sum(".bf16.bf16" in m for m in mma)}

strides = ["stride_kn", "stride_kt", "stride_kh", "stride_vn", "stride_vt", "stride_vh",
           "stride_bt"]
bf16 = {"q_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16",
        "block_tables": "*i32", "seq_lens": "*i32"}
done = {}
for native in (True, False):
    for splits in (1, 33):  # the output written directly, or partials for the combine
        out = "*bf16" if splits == 1 else "*fp32"
        asm = build(da._decode_split, bf16 | {"out_ptr": out, "lse_ptr": "*fp32"},
                    ["window", "stride_qb", "stride_qh", *strides, "stride_ob", "stride_oh",
                     "stride_os"], ["scale"],
                    dict(GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16,
                         BLOCK_N=64, NUM_SPLITS=splits, DOT_PRECISION="tf32", NATIVE=native,
                         PDL=False), 4)
        done[f"decode native={native} splits={splits}"] = asm
    asm = build(pa._prefill, bf16 | {"q_start": "*i32", "out_ptr": "*bf16"},
                ["window", "stride_qt", "stride_qh", *strides, "stride_ot", "stride_oh"],
                ["scale"],
                dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=64,
                     BLOCK_N=64, DOT_PRECISION="tf32", NATIVE=native), 4)
    done[f"prefill native={native}"] = asm
print(json.dumps({"compiled": done}))
"""


def test_attention_kernels_compile_for_sm90() -> None:
    """Decode (one split and several) and prefill attention, with bf16 dots and with fp32
    copies: each compiles for sm_90 and its dots are tensor-core instructions."""
    compiled = _compile(_ATTENTION)["compiled"]
    assert len(compiled) == 6, compiled
    for name, mma in compiled.items():
        native = "native=True" in name
        # bf16 dots natively (and no tf32 ones); the fp32 copies' tf32 dots twice as many
        assert mma["mma"] > 0 and mma["bf16"] == (mma["mma"] if native else 0), (name, mma)
    for kind in ("decode", "prefill"):
        for splits in (" splits=1", " splits=33") if kind == "decode" else ("",):
            ours = compiled[f"{kind} native=True{splits}"]["mma"]
            assert 2 * ours >= compiled[f"{kind} native=False{splits}"]["mma"] > ours


_DEPENDENT = r"""
import json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"skip": str(e)}))
    sys.exit(0)
from compute_plane.kernels import decode_attention as da, rms_norm as rn, rotary as ro

def opcodes(ptx):
    # each instruction's opcode (after a predicate such as `@%p1`)
    return [t[1] if t[0].startswith("@") and len(t) > 1 else t[0].rstrip(";")
            for t in (ln.split() for ln in ptx.splitlines()) if t]

def build(fn, ptrs, ints, floats, consts, pdl):
    sig = {**ptrs, **{n: "i32" for n in ints}, **{n: "fp32" for n in floats}}
    consts = consts | {"PDL": pdl}
    src = ASTSource(fn, dict(sig) | {k: "constexpr" for k in consts}, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2, "launch_pdl": pdl})
    ops = opcodes(k.asm["ptx"])
    gdc = [i for i, op in enumerate(ops) if op.startswith("griddepcontrol")]
    first = gdc[0] if gdc else len(ops)
    return {"gdc": [ops[i] for i in gdc],
            "loads_before": sum(op.startswith(("ld.global", "cp.async")) for op in ops[:first]),
            "stores_before": sum(op.startswith(("st.global", "red.", "atom."))
                                 for op in ops[:first])}

bf16, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
kernels = {
    "rotary": (ro._qk_rotary,
               dict(q_ptr=bf16, k_ptr=bf16, q_out=bf16, k_out=bf16, v_ptr=bf16, v_cache=bf16,
                    slots=i64, positions=i64, cos_ptr=bf16, sin_ptr=bf16, qw_ptr=bf16,
                    kw_ptr=bf16),
               ["num_q", "num_k", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                "stride_vt", "stride_vh", "stride_cos"], ["eps"],
               dict(HALF=64, BLOCK_Q=16, BLOCK_K=8, BLOCK_HALF=64, HAS_NORM=True,
                    WRITE_CACHE=True)),
    "decode_split": (da._decode_split,
                     dict(q_ptr=bf16, k_cache=bf16, v_cache=bf16, block_tables=i32,
                          seq_lens=i32, out_ptr=f32, lse_ptr=f32),
                     ["window", "stride_qb", "stride_qh", "stride_kn", "stride_kt",
                      "stride_kh", "stride_vn", "stride_vt", "stride_vh", "stride_bt",
                      "stride_ob", "stride_oh", "stride_os"], ["scale"],
                     dict(GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16,
                          BLOCK_N=64, NUM_SPLITS=16, DOT_PRECISION="tf32", NATIVE=True)),
    "combine": (da._combine, dict(part_ptr=f32, lse_ptr=f32, out_ptr=bf16, seq_lens=i32),
                ["window", "stride_pb", "stride_ph", "stride_ps", "stride_ob", "stride_oh"],
                [], dict(NUM_HEADS=16, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=16, BLOCK_S=16,
                         BLOCK_N=64)),
    "rms_norm": (rn._rms_norm,
                 dict(x_ptr=bf16, res_ptr=bf16, w_ptr=bf16, out_ptr=bf16, res_out_ptr=bf16),
                 ["inner", "stride_x0", "stride_x1", "stride_r0", "stride_r1"], ["eps"],
                 dict(N=1024, BLOCK=1024, HAS_RESIDUAL=True)),
}
try:
    found = {f"{name} pdl={pdl}": build(*spec, pdl) for name, spec in kernels.items()
             for pdl in (False, True)}
except TypeError as e:  # another Triton's ASTSource
    print(json.dumps({"skip": f"ASTSource: {e}"}))
    sys.exit(0)
print(json.dumps({"compiled": found}))
"""


def test_every_decode_kernel_waits_before_it_reads_what_the_kernel_before_wrote() -> None:
    """As programmatic dependent launches (`--pdl`) the rotation, decode attention's split
    and combine, and the norm wait (griddepcontrol.wait), then let the next launch start,
    before any store and before any load but of what no kernel of the step writes: the
    attention kernels' sequence length (staged by the host), the rotation's positions,
    slots, angles and norm weights; without PDL neither instruction is there."""
    compiled = _compile(_DEPENDENT)["compiled"]
    assert len(compiled) == 8, compiled
    for name, found in compiled.items():
        if name.endswith("pdl=False"):
            assert found["gdc"] == [], (name, found)
            continue
        assert found["gdc"][:2] == [
            "griddepcontrol.wait",
            "griddepcontrol.launch_dependents",
        ], (name, found)
        assert found["stores_before"] == 0, (name, found)
        if name.startswith("rotary"):  # (its position, then the angles at it, ...)
            assert found["loads_before"] > 1, (name, found)
        else:
            attention = name.startswith(("decode_split", "combine"))
            assert found["loads_before"] == (1 if attention else 0), (name, found)
