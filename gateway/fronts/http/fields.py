"""Typed reads of a JSON request body, each failure a 400 that names the field.

JSON has no integers distinct from floats for some clients, and ``True`` is
an ``int`` in Python: ``Fields`` accepts ``2.0`` for an integer field, never
``true`` for a number, and treats ``null`` as "not given" everywhere.
"""

from __future__ import annotations

from typing import Any, TypeVar

from gateway.fronts.http.errors import ApiError

T = TypeVar("T")
UINT32_MAX = (1 << 32) - 1
_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}


MAX_DEPTH = 32  # an OpenAI request body nests 5 levels at most


def check_body(body: Any) -> None:
    """400 naming the field when a decoded body nests deeper than ``MAX_DEPTH`` or holds
    a string that is not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``,
    which JSON allows and UTF-8 cannot carry). Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError.invalid(
                path or None,
                f"the request body nests deeper than {MAX_DEPTH} levels at {path or 'the top'}",
            )
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError.invalid(
                        path or None,
                        f"{path or 'a string'} is not valid "
                        "Unicode (a lone UTF-16 surrogate escape such as "
                        "\\ud800); send text as UTF-8",
                    ) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                key_path = f"{path}.{k}" if path else str(k)
                stack.append((k, key_path, depth + 1))
                stack.append((v, key_path, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


class Fields:
    """Accessors over one request body (a JSON object).

    Args:
        body: The decoded JSON object.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    @staticmethod
    def typed(value: Any, tp: type[T], param: str) -> T:
        """``value`` when it is a ``tp`` (bools are not numbers), else a 400."""
        if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
            return value
        raise ApiError.invalid(
            param, f"{param} must be {_TYPE_NAMES.get(tp, tp.__name__)}, got {value!r}"
        )

    def str_(self, name: str) -> str:
        """A string field ("" when absent)."""
        value = self.body.get(name)
        return "" if value is None else self.typed(value, str, name)

    def bool_(self, name: str) -> bool:
        """A boolean field (False when absent)."""
        value = self.body.get(name)
        return False if value is None else self.typed(value, bool, name)

    def number(self, name: str, default: float) -> float:
        """A number field (``default`` when absent)."""
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # JSON integers have no size limit; floats do
                raise ApiError.invalid(name, f"{name} is out of range") from None
        return self.typed(value, float, name)

    def int_(self, name: str, lo: int = 0, hi: int = UINT32_MAX) -> int | None:
        """An integer field in ``[lo, hi]`` (None when absent)."""
        value = self.body.get(name)
        if value is None:
            return None
        return self._int(value, name, lo, hi)

    def int_list(self, name: str, lo: int = 0, hi: int = UINT32_MAX) -> list[int]:
        """A list of integers in ``[lo, hi]`` (empty when absent)."""
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list):
            raise ApiError.invalid(name, f"{name} must be a list of integers")
        return [self._int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(value)]

    @staticmethod
    def _int(value: Any, name: str, lo: int, hi: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        number = Fields.typed(value, int, name)
        if not lo <= number <= hi:
            raise ApiError.invalid(name, f"{name} must be in [{lo}, {hi}], got {number}")
        return number
