"""OfflineLLM takes vLLM's {"prompt": ..., "cache_salt": ...} prompt dicts: prompts share
prefix-cache blocks only under one salt (or none); a bad salt is refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from hetero_infer.offline import OfflineLLM
from hetero_proto import control_pb2 as pb

# Three 16-token blocks and more: a hit is 48 tokens.
PROMPT = "A prompt for salted prefix caching, run offline by several tenants in turn. " * 3


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> OfflineLLM:
    path = str(smollm2_path)
    # One request at a time: each prompt is computed (and cached) before the next looks.
    return OfflineLLM(
        path,
        compute=ComputeConfig(model=path, metrics_port=-1, block_size=16),
        control=ControlConfig(model=path, metrics_port=-1, max_num_seqs=1),
    )


def _hits(llm: OfflineLLM) -> float:
    """Prompt tokens found in the prefix cache so far (hetero_prefix_cache_hits_total)."""
    return sum(
        s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == "hetero_prefix_cache_hits_total"
        and s.labels.get("model_name") == llm.model_name
    )


def test_salted_prompts_hit_the_cache_only_under_their_own_salt(llm: OfflineLLM) -> None:
    p = pb.GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    n = len(llm.tokenizer.encode(PROMPT))
    full = (n - 1) // 16 * 16  # the last token is always computed
    before = _hits(llm)
    salted = [
        {"prompt": PROMPT, "cache_salt": "a"},
        {"prompt": PROMPT, "cache_salt": "b"},
        {"prompt": PROMPT},
        {"prompt": PROMPT, "cache_salt": "a"},  # the one hit: a's blocks
    ]
    out = llm.generate(salted, p)
    assert _hits(llm) - before == full
    assert len({tuple(c.token_ids[0]) for c in out}) == 1  # greedy: one answer
    before = _hits(llm)
    llm.generate([PROMPT, PROMPT, PROMPT], p)  # no salt: the second and third hit
    assert _hits(llm) - before == 2 * full
    # A salt in the params works as well, and one given in both places must agree.
    before = _hits(llm)
    ids = llm.tokenizer.encode(PROMPT)
    salt_c = pb.GenerationParams(max_tokens=1, temperature=0.0, cache_salt="c")
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "c"}, PROMPT], [p, salt_c])
    assert _hits(llm) - before == full


def test_a_bad_salt_is_refused_naming_it(llm: OfflineLLM) -> None:
    p = pb.GenerationParams(max_tokens=1)
    for salt, message in [
        ("", r"^prompts\[0\]\['cache_salt'\] must be a non-empty str, got ''$"),
        (5, r"^prompts\[0\]\['cache_salt'\] must be a non-empty str, got int$"),
    ]:
        with pytest.raises(TypeError, match=message):
            llm.generate([{"prompt": "Hi", "cache_salt": salt}], p)
    with pytest.raises(ValueError, match=r"^prompts\[1\]\['cache_salt'\] is 'a' but its params'"):
        llm.generate(
            ["Hi", {"prompt": "Hi", "cache_salt": "a"}], pb.GenerationParams(cache_salt="b")
        )
    with pytest.raises(TypeError, match=r"got keys \['cache_salt'\]$"):
        llm.generate([{"cache_salt": "a"}], p)
    shared = pb.GenerationParams(max_tokens=1)
    llm.generate([{"prompt": "Hi", "cache_salt": "a"}], [shared])
    assert shared.cache_salt == ""  # the caller's params are left as they were
