"""Offline capacity planning: the model and what feeds it, with no I/O beyond reading a config.json.

In dependency order: `model` (pure step and KV physics: bytes read per step, step time, token
budget, KV capacity), `presets` (built-in models and GPUs, each with its source), `hf_config` (a
Hugging Face config.json -> an Architecture), `deployment` (what a user names -> a ServingSetup,
shared by `plan`, `calibrate`, `serve` and the simulator), `pools` (short- and long-context pools),
`planner` (`stepbudget plan`) and `calibrate` (`stepbudget calibrate`: effective bandwidth and
overhead from measured inter-token gaps). Nothing here imports the daemon.
"""
