"""The demo's claims hold: its faulty simulated replica makes the proxy retry, visibly."""

from __future__ import annotations

import io
import re
from pathlib import Path

import yaml

from proxy.demo import DEMO_FAULT_STATUS, TenantStats, run_demo, sim_configs, summary_table
from proxy.settings import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_one_demo_replica_fails_a_retryable_share_of_requests() -> None:
    """Only the last simulator injects errors, with a status the demo config retries."""
    config = load_config(ROOT / "config" / "demo.yaml")
    sims = sim_configs(len(config.replicas))
    assert [s.faults.error_rate > 0 for s in sims] == [False] * (len(sims) - 1) + [True]
    assert 0 < sims[-1].faults.error_rate <= 0.1
    assert f"http_{DEMO_FAULT_STATUS}" in config.retry.retry_on


async def test_the_demo_summary_counts_the_retries(tmp_path: Path) -> None:
    """A 2 s demo whose faulty replica fails every request (no warm-up, which it would fail):
    the requests sent there are retried on the other replica and the summary says how many."""
    document = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text(encoding="utf-8"))
    document["warmup"] = {"requests": 0}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    out = io.StringIO()

    assert await run_demo(duration_s=2.0, config_path=str(path), out=out, fault_rate=1.0) == 0

    text = out.getvalue()
    match = re.search(r"^retries: (\d+) \(http_503 (\d+)\)$", text, re.MULTILINE)
    assert match, text
    assert int(match[1]) == int(match[2]) >= 1
    assert "| chat | interactive |" in text


async def test_the_demo_in_observe_mode_refuses_nothing_and_says_what_it_would(
    tmp_path: Path,
) -> None:
    """demo --mode observe: no request is refused by admission (no queue, rate or wait
    refusal in the table), and the summary counts what enforcing would have refused."""
    document = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text(encoding="utf-8"))
    document["warmup"] = {"requests": 0}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    out = io.StringIO()

    assert await run_demo(duration_s=2.0, config_path=str(path), out=out, mode="observe") == 0

    text = out.getvalue()
    table = text[text.index("| tenant |") : text.index("\nretries:")]
    for reason in ("tenant_queue_full", "tenant_concurrency", "rate_limited",
                   "predicted_wait_exceeds_budget", "queue_timeout"):  # fmt: skip
        assert reason not in table, text
    match = re.search(r"^observed \(enforcing would have refused\): (\d+)", text, re.MULTILINE)
    assert match, text
    assert int(match[1]) >= 1 and "would_" in text  # the demo offers several times the seats


def test_requests_still_running_when_the_demo_ends_are_counted() -> None:
    """Five sent, two answered, one refused: the two the demo cut when it ended show as
    unfinished (in observe mode the engines' own queues held many, and the rows did not
    add up)."""
    config = load_config(Path(__file__).resolve().parent.parent / "config" / "demo.yaml")
    tenant = next(iter(config.tenants))
    stats = TenantStats(sent=5, ok=2)
    stats.refused["rate_limited"] = 1
    assert "rate_limited 1, unfinished when the demo ended 2" in summary_table(
        {tenant: stats}, config
    )
