"""Price: dollars per 1M tokens, by how a token is billed (prefilled input, cached input, output).

The server's `--price` and a workload lane's `price:` both parse into it, and the bill turns token counts
into money with it, so it sits with the vocabulary every layer shares.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Price:
    """Dollars per 1M tokens."""

    input_per_m: float = 0.0
    cached_input_per_m: float = 0.0
    output_per_m: float = 0.0

    @classmethod
    def parse(cls, value: dict | str | None) -> "Price":
        """From the workload's dict or the CLI's 'INPUT,CACHED,OUTPUT' (dollars per 1M tokens)."""
        if value is None:
            return cls()
        if isinstance(value, str):
            parts = value.split(",")
            if len(parts) != 3:
                raise ValueError(f"--price expects INPUT,CACHED,OUTPUT dollars per 1M tokens, got {value!r}")
            return cls(*(float(p) for p in parts))
        return cls(**{k: float(v) for k, v in value.items()})
