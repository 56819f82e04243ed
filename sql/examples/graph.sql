-- Message passing over an edge table: a sparse tensor relation joined with ordinary tables.
-- Run: tra-sql -f sql/examples/graph.sql

CREATE TABLE people (id INTEGER, name VARCHAR);
INSERT INTO people VALUES (0, 'ada'), (1, 'bob'), (2, 'cy'), (3, 'dee');
CREATE TABLE follows (src INTEGER, dst INTEGER);
INSERT INTO follows VALUES (0, 1), (0, 2), (1, 2), (2, 0), (3, 2);

-- adjacency adj[dst, src] = 1 in tiles of one element: absent edges are absent rows
CREATE TENSOR adj AS SELECT * FROM tra_from_elements(
    (SELECT dst, src, 1.0 FROM follows), shape => [4, 4], tile => [1, 1]);
-- one feature per person
CREATE TENSOR feat AS SELECT * FROM tra_from_elements(
    (SELECT id, 0, id + 1.0 FROM people), shape => [4, 1]);

-- followers per person (people nobody follows have no tile, hence no row)
SELECT p.name, d.value AS followers
FROM tra_elements(einsum('ds->d', adj)) AS d JOIN people AS p ON p.id = d.i0
ORDER BY p.name;

-- the sum of the followers' features, for people whose id is below 3
SELECT p.name, m.value AS incoming
FROM tra_elements(einsum('ds,sf->df', adj, feat)) AS m JOIN people AS p ON p.id = m.i0
WHERE m.i0 < 3
ORDER BY p.name;
