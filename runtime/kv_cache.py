"""The KV pool: preallocated key and value storage for every layer, addressed by slot.

A slot is ``block_id * block_size + offset``. Each layer stores keys and values as
``(num_kv_heads, num_slots, head_dim)``: the attention hook receives keys as
``(1, num_kv_heads, T, head_dim)``, so writing is one ``index_copy_`` along dim 1 and gathering a
sequence's context gives the ``(num_kv_heads, L, head_dim)`` layout SDPA wants, without
transposes.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Exact: 2 (K and V) x layers x KV heads x head dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = num_blocks * block_size
        shape = (layout.num_kv_heads, num_slots, layout.head_dim)
        # torch.empty maps pages lazily on CPU, so an unused pool costs address space, not RAM.
        self.key_cache = [
            torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.value_cache = [
            torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def k_dtype(self) -> str:
        return dtype_name(self.layout.dtype)

    @property
    def v_dtype(self) -> str:
        return dtype_name(self.layout.dtype)

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values (num_kv_heads, T, head_dim) at ``slot_mapping`` (T,)."""
        self.key_cache[layer].index_copy_(1, slot_mapping, key)
        self.value_cache[layer].index_copy_(1, slot_mapping, value)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (L,) as (num_kv_heads, L, head_dim)."""
        return (
            self.key_cache[layer].index_select(1, slots),
            self.value_cache[layer].index_select(1, slots),
        )

    def seal(self, block_ids: list[int]) -> None:
        """Called when blocks become full; full-precision storage has nothing to do."""


def num_blocks_for(pool_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return pool_bytes // (bytes_per_token * block_size)
