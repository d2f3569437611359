"""What the alert loop's tests share: a reading under budget to override, and a recorder of posts."""

from __future__ import annotations

from exporter.serve.reading import Reading


def reading(**values: object) -> Reading:
    """A healthy reading under budget; tests override what they need."""
    base = dict(deployment="chat", target="10.0.0.5:8000", model_name="Qwen/Qwen3-8B", engine="0",
                namespace="llm", pod="vllm-0", target_up=True, predicted_step_seconds=0.010,
                predicted_memory_step_seconds=0.010, measured_step_seconds=0.0105, prediction_error_ratio=-0.05,
                step_budget_seconds=0.018, kv_cache_usage_ratio=0.5, preemptions_total=0.0)
    return Reading(**{**base, **values})  # type: ignore[arg-type]  # fields given as object: each test overrides a few


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.posts: list[tuple[str, list[dict[str, object]], float]] = []
        self.fail = fail

    def __call__(self, url: str, alerts: list[dict[str, object]], timeout: float) -> None:
        self.posts.append((url, alerts, timeout))
        if self.fail:
            raise ConnectionError("Connection refused")
