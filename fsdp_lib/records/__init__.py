"""The records wing (no torch): the dataset schema and the record shapes. Columns, roles, turn fields, tool-call
normalisation, and how a conversation, a preference pair or a text record is read: the one place a record format is
defined, imported by data_hf.py (writing) and the trainer (reading). No re-exports: import the modules."""
