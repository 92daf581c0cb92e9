"""What every other folder stands on: the declarations and the ground rules. Nothing here imports a folder.

  base.config      ModelConfig and TrainConfig (one field per setting, validated once), the presets, --set
  base.fields      the field types and rules a declaration is written in; flags and help derived from them
  base.parts       Registry and Kind: the parts people add (routers, optimizers, products) by name
  base.configfile  config files (TOML: [model], [train], a kind's own table), read against the declarations
  base.plugins     --import: a user's module, loaded once, that registers parts of its own
  base.errors      Nanollama4Error and its kinds: the one-line errors meant for people
  base.files       files a user handed us: bounded reads, atomic writes, never through a planted link
  base.runtime     the machine: device, bf16 or not, memory still free, the allocator
  base.threads     how many CPU threads a training step takes when the run leaves it to us
  base.moved       the flat layout's module names, still importable for one release
"""
