"""``tra-sql [DATABASE] [-c SQL | -f FILE.sql]``: tensor SQL on a DuckDB database.

With ``-c`` or ``-f`` the statements run in order and stop at the first error (exit status 1,
one line on stderr). Without them, statements are read from a prompt (from stdin when it is
not a terminal): a statement may span lines and ends with ``;``; ``EXPLAIN <statement>``
prints the SQL the tensor syntax is rewritten into; ``.tensors``, ``.views`` (tensor views),
``.runs`` (training runs), ``.help`` and ``.quit`` (or ``.exit``) are commands, taking no
arguments (anything else is an error line, as a failed statement is). A command may also come
inside an unfinished statement (a line starting with ``.`` and a letter), as psql's backslash
commands do: it runs at once and the statement goes on (``.quit`` drops it). Results are
printed as tables. When the reader of the output goes
away (``tra-sql -c ... | head``), the command stops quietly with exit status 141, as programs
ended by SIGPIPE do.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import TextIO

import duckdb
import sqlglot
from sqlglot.tokens import TokenType

from tra_sql import train
from tra_sql.catalog import CATALOG_TABLE
from tra_sql.errors import TraError
from tra_sql.frontend import tensor_views
from tra_sql.frontend.blame import engine_error
from tra_sql.frontend.runner import Frontend
from tra_sql.frontend.statements import DIALECT, Statement, split_statements
from tra_sql.session import Session, connect

HISTORY = os.path.join(os.path.expanduser("~"), ".tra_sql_history")
QUIET = (["Count"], ["Success"])
QUIT = (".quit", ".exit")
LISTS = {  # dot-command -> (the table it shows, its columns); views and runs: none before the first
    ".tensors": (CATALOG_TABLE, "*"),
    ".views": (tensor_views.TABLE, "name, definition"),
    ".runs": (train.RUNS, "run, epoch, step, optimizer"),
}
COMMANDS = (*LISTS, ".help", *QUIT)
BROKEN_PIPE = 141  # the exit status of a program ended by SIGPIPE, as shells report it
HELP = """Statements end with ';'. Tensor SQL, besides DuckDB's (docs/sql.md):
  SELECT * FROM einsum('ij,jk->ik', A, B [, "join" => 'x0 * x1'] [, agg => 'sum'])
  SELECT * FROM grad(loss, W)                        -- d loss / d W
  SELECT * FROM tra_elements(A)                      -- one row per element
  SELECT * FROM tra_random(shape => [4, 3], tile => [2, 2], seed => 0)
  SELECT * FROM tra_from_elements((SELECT i, j, v FROM t), shape => [4, 3])
  SELECT * FROM tra_relation(edges, keys => ['src', 'dst'], value => 'w', layout => 'csr')
  CREATE [OR REPLACE] TENSOR name [WITH (shape := [..], ...)] AS <query>;   DROP TENSOR name;
  CREATE [OR REPLACE] TENSOR VIEW name AS SELECT * FROM einsum(...);   DROP TENSOR VIEW name;
  CREATE [OR REPLACE] PARAMETER W WITH (shape := [4, 3], init := 'glorot_uniform', seed := 0);
  TRAIN [STEP] loss PARAMETERS W, b WITH (optimizer := 'adam', lr := 0.1, epochs := 20);
  EXPLAIN <statement>                                -- the rewritten SQL
Commands: .tensors  .views  .runs  .help  .quit"""


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def show(result: duckdb.DuckDBPyRelation | None, out: TextIO) -> None:
    """Print a statement's result as a table (nothing for DDL counts)."""
    if result is None or (result.type == "MATERIALIZED_RELATION" and result.columns in QUIET):
        return
    if result.columns == ["explain_key", "explain_value"]:
        for _, plan in result.fetchall():
            print(plan, file=out)
        return
    print(str(result).rstrip("\n"), file=out)


def run_statement(db: Session, statement: Statement, out: TextIO) -> None:
    """Run one statement and print what it gives."""
    frontend = Frontend(db)
    rewritten = frontend.explain_statement(statement)
    if rewritten is not None:
        print(rewritten, file=out)
        return
    result = frontend.run_statement(statement)
    try:
        show(result, out)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from None


def run_script(db: Session, text: str, out: TextIO, err: TextIO, stop: bool = True) -> bool:
    """Run the statements of ``text``; report errors on ``err``; False if any failed."""
    ok = True
    try:
        statements = split_statements(text)
    except TraError as error:
        print(f"Error: {one_line(error)}", file=err)
        return False
    for statement in statements:
        try:
            run_statement(db, statement, out)
        except TraError as error:
            print(f"Error: {one_line(error)}", file=err)
            ok = False
            if stop:
                break
    return ok


def complete(text: str) -> bool:
    """Whether ``text`` ends with a ``;`` outside strings and comments."""
    try:
        tokens = DIALECT.tokenize(text)
    except sqlglot.errors.TokenError:
        return False
    return bool(tokens) and tokens[-1].token_type == TokenType.SEMICOLON


def _history(interactive: bool) -> None:
    if not interactive:
        return
    try:
        import atexit
        import readline
    except ImportError:
        return
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass
    atexit.register(lambda: _save_history(readline))


def _save_history(readline) -> None:
    try:
        readline.write_history_file(HISTORY)
    except OSError:
        pass


def command(db: Session, line: str, out: TextIO, err: TextIO) -> bool:
    """Run a dot command other than .quit; False (after an error line) if it failed."""
    name, *args = line.split()
    if name.lower() not in COMMANDS:
        print(f"Error: unknown command {name}; the commands are {', '.join(COMMANDS)}", file=err)
        return False
    if args:
        print(f"Error: {name} takes no arguments, got {' '.join(args)}", file=err)
        return False
    if name.lower() == ".help":
        print(HELP, file=out)
        return True
    table, columns = LISTS[name.lower()]
    if table != CATALOG_TABLE and db.engine.object_kind(table) is None:
        return True
    try:
        show(db.engine.query(f"SELECT {columns} FROM {table} ORDER BY 1"), out)
    except duckdb.Error as error:
        print(f"Error: {name}: {one_line(error)}", file=err)
        return False
    return True


def repl(db: Session, out: TextIO, err: TextIO, interactive: bool) -> int:
    """Read statements until EOF or .quit; exit status 1 if a piped statement failed."""
    _history(interactive)
    if interactive:
        print("tra-sql: tensor SQL on DuckDB. Statements end with ';'. .help for help.", file=out)
    buffer: list[str] = []
    ok = True
    while True:
        prompt = ("tra-sql> " if not buffer else "   ...> ") if interactive else ""
        try:
            line = input(prompt)
        except EOFError:
            break
        except KeyboardInterrupt:
            buffer = []
            print(file=out)
            continue
        if line.strip().startswith(".") and (not buffer or re.match(r"\.[A-Za-z]", line.strip())):
            if line.split()[0].lower() in QUIT:
                buffer = []  # an unfinished statement is dropped, as psql's \q does
                break
            ok = command(db, line.strip(), out, err) and ok
            continue
        buffer.append(line)
        text = "\n".join(buffer)
        if complete(text):
            buffer = []
            try:
                ok = run_script(db, text, out, err, stop=False) and ok
            except KeyboardInterrupt:
                print("Interrupted", file=err)
    if interactive:
        print(file=out)
    if "".join(buffer).strip():
        ok = run_script(db, "\n".join(buffer), out, err, stop=False) and ok
    return 0 if ok or interactive else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tra-sql", description="Tensor SQL (einsum in SQL) on DuckDB.")
    parser.add_argument("database", nargs="?", default=":memory:", help="database file (default: in memory)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-c", dest="command", metavar="SQL", help="run these statements and exit")
    source.add_argument("-f", dest="file", metavar="FILE.sql", help="run the statements in FILE and exit")
    args = parser.parse_args(argv)
    try:
        text = None
        if args.file is not None:
            with open(args.file, encoding="utf-8") as handle:
                text = handle.read()
        elif args.command is not None:
            text = args.command
        db = connect(args.database)
    except OSError as error:
        print(f"Error: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 1
    except UnicodeDecodeError as error:
        print(f"Error: cannot read {args.file}: byte {error.start} is not UTF-8 text", file=sys.stderr)
        return 1
    except TraError as error:
        print(f"Error: {one_line(error)}", file=sys.stderr)
        return 1
    try:
        with db:
            if text is not None:
                return 0 if run_script(db, text, sys.stdout, sys.stderr) else 1
            return repl(db, sys.stdout, sys.stderr, sys.stdin.isatty())
    except BrokenPipeError:  # the reader is gone; stdout to /dev/null, so the flush at exit cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
