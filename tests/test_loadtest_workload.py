"""The workload YAML of `loadtest phases`: validated with every error at its YAML path."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from proxy.loadtest.schedule import build_arrivals
from proxy.loadtest.workload import WorkloadError, load_workload, parse_workload, scale_durations

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "workload.example.yaml"

VALID = """
request_classes:
  short: {input_tokens: [8, 16], max_tokens: 8}
tenants:
  a: {api_key: k, mix: {short: 1}}
phases:
  - {name: only, duration_s: 1, rate_per_s: 5}
"""


def issues(text: str) -> dict[str, str]:
    with pytest.raises(WorkloadError) as caught:
        parse_workload(text, "w.yaml")
    return {issue.path: issue.message for issue in caught.value.issues}


def test_example_workload_is_valid_and_has_four_phases() -> None:
    """The shipped example loads, with the four phases, three tenants and a fault."""
    workload = load_workload(EXAMPLE)
    assert [p.name for p in workload.phases] == ["baseline", "ramp", "burst", "recovery"]
    assert set(workload.tenants) == {"chat", "webapp", "analytics"}
    assert set(workload.request_classes) == {"short", "medium", "long"}
    assert workload.drain_phase().name == "burst"
    burst = workload.phases[2]
    assert burst.fault is not None and burst.fault.settings() == {
        "error_rate": 0.2,
        "error_status": 503,
    }
    assert workload.slo_for("chat").ttft_ms == 1000
    assert workload.slo_for("webapp").ttft_ms == 3000  # the global default


def test_minimal_workload_gets_defaults() -> None:
    workload = parse_workload(VALID)
    assert workload.endpoint == "chat"
    assert workload.drain_phase().name == "only"
    assert workload.slo_for("a").ttft_ms is None


def test_every_problem_is_reported_at_its_path() -> None:
    """Field errors and cross-section errors come together, each at its YAML path."""
    found = issues(
        """
seed: x
request_classes:
  short: {input_tokens: [64, 16], max_tokens: 0}
  ok: {input_tokens: [1, 2], max_tokens: 3}
tenants:
  chat: {api_key: k, mix: {huge: 1}, slo: {ttft_ms: -1}}
  both: {api_key: k, api_key_env: K, mix: {ok: 1}}
phases:
  - {name: burst, duration_s: 0, rate_per_s: 5}
  - {name: burst, duration_s: 1, rate_per_s: 5, fault: {error_rat: 0.3}}
  - {name: bad, duration_s: 1, rate_per_s: 5, fault: {error_rate: 3}}
drain_after: nope
surprise: 1
"""
    )
    assert found == {
        "seed": "input should be a valid integer, unable to parse string as an integer (got 'x')",
        "request_classes.short.input_tokens": (
            "must be [min, max] with 1 <= min <= max, got [64, 16]"
        ),
        "request_classes.short.max_tokens": "input should be greater than 0 (got 0)",
        "tenants.chat.slo.ttft_ms": "input should be greater than 0 (got -1)",
        "tenants.chat.mix.huge": "unknown request class (known: ok, short)",
        "tenants.both": "give api_key or api_key_env, not both",
        "phases[0].duration_s": "input should be greater than 0 (got 0)",
        "phases[1].name": "duplicate phase name (also phases[0])",
        "phases[1].fault.error_rat": "unknown simulator fault field",
        "phases[2].fault": "error_rate must be between 0 and 1, got 3.0",
        "drain_after": "no phase is named 'nope'",
        "surprise": "unknown key",
    }


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        pytest.param("tenants: {}\nphases: []\n", "request_classes", "required", id="missing"),
        pytest.param(
            VALID.replace("mix: {short: 1}", "mix: {}"), "tenants.a.mix", "at least one", id="mix"
        ),
        pytest.param(
            VALID.replace("rate_per_s: 5}", "rate_per_s: 5, fault: {}}"),
            "phases[0].fault",
            "name at least one fault field",
            id="empty-fault",
        ),
        pytest.param(VALID + "endpoint: grpc\n", "endpoint", "'chat' or 'completions'", id="ep"),
        pytest.param(
            VALID.replace("phases:\n  - {name: only, duration_s: 1, rate_per_s: 5}", "phases: []"),
            "phases",
            "at least one",
            id="no-phases",
        ),
    ],
)
def test_single_problems(text: str, path: str, fragment: str) -> None:
    found = issues(text)
    assert path in found, found
    assert fragment in found[path]


def test_yaml_syntax_error_has_line_and_column() -> None:
    found = issues("request_classes: [1\n")
    assert list(found) == ["<yaml>"]
    assert "line 2" in found["<yaml>"]


def test_duplicate_key_is_refused() -> None:
    found = issues(VALID + "tenants: {}\n")
    assert "<yaml>" in found


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError) as caught:
        load_workload(tmp_path / "nope.yaml")
    assert caught.value.issues[0].path == "<file>"


def test_cli_lists_the_errors_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`loadtest phases` with a bad workload sends nothing and prints every problem."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(VALID.replace("mix: {short: 1}", "mix: {long: 1}") + "extra: 1\n")
    status = main(["loadtest", "phases", "--url", "http://127.0.0.1:9", "--workload", str(bad)])
    assert status == 2
    err = capsys.readouterr().err
    assert "tenants.a.mix.long: unknown request class" in err
    assert "extra: unknown key" in err


def test_cli_refuses_a_fault_without_its_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A phase fault pointing past the --fault-url list is refused before any load."""
    path = tmp_path / "w.yaml"
    path.write_text(VALID.replace("rate_per_s: 5}", "rate_per_s: 5, fault: {error_rate: 0.5}}"))
    status = main(["loadtest", "phases", "--url", "http://127.0.0.1:9", "--workload", str(path)])
    assert status == 2
    assert "--fault-url number 0" in capsys.readouterr().err


def test_schedule_is_seeded_and_follows_the_rates() -> None:
    """Same seed, same arrivals; counts near rate x duration; a ramp's second half is busier."""
    text = VALID.replace(
        "  - {name: only, duration_s: 1, rate_per_s: 5}",
        "  - {name: flat, duration_s: 20, rate_per_s: 50}\n"
        "  - {name: ramp, duration_s: 20, rate_per_s: 0, to_rate_per_s: 100}",
    )
    workload = parse_workload(text)
    first, second = build_arrivals(workload), build_arrivals(workload)
    assert first == second
    assert build_arrivals(workload, seed=99) != first
    flat = [a for a in first if a.phase == "flat"]
    ramp = [a for a in first if a.phase == "ramp"]
    assert 850 <= len(flat) <= 1150  # 1000 expected, Poisson sd about 32
    assert 850 <= len(ramp) <= 1150
    early = sum(1 for a in ramp if a.at_s < 30.0)
    assert early < len(ramp) - early  # a quarter versus three quarters
    assert all(8 <= a.input_tokens <= 16 for a in first)
    assert [a.at_s for a in first] == sorted(a.at_s for a in first)


def test_duration_scale_shortens_every_phase_and_keeps_the_rest() -> None:
    """`--duration-scale 0.25`: each phase a quarter as long, same rates and faults."""
    workload = load_workload(EXAMPLE)
    short = scale_durations(workload, 0.25)
    assert [p.duration_s for p in short.phases] == [p.duration_s / 4 for p in workload.phases]
    assert [p.rate_per_s for p in short.phases] == [p.rate_per_s for p in workload.phases]
    assert [p.fault for p in short.phases] == [p.fault for p in workload.phases]
    assert short.duration_s == workload.duration_s / 4
