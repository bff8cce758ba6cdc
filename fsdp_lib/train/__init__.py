"""The training wing: the optimizer and its guard, training checkpoints (saving, finding and verifying), the metrics
sink, sample generations, and the training objectives beyond the language-model loss (DPO). No re-exports: import
the modules."""
