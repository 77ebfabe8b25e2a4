"""The commands, one module each: `register(sub)` adds its grammar to the parser, and the
handler it sets calls the library and prints the answer (memsched.cli.render)."""
from __future__ import annotations

# in the order `memsched --help` lists them
NAMES = ("compile", "report", "tune_batch", "inspect", "models", "hardware", "profile", "simulate", "remat",
         "train_graph", "check_numerics", "doctor", "train", "run")
