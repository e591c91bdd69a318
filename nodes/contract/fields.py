"""Reading a record's fields from a JSON body (`cluster.py`'s records): a missing key takes
its default, a key of the wrong type is a ContractError naming it. Stdlib only."""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.http import ContractError


def read_str(obj: dict[str, Any], key: str, what: str) -> str:
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ContractError(f"{what} {key} is not a string")
    return value


def read_int(obj: dict[str, Any], key: str, what: str) -> int:
    value = obj.get(key)
    if value is None:
        return 0
    if type(value) is not int:
        raise ContractError(f"{what} {key} is not an integer")
    return value


def read_rate(obj: dict[str, Any], key: str, what: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ContractError(f"{what} {key} is not a number")
    return float(value)


def read_roles(obj: dict[str, Any], what: str) -> tuple[str, ...]:
    roles = obj.get("roles") or ()
    if not isinstance(roles, list | tuple) or not all(isinstance(r, str) for r in roles):
        raise ContractError(f"{what} roles is not a list of strings")
    return tuple(roles)


def as_body(obj: Any, what: str) -> dict[str, Any]:
    """`obj`, which must be a JSON object: ContractError "WHAT is not a JSON object"."""
    if not isinstance(obj, dict):
        raise ContractError(f"{what} is not a JSON object")
    return obj


def read_object(obj: Any, key: str, what: str) -> dict[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ContractError(f"{what} {key} is not a JSON object")
    return value
