"""stepbudget: capacity planning and monitoring of LLM model servers in tokens in flight."""

__version__ = "0.2.0"
