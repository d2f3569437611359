"""Helpers for tests/product/test_e2e_stack.py: the whole path on loopback (simulated vLLM -> stepbudget serve
-> Prometheus -> Alertmanager -> a webhook receiver)."""
