"""Offline capacity planning: the model and what feeds it, with no I/O beyond reading a config.json.

In dependency order: `architecture` (what a model is, its bytes per token and weights per GPU),
`fit` (least squares from measured steps to the step's terms), `kv_cache` (the KV cache's capacity
and block layout), `model` (pure step physics: bytes and FLOPs per step, step time, token budget),
`presets` (built-in models and GPUs, each with its source), `hf_config` (a Hugging Face
config.json -> an Architecture), `deployment` (what a user names -> a ServingSetup, shared by
`plan`, `calibrate`, `serve` and the simulator), `pools` (short- and long-context pools),
`planner` (`stepbudget plan`) and `calibrate` (`stepbudget calibrate`: effective bandwidth and
overhead from measured inter-token gaps). Nothing here imports the daemon.
"""
