"""What a request cost, in machine time and in dollars.

Two ways to price the same request, so local and remote runs compare on one scale:

- **machine**: dollars per hour of compute. The local engine is busy for its prefill and decode
  (``prefill_ms + decode_ms``); a price per hour (a rented GPU, a laptop's share of one) turns
  that into dollars.
- **tokens**: dollars per million prompt, cached-prompt and generated tokens, as API providers
  bill. Prompt tokens the server served from its prefix cache are billed at the cached rate, the
  rest at the input rate; without a cached rate they are billed as input.

When both are set, the machine price is what the run cost (``usd``) and the token price what the
same tokens would have cost at an API (``usd_tokens``). Prices come from flags
(``--price-per-hour``, ``--prices "in=2.5,cached=1.25,out=10"``), a few built-in presets, or a
TOML file (``--price-table FILE``) whose entries override the presets::

    [models."gpt-4o"]
    input = 2.5
    cached_input = 1.25
    output = 10.0
"""

import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from runtime.engine.metrics import RequestMetrics

_COMPACT_KEYS = {"in": "input_per_mtok", "cached": "cached_input_per_mtok", "out": "output_per_mtok"}
_TOML_KEYS = {
    "input": "input_per_mtok",
    "cached_input": "cached_input_per_mtok",
    "output": "output_per_mtok",
    "per_hour": "per_hour",
}


@dataclass(slots=True)
class PriceTable:
    """Prices in US dollars; a field left None is not priced."""

    per_hour: float | None = None  # machine time, for the local engine
    input_per_mtok: float | None = None  # uncached prompt tokens
    cached_input_per_mtok: float | None = None  # prompt tokens served from the prefix cache
    output_per_mtok: float | None = None  # generated tokens

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"price {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"price {f.name} must be a finite number >= 0, got {value}")
            setattr(self, f.name, float(value))
        if (self.input_per_mtok is None) != (self.output_per_mtok is None):
            raise ValueError("token prices need both an input and an output price (in=..., out=...)")
        if self.cached_input_per_mtok is not None and self.input_per_mtok is None:
            raise ValueError("a cached-input price needs an input price too")

    @property
    def has_token_prices(self) -> bool:
        return self.input_per_mtok is not None

    @classmethod
    def from_args(
        cls,
        price_per_hour: float | None = None,
        prices: str | None = None,
        *,
        model: str | None = None,
        table: Mapping[str, "PriceTable"] | None = None,
    ) -> "PriceTable":
        """Prices from the command line.

        ``prices`` is a compact ``in=2.5,cached=1.25,out=10`` (dollars per million tokens) or the
        name of an entry in ``table`` (the presets by default); without it, ``model``'s entry is
        used when there is one. ``price_per_hour`` prices machine time.
        """
        table = PRESETS if table is None else table
        tokens: PriceTable | None = None
        if prices is not None and not prices.strip():
            raise ValueError("prices are empty; give in=..,cached=..,out=.. ($/Mtok) or a preset name")
        if prices is not None and "=" not in prices:
            tokens = lookup_prices(prices.strip(), table)
            if tokens is None:
                raise ValueError(f"no prices named {prices!r}; known: {', '.join(sorted(table))}")
        elif prices is not None:
            tokens = cls(**parse_compact_prices(prices))
        elif model is not None:
            tokens = lookup_prices(model, table)
        return cls(
            per_hour=price_per_hour if price_per_hour is not None else (tokens.per_hour if tokens else None),
            input_per_mtok=tokens.input_per_mtok if tokens else None,
            cached_input_per_mtok=tokens.cached_input_per_mtok if tokens else None,
            output_per_mtok=tokens.output_per_mtok if tokens else None,
        )


@dataclass(frozen=True, slots=True)
class Cost:
    compute_s: float  # prefill + decode time the request kept the engine busy
    usd: float | None  # the machine cost when priced per hour, else the token cost, else None
    usd_machine: float | None
    usd_tokens: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Public list prices (USD per million tokens) at the time of writing; a price table file
# overrides them, and they are a starting point for comparison, not a bill.
PRESETS: Mapping[str, PriceTable] = MappingProxyType(
    {
        "gpt-4o": PriceTable(input_per_mtok=2.5, cached_input_per_mtok=1.25, output_per_mtok=10.0),
        "gpt-4o-mini": PriceTable(input_per_mtok=0.15, cached_input_per_mtok=0.075, output_per_mtok=0.6),
        "gpt-4.1": PriceTable(input_per_mtok=2.0, cached_input_per_mtok=0.5, output_per_mtok=8.0),
        "gpt-4.1-mini": PriceTable(input_per_mtok=0.4, cached_input_per_mtok=0.1, output_per_mtok=1.6),
    }
)


def parse_compact_prices(text: str) -> dict[str, float]:
    """``"in=2.5,cached=1.25,out=10"`` -> PriceTable keyword arguments."""
    result: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in _COMPACT_KEYS:
            raise ValueError(
                f"bad price {item.strip()!r} in {text!r}; expected in=..,cached=..,out=.. ($/Mtok)"
            )
        if _COMPACT_KEYS[key] in result:
            raise ValueError(f"price {key!r} given twice in {text!r}")
        try:
            result[_COMPACT_KEYS[key]] = float(value)
        except ValueError:
            raise ValueError(f"price {key!r} is not a number in {text!r}: {value.strip()!r}") from None
    return result


def load_price_table(path: str | Path) -> dict[str, PriceTable]:
    """The presets, overridden and extended by the ``[models."name"]`` entries of a TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"price table not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(" ".join(f"cannot read price table {path}: {exc}".split())) from exc
    models = data.get("models", {})
    if set(data) - {"models"} or not isinstance(models, dict):
        raise ValueError(f'price table {path} must hold only [models."name"] tables')
    table = dict(PRESETS)
    for name, entry in models.items():
        if not isinstance(entry, dict):
            raise ValueError(f'price table {path}: models."{name}" must be a table')
        unknown = set(entry) - set(_TOML_KEYS)
        if unknown:
            raise ValueError(
                f'price table {path}: models."{name}" has unknown keys {", ".join(sorted(unknown))}; '
                f"known: {', '.join(_TOML_KEYS)}"
            )
        try:
            table[name] = PriceTable(**{_TOML_KEYS[key]: value for key, value in entry.items()})
        except ValueError as exc:
            raise ValueError(f'price table {path}: models."{name}": {exc}') from None
    return table


def lookup_prices(model: str, table: Mapping[str, PriceTable] = PRESETS) -> PriceTable | None:
    """``model``'s entry, trying the name without a provider prefix (``openai/gpt-4o``) too."""
    for name in (model, model.rsplit("/", 1)[-1]):
        if name in table:
            return table[name]
    return None


def request_cost(metrics: RequestMetrics, prices: PriceTable) -> Cost:
    """Price one request's metrics."""
    compute_s = (metrics.prefill_ms + metrics.decode_ms) / 1000.0
    usd_machine = prices.per_hour * compute_s / 3600.0 if prices.per_hour is not None else None
    usd_tokens = None
    if prices.input_per_mtok is not None and prices.output_per_mtok is not None:
        cached = min(metrics.num_cached_tokens, metrics.num_prompt_tokens)
        uncached = metrics.num_prompt_tokens - cached
        cached_rate = prices.cached_input_per_mtok
        if cached_rate is None:
            cached_rate = prices.input_per_mtok
        usd_tokens = (
            uncached * prices.input_per_mtok
            + cached * cached_rate
            + metrics.num_generated_tokens * prices.output_per_mtok
        ) / 1_000_000
    usd = usd_machine if usd_machine is not None else usd_tokens
    return Cost(compute_s=compute_s, usd=usd, usd_machine=usd_machine, usd_tokens=usd_tokens)
