"""The prefix cache's disk tier: a new process starts warm, and nothing wrong is ever loaded.

Unit tests run a tiny random Llama (``tiny_llama_path``); each engine here is a "new process" as
far as the tier is concerned (nothing in memory, only the files). The real subprocess tests are
at the end: block digests across interpreters, ``kill -9`` during write-behind, and ``liubai
run`` resumed in a new process on the default model.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memory.store import Store
from runtime import Engine
from runtime.engine.sampling import SamplingParams
from runtime.kv.digest import block_digest
from runtime.kv.disk_tier import SUFFIX, DiskTier, scan

BS = 16
PROMPT = [(i * 37) % 5000 + 100 for i in range(200)]  # 12 full blocks and 8 tokens
FULL = (len(PROMPT) - 1) // BS * BS  # 192: what can hit (at least one token is recomputed)
GREEDY = SamplingParams(max_tokens=8)


def engine(model: Path, root: Path, **options: object) -> Engine:
    return Engine(model, kv_pool="8MiB", kv_disk="64MiB", kv_disk_dir=root, **options)


def cold_tokens(model: Path, prompt: list[int], **options: object) -> list[int]:
    return Engine(model, kv_pool="8MiB", **options).generate(prompt, GREEDY)[0].token_ids


def warm_up(model: Path, root: Path, prompt: list[int] = PROMPT, **options: object) -> None:
    first = engine(model, root, **options)
    first.generate(prompt, GREEDY)
    first.close()


def block_files(root: Path) -> list[Path]:
    return [path for _mtime, path, _size in scan(root)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_new_engine_hits_the_blocks_on_disk_and_answers_as_cold(
    tiny_llama_path: Path, tmp_path: Path, kv_dtype: str
) -> None:
    root = tmp_path / "kv"
    warm_up(tiny_llama_path, root, kv_dtype=kv_dtype)
    files = block_files(root)
    second = engine(tiny_llama_path, root, kv_dtype=kv_dtype)
    # Each file: 28-byte header, 16-byte digest, 16 int64 token ids, then the block's pool bytes.
    per_file = 28 + 16 + BS * 8 + second.kv_cache.bytes_per_block
    assert {p.stat().st_size for p in files} == {per_file}
    # The prompt's 12 full blocks and the generated tokens' (208 - 1 computed tokens: 12 blocks).
    assert len(files) == 12
    out = second.generate(PROMPT, GREEDY)[0]
    assert out.metrics.num_cached_tokens == FULL
    assert out.metrics.num_disk_cached_tokens == FULL
    assert out.metrics.disk_load_ms > 0
    assert out.token_ids == cold_tokens(tiny_llama_path, PROMPT, kv_dtype=kv_dtype)
    stats = second.stats()
    assert (stats.kv_disk_blocks, stats.kv_disk_bytes) == (12, 12 * per_file)
    assert stats.kv_disk_hit_tokens == FULL


def test_a_longer_prompt_hits_memory_then_disk(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The in-memory hit comes first; the disk continues the chain after it."""
    root = tmp_path / "kv"
    warm_up(tiny_llama_path, root)
    second = engine(tiny_llama_path, root)
    short = second.generate(PROMPT[:100], GREEDY)[0]  # 6 blocks from disk, now in memory too
    assert short.metrics.num_disk_cached_tokens == 96
    longer = second.generate(PROMPT + [7, 8, 9], GREEDY)[0]
    assert longer.metrics.num_cached_tokens == 192
    assert longer.metrics.num_disk_cached_tokens == 96  # blocks 6..11; 0..5 were in memory
    assert longer.token_ids == cold_tokens(tiny_llama_path, PROMPT + [7, 8, 9])


@pytest.mark.parametrize("other", [{"kv_dtype": "int8"}, {"k_dtype": "int8"}, {"dtype": "bfloat16"}])
def test_other_numbers_never_hit_each_others_blocks(
    tiny_llama_path: Path, tmp_path: Path, other: dict[str, str]
) -> None:
    root = tmp_path / "kv"
    warm_up(tiny_llama_path, root)
    e = engine(tiny_llama_path, root, **other)
    out = e.generate(PROMPT, GREEDY)[0]
    e.close()  # its own blocks are on disk now, beside the first engine's
    assert out.metrics.num_disk_cached_tokens == 0
    assert len({p.parent for p in block_files(root)}) == 2  # a fingerprint directory each


def test_truncated_or_corrupted_files_are_ignored_and_recomputed(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    warm_up(tiny_llama_path, root)
    tier_dir = block_files(root)[0].parent
    digests = []
    parent = None
    for i in range(FULL // BS):
        parent = block_digest(parent, PROMPT[i * BS : (i + 1) * BS])
        digests.append(parent)
    truncated = tier_dir / f"{digests[8].hex()}{SUFFIX}"
    corrupted = tier_dir / f"{digests[4].hex()}{SUFFIX}"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(corrupted.read_bytes())
    data[-1] ^= 0xFF
    corrupted.write_bytes(bytes(data))

    damaged = corrupted.read_bytes()
    second = engine(tiny_llama_path, root)
    out = second.generate(PROMPT, GREEDY)[0]
    second.close()
    assert out.metrics.num_disk_cached_tokens == 4 * BS  # blocks 0..3; block 4 fails its checksum
    assert out.token_ids == cold_tokens(tiny_llama_path, PROMPT)
    # Removed, then written again, whole, at the request's end: the damaged byte is repaired.
    assert len(corrupted.read_bytes()) == len(damaged) and corrupted.read_bytes() != damaged
    third = engine(tiny_llama_path, root)
    out = third.generate(PROMPT, GREEDY)[0]
    assert out.metrics.num_disk_cached_tokens == 8 * BS  # block 8, never read before, is cut short
    assert out.token_ids == cold_tokens(tiny_llama_path, PROMPT)


def test_an_unwritable_disk_turns_the_tier_off_with_one_notice(
    tiny_llama_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the tier's directory should be")
    with caplog.at_level(logging.WARNING, logger="liubai.kv"):
        e = engine(tiny_llama_path, root)
        out = e.generate(PROMPT, GREEDY)[0]
        e.generate(PROMPT[:50], GREEDY)
    assert out.token_ids == cold_tokens(tiny_llama_path, PROMPT)
    notices = [r for r in caplog.records if r.name == "liubai.kv"]
    assert len(notices) == 1 and "KV disk tier off" in notices[0].getMessage()
    assert e.stats().kv_disk_notice == notices[0].getMessage()


# -- the tier alone: size limit and LRU order ---------------------------------------------------

BPB = 1000  # bytes per block in these tests
FILE_SIZE = 28 + 16 + 4 * 8 + BPB


def block(n: int) -> tuple[bytes, tuple[int, ...], torch.Tensor]:
    tokens = (n, n + 1, n + 2, n + 3)
    return block_digest(None, tokens), tokens, torch.full((1, BPB), n % 256, dtype=torch.uint8)


def save(tier: DiskTier, n: int) -> None:
    digest, tokens, data = block(n)
    tier.save([digest], [tokens], data)
    assert tier.flush()


def load(tier: DiskTier, n: int) -> bool:
    digest, tokens, data = block(n)
    out = torch.empty(BPB, dtype=torch.uint8)
    ok = tier.load_into(digest, tokens, out)
    assert not ok or torch.equal(out, data[0])
    return ok


def test_the_size_limit_holds_evicting_least_recently_used_files_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, "fp-a", limit_bytes=3 * FILE_SIZE, bytes_per_block=BPB)
    for n in (1, 2, 3):
        save(tier, n)
    assert load(tier, 1)  # 1 is now the most recently used: 2 goes first
    save(tier, 4)
    assert [load(tier, n) for n in (1, 2, 3, 4)] == [True, False, True, True]
    tier.close()
    # A new process (a new tier over the same files, another fingerprint) sees the same order:
    # the uses above left 2 evicted, then 1, 3, 4 used in that order.
    other = DiskTier(tmp_path, "fp-b", limit_bytes=3 * FILE_SIZE, bytes_per_block=BPB)
    save(other, 10)
    save(other, 11)
    names = {p.name for p in block_files(tmp_path)}
    assert names == {f"{block(n)[0].hex()}{SUFFIX}" for n in (4, 10, 11)}
    assert other.stats().num_bytes == 3 * FILE_SIZE == sum(p.stat().st_size for p in block_files(tmp_path))
    assert other.stats().num_evicted_blocks == 2
    for sessions in range(20):  # many sessions later the limit still holds
        save(other, 100 + sessions)
    assert sum(p.stat().st_size for p in block_files(tmp_path)) <= 3 * FILE_SIZE


def test_two_writers_of_one_block_are_harmless(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, "fp", limit_bytes=10 * FILE_SIZE, bytes_per_block=BPB)
    b = DiskTier(tmp_path, "fp", limit_bytes=10 * FILE_SIZE, bytes_per_block=BPB)
    save(a, 1)
    save(b, 1)
    assert load(a, 1) and load(b, 1)
    assert len(block_files(tmp_path)) == 1


# -- across processes ----------------------------------------------------------------------------


def test_block_digests_are_the_same_in_every_process() -> None:
    code = "from runtime.kv.digest import block_digest as d; print(d(d(None, (1, 2)), (3,)).hex())"
    runs = set()
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        runs.add(run.stdout.strip())
    assert runs == {block_digest(block_digest(None, (1, 2)), (3,)).hex()}


WRITER = """
import sys, torch
from pathlib import Path
from runtime.kv.digest import block_digest
from runtime.kv.disk_tier import DiskTier
tier = DiskTier(Path(sys.argv[1]), "fp", limit_bytes=1 << 40, bytes_per_block=1 << 22)
n = 0
while True:
    tokens = (n, n + 1, n + 2, n + 3)
    tier.save([block_digest(None, tokens)], [tokens], torch.full((1, 1 << 22), n % 256, dtype=torch.uint8))
    if n == 3:
        print("writing", flush=True)
    n += 1
    tier.flush()
"""


def test_kill_9_during_write_behind_leaves_no_file_that_loads_wrong(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    files = block_files(tmp_path)
    assert len(files) >= 3
    tier = DiskTier(tmp_path, "fp", limit_bytes=1 << 40, bytes_per_block=1 << 22)
    out = torch.empty(1 << 22, dtype=torch.uint8)
    written = {block_digest(None, (n, n + 1, n + 2, n + 3)).hex(): n for n in range(100000)}
    for path in files:
        n = written[path.stem]
        assert tier.load_into(bytes.fromhex(path.stem), (n, n + 1, n + 2, n + 3), out)
        assert bool((out == n % 256).all())
    # Whatever was mid-write is a temporary file, never a block file.
    assert all(p.name.endswith(SUFFIX) for p in files)


# -- liubai run, resumed in a new process, on the default model ----------------------------------


def liubai(*args: str, env: dict[str, str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "--json", "--max-tokens", "24", "--tools", "on", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_run_session_resumed_in_a_new_process_starts_warm(default_model_path: Path, tmp_path: Path) -> None:
    env = {**os.environ, "LIUBAI_KV_DISK_DIR": str(tmp_path / "kv")}
    db = tmp_path / "a.db"
    first = liubai("What is the capital of France?", "--db", str(db), env=env)
    assert first["usage"]["disk_cached_tokens"] == 0
    system_blocks = first["usage"]["prompt_tokens"] // BS * BS

    # A one-shot run in a fresh process hits the system prompt's blocks on disk.
    oneshot = liubai("Name a colour.", "--db", str(tmp_path / "b.db"), env=env)
    assert oneshot["usage"]["disk_cached_tokens"] == oneshot["usage"]["cached_tokens"] > 0

    shutil.copy(db, tmp_path / "cold.db")
    resumed = liubai("And of Italy?", "--session", first["session_id"], "--db", str(db), env=env)
    cold_db = str(tmp_path / "cold.db")
    cold = liubai(
        "And of Italy?", "--session", first["session_id"], "--db", cold_db, "--kv-disk", "0", env=env
    )
    u = resumed["usage"]
    # The first run's prompt (system, question, assistant header) is a prefix of the resumed one,
    # and its full blocks (and those of the reply) all come from disk.
    assert u["cached_tokens"] == u["disk_cached_tokens"] >= system_blocks
    assert u["cached_tokens"] % BS == 0 and u["cached_tokens"] < u["prompt_tokens"]
    assert cold["usage"]["cached_tokens"] == 0
    assert resumed["answer"] == cold["answer"]
    # The store keeps the split for `liubai logs show`: the resumed turn's request, disk hits and all.
    [last] = Store(db).requests(first["session_id"])[-1:]
    assert last["cached_tokens"] == u["cached_tokens"]
    assert last["disk_cached_tokens"] == u["disk_cached_tokens"]


def test_liubai_kv_shows_the_tier_and_clears_it(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, "fp", limit_bytes=10 * FILE_SIZE, bytes_per_block=BPB)
    for n in (1, 2, 3):
        save(tier, n)
    tier.close()
    env = {**os.environ, "LIUBAI_KV_DISK_DIR": str(tmp_path)}

    def kv(*args: str) -> dict:
        run = subprocess.run(
            [sys.executable, "-m", "agent.cli", "kv", "--json", *args],
            capture_output=True,
            text=True,
            env=env,
        )
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    shown = kv()
    assert (shown["blocks"], shown["bytes"]) == (3, 3 * FILE_SIZE)
    assert shown["fingerprints"] == [{"fingerprint": "fp", "blocks": 3, "bytes": 3 * FILE_SIZE}]
    assert kv("clear") == {"root": str(tmp_path), "removed_blocks": 3, "removed_bytes": 3 * FILE_SIZE}
    assert kv()["blocks"] == 0 and block_files(tmp_path) == []


def test_tier_stats_reach_the_pool_panel_and_metrics() -> None:
    from runtime.engine.metrics import EngineStats
    from runtime.serve.metrics import ServerMetrics
    from tui.widgets.pool_panel import _disk_line

    base = dict(block_size=16, num_blocks_total=8, num_blocks_used=0, num_blocks_cached=0, num_blocks_free=8,
                kv_tokens_in_use=0, kv_bytes_in_use=0, kv_pool_bytes=8, bytes_per_token=1, k_dtype="int8",
                v_dtype="int8", prefix_queried_tokens=0, prefix_hit_tokens=0, prefix_hittable_tokens=0,
                num_preemptions=0, max_batch_size=0, num_running=0, num_waiting=0)  # fmt: skip
    disk = dict(
        kv_disk_limit_bytes=2 * 1024**3, kv_disk_blocks=12, kv_disk_bytes=3 * 1024**2, kv_disk_hit_tokens=192
    )
    stats = EngineStats(**base, **disk, kv_disk_evicted_blocks=5)  # type: ignore[arg-type]
    assert _disk_line(stats) == "disk 12 blocks · 3.0 MiB/2.0 GiB · hit 192 tok"
    text = ServerMetrics().render(stats, "m")
    assert 'liubai:kv_disk_bytes{model_name="m"} 3145728' in text
    assert 'liubai:kv_disk_hits_total{model_name="m"} 192' in text
    assert 'liubai:kv_disk_evictions_total{model_name="m"} 5' in text
    assert "kv_disk" not in ServerMetrics().render(EngineStats(**base), "m")  # type: ignore[arg-type]
