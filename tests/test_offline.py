"""OfflineLLM, the in-process batch API (vLLM's LLM.generate), on the bundled model."""

from __future__ import annotations

from pathlib import Path

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from hetero_infer.offline import OfflineLLM
from hetero_proto import control_pb2 as pb

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "Water is", "Red, green,"]


def test_more_prompts_than_the_waiting_queue_all_run_as_each_runs_alone(
    smollm2_path: Path,
) -> None:
    """Offline, every prompt is admitted at once however small --max-waiting is (vLLM's
    LLM.generate takes any number); a batch's greedy output is each prompt's output alone."""
    path = str(smollm2_path)
    llm = OfflineLLM(
        path,
        compute=ComputeConfig(model=path, metrics_port=-1, kv_cache_bytes=32 << 20),
        control=ControlConfig(model=path, metrics_port=-1, max_waiting=2),
    )
    params = pb.GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = llm.generate(PROMPTS, [params] * len(PROMPTS))
    alone = [llm.generate([p], [params])[0] for p in PROMPTS]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    assert all(len(c.token_ids[0]) == 6 for c in batch)
    assert llm.control_config.max_waiting == 2  # the caller's config is left as it was
