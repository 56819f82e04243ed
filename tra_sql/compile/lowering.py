"""The SQL lowering of every node kind, one rule per kind: ``LOWERING(node)(node, relations)``
is the SELECT computing ``node``'s tiles (or the name of the stored table holding them), where
``relations(nodes)`` gives the relation names of ``nodes``' results and their labels for the
kernels' error messages. Each kind's module registers its rule."""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from tra_sql.graph import Node
from tra_sql.kinds import Rules

Relations = Callable[[list[Node]], tuple[list[str], list[str]]]
Lower = Callable[[Node, Relations], exp.Select | str]

LOWERING: Rules[Lower] = Rules("SQL lowering")
