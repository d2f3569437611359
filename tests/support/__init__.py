"""Helpers the tests import (conftest.py holds only fixtures, which may use these).

- clocks: ManualClock (time moves when a test says so), SteppingClock (moves at every read)
- servers: free_port, wait_until, send_text, PageServer (a real HTTP server on 127.0.0.1)
- configs: write (a config file for a test), MINIMAL (the smallest valid config), make_config (one vLLM target)
- pages: VllmState and vllm_page, a vLLM V1 /metrics page builder
- simulator: the simulated engine worked by hand (blocks_by_hand, step), its ground-truth step over a window
  (true_mean_step_seconds), its page's structure, its calibration
- pollers: MakePoller, the type of the `make_poller` fixture, and scrape (what the collector exports from its readings)
- alertmanager: Alertmanager (a client of a real one) and its config
- admission: daemon_with_admission, a running daemon with admission on (its HTTP API and the ASGI gateway)
- tools: REPO and require_tool (external tools the tests drive: promtool, helm, ...; fails a test without a tier marker)
- tiers: which tests drive an external tool, read from the source (conftest marks them `tools`)
- chart: the Helm chart rendered by the real helm binary (render, helm) and its objects (of_kind, one, ...)
- monitoring: shared checks for the rules, the dashboards and the chart's copies of both
- e2e: the pieces of the end-to-end stack and the quickstart checks (tests/product/test_e2e_stack.py)
"""
