"""``liubai plan``: the KV planner's figures equal hand computation and the engine's own.

Hand computation is written out as the formula in each test (2 x layers x KV heads x head dim x
bytes for the model dtype; codes plus scales per KV head for quantized storage, as
``runtime/kv/quant.py`` describes them), so a reader can check every number. The engine
comparison builds a real :class:`runtime.Engine` on tiny random models and reads its stats.
"""

import argparse
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from agent.cli.plan import add_parser, render_plan, run
from runtime.capacity import (
    BLOCK_SIZE,
    KVPlan,
    ModelShape,
    PlanRequest,
    parse_context,
    plan_kv,
    read_shape,
    shape_from_config,
)
from runtime.errors import ModelError

GIB = 1024**3
SMOLLM2 = ModelShape("smollm2", "llama", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64)
TEXTBOOK_MHA = ModelShape("", "", num_layers=80, num_attention_heads=64, num_kv_heads=64, head_dim=128)
TEXTBOOK_GQA = ModelShape("", "", num_layers=80, num_attention_heads=64, num_kv_heads=8, head_dim=128)

# Bytes per token and KV head at block size 16 and head dim D (kv_quant.py's module docstring):
#   int8 keys:   D codes + D fp8 scales per 16-token block   = D + D/16
#   int8 values: D codes + one fp16 scale per token          = D + 2
#   fp8 either:  D codes + one fp16 scale per token          = D + 2
#   int4 keys:   D/2 packed codes + 2 x D fp8 per block      = D/2 + 2D/16
#   int4 values: D/2 packed codes + fp16 step and minimum    = D/2 + 4


def per_head(kv_dtype: str, is_key: bool, d: int, model_bytes: int) -> Fraction:
    if kv_dtype == "auto":
        return Fraction(d * model_bytes)
    if kv_dtype == "int8":
        return d + Fraction(d, 16) if is_key else Fraction(d + 2)
    if kv_dtype == "fp8":
        return Fraction(d + 2)
    return Fraction(d, 2) + Fraction(2 * d, 16) if is_key else Fraction(d, 2) + 4


# (dtype, k_dtype, v_dtype, hand-computed bytes per token of SmolLM2: 30 layers x 3 KV heads x ...)
SMOLLM2_CASES = [
    ("float32", "auto", "auto", 2 * 30 * 3 * 64 * 4),  # 46,080
    ("bfloat16", "auto", "auto", 2 * 30 * 3 * 64 * 2),  # 23,040
    ("float16", "auto", "auto", 2 * 30 * 3 * 64 * 2),
    ("float32", "int8", "int8", 30 * 3 * ((64 + 4) + (64 + 2))),  # 12,060
    ("float32", "fp8", "fp8", 30 * 3 * ((64 + 2) + (64 + 2))),  # 11,880
    ("float32", "int4", "int4", 30 * 3 * ((32 + 8) + (32 + 4))),  # 6,840
    ("float32", "int8", "int4", 30 * 3 * ((64 + 4) + (32 + 4))),  # 9,360
    ("float32", "auto", "int8", 30 * 3 * (64 * 4 + (64 + 2))),  # 28,980
    ("bfloat16", "int4", "auto", 30 * 3 * ((32 + 8) + 64 * 2)),  # 15,120
    ("float16", "fp8", "int4", 30 * 3 * ((64 + 2) + (32 + 4))),  # 9,180
]


@pytest.mark.parametrize(("dtype", "k_dtype", "v_dtype", "expected"), SMOLLM2_CASES)
def test_bytes_per_token_equals_hand_computation(
    dtype: str, k_dtype: str, v_dtype: str, expected: int
) -> None:
    plan = plan_kv(SMOLLM2, PlanRequest(dtype=dtype, k_dtype=k_dtype, v_dtype=v_dtype))
    assert plan.bytes_per_token == expected
    assert plan.bytes_per_block == expected * 16
    assert plan.mha_bytes_per_token == expected * 3  # 9 heads instead of 3 KV heads


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8", "int4"])
@pytest.mark.parametrize("shape", [TEXTBOOK_GQA, ModelShape("", "", 2, 4, 1, 72)])
def test_every_kv_dtype_on_other_shapes(shape: ModelShape, kv_dtype: str) -> None:
    """Head dims 128 and 72 (72 / 16 is not whole: int8 keys cost 76.5 B per head and token)."""
    d, layers, heads = shape.head_dim, shape.num_layers, shape.num_kv_heads
    expected = layers * heads * (per_head(kv_dtype, True, d, 2) + per_head(kv_dtype, False, d, 2))
    plan = plan_kv(shape, PlanRequest(dtype="float16", k_dtype=kv_dtype, v_dtype=kv_dtype))
    assert plan.bytes_per_token == expected
    # The printed terms are the same arithmetic: layers x KV heads x (K + V per head and token).
    k = Fraction(plan.key.data_bytes_per_head_block + plan.key.scale_bytes_per_head_block, 16)
    v = Fraction(plan.value.data_bytes_per_head_block + plan.value.scale_bytes_per_head_block, 16)
    assert layers * heads * (k + v) == plan.bytes_per_token


def test_textbook_example_is_computed_not_quoted() -> None:
    """80 layers x 64 KV heads x head dim 128 in fp16 at 8,192 tokens: 21.5 GB by the formula.

    The figure often quoted for it is 43 GB, which counts K and V twice; the planner computes.
    """
    request = PlanRequest(dtype="float16", context=8192)
    mha = plan_kv(TEXTBOOK_MHA, request)
    assert mha.bytes_per_token == 2 * 80 * 64 * 128 * 2 == 2_621_440
    assert mha.session_bytes == 21_474_836_480
    gqa = plan_kv(TEXTBOOK_GQA, request)
    assert gqa.session_bytes == 2 * 80 * 8 * 128 * 2 * 8192 == 2_684_354_560
    assert gqa.mha_bytes_per_token == mha.bytes_per_token
    assert gqa.gqa_saving == 8.0


def test_scales_per_block_make_bytes_per_token_depend_on_block_size() -> None:
    """int8 keys keep one fp8 scale per channel and block: 64 + 64/16 at 16, 64 + 64/32 at 32."""
    at16 = plan_kv(SMOLLM2, PlanRequest(k_dtype="int8", v_dtype="int8"))
    at32 = plan_kv(SMOLLM2, PlanRequest(k_dtype="int8", v_dtype="int8", block_size=32))
    assert at16.bytes_per_token == 30 * 3 * (68 + 66)
    assert at32.bytes_per_token == 30 * 3 * (66 + 66)
    assert at16.key.scales_per_block and not at16.value.scales_per_block
    int4 = plan_kv(SMOLLM2, PlanRequest(k_dtype="int4", v_dtype="int4"))
    assert int4.key.scales_per_block and not int4.value.scales_per_block
    fp8 = plan_kv(SMOLLM2, PlanRequest(k_dtype="fp8", v_dtype="fp8"))
    assert not fp8.key.scales_per_block and not fp8.value.scales_per_block
    assert "at block size 16" in render_plan(at16)
    assert "at block size" not in render_plan(fp8)


def test_sessions_take_whole_blocks() -> None:
    """8,200 tokens occupy 513 blocks (8,208 tokens); concurrency counts blocks, not tokens."""
    plan = plan_kv(SMOLLM2, PlanRequest(context=8200, pool_bytes=24 * GIB, num_sessions=24))
    assert plan.session_bytes == 8200 * 46_080
    assert plan.blocks_per_session == 513
    assert plan.session_allocated_bytes == 513 * 16 * 46_080
    assert plan.pool_blocks == 24 * GIB // (16 * 46_080) == 34_952
    assert plan.max_sessions == 34_952 // 513 == 68
    assert plan.pool_bytes_needed == 24 * 513 * 16 * 46_080


def test_pool_smaller_than_a_block() -> None:
    plan = plan_kv(SMOLLM2, PlanRequest(context=8192, pool_bytes=1024))
    assert (plan.pool_blocks, plan.max_sessions) == (0, 0)
    assert "holds no 16-token block" in render_plan(plan)


def test_context_defaults_to_the_models_own() -> None:
    shape = ModelShape("m", "llama", 30, 9, 3, 64, max_context=8192)
    plan = plan_kv(shape, PlanRequest(pool_bytes=24 * GIB))
    assert (plan.context, plan.context_is_model_max, plan.max_sessions) == (8192, True, 68)
    with pytest.raises(ValueError, match="needs a context length"):
        plan_kv(TEXTBOOK_GQA, PlanRequest(pool_bytes=24 * GIB))


def test_block_size_matches_the_engine() -> None:
    from agent.config import KV_DTYPES as CLI_KV_DTYPES
    from runtime.engine.config import EngineConfig
    from runtime.kv.quant import KV_DTYPES

    assert EngineConfig().block_size == BLOCK_SIZE
    assert CLI_KV_DTYPES == KV_DTYPES


@pytest.mark.parametrize(
    ("text", "tokens"), [("8192", 8192), ("8k", 8192), ("128K", 131_072), ("1.5k", 1536), (" 1m ", 1024**2)]
)
def test_parse_context(text: str, tokens: int) -> None:
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["0", "-1", "eight", "8kb", "8.5", "0.1k"])
def test_parse_context_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_context(text)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((0, 4, 4, 64), "num_layers must be a positive integer"),
        ((2, 6, 4, 64), r"attention heads \(6\) must be a multiple of KV heads \(4\)"),
    ],
)
def test_shape_rejects_nonsense(fields: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelShape("", "", *fields)


@pytest.mark.parametrize(
    "options", [{"dtype": "float8"}, {"k_dtype": "int2"}, {"pool_bytes": 0}, {"num_sessions": 0}]
)
def test_request_rejects_nonsense(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PlanRequest(**options)  # type: ignore[arg-type]


# --- against the engine ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("tiny_llama_path", {"kv_dtype": "auto"}),
        ("tiny_llama_path", {"kv_dtype": "int8"}),
        ("tiny_llama_path", {"kv_dtype": "fp8"}),
        ("tiny_llama_path", {"kv_dtype": "int4"}),
        ("tiny_llama_path", {"k_dtype": "int8", "v_dtype": "int4"}),
        ("tiny_qwen2_path", {"k_dtype": "int4", "v_dtype": "auto", "dtype": "bfloat16"}),
        ("tiny_qwen2_path", {"k_dtype": "auto", "v_dtype": "fp8", "dtype": "float16"}),
    ],
)
def test_planner_equals_engine(model: str, options: dict[str, str], request: pytest.FixtureRequest) -> None:
    """The engine's bytes per token and pool blocks are the planner's, for every storage dtype."""
    from runtime import Engine

    path: Path = request.getfixturevalue(model)
    options = {"dtype": "float32", **options}  # named: --weights auto could pick another dtype
    engine = Engine(model=path, kv_pool="4MiB", device="cpu", **options)
    stats = engine.stats()
    kv_dtype = options.get("kv_dtype", "auto")
    plan = plan_kv(
        read_shape(path),
        PlanRequest(
            dtype=options["dtype"],
            k_dtype=options.get("k_dtype", kv_dtype),
            v_dtype=options.get("v_dtype", kv_dtype),
            pool_bytes=4 * 1024**2,
        ),
    )
    assert plan.bytes_per_token == stats.bytes_per_token
    assert plan.pool_blocks == stats.num_blocks_total
    assert plan.bytes_per_block * stats.num_blocks_total == stats.kv_pool_bytes
    assert plan.context == engine.max_model_len == 2048


def test_tiny_model_by_hand(tiny_llama_path: Path) -> None:
    """2 layers x 2 KV heads x head dim 16 (hidden 64 / 4 heads); int8: (16 + 1) + (16 + 2)."""
    shape = read_shape(tiny_llama_path)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 16)
    assert plan_kv(shape, PlanRequest()).bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert plan_kv(shape, PlanRequest(k_dtype="int8", v_dtype="int8")).bytes_per_token == 2 * 2 * (17 + 18)


# --- reading a model's shape ------------------------------------------------------------------


def test_short_name_reads_the_pulled_config(default_model_path: Path) -> None:
    shape = read_shape("smollm2-135m-instruct")
    assert shape == ModelShape("smollm2-135m-instruct", "llama", 30, 9, 3, 64, max_context=8192)


def test_short_name_not_pulled_is_an_error_not_a_download(fake_cache: Path) -> None:
    with pytest.raises(ModelError, match="run `liubai pull smollm2-135m-instruct`"):
        read_shape("smollm2-135m-instruct")
    assert not any(fake_cache.rglob("*"))


def test_directory_needs_only_its_config(tmp_path: Path) -> None:
    """No weights on disk: the planner never loads them."""
    config = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64}
    config |= {"num_key_value_heads": 8, "hidden_size": 8192, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_shape(tmp_path) == ModelShape(str(tmp_path), "llama", 80, 64, 8, 128, max_context=4096)


def test_config_without_shape_fields_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="lacks num_hidden_layers"):
        shape_from_config(argparse.Namespace(model_type="odd", num_attention_heads=4), name="odd")
    with pytest.raises(ModelError, match="sliding-window"):
        shape_from_config(argparse.Namespace(layer_types=["sliding_attention", "full_attention"]))


def test_unknown_model_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unknown model"):
        read_shape(str(tmp_path / "missing"))


def write_gguf(path: Path, arch: str = "llama", **keys: object) -> Path:
    """A metadata-only GGUF file (no tensors), written with the gguf package."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_architecture()
    for name, value in keys.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf",
        block_count=30,
        head_count=9,
        head_count_kv=3,
        embedding_length=576,
        context_length=8192,
    )
    assert read_shape(path) == ModelShape(str(path), "llama", 30, 9, 3, 64, max_context=8192)
    explicit = write_gguf(
        tmp_path / "k.gguf", "qwen2", block_count=2, head_count=4, embedding_length=64, key_length=32
    )
    assert read_shape(explicit) == ModelShape(str(explicit), "qwen2", 2, 4, 4, 32)


def test_gguf_without_shape_keys_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="lacks llama.block_count"):
        read_shape(write_gguf(tmp_path / "bare.gguf", head_count=4))
    with pytest.raises(ModelError, match="head_count_kv differs between layers"):
        read_shape(
            write_gguf(
                tmp_path / "mixed.gguf",
                block_count=2,
                head_count=4,
                head_count_kv=[2, 4],
                embedding_length=64,
            )
        )
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        read_shape(tmp_path / "junk.gguf")


# --- the command -------------------------------------------------------------------------------


def plan_command(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="liubai")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    result: int = args.handler(args)
    return result


def test_table_for_the_default_model(default_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_command("smollm2-135m-instruct", "--context", "8k", "--pool", "24GiB") == 0
    assert capsys.readouterr().out.splitlines() == [
        "model            smollm2-135m-instruct (llama, 30 layers, 9 heads, 3 KV heads, head dim 64)",
        "K / V storage    float32 / float32",
        "bytes per token  2 × 30 layers × 3 KV heads × 64 head dim × 4 B = 46,080 B (45.0 KiB)",
        "without GQA      138,240 B per token; grouped-query attention saves 3.0× (66.7%)",
        "per session      8,192 tokens = 512 blocks → 377,487,360 B (360.0 MiB)",
        "pool 24.0 GiB    68 concurrent sessions of 8,192 tokens (34,952 blocks, 512 per session)",
    ]


def test_table_for_quantized_storage(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64"]
    assert plan_command(*argv, "--kv-dtype", "int8", "--context", "8200", "--sessions", "2") == 0
    out = capsys.readouterr().out
    assert (
        "bytes per token  30 layers × 3 KV heads × (68 B K + 66 B V) = 12,060 B (11.8 KiB) at block size 16"
        in out
    )
    assert (
        "  K int8         64 head dim × 1 B + 4 B scales = 68 B per KV head; "
        "its scales are per 16-token block" in out
    )
    assert "  V int8         64 head dim × 1 B + 2 B scales = 66 B per KV head\n" in out
    assert "per session      8,200 tokens → 98,892,000 B (94.3 MiB)" in out
    assert "  allocated      513 blocks of 16 = 8,208 tokens → 98,988,480 B (94.4 MiB)" in out
    assert f"2 sessions       of 8,200 tokens need a pool of {2 * 513 * 16 * 12_060:,} B" in out
    assert "staging          737,280 B (720.0 KiB) per open block, in float32 outside the pool" in out


def test_textbook_shape_from_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--layers", "80", "--head-dim", "128", "--dtype", "float16", "--context", "8k"]
    plan_command(*shape, "--kv-heads", "64")
    assert "8,192 tokens = 512 blocks → 21,474,836,480 B (20.0 GiB)" in capsys.readouterr().out
    plan_command(*shape, "--heads", "64", "--kv-heads", "8", "--json")
    result = json.loads(capsys.readouterr().out)
    assert result["session_bytes"] == 2_684_354_560
    assert result["mha_bytes_per_token"] == 2 * 80 * 64 * 128 * 2
    assert result["gqa_saving"] == 8.0
    assert result["shape"]["num_kv_heads"] == 8


def test_json_is_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64", "--context", "8200"]
    plan_command(*argv, "--pool", "24GiB", "--sessions", "24", "--k-dtype", "int4", "--json")
    result = json.loads(capsys.readouterr().out)
    plan = plan_kv(SMOLLM2, PlanRequest(k_dtype="int4", context=8200, pool_bytes=24 * GIB, num_sessions=24))
    assert result == json.loads(json.dumps(_without_name(plan)))


def _without_name(plan: KVPlan) -> dict[str, object]:
    result = plan.to_dict()
    result["shape"] |= {"name": "", "architecture": ""}
    return result


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--context", "0"], "at least 1 token"),
        (["--pool", "lots"], "not a size"),
        (["--sessions", "0"], "at least 1"),
        (["m", "--layers", "2"], "not both"),
        (["--layers", "2", "--head-dim", "64"], "needs --layers, --head-dim and --heads or --kv-heads"),
        (["--layers", "2", "--heads", "4", "--kv-heads", "0", "--head-dim", "64"], "num_kv_heads must be"),
        (["--layers", "2", "--heads", "4", "--head-dim", "64", "--pool", "1GiB"], "needs a context length"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str) -> None:
    from agent.errors import UsageError

    with pytest.raises(UsageError, match=message):
        plan_command(*argv)


def test_missing_model_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="unknown model"):
        plan_command("/nonexistent/model")


def test_parser_shape_and_fast_import() -> None:
    """add_parser registers ``plan``, and importing it and building the parser leaves torch unloaded."""
    code = (
        "import argparse, sys\n"
        "from agent.cli.plan import add_parser\n"
        "p = argparse.ArgumentParser(); sub = p.add_subparsers(); add_parser(sub)\n"
        "print(sub.choices['plan'].format_help())\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    help_text, torch_loaded = result.stdout.rsplit("\n", 2)[:2]
    assert torch_loaded == "False"
    for flag in ("--layers", "--heads", "--kv-heads", "--head-dim", "--dtype", "--kv-dtype", "--k-dtype"):
        assert flag in help_text
    for flag in ("--v-dtype", "--context", "--pool", "--sessions", "--json", "MODEL"):
        assert flag in help_text


def test_run_is_the_handler() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["plan"]).handler is run
