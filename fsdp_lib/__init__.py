"""The parts of fsdp_train.py, one concern per module; imports run one way, from small to large, and nothing here
imports fsdp_train.py. README.md ("Repository layout") has the table of what lives where."""
