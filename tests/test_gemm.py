"""The GEMM plan: both forms of a product agree, the timed choice is cached per machine, and the
real model decodes the same tokens as ``generate()`` with every product weight-major."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime import Engine
from runtime.layers import gemm, llama_forward
from runtime.layers.gemm import LINEAR, ROW_BUCKETS, GemmPlan, matmul, plan_for
from tests.engine_helpers import GREEDY, NEW_TOKENS, PROMPTS, chat_ids, hf_greedy


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_form_computes_the_linear_product(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(160, 96, generator=generator)
    bias = torch.randn(160, generator=generator) if with_bias else None
    for chunk in (1, 2, 4, 64):
        y = matmul(x, weight, bias, chunk)
        assert y.shape == (rows, 160) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(matmul(x, weight, bias, LINEAR), F.linear(x, weight, bias))


def test_row_counts_map_to_the_smallest_bucket_not_below_them() -> None:
    entries = (1, LINEAR, 2, LINEAR, 8, LINEAR, 32)  # buckets 1, 4, 16, 64 weight-major
    plan = GemmPlan({(512, 256): entries, (256, 512): (LINEAR,) * len(ROW_BUCKETS)})
    assert plan.forms_for(1) == {(512, 256): 1}
    assert plan.forms_for(2) == {}  # bucket 2
    assert plan.forms_for(3) == {(512, 256): 2}  # bucket 4
    assert plan.forms_for(7) == {}  # bucket 8
    assert plan.forms_for(24) == {}  # bucket 32: a short prefill over a cached chat
    assert plan.forms_for(33) == {(512, 256): 32}  # bucket 64
    assert plan.forms_for(64) == {(512, 256): 32}
    assert plan.forms_for(65) == {}  # prefill-sized: always F.linear
    assert GemmPlan.from_json(plan.to_json()).chunks == plan.chunks
    with pytest.raises(ValueError):
        GemmPlan.from_json({"512x256": [1, 2]})


@pytest.fixture
def plan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty plan directory of this test's own."""
    directory = tmp_path / "gemm-plans"
    monkeypatch.setenv(gemm.PLAN_DIR_ENV, str(directory))
    return directory


def test_plans_live_in_the_cache_dir_unless_told_otherwise(
    fake_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(gemm.PLAN_DIR_ENV)
    assert gemm.plan_dir() == fake_cache / "gemm"
    monkeypatch.setenv(gemm.PLAN_DIR_ENV, str(fake_cache / "elsewhere"))
    assert gemm.plan_dir() == fake_cache / "elsewhere"


@pytest.fixture(scope="module")
def plan_dir_seen_by_a_module_fixture() -> Path:
    return gemm.plan_dir()


def test_tests_keep_plans_out_of_the_user_cache(
    plan_dir_seen_by_a_module_fixture: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """conftest.py's session fixture: plans go to this session's temporary directory, for the
    module-scoped engines too (they are built before any function-scoped fixture runs)."""
    session = tmp_path_factory.getbasetemp()
    assert gemm.plan_dir().is_relative_to(session)
    assert plan_dir_seen_by_a_module_fixture.is_relative_to(session)


def test_plan_is_timed_once_then_read_from_the_cache(plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int]] = []

    def fake_time(weights: list[torch.Tensor]) -> tuple[int, ...]:
        timed.append(tuple(weights[0].shape))  # type: ignore[arg-type]
        return (1,) + (LINEAR,) * (len(ROW_BUCKETS) - 1)

    monkeypatch.setattr(gemm, "_time_shape", fake_time)
    weights = [torch.zeros(512, 256), torch.zeros(512, 256), torch.zeros(256, 1024), torch.zeros(8, 8)]
    first = plan_for(weights)
    assert sorted(timed) == [(256, 1024), (512, 256)]  # each shape once; the tiny one never
    assert first.forms_for(1) == {(512, 256): 1, (256, 1024): 1}
    [cached] = plan_dir.glob("*.json")
    assert json.loads(cached.read_text()) == first.to_json()

    assert plan_for(weights).chunks == first.chunks
    assert len(timed) == 2  # read back, not timed again

    cached.write_text("{not json")
    assert plan_for(weights).chunks == first.chunks
    assert len(timed) == 4  # a corrupt cache is timed again and rewritten
    assert json.loads(cached.read_text()) == first.to_json()


def test_no_plan_for_tiny_weights_or_when_disabled(plan_dir: Path) -> None:
    assert plan_for([torch.zeros(64, 64)]).chunks == {}
    assert plan_for([torch.zeros(512, 512)], enabled=False).chunks == {}
    assert not plan_dir.exists()


def test_engine_rejects_an_unknown_gemm_option() -> None:
    with pytest.raises(ValueError, match="gemm must be"):
        Engine("unused", gemm="fastest")


@pytest.mark.model
def test_weight_major_products_still_equal_generate(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def every_product_weight_major(weights: list[torch.Tensor], enabled: bool = True) -> GemmPlan:
        asked.append(enabled)
        return GemmPlan({(w.shape[0], w.shape[1]): (1, 2, 2, 4, 8, 16, 32) for w in weights})  # 3 rows: 2 + 1

    monkeypatch.setattr(llama_forward, "plan_for", every_product_weight_major)
    engine = Engine(default_model_path, kv_pool="32MiB", dtype="float32", device="cpu")
    lean = engine.runner.lean_forward
    assert lean is not None and asked == [True]
    shapes = {(w.shape[0], w.shape[1]) for w in lean.matrices()}
    assert set(lean.gemm.chunks) == shapes
    prompts = [chat_ids(engine, p) for p in PROMPTS[:3]]
    reference = [hf_greedy(engine, ids, NEW_TOKENS, ignore_eos=True) for ids in prompts]
    assert engine.generate(prompts[0], GREEDY)[0].token_ids == reference[0]  # batch 1: one row padded to two
    engine.reset_prefix_cache()
    batched = engine.generate(prompts, GREEDY)  # 3 rows per step: a chunk of 2 and one of 1
    assert [c.token_ids for c in batched] == reference
