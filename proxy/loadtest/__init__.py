"""Capacity tooling: ``admission-proxy loadtest staircase`` and ``loadtest phases``.

Operators must not guess concurrency limits (docs/REFERENCE.md). The
staircase test steps closed-loop concurrency against any OpenAI-compatible
URL and names the knee; the phases test drives open-loop Poisson traffic from
a workload file through the proxy and reports goodput, rejections and how the
queues drain after a burst.

Modules, one job each:

- ``results``: what one request did (``RequestResult``) and percentiles.
- ``knee``: the staircase's stop lines and knee rules; pure, no I/O.
- ``levels``: one staircase level's row, summarised from its results.
- ``generator``: the HTTP load itself (closed and open loop, SSE reading).
- ``scrape``: reading Prometheus ``/metrics`` (memory, queue depth, retries).
- ``workload``: the phases test's YAML model, validated with YAML paths.
- ``schedule``: Poisson arrivals for the phases; pure and seeded.
- ``timeline``: goodput, phase and tenant summaries, drain time; pure.
- ``staircase``, ``phases``: the two runs.
- ``report``, ``phases_report``, ``plots``, ``progress``: what the operator reads.
- ``cli``: the ``loadtest`` subcommand.

Every load loop here is bounded in requests and in time and ends by itself.
"""
