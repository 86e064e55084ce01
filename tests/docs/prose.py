"""A Python source's prose: its docstrings (module, class, function) and its comments."""
from __future__ import annotations

import ast
import io
import tokenize


def docstrings(tree: ast.AST):
    """(node, docstring expression) for every module, class and function of `tree` that has a docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                   str):
                yield node, first


def comments(src: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
