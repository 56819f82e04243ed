-- A matrix product in SQL: two small matrices from element rows, their product, its elements.
-- Run: tra-sql -f sql/examples/matmul.sql

CREATE TENSOR A AS SELECT * FROM tra_from_elements(
    (VALUES (0, 0, 1.0), (0, 1, 2.0), (1, 0, 3.0), (1, 1, 4.0), (2, 0, 5.0), (2, 1, 6.0)),
    shape => [3, 2], tile => [2, 2]);

-- elements that are not listed are zeros
CREATE TENSOR B AS SELECT * FROM tra_from_elements(
    (VALUES (0, 0, 1.0), (0, 1, -1.0), (1, 0, 0.5), (1, 2, 2.0)),
    shape => [2, 3], tile => [2, 2]);

-- C[i, k] = sum_j A[i, j] * B[j, k]
CREATE TENSOR C AS SELECT * FROM einsum('ij,jk->ik', A, B);

SELECT name, shape, tile_shape FROM tra_tensors ORDER BY name;
SELECT i0 AS i, i1 AS k, value FROM tra_elements(C) ORDER BY i, k;
