"""data_hf.py's engine (no torch): streaming files into records, planning the work, the worker pool, Arrow chunks,
the split writer, the summary and the atomic publish. No re-exports: import the modules."""
