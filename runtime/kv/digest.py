"""A full block's identity: a chained blake2b digest of its parent's digest and its token ids.

Stable across processes and machines (Python's ``hash()`` is not: on 3.11 ``hash(None)`` changes
from one process to the next), so the in-memory prefix cache and the disk tier key blocks alike.
"""

import hashlib

import numpy as np

DIGEST_SIZE = 16  # bytes; hits are verified against token ids anyway
_PERSON = b"liubai-kv-block"  # domain separation from any other blake2b use


def block_digest(parent: bytes | None, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """The digest of a block holding ``token_ids`` after the block whose digest is ``parent``
    (None for a sequence's first block)."""
    h = hashlib.blake2b(parent or b"", digest_size=DIGEST_SIZE, person=_PERSON)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()
