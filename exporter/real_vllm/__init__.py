"""A real vLLM in the loop: its CPU build started on 127.0.0.1, and a load generator that knows the truth."""
