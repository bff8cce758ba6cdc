"""model_download.py's parts (no torch at import): size presets, the download plan, weight-file inspection, offline
verification, hub download (models and datasets), and from-scratch initialisation with a tokenizer trained on the
user's corpus. No re-exports: import the modules."""
