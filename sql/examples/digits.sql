-- Logistic regression on scikit-learn's digits, trained in the database, from SQL alone.
-- Run from a folder holding digits_train.csv (1500 rows) and digits_test.csv (297 rows), each
-- with columns id, label, p0..p63 (8x8 pixels, 0..16); tests/test_sql_training.py writes them:
--   tra-sql digits.duckdb -f sql/examples/digits.sql

CREATE OR REPLACE TABLE train AS SELECT * FROM read_csv('digits_train.csv');
CREATE OR REPLACE TABLE test AS SELECT * FROM read_csv('digits_test.csv');

-- features (pixels scaled to [0, 1]) and one-hot labels as tensors, from element rows
CREATE OR REPLACE TENSOR X AS SELECT * FROM tra_from_elements(
    (SELECT id, CAST(substr(pixel, 2) AS INTEGER), v / 16.0 FROM (UNPIVOT train ON COLUMNS('^p') INTO NAME pixel VALUE v)),
    shape => [1500, 64], tile => [500, 64]);
CREATE OR REPLACE TENSOR X_test AS SELECT * FROM tra_from_elements(
    (SELECT id, CAST(substr(pixel, 2) AS INTEGER), v / 16.0 FROM (UNPIVOT test ON COLUMNS('^p') INTO NAME pixel VALUE v)),
    shape => [297, 64]);
CREATE OR REPLACE TENSOR Y AS SELECT * FROM tra_from_elements(
    (SELECT id, label, 1.0 FROM train), shape => [1500, 10], tile => [500, 10]);

-- the model: softmax(X W + b); kept if they exist (a second run of this script resumes)
CREATE PARAMETER W WITH (shape := [64, 10], init := 'zeros');
CREATE PARAMETER b WITH (shape := [10], init := 'zeros');

-- tensor views are definitions, evaluated again wherever they are read
CREATE OR REPLACE TENSOR VIEW logits AS SELECT * FROM einsum('nc,c->nc', einsum('nf,fc->nc', X, W), b, "join" => 'x0 + x1');
-- mean cross-entropy: logsumexp(logits) - the label's logit, over 1500 rows
CREATE OR REPLACE TENSOR VIEW loss AS SELECT * FROM einsum('nc,nc,n->', Y, logits,
    einsum('nc->n', logits, agg => 'logsumexp'), "join" => 'x0 * (x2 - x1) / 1500.0');

-- 40 epochs of Adam; each epoch's loss is logged in tra_run_log (run 'digits'), resumably
TRAIN loss PARAMETERS W, b WITH (optimizer := 'adam', lr := 0.05, epochs := 40, run := 'digits');

-- test accuracy: each test row's class is its largest logit
CREATE OR REPLACE TENSOR VIEW test_logits AS SELECT * FROM einsum('nc,c->nc', einsum('nf,fc->nc', X_test, W), b,
    "join" => 'x0 + x1');
SELECT round(avg(CASE WHEN p.class = t.label THEN 1.0 ELSE 0.0 END), 4) AS test_accuracy
FROM (SELECT i0 AS id, arg_max(i1, value) AS class FROM tra_elements(test_logits) GROUP BY i0) AS p
JOIN test AS t USING (id);
