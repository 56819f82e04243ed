"""EinDecomp: choose the tiling of every index of an einsum program, and run the plan.

- ``problem``: the ops, edges and fixed tilings of a DAG; ``cost``: the cost model;
- ``model``: every state of every op priced; ``search``: DP, presets, exhaustive search;
- ``plan``: ``Plan`` (explain, DOT, apply); ``execute``: plans run as several statements
  when one would not fit in memory; ``calibrate``: the constants, measured on this engine;
- ``graphs``: planning-only graphs (matrix chain, MLP, transformer block, LLaMA decoder).
"""

from tra_sql.decompose.cost import Budget, Constants, parse_bytes
from tra_sql.decompose.plan import Plan, make_plan, rebuild

__all__ = ["Budget", "Constants", "Plan", "make_plan", "parse_bytes", "rebuild"]
