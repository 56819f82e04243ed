"""The tra_sql error hierarchy: every failure a user can cause is a ``TraError``."""


class TraError(Exception):
    """Base class of every error tra_sql raises on bad input or a failed statement."""


class SpecError(TraError, ValueError):
    """A malformed einsum spec, join expression or option."""


class ShapeError(TraError, ValueError):
    """Operand count, rank, index size or tile shape that does not fit."""


class DTypeError(TraError, TypeError):
    """A dtype tra_sql cannot store or compute with."""


class UnknownTensorError(TraError, LookupError):
    """A tensor name that is not in the catalog."""

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class TensorExistsError(TraError):
    """A tensor or table of that name exists already."""


class CorruptTileError(TraError):
    """A stored tile whose bytes disagree with the catalog's shape and dtype."""


class CatalogDriftError(TraError):
    """A catalog row and its table disagree: the table is gone or its columns were altered
    outside tra_sql, or the row itself is invalid (``Session.check`` lists and repairs)."""


class MemoryBudgetError(TraError, MemoryError):
    """A tensor, result or tile whose size is known before it runs and exceeds what the
    session can hold (``tra_sql.budget``): refused before anything is allocated."""


class ExecutionError(TraError):
    """The engine rejected or failed a generated or user statement."""


class SQLError(TraError, ValueError):
    """A malformed SQL statement, or a misuse of the tensor extensions to SQL."""


class SessionClosedError(TraError):
    """A session (or a tensor of one) used after ``close()``."""


class StaleTensorError(TraError):
    """A tensor handle read after its stored tensor was replaced, under the same name, by one
    of another shape, tile shape, dtype or layout (its tiles would be read as the old ones)."""
