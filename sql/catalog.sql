-- The tra_sql catalog: one row per tensor relation. The tensor's own table has one row per
-- tile: integer keys k0, k1, ... (the tile's index along each dimension) and a BLOB `tile`
-- holding the tile's elements in C order. Boundary tiles are ragged: along dimension d the
-- tile with key k has min(tile_shape[d], shape[d] - k * tile_shape[d]) elements. A 2-D
-- tensor with layout 'csr' keeps each tile as its nonzeros instead (tra_sql.udfs.sparse).
CREATE TABLE IF NOT EXISTS tra_tensors (
    name       VARCHAR PRIMARY KEY,
    dtype      VARCHAR NOT NULL,   -- numpy dtype name: float32, float64, int32, int64
    shape      BIGINT[] NOT NULL,  -- full shape
    tile_shape BIGINT[] NOT NULL,  -- shape of an interior tile
    layout     VARCHAR NOT NULL DEFAULT 'dense'  -- 'dense' (C-order elements) or 'csr'
);
-- catalogs written before the layout column existed
ALTER TABLE tra_tensors ADD COLUMN IF NOT EXISTS layout VARCHAR DEFAULT 'dense';
