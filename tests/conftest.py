import numpy as np
import pytest

import tra_sql


@pytest.fixture
def db():
    session = tra_sql.connect()
    yield session
    session.close()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
