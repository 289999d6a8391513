"""One spawned group of ranks runs several checks; each check's outcome, or its error, is kept under
its own key, so that each test of the group fails alone (used by the Horovod facade's test modules)."""


def record(out: dict, key: str, fn) -> None:
    """``out[key] = fn()``, or ``"ErrorType: message"`` when it raises (reported by that key's test)."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 - reported by that key's test
        out[key] = f"{type(e).__name__}: {e}"


def per_rank(results: list, key: str) -> list:
    """``key``'s value on every rank; fails naming the rank whose check raised."""
    for r, o in enumerate(results):
        assert not (isinstance(o[key], str) and ":" in o[key]), f"rank {r}: {o[key]}"
    return [o[key] for o in results]
