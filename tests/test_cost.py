"""Request cost: machine time and token prices, checked against values computed by hand."""

from pathlib import Path

import pytest

from agent.cost import PRESETS, PriceTable, load_price_table, parse_compact_prices, request_cost
from runtime.engine.metrics import RequestMetrics


def metrics() -> RequestMetrics:
    """1000 prompt tokens of which 400 were cached, 200 generated, 0.5 s prefill + 2.5 s decode."""
    return RequestMetrics(
        num_prompt_tokens=1000,
        num_cached_tokens=400,
        num_prefilled_tokens=600,
        prefill_ms=500.0,
        ttft_ms=520.0,
        num_generated_tokens=200,
        decode_ms=2500.0,
    )


def test_token_prices_bill_cached_tokens_at_the_cached_rate() -> None:
    prices = PriceTable.from_args(prices="in=2.5,cached=1.25,out=10")
    cost = request_cost(metrics(), prices)
    # 600 * 2.5 + 400 * 1.25 + 200 * 10 = 1500 + 500 + 2000 = 4000 $ per million
    assert cost.usd_tokens == pytest.approx(0.004)
    assert cost.usd == cost.usd_tokens
    assert cost.usd_machine is None
    assert cost.compute_s == pytest.approx(3.0)


def test_without_a_cached_rate_cached_tokens_cost_as_input() -> None:
    cost = request_cost(metrics(), PriceTable.from_args(prices="in=2.5,out=10"))
    # 1000 * 2.5 + 200 * 10 = 4500 $ per million
    assert cost.usd_tokens == pytest.approx(0.0045)


def test_machine_price_is_compute_time() -> None:
    cost = request_cost(metrics(), PriceTable.from_args(price_per_hour=3.6))
    # (0.5 s + 2.5 s) * 3.6 $/h / 3600 s/h
    assert (cost.compute_s, cost.usd_tokens) == (3.0, None)
    assert cost.usd == cost.usd_machine == pytest.approx(0.003)


def test_machine_price_wins_when_both_are_set() -> None:
    cost = request_cost(
        metrics(), PriceTable.from_args(price_per_hour=3.6, prices="in=2.5,cached=1.25,out=10")
    )
    assert cost.usd == pytest.approx(0.003)
    assert cost.usd_machine == pytest.approx(0.003)
    assert cost.usd_tokens == pytest.approx(0.004)


def test_unpriced_request_has_no_dollars() -> None:
    cost = request_cost(metrics(), PriceTable())
    assert cost.to_dict() == {"compute_s": 3.0, "usd": None, "usd_machine": None, "usd_tokens": None}


def test_cached_count_above_prompt_is_clamped() -> None:
    m = RequestMetrics(num_prompt_tokens=10, num_cached_tokens=16, num_generated_tokens=0)
    cost = request_cost(m, PriceTable(input_per_mtok=1.0, cached_input_per_mtok=0.0, output_per_mtok=1.0))
    assert cost.usd_tokens == 0.0


def test_compact_prices_parse() -> None:
    assert parse_compact_prices(" in=2.5, cached=1.25 ,OUT=10") == {
        "input_per_mtok": 2.5,
        "cached_input_per_mtok": 1.25,
        "output_per_mtok": 10.0,
    }


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("in=2.5,out", "bad price 'out'"),
        ("in=two,out=1", "not a number"),
        ("input=1,out=1", "bad price 'input=1'"),
        ("in=1,in=2,out=1", "given twice"),
        ("in=1", "both an input and an output"),
        ("cached=1,out=1", "both an input and an output"),
        ("in=-1,out=1", ">= 0"),
        ("in=nan,out=1", ">= 0"),
        ("", "empty"),
        (",in=1,out=1", "bad price ''"),
    ],
)
def test_bad_compact_prices_are_one_line_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        PriceTable.from_args(prices=text)
    assert "\n" not in str(caught.value)


def test_price_table_validates_fields() -> None:
    with pytest.raises(ValueError, match="per_hour"):
        PriceTable(per_hour=-1.0)
    with pytest.raises(ValueError, match="number"):
        PriceTable(per_hour="3")  # type: ignore[arg-type]
    assert PriceTable(per_hour=2).per_hour == 2.0


def test_presets_by_name_and_by_model() -> None:
    assert PriceTable.from_args(prices="gpt-4o") == PRESETS["gpt-4o"]
    by_model = PriceTable.from_args(price_per_hour=1.0, model="openai/gpt-4o-mini")
    assert (by_model.per_hour, by_model.input_per_mtok, by_model.output_per_mtok) == (1.0, 0.15, 0.6)
    assert PriceTable.from_args(model="my-local-model") == PriceTable()
    with pytest.raises(ValueError, match="no prices named 'gpt-9'"):
        PriceTable.from_args(prices="gpt-9")


def test_price_table_file_overrides_and_extends_presets(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(
        '[models."gpt-4o"]\ninput = 2.0\noutput = 8\n\n[models."h100-vllm"]\nper_hour = 2.49\n',
        encoding="utf-8",
    )
    table = load_price_table(path)
    assert table["gpt-4o"] == PriceTable(input_per_mtok=2.0, output_per_mtok=8.0)
    assert table["h100-vllm"] == PriceTable(per_hour=2.49)
    assert table["gpt-4.1"] == PRESETS["gpt-4.1"]
    assert PriceTable.from_args(model="h100-vllm", table=table).per_hour == 2.49


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('[models."x"]\ninput = 1\noutput = 1\nextra = 2\n', "unknown keys extra"),
        ('[models."x"]\ninput = 1\n', 'models."x": token prices need both'),
        ('[models."x"]\ninput = "1"\noutput = 1\n', "must be a number"),
        ("[prices]\nx = 1\n", "only"),
        ("[models\n", "cannot read price table"),
    ],
)
def test_bad_price_table_files(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=match) as caught:
        load_price_table(path)
    assert "\n" not in str(caught.value)


def test_missing_price_table_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="price table not found"):
        load_price_table(tmp_path / "nope.toml")
