"""From the DAG to SQL: the fusion passes (``passes``, one module per fusion: ``attention``,
``prologue``, ``epilogue``, ``chain``) replace the nodes they fuse with explicit fused kinds;
every kind is lowered to a SELECT over its inputs' tile relations by its rule in
``lowering.LOWERING`` (``einsum``, ``placement`` and the fusion modules register them);
``program.Program`` chains the SELECTs as CTEs; ``dialect`` writes them for an engine. Kernel
calls carry typed ``tra_sql.udfs.protocol`` steps and kernel references."""
