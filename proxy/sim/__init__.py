"""The simulated GPU replica: a continuous-batching engine model behind an
OpenAI/TGI-compatible HTTP API, with fault injection.

The embedded default upstream of the proxy and the test double for
everything. `start_sim()` serves one in-process; `build_sim_app()` gives the
bare aiohttp application; `proxy.sim.cli` holds the `sim` subcommand.
"""

from proxy.sim.config import SimConfig
from proxy.sim.engine import SimEngine
from proxy.sim.faults import Faults, FaultsError
from proxy.sim.runner import SimServer, start_sim
from proxy.sim.server import build_sim_app

__all__ = [
    "Faults",
    "FaultsError",
    "SimConfig",
    "SimEngine",
    "SimServer",
    "build_sim_app",
    "start_sim",
]
