"""The bundled SmolLM2 on a GPU (Triton kernels, CUDA graphs) against the CPU torch path.

GPU only: run with `pytest -m gpu` on a CUDA machine.

In float32 the GPU's greedy tokens must equal the CPU's exactly. In bf16/fp16 the
weights and activations are rounded, so greedy decoding may take the other branch
where the CPU's own top two logits are nearly tied; there the test checks that every
token up to the first difference is equal, that the GPU's logits stay close to the
CPU's on that shared prefix, and that the difference happens only at a near tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_common.model_path import BUNDLED_DISTRIBUTION
from tests.conftest import installed
from tests.kernels.reference import ON_GPU

# A lent GPU machine has no bundled model: its 98 MB are over what a device call carries
# (tests/kernels/test_engine_triton.py runs tiny models there against transformers).
pytestmark = [
    *ON_GPU,
    pytest.mark.skipif(not installed(BUNDLED_DISTRIBUTION), reason=f"needs {BUNDLED_DISTRIBUTION}"),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]
N = 32
# Half precision: largest logit error allowed on the shared prefix, and the largest
# fp32 margin between the CPU's token and the GPU's where the two may part.
LOGIT_TOL = {"bfloat16": 1.5, "float16": 0.5}
TIE = {"bfloat16": 1.0, "float16": 0.35}


def _greedy(path: Path, device: str, dtype: str) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: the N greedy tokens and the fp32 logits that chose them [N, V] (CPU)."""
    from compute_plane.config import ComputeConfig
    from control_plane.config import ControlConfig
    from hetero_infer.offline import OfflineLLM
    from hetero_proto import control_pb2 as pb

    llm = OfflineLLM(
        str(path),
        compute=ComputeConfig(
            model=str(path),
            device=device,
            dtype=dtype,
            metrics_port=-1,
            gpu_memory_utilization=0.3,
            max_num_seqs=8,
        ),
        control=ControlConfig(model=str(path), metrics_port=-1),
    )
    if device == "cuda":
        assert llm.engine.describe().attention_backend == "triton"
        assert llm.engine.graphs is not None, "decode steps should replay CUDA graphs"
    llm.engine.capture_logits = True
    params = pb.GenerationParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    out = []
    for p in PROMPTS:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
        llm.engine.captured_logits.clear()
        (done,) = llm.generate([prompt], [params])
        (rows,) = llm.engine.captured_logits.values()
        logits = torch.cat(rows).float().cpu()
        start = len(done.prompt_token_ids) - 1  # the row whose logits chose token 0
        out.append((done.token_ids[0], logits[start : start + N]))
    return out


@pytest.fixture(scope="module")
def cpu_run(smollm2_path: Path) -> list[tuple[list[int], torch.Tensor]]:
    return _greedy(smollm2_path, "cpu", "float32")


def test_greedy_tokens_on_gpu_equal_cpu_in_fp32(
    smollm2_path: Path, cpu_run: list[tuple[list[int], torch.Tensor]]
) -> None:
    for prompt, (ours, _), (ref, _) in zip(
        PROMPTS, _greedy(smollm2_path, "cuda", "float32"), cpu_run, strict=True
    ):
        assert ours == ref, f"{prompt!r}: GPU fp32 tokens differ from the CPU's"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_greedy_follows_cpu_until_a_near_tie(
    smollm2_path: Path, cpu_run: list[tuple[list[int], torch.Tensor]], dtype: str
) -> None:
    report = []
    for prompt, (ours, gpu_lg), (ref, cpu_lg) in zip(
        PROMPTS, _greedy(smollm2_path, "cuda", dtype), cpu_run, strict=True
    ):
        same = next((i for i in range(N) if ours[i] != ref[i]), N)
        err = (gpu_lg[: same + 1] - cpu_lg[: same + 1]).abs().max().item()
        margin = (cpu_lg[same, ref[same]] - cpu_lg[same, ours[same]]).item() if same < N else None
        report.append(f"{prompt[:20]!r}: equal for {same}, logit err {err:.3f}, margin {margin}")
        assert err <= LOGIT_TOL[dtype], f"{dtype} {prompt!r}: logit error {err:.3f}"
        if margin is not None:
            assert margin <= TIE[dtype], (
                f"{dtype} {prompt!r}: token {same} differs where the CPU's margin is {margin:.3f}"
            )
    print(f"\n{dtype}: " + "\n".join(report))
