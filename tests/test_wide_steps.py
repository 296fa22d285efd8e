"""Wide steps: bfloat16 copies of the quantized weights for steps of many rows (prefill).

The copies must be the matrices the kernels multiply by, the threshold a timing kept once per
machine, and on the default model a long prompt must read through them at the format's quality.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.engine.scoring import MAX_KLD, MIN_TOP1, held_token_ids, quality
from runtime.layers import gemm, wide_steps
from runtime.layers.weights import QuantizedWeight, quantize
from runtime.layers.wide_steps import WideMatrix, build_wide_copies, dense_copy, threshold

# 30 layers of SmolLM2-135M: (960 + 576 + 3072) x 576 and 576 x 1536 weights, 2 bytes each.
DEFAULT_MODEL_COPY_BYTES = 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) * 2


@pytest.fixture
def plan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A timing cache of this test's own, so no test reads another's threshold."""
    monkeypatch.setenv(gemm.PLAN_DIR_ENV, str(tmp_path / "gemm"))
    return tmp_path / "gemm"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_copy_is_the_matrix_the_kernel_multiplies_by(fmt: str) -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    packed = quantize(weight, fmt)
    copy = dense_copy(packed, weight)
    assert copy.dtype == torch.bfloat16 and copy.shape == (64, 128)
    # The kernel's own matrix, read back through it: bit for bit the same bfloat16 numbers.
    assert torch.equal(copy, packed.dequantize().to(torch.bfloat16))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    exact = x.float() @ copy.float().T
    # Both products accumulate in float32 and round the result to bfloat16 (8 significant bits).
    for y in (WideMatrix(copy).matmul(x), packed.matmul(x)):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=2**-7 * float(exact.abs().max()))


@pytest.mark.parametrize(
    ("faster", "expected"),
    [
        ([False, False, True, True, True], 16),
        ([True, False, True, True, True], 16),  # a lone early win does not count
        ([True] * 5, 4),
        ([False] * 5, None),
        ([True, True, True, True, False], None),  # losing at the widest count: never
    ],
)
def test_the_threshold_is_where_the_copies_win_from_then_on(faster: list[bool], expected: int | None) -> None:
    assert threshold((4, 8, 16, 32, 64), faster) == expected


def _matrices() -> tuple[list[torch.Tensor], list[QuantizedWeight]]:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(512, 256, generator=generator) for _ in range(4)]  # large enough to matter
    return weights, [quantize(w, "int4") for w in weights]


def test_the_threshold_is_timed_once_per_machine(plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights, packed = _matrices()
    timings: list[int] = []

    def timed(*_args: object) -> int:
        timings.append(1)
        return 8

    monkeypatch.setattr(wide_steps, "time_min_rows", timed)
    first = build_wide_copies(packed, weights)
    second = build_wide_copies(packed, weights)
    assert first is not None and second is not None
    assert (first.min_rows, second.min_rows, len(timings)) == (8, 8, 1)
    assert first.nbytes == 4 * 512 * 256 * 2
    assert len(list(plan_dir.glob("*.json"))) == 1


def test_no_copies_where_they_never_win(plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights, packed = _matrices()
    monkeypatch.setattr(wide_steps, "time_min_rows", lambda *_args: None)
    assert build_wide_copies(packed, weights) is None

    def refuse(*_args: object) -> None:
        raise AssertionError("the kept timing says the copies never win: none are built")

    monkeypatch.setattr(wide_steps, "dense_copy", refuse)
    assert build_wide_copies(packed, weights) is None


def test_no_copies_when_disabled_tiny_or_beyond_the_memory_share(
    plan_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights, packed = _matrices()
    monkeypatch.setattr(wide_steps, "time_min_rows", lambda *_args: 4)
    assert build_wide_copies(packed, weights, enabled=False) is None
    small = [torch.randn(64, 64) for _ in range(2)]
    assert build_wide_copies([quantize(w, "int4") for w in small], small) is None
    copy_bytes = 4 * 512 * 256 * 2
    monkeypatch.setattr(wide_steps, "available_memory_bytes", lambda: 3 * copy_bytes)  # a quarter is less
    assert build_wide_copies(packed, weights) is None
    monkeypatch.setattr(wide_steps, "available_memory_bytes", lambda: 4 * copy_bytes)
    assert build_wide_copies(packed, weights) is not None


def test_a_long_prompt_reads_through_the_copies_on_the_default_model(
    default_model_path: Path, plan_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The threshold this machine would time is its own; 16 rows here, whatever the CPU.
    monkeypatch.setattr(wide_steps, "time_min_rows", lambda *_args: 16)
    engine = Engine(default_model_path, kv_pool="32MiB", device="cpu", weights="int4", speculate="off")
    stats = engine.stats()
    assert (stats.wide_step_rows, stats.wide_copy_bytes) == (16, DEFAULT_MODEL_COPY_BYTES)

    products: list[tuple[int, int]] = []
    multiply = WideMatrix.matmul

    def counted(self: WideMatrix, x: torch.Tensor) -> torch.Tensor:
        products.append(tuple(x.shape))
        return multiply(self, x)

    monkeypatch.setattr(WideMatrix, "matmul", counted)
    held = held_token_ids(engine.tokenizer)
    completion = engine.generate(held[:200], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(completion.token_ids) == 8
    # The prompt's one chunk of 200 rows through all 120 copies; the 1-row decode steps through none.
    assert Counter(products) == {(200, 576): 90, (200, 1536): 30}
    products.clear()
    engine.generate(held[:15], SamplingParams(max_tokens=2, ignore_eos=True))
    assert products == []  # 15 rows: the kernels

    reference = Engine(default_model_path, kv_pool="32MiB", device="cpu", weights="float32")
    expected = reference.prompt_logits(held)
    wide = quality(expected, engine.prompt_logits(held, decode_kernels=False), held)
    assert wide.kld_mean <= MAX_KLD and wide.top1_agree >= MIN_TOP1, wide
