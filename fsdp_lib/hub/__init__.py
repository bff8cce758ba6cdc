"""model_download.py's parts (no torch at import): size presets, the download plan, weight-file inspection, offline
verification, hub download and from-scratch initialisation. No re-exports: import the modules."""
