"""What each `nanollama4` command does, once `cli.py` has parsed and checked its arguments.

  arithmetic  params, kv-cache, rope-check, summary, config: a config and no run
  training    train, eval, plot, compare, sweep, experiment: around a run folder
  inference   generate, explain, experts, serve: a trained model reading text
  export      export: to transformers' layout or llama.cpp's GGUF
  common      the exit statuses and the model loading the commands share

One function per command (`cmd_NAME(args)`), returning None or an exit status. Nothing here parses
arguments, and heavy imports (torch, the engine, the server) happen inside the command that needs them.
"""

from .arithmetic import cmd_config, cmd_kv_cache, cmd_params, cmd_rope_check, cmd_summary
from .export import cmd_export
from .inference import cmd_experts, cmd_explain, cmd_generate, cmd_serve
from .training import cmd_compare, cmd_eval, cmd_experiment, cmd_plot, cmd_sweep, cmd_train

__all__ = ["cmd_params", "cmd_kv_cache", "cmd_rope_check", "cmd_summary", "cmd_config", "cmd_train", "cmd_eval",
           "cmd_plot", "cmd_compare", "cmd_sweep", "cmd_experiment", "cmd_generate", "cmd_explain", "cmd_experts",
           "cmd_serve", "cmd_export"]
