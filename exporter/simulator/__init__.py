"""A simulated vLLM server: continuous batching in simulated time, vLLM's /metrics page, a
streaming OpenAI-compatible /v1/completions. See docs/simulator.md.

Public API:
  * `Simulator(spec, scenario, record_steps=...)` — the engine in simulated time; `run_until(t)`,
    `submit(...)`, `render_metrics()`, `steps` (StepRecord list when recorded), `counters`.
  * `start_server(host, port, scenario, speed, spec)` -> `ServerHandle` (`.url`, `.simulator`, `.stop()`).
  * `ServerSpec`, `HardwareTruth`, `load_scenario(name_or_yaml_path)`, `builtin_scenarios()`.
"""

from exporter.simulator.hardware import HardwareTruth
from exporter.simulator.scenarios import (
    AGENTS_JOIN_SECONDS,
    AGENTS_LEAVE_SECONDS,
    Scenario,
    builtin_scenarios,
    load_scenario,
    scenario_from_dict,
)
from exporter.simulator.server import ServerHandle, start_server
from exporter.simulator.simulation import Simulator
from exporter.simulator.spec import ServerSpec, SimRequest, StepRecord

__all__ = [
    "AGENTS_JOIN_SECONDS", "AGENTS_LEAVE_SECONDS", "HardwareTruth", "Scenario", "ServerHandle", "ServerSpec",
    "SimRequest", "Simulator", "StepRecord", "builtin_scenarios", "load_scenario", "scenario_from_dict",
    "start_server",
]
