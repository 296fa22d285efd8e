"""Quantized KV storage: codec error bounds, exact byte accounting, the pool's staging of open
blocks, and the engine on tiny models with every storage dtype."""

from pathlib import Path

import pytest
import torch

from runtime import Engine, PromptTooLongError, SamplingParams
from runtime.engine.config import EngineConfig
from runtime.kv import quant as kq
from runtime.kv.cache import KVCache, KVLayout
from tests.kv_bounds import CHECKS

QUANTIZED = ("int8", "fp8", "int4")


def key_like(seed: int, shape: tuple[int, ...] = (3, 8, 16, 64)) -> torch.Tensor:
    """Random blocks with what makes keys hard: a few outlier channels, offset from zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., :4] = x[..., :4] * 8 + 12  # outlier channels, all positive
    x[..., 4:6] = x[..., 4:6] * 0.01 - 3  # narrow but offset
    return x


# --- codecs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_error_is_within_its_bound(name: str, seed: int) -> None:
    relative = CHECKS[name](key_like(seed))
    assert (
        relative < {"int8": 0.02, "int8-keys": 0.005, "fp8": 0.05, "int4-values": 0.2, "int4-keys": 0.1}[name]
    )
    CHECKS[name](torch.randn(2, 3, 16, 64) * 1e-3)  # small magnitudes, near e4m3's subnormals


def test_keys_per_channel_beat_per_token_on_outlier_channels() -> None:
    """Why integer keys are grouped by channel (KIVI): a token's 64 values span the outliers' range."""
    x = key_like(2)
    assert CHECKS["int4-keys"](x) < 0.5 * CHECKS["int4-values"](x)
    assert CHECKS["int8-keys"](x) < 0.5 * CHECKS["int8"](x)


@pytest.mark.parametrize(
    "codec", [kq.INT8, kq.INT8_PER_CHANNEL, kq.FP8_E4M3, kq.INT4_PER_TOKEN, kq.INT4_PER_CHANNEL]
)
def test_all_zero_blocks_round_trip_to_zero(codec: kq.Codec) -> None:
    out = codec.dequantize(codec.quantize(torch.zeros(2, 3, 16, 8)))
    assert torch.equal(out, torch.zeros(2, 3, 16, 8))


def test_fp8_directed_rounding_and_bit_conversion() -> None:
    x = torch.randn(10_000) * 40
    down, up = kq.fp8_round_down(x).float(), kq.fp8_round_up(x).float()
    assert torch.all(down <= x) and torch.all(up >= x)
    assert not torch.isnan(down).any() and not torch.isnan(up).any()
    assert kq.fp8_round_down(torch.tensor([-1000.0])).float().item() == -448.0  # saturates, no NaN
    codes = torch.arange(256, dtype=torch.uint8).view(kq.FP8)
    exact = codes.float()
    finite = ~torch.isnan(exact)
    assert torch.equal(kq.fp8_to_float(codes)[finite], exact[finite])


def test_int4_packing_round_trips() -> None:
    codes = torch.randint(0, 16, (3, 5, 16, 8), dtype=torch.uint8)
    packed = kq.pack_int4(codes)
    assert packed.shape == (3, 5, 8, 8)
    assert torch.equal(kq.unpack_int4(packed), codes)


# --- byte accounting -------------------------------------------------------------------------


def predicted_bytes_per_token(k: str, v: str, layers: int, heads: int, d: int, bs: int, itemsize: int) -> int:
    """The layouts of kv_quant.py written out by hand, per KV head and token."""
    per_block = {
        ("auto", True): bs * d * itemsize,
        ("int8", True): bs * d + d,  # one e4m3 scale per channel, per block
        ("fp8", True): bs * (d + 2),  # one fp16 scale per token
        ("int4", True): bs * d // 2 + 2 * d,  # e4m3 step and minimum per channel, per block
        ("auto", False): bs * d * itemsize,
        ("int8", False): bs * (d + 2),
        ("fp8", False): bs * (d + 2),
        ("int4", False): bs * (d // 2 + 4),  # fp16 step and minimum per token
    }
    return layers * heads * (per_block[(k, True)] + per_block[(v, False)]) // bs


@pytest.mark.parametrize("k_dtype", kq.KV_DTYPES)
@pytest.mark.parametrize("v_dtype", kq.KV_DTYPES)
def test_a_fixed_pool_holds_exactly_the_predicted_tokens(
    tiny_llama_path: Path, k_dtype: str, v_dtype: str
) -> None:
    pool = 48 * 1024
    engine = Engine(tiny_llama_path, kv_pool=pool, k_dtype=k_dtype, v_dtype=v_dtype, device="cpu")
    bytes_per_token = predicted_bytes_per_token(k_dtype, v_dtype, 2, 2, 16, 16, 4)
    capacity = pool // (bytes_per_token * 16) * 16
    stats = engine.stats()
    assert stats.bytes_per_token == bytes_per_token
    assert engine.pool_capacity_tokens == capacity
    cache = engine.kv_cache
    assert cache.pool_nbytes == stats.kv_pool_bytes == stats.num_blocks_total * cache.bytes_per_block <= pool
    assert pool - cache.pool_nbytes < cache.bytes_per_block

    ids = torch.randint(3, 40000, (capacity + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(PromptTooLongError, match=f"KV pool holds {capacity}"):
        engine.generate(ids, SamplingParams(max_tokens=1))
    engine.generate(ids[:capacity], SamplingParams(max_tokens=1))
    after = engine.stats()
    assert after.num_blocks_cached == after.num_blocks_total  # every block was filled and sealed
    assert cache.num_open_blocks == 0


def test_unknown_or_mismatched_kv_dtypes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, int8, fp8, int4, got 'int3'"):
        EngineConfig(kv_dtype="int3")
    with pytest.raises(ValueError, match="v_dtype must be one of"):
        EngineConfig(v_dtype="fp4")
    config = EngineConfig(kv_dtype="int8", v_dtype="int4")
    assert (config.k_dtype, config.v_dtype) == ("int8", "int4")
    with pytest.raises(ValueError, match="at least 2"):
        KVLayout(1, 1, 64, torch.float32, block_size=1, k_dtype="int4")
    with pytest.raises(ValueError, match="do not divide evenly"):  # 2 * 64 e4m3 bytes / 256 tokens
        KVLayout(1, 1, 64, torch.float32, block_size=256, k_dtype="int4")


# --- the pool: open blocks staged, full blocks quantized -------------------------------------


def int8_keys(block: torch.Tensor) -> torch.Tensor:
    """(KVH, 1, bs, D) -> its int8 round trip, (KVH, bs, D)."""
    return kq.INT8_PER_CHANNEL.dequantize(kq.quantize_int8_per_channel(block))[:, 0]


def test_each_token_reads_earlier_blocks_quantized_and_its_own_block_exactly() -> None:
    layout = KVLayout(1, 2, 8, torch.float32, block_size=4, k_dtype="int8", v_dtype="int4")
    cache = KVCache(layout, num_blocks=8, block_size=4, device=torch.device("cpu"))
    keys, values = torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    slots = torch.tensor([12, 13, 14, 15, 20, 21, 22, 23, 8])  # block table [3, 5, 2]

    with torch.inference_mode():
        # A 6-token prompt: block 3 fills (quantized), block 5 stays open.
        cache.begin_step(slots[:6])
        cache.write(0, slots[:6], keys[:, :6], values[:, :6])
        k, v, mask = cache.read_span(0, 0, slots[:6], keys[:, :6], values[:, :6])
        assert torch.equal(k[:, :4], int8_keys(keys[:, None, :4]))  # block 3 as stored
        assert torch.equal(k[:, 4:], keys[:, :6]) and torch.equal(v[:, 4:], values[:, :6])  # exact rows
        assert mask.tolist()[2] == [False] * 4 + [True, True, True, False, False, False]  # own block 0
        assert mask.tolist()[5] == [True] * 4 + [False] * 4 + [True, True]  # block 0 as stored, own exact
        cache.seal([3])
        assert cache.num_open_blocks == 1

        # Decode position 6, then 7, which fills block 5: both read block 5 exactly.
        for p in (6, 7):
            cache.begin_step(slots[p : p + 1])
            cache.write(0, slots[p : p + 1], keys[:, p : p + 1], values[:, p : p + 1])
            k, v, mask = cache.read_decode(0, slots[None, : p + 1], None)  # (1, KVH, 8, D)
            assert torch.equal(k[0, :, :4], int8_keys(keys[:, None, :4]))
            assert torch.equal(k[0, :, 4 : p + 1], keys[:, 4 : p + 1])
            assert mask[0, 0, 0].tolist() == [True] * 4 + [o <= p - 4 for o in range(4)]
        cache.seal([5])

        # Position 8 opens block 2; block 5 is now read as stored, by anyone.
        cache.begin_step(slots[8:])
        cache.write(0, slots[8:], keys[:, 8:], values[:, 8:])
        k, v, _ = cache.read_decode(0, slots[None], None)  # (1, KVH, 12, D)
        assert torch.equal(k[0, :, 4:8], int8_keys(keys[:, None, 4:8]))
        expected_v = kq.INT4_PER_TOKEN.dequantize(kq.quantize_int4_per_token(values[:, None, 4:8]))[:, 0]
        assert torch.equal(v[0, :, 4:8], expected_v)
        alone = k.clone()

        # A padded batch reads each row as it is read alone (in a step of its own: a step's
        # decode plan serves all of its layers). Position 8 is written again, unchanged.
        cache.begin_step(slots[8:])
        cache.write(0, slots[8:], keys[:, 8:], values[:, 8:])
        batch = torch.stack([slots, torch.tensor([8, 0, 0, 0, 0, 0, 0, 0, 0])])  # (2, 9)
        lengths = torch.tensor([9, 1])
        pad_mask = (torch.arange(9)[None, :] < lengths[:, None])[:, None, None, :]  # (2, 1, 1, 9)
        kb, _, mask = cache.read_decode(0, batch, pad_mask)
        assert torch.equal(kb[0], alone[0])
        assert (
            torch.equal(kb[1, :, 8], keys[:, 8])
            and mask[1, 0, 0].tolist() == [False] * 8 + [True] + [False] * 3
        )
        assert torch.isfinite(kb).all(), "padding reads block 0, which must hold finite values"
    cache.release([2])  # its request was preempted: the staging goes back
    assert cache.num_open_blocks == 0 and cache.staging_bytes > 0


def test_a_quantized_write_needs_its_step_begun() -> None:
    """The write plan is made by begin_step, once per step; writing without one is a bug."""
    layout = KVLayout(1, 2, 8, torch.float32, block_size=4, k_dtype="int8")
    cache = KVCache(layout, num_blocks=4, block_size=4, device=torch.device("cpu"))
    rows = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="without a begin_step"):
        cache.write(0, torch.tensor([4, 5, 6]), rows, rows)
    cache.begin_step(torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="without a begin_step"):
        cache.write(0, torch.tensor([4, 5, 6]), rows, rows)


# --- the engine ------------------------------------------------------------------------------


def prompts(seed: int, shared: int, suffixes: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 40000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, 40000, (n,), generator=g).tolist() for n in suffixes]


@pytest.mark.parametrize(
    "options", [{"kv_dtype": d} for d in QUANTIZED] + [{"k_dtype": "int8", "v_dtype": "int4"}]
)
def test_batch_sharing_a_quantized_cached_prefix_equals_each_alone(
    tiny_qwen2_path: Path, options: dict[str, str]
) -> None:
    engine = Engine(tiny_qwen2_path, kv_pool="1MiB", device="cpu", dtype="float32", **options)
    batch = prompts(3, 40, (5, 19, 33))  # 2 full shared blocks, then each its own tokens
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def warm() -> None:
        engine.reset_prefix_cache()
        engine.generate(batch[0][:41], SamplingParams(max_tokens=1))  # seals the shared blocks

    alone = []
    for ids in batch:
        warm()
        result = engine.generate(ids, params)[0]
        assert result.metrics.num_cached_tokens == 32
        alone.append(result.token_ids)
    warm()
    together = engine.generate(batch, params)
    assert [c.token_ids for c in together] == alone
    assert all(c.metrics.num_cached_tokens == 32 for c in together)
    assert engine.stats().max_batch_size == 3
    assert engine.kv_cache.num_open_blocks == 0


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_preemption_frees_staging_and_keeps_the_tokens(tiny_qwen2_path: Path, kv_dtype: str) -> None:
    batch = prompts(5, 0, (37, 41, 45))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ample = Engine(tiny_qwen2_path, kv_pool="1MiB", device="cpu", dtype="float32", kv_dtype=kv_dtype)
    expected = [c.token_ids for c in ample.generate(batch, params)]
    bytes_per_block = ample.kv_cache.bytes_per_block
    tight = Engine(
        tiny_qwen2_path, kv_pool=12 * bytes_per_block, device="cpu", dtype="float32", kv_dtype=kv_dtype
    )
    assert tight.stats().num_blocks_total == 12  # each request needs 6 blocks: not all three fit
    result = tight.generate(batch, params)
    stats = tight.stats()
    assert stats.num_preemptions > 0
    # A preempted request hits its own sealed (quantized) blocks again and recomputes only its
    # open tail, from the same tokens against the same blocks: nothing about it changes.
    assert [c.token_ids for c in result] == expected
    assert stats.num_blocks_used == 0 and tight.kv_cache.num_open_blocks == 0
    assert stats.kv_staging_bytes == tight.kv_cache.staging_bytes > 0


def test_stats_name_the_storage_dtypes(tiny_llama_path: Path) -> None:
    auto = Engine(tiny_llama_path, kv_pool="64KiB", device="cpu", dtype="float32").stats()
    assert (auto.k_dtype, auto.v_dtype, auto.kv_staging_bytes) == ("float32", "float32", 0)
    mixed = Engine(tiny_llama_path, kv_pool="64KiB", device="cpu", k_dtype="int8", v_dtype="int4").stats()
    assert (mixed.k_dtype, mixed.v_dtype) == ("int8", "int4")
