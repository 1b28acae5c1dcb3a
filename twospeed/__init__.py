"""twospeed: an LLM serving engine and latency lab that keeps prefill and decode apart.

`LLM` is imported on first use: the bookkeeping and the planner import this package without loading torch.
"""

from twospeed.engine.request import Bill, Clock, RequestOutput
from twospeed.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Clock", "Bill"]


def __getattr__(name: str):
    if name == "LLM":
        from twospeed.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
