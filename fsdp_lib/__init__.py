"""The parts of fsdp_train.py and the engines of the helper tools: wings as subpackages (records, convert, organize,
data, model, hub, train) over a ground of small modules everyone stands on (errors, state, integrity, config,
offline, runtime, lock, faults). Imports run one way, from small to large; nothing here imports the top-level
scripts. docs/layout.md has the table of what lives where."""
