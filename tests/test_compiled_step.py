"""The compiled decode step (runtime/layers/compiled_step.py) on a tiny Llama, in float32.

Compiling is slow (tens of seconds per graph on these machines), so one module-scoped engine
with buckets up to 8 serves every in-process test, and its graphs are compiled once.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.layers.compiled_step import CompiledDecodeStep, batch_buckets
from runtime.layers.gemm import LINEAR
from tests.engine_helpers import hf_greedy

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def notices() -> list[str]:
    return []


@pytest.fixture(scope="module")
def compiled(tiny_llama_path: Path, notices: list[str]) -> Engine:
    return Engine(
        tiny_llama_path,
        kv_pool="4MiB",
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        speculate_max_batch=1,  # one guessing sequence: verification graphs of (1, Q)
        compile=True,
        on_notice=notices.append,
    )


def prompts(count: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 40000, (5 + 23 * i,), generator=g).tolist() for i in range(count)]


def test_graphs_take_the_gemm_plans_forms(compiled: Engine) -> None:
    """The GEMM plan's form for each bucket is a constant of that bucket's graph: on the AMD
    EPYC the default model's batch-1 step ran at 20 tok/s with F.linear everywhere (eager: 32)
    and at 41 with the plan's weight-major products."""
    lean, step = compiled.runner.lean_forward, step_of(compiled)
    assert lean is not None
    head = step.graph.head
    shape = (head.weight.shape[0], head.weight.shape[1])
    assert head.chunks == {b: lean.gemm.forms_for(b).get(shape, LINEAR) for b in step.row_counts}


def step_of(engine: Engine) -> CompiledDecodeStep:
    step = engine.runner.compiled_step
    assert step is not None
    return step


def test_greedy_equals_generate_alone_and_batched(compiled: Engine, notices: list[str]) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    reference = [hf_greedy(compiled, p, NEW_TOKENS, ignore_eos=True) for p in prompts()]
    alone = [compiled.generate(p, params)[0].token_ids for p in prompts()]
    together = [c.token_ids for c in compiled.generate(prompts(), params)]
    assert alone == reference
    assert together == reference
    report = step_of(compiled).report()
    assert report.enabled and report.notice is None
    assert set(report.compiled_buckets) == {1, 4}  # 3 sequences ran in the bucket of 4
    # Every step after the prefill ran compiled: 63 for each request alone, 63 for the three
    # together (their prompts prefill in one step).
    assert report.num_compiled_steps == 4 * (NEW_TOKENS - 1)
    assert not any("eager" in line for line in notices)
    assert compiled.stats().compiled


def run_staggered(engine: Engine) -> dict[str, list[int]]:
    """A batch growing 1 -> 3 -> 8 decoding sequences, then shrinking as they finish."""
    ids = prompts(8)
    lengths = [40, 36, 30, 24, 20, 16, 12, 8]  # each joins later and most stop sooner
    tokens: dict[str, list[int]] = {}
    joins = {0: [0], 3: [1, 2], 6: [3, 4, 5, 6, 7]}  # step -> requests that arrive then
    params = {i: SamplingParams(max_tokens=lengths[i], ignore_eos=True) for i in range(8)}
    names: dict[str, int] = {}
    step = 0
    while step in joins or engine.scheduler.running or engine.scheduler.waiting:
        for i in joins.get(step, []):
            names[engine.add_request(ids[i], params[i])] = i
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    return {str(names[rid]): t for rid, t in tokens.items()}


def test_a_growing_and_shrinking_batch_reuses_its_graphs(compiled: Engine) -> None:
    step = step_of(compiled)
    assert step.buckets == batch_buckets(8) == (1, 2, 4, 8)
    first = run_staggered(compiled)
    report = step.report()
    assert report.compiled_buckets == (1, 2, 4, 8)
    # One graph per bucket: the growing context never recompiled one.
    assert report.num_compilations == 4
    again = run_staggered(compiled)
    assert step.num_compilations == 4
    assert again == first
    lengths = [40, 36, 30, 24, 20, 16, 12, 8]
    for i, prompt in enumerate(prompts(8)):
        assert first[str(i)] == hf_greedy(compiled, prompt, lengths[i], ignore_eos=True)


class ReferenceGuesses:
    """Guesses plain decoding's own continuation, with every third guess wrong."""

    def __init__(self, prompt: list[int], reference: list[int]) -> None:
        self.prompt, self.reference = prompt, reference

    def propose(self, seqs, num_tokens):  # type: ignore[no-untyped-def]
        guesses = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            start = len(seq.token_ids) - len(self.prompt)
            right = self.reference[start : start + k]
            guesses.append([t if (start + i) % 3 else (t + 1) % 40000 for i, t in enumerate(right)])
        return guesses

    def forget(self, seq) -> None:  # type: ignore[no-untyped-def]
        pass

    def reset_prefix_cache(self) -> None:
        pass


def test_verification_steps_run_through_the_compiled_graphs(compiled: Engine) -> None:
    """A speculating sequence's verification rows go through graphs of their own, bucketed by
    (sequences, query rows), and the tokens stay generate()'s."""
    prompt = prompts(1)[0]
    reference = hf_greedy(compiled, prompt, 40, ignore_eos=True)
    saved = compiled._drafters["ngram"]
    compiled._drafters["ngram"] = ReferenceGuesses(prompt, reference)
    step = step_of(compiled)
    before = step.report()
    try:
        compiled.reset_prefix_cache()
        done = compiled.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, speculate="ngram"))[0]
    finally:
        compiled._drafters["ngram"] = saved
    assert done.token_ids == reference
    metrics = done.metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    after = step.report()
    assert after.enabled and set(after.compiled_buckets) <= {1, 2, 4, 8}
    assert after.compiled_verify_shapes, "guesses were verified"
    assert {s for s, _ in after.compiled_verify_shapes} == {1}
    assert {q for _, q in after.compiled_verify_shapes} <= set(step.query_buckets)
    # Every step after the prefill ran compiled, verification steps included.
    steps = 40 - 1 - metrics.num_accepted_tokens
    assert after.num_compiled_steps - before.num_compiled_steps == steps


FALLBACK_SCRIPT = """
import json, sys
import torch
from runtime import Engine, SamplingParams
from tests.engine_helpers import hf_greedy
notices = []
engine = Engine(sys.argv[1], kv_pool="4MiB", device="cpu", dtype="float32", gemm="torch",
                compile=True, on_notice=notices.append)
prompt = torch.randint(3, 40000, (20,), generator=torch.Generator().manual_seed(2)).tolist()
params = SamplingParams(max_tokens=24, ignore_eos=True)
tokens = [engine.generate(prompt, params)[0].token_ids, engine.generate([prompt] * 2, params)[0].token_ids]
report = engine.runner.compiled_step.report()
print(json.dumps({
    "notices": notices, "equal": all(t == hf_greedy(engine, prompt, 24, ignore_eos=True) for t in tokens),
    "enabled": report.enabled, "compiled": engine.stats().compiled,
}))
"""


def test_without_a_compiler_the_engine_runs_eager_after_one_notice(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    """Inductor reads CXX when its config is imported, hence a fresh process; and a fresh
    inductor cache, or a graph cached by an earlier run would load without a compiler."""
    env = dict(os.environ, CXX="/nonexistent", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, str(tiny_llama_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    fallbacks = [line for line in result["notices"] if "run eager" in line]
    assert len(fallbacks) == 1, result["notices"]
    assert "compiling failed" in fallbacks[0] and "\n" not in fallbacks[0]
    assert result["equal"]
    assert not result["enabled"] and not result["compiled"]
    assert "Traceback" not in done.stderr


def test_int4_weights_decode_through_the_graph(tiny_llama_path: Path) -> None:
    """int4 weights (and their rescored head) run in the graph and compute what the eager int4
    forward does, up to an exact bfloat16 tie: on the Intel Xeon the default model decoded at
    43 tok/s eager and 83 compiled this way (bench.decode, batch 1)."""
    from tests.test_weight_formats import assert_equal_up_to_a_tie

    options = dict(kv_pool="4MiB", device="cpu", weights="int4", max_num_seqs=1, speculate="off")
    compiled = Engine(tiny_llama_path, compile=True, **options)  # type: ignore[arg-type]
    eager = Engine(tiny_llama_path, **options)  # type: ignore[arg-type]
    step = step_of(compiled)
    assert [layer.qkv.kind for layer in step.graph.layers][:1] == ["int4"]
    assert step.graph.head.kind == "rescored" and step.graph.head.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = prompts(1)[0]
    expected = eager.generate(prompt, params)[0].token_ids
    got = compiled.generate(prompt, params)[0].token_ids
    assert_equal_up_to_a_tie(eager, prompt, expected, got)
    report = step.report()
    assert report.enabled and report.num_compiled_steps == 15
    assert compiled.stats().compiled and compiled.stats().weight_format == "int4"


CACHE_DIR_SCRIPT = """
import torch._dynamo  # as transformers does: it writes inductor's /tmp default into the environment
from torch._inductor.runtime.cache_dir_utils import cache_dir
from runtime.layers.compiled_step import configure_inductor
configure_inductor()
print(cache_dir())
"""


@pytest.mark.parametrize("user_set", [False, True])
def test_compiled_graphs_are_cached_under_liubais_cache_dir(tmp_path: Path, user_set: bool) -> None:
    """Inductor compiles into the directory its ``cache_dir()`` names: liubai's cache, even after
    dynamo's import wrote /tmp's default; a directory the user chose stays theirs."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["LIUBAI_CACHE_DIR"] = str(tmp_path / "liubai")
    if user_set:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    done = subprocess.run(
        [sys.executable, "-c", CACHE_DIR_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    expected = tmp_path / ("mine" if user_set else "liubai/inductor")
    assert done.stdout.strip().splitlines()[-1] == str(expected)
