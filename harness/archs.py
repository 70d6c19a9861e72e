"""
archs.py -- the architecture table: which architectures exist, and which of train.py's flags each one reads.

Each architecture module (ARCH_MODULES, imported here) exposes ARCH_SPECS, a list of model.ArchSpec (config class,
model class, presets, and optional hooks: extra flags, config overrides from flags, batch preparation, training
defaults); arch_table() maps every spec's name to it. Architectures register here as they land. A model converted
from a vanilla one is train.py's to make (train.convert calls each paper's own conversion). add_arch_args puts every
architecture's flags into train.py's parser and records which architectures read each one (`ap.arch_flags`), so that
a flag of another architecture is named in a warning (run_flags.warn_inapplicable) and a saved flag is checked against
the architecture that reads it (run_flags.check_saved_run).
"""
from __future__ import annotations

import block_transformer
import double_decoder
import model
import plt
import recursive
from harness.cli import number
from model import ArchSpec

# ----------------------------------------------------------------------------------------------------------------
# The architecture table

ARCH_MODULES = [model, recursive, block_transformer, plt, double_decoder]


def arch_table() -> dict[str, ArchSpec]:
    table = {}
    for module in ARCH_MODULES:
        for spec in module.ARCH_SPECS:
            table[spec.name] = spec
    return table


# ----------------------------------------------------------------------------------------------------------------
# Which architectures read which flag

def add_arch_args(ap, table, shared: dict):
    """Every architecture's flags (spec.add_args, plain argparse) into train.py's parser, and `ap.arch_flags`: the
    dest of every flag that only some architectures read -> their names (the flags each add_args adds, plus `shared`:
    the command's own flags that only some read, {dest: names}). A flag with `bounds` ({min, above, max}, set by its
    add_args) gets them checked as it is parsed: its type becomes cli.number(type, **bounds), the one-line error."""
    ap.arch_flags = {dest: set(names) for dest, names in shared.items()}
    added = {}  # add_args function -> dests it added (recursive and relaxed share one function, called once)
    for spec in table.values():
        if spec.add_args is not None and spec.add_args not in added:
            before = set(map(id, ap._actions))
            spec.add_args(ap)
            new = [a for a in ap._actions if id(a) not in before]
            for a in new:
                if getattr(a, "bounds", None):
                    a.type = number(a.type, **a.bounds)
            added[spec.add_args] = [a.dest for a in new]
    for spec in table.values():
        for dest in added.get(spec.add_args, []):
            ap.arch_flags.setdefault(dest, set()).add(spec.name)
