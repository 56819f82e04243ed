"""Reading a script: tokens, statements split at ``;``, and what kind each statement is."""

from __future__ import annotations

import re
from dataclasses import dataclass

import sqlglot
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import Token, TokenType

from tra_sql.errors import SQLError
from tra_sql.frontend.syntax import options_text

DIALECT = Dialect.get_or_raise("duckdb")
TENSOR_FUNCTIONS = ("einsum", "grad", "tra_random", "tra_from_elements", "tra_relation")
FUNCTIONS = TENSOR_FUNCTIONS + ("tra_elements", "tra_check", "tra_plan")


@dataclass(frozen=True)
class Statement:
    """One statement of a script: its number (from 1), text and sqlglot tokens."""

    number: int
    text: str
    tokens: tuple[Token, ...]
    offset: int

    def words(self, start: int, count: int) -> list[str]:
        """Upper-cased texts of ``count`` tokens from ``start`` ('' for strings, quoted
        names and past the end)."""
        words = [t.text.upper() if t.token_type not in (TokenType.STRING, TokenType.IDENTIFIER) else ""
                 for t in self.tokens[start : start + count]]
        return words + [""] * (count - len(words))

    @property
    def kind(self) -> str:
        """create, view (CREATE TENSOR VIEW), parameter, drop, drop view, train, explain,
        tensor (calls a tensor function) or plain."""
        head = self.words(0, 6)
        if head[0] == "CREATE":
            at = 3 if head[1:3] == ["OR", "REPLACE"] else 1
            if head[at] == "TENSOR":
                view = head[at + 1] == "VIEW" and len(self.tokens) > at + 2 and head[at + 2] not in ("AS", "WITH")
                return "view" if view else "create"
            if head[at] == "PARAMETER":
                return "parameter"
        if head[:2] == ["DROP", "TENSOR"]:
            return "drop view" if head[2] == "VIEW" and len(self.tokens) > 3 else "drop"
        if head[0] == "TRAIN":
            return "train"
        if head[0] == "EXPLAIN":
            return "explain"
        calls = any(t.token_type == TokenType.VAR and t.text.lower() in FUNCTIONS and
                    n.token_type == TokenType.L_PAREN for t, n in zip(self.tokens, self.tokens[1:]))
        return "tensor" if calls else "plain"

    def names(self, names: set[str]) -> bool:
        """Whether a name (identifier) of ``names`` (lower case) occurs in the statement."""
        return any(t.token_type in (TokenType.VAR, TokenType.IDENTIFIER) and t.text.lower() in names
                   for t in self.tokens)

    @property
    def analyze(self) -> bool:
        """Whether this is ``EXPLAIN ANALYZE ...``."""
        return bool(re.match(r"EXPLAIN\s+ANALYZE\b", self.text, re.I))

    def options(self, paren: int, what: str, allowed: tuple[str, ...]) -> tuple[dict, int]:
        """The options ``(name := value, ...)`` whose ``(`` is token ``paren``, and the number of
        the token after their ``)``."""
        depth = 0
        for j in range(paren, len(self.tokens)):
            kind = self.tokens[j].token_type
            depth += (kind == TokenType.L_PAREN) - (kind == TokenType.R_PAREN)
            if depth == 0:
                inside = self.text[self.tokens[paren].end + 1 - self.offset : self.tokens[j].start - self.offset]
                return options_text(inside, what, allowed), j + 1
        raise SQLError(f"{what}: the options' ( is not closed")

    def rest(self, token: int) -> str:
        """The text after token number ``token``."""
        return self.text[self.tokens[token].end + 1 - self.offset :].strip()

    def where(self) -> str:
        text = " ".join(self.text.split())
        return f"statement {self.number} `{text if len(text) <= 160 else text[:157] + '...'}`"


def tokenize(text: str) -> list[Token]:
    try:
        return DIALECT.tokenize(text)
    except sqlglot.errors.TokenError as err:
        raise SQLError(f"cannot read the SQL: {err}") from None


def split_statements(text: str, first: int = 1) -> list[Statement]:
    """The statements of ``text`` (separated by ``;``), empty ones left out."""
    statements: list[Statement] = []
    current: list[Token] = []
    for tok in [*tokenize(text), None]:
        if tok is not None and tok.token_type != TokenType.SEMICOLON:
            current.append(tok)
            continue
        if current:
            begin = current[0].start
            body = text[begin : tok.start if tok is not None else len(text)].rstrip()
            statements.append(Statement(first + len(statements), body, tuple(current), begin))
        current = []
    return statements


def is_extended(text: str) -> bool:
    """Whether ``text`` uses tensor syntax (otherwise DuckDB gets it unchanged)."""
    try:
        statements = split_statements(text)
    except SQLError:
        return False
    return any(s.kind != "plain" and (s.kind != "explain" or explained(s).kind != "plain")
               for s in statements)


def explained(statement: Statement) -> Statement:
    """The statement an ``EXPLAIN [ANALYZE]`` statement explains."""
    body = statement.rest(0)
    analyze = re.match(r"ANALYZE\b", body, re.I)
    inner = split_statements(body[analyze.end() :] if analyze else body, statement.number)
    if len(inner) != 1:
        raise SQLError(f"{statement.where()}: EXPLAIN takes one statement")
    return inner[0]
