"""organize_data.py's engine (no torch): the balanced split plan and its manifest (plan), and placing files into the
split folders atomically, resumably and without touching what the tool did not write (place). No re-exports:
import the modules."""
