"""A client of a real Alertmanager (the `alertmanager` fixture starts one) and the config it runs with."""

from __future__ import annotations

from dataclasses import dataclass

import requests

ALERTMANAGER_CONFIG = """\
route:
  receiver: "null"
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: "null"
"""


@dataclass
class Alertmanager:
    url: str

    def alerts(self) -> list[dict[str, object]]:
        response = requests.get(f"{self.url}/api/v2/alerts", timeout=5)
        response.raise_for_status()
        return response.json()

