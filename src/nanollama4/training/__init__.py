"""Training: text to batches, the loop, its run folder, and the same on several processes.

  training.corpus       finding a corpus's files and reading them, bounded
  training.data         tokenize once (a cache beside the run), split, sample batches
  training.optim        the optimizers as parts (AdamW, Muon), with their own settings
  training.schedule     warmup and cosine, in steps or on the clock
  training.runsetup     what a run starts from: config, tokenizer, model, optimizer, precision
  training.train        the loop in short named steps: one step, validation and saving, signals
  training.runs         the run folder: the lock, exact resume, what the project may remove
  training.metrics      metrics.jsonl (and TensorBoard): losses and the routing telemetry
  training.evaluation   validation losses: the fixed batches and a run's whole validation text
  training.runtext      a run's text read back, checked against what it recorded
  training.distributed  torchrun: DDP, FSDP2 and expert parallelism, wrapped around the model
"""
