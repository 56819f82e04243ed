-- A two-layer perceptron's forward pass over random data, without leaving SQL.
-- Run: tra-sql model.db -f sql/examples/mlp.sql

CREATE OR REPLACE TENSOR X  AS SELECT * FROM tra_random(shape => [8, 6], tile => [4, 3], seed => 1);
CREATE OR REPLACE TENSOR W1 AS SELECT * FROM tra_random(shape => [6, 5], tile => [3, 5], seed => 2, dist => 'normal');
CREATE OR REPLACE TENSOR b1 AS SELECT * FROM tra_from_elements((SELECT range, 0.1 FROM range(5)), shape => [5]);
CREATE OR REPLACE TENSOR W2 AS SELECT * FROM tra_random(shape => [5, 3], seed => 3, dist => 'normal');

-- hidden layer: relu(X W1 + b1); the bias and the activation are the join of one einsum
CREATE OR REPLACE TENSOR H AS SELECT * FROM einsum('bh,h->bh',
    einsum('bi,ih->bh', X, W1), b1, "join" => 'greatest(x0 + x1, 0)');

-- output layer
CREATE OR REPLACE TENSOR Y AS SELECT * FROM einsum('bh,hc->bc', H, W2);

-- each row's best class: the largest logit, with an ordinary GROUP BY over the elements
SELECT i0 AS row, arg_max(i1, value) AS class, round(max(value), 4) AS logit
FROM tra_elements(Y) GROUP BY i0 ORDER BY row;

-- the SQL that an einsum becomes
EXPLAIN SELECT * FROM einsum('bh,hc->bc', H, W2, agg := 'max');
